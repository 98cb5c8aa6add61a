"""The processes `vlm-assets run` works in: when its workers start, what they start with and hold, and the collector around imports."""

from __future__ import annotations

import concurrent.futures
import gc
import os
import shutil
import subprocess
import sys
import threading
from pathlib import Path

from vlm_assets.demo import write_demo
from vlm_assets.locks import file_lock, process_alive, process_token
from vlm_assets.orchestration.home import ensure_dagster_home
from vlm_assets.orchestration.workers import ENERGON_MODULE, WORKER_MODULE, start_workers
from vlm_assets.parallel import imports_without_gc


def _loaded(module: str) -> str:
    return f"{module!r} in __import__('sys').modules"


def _in_a_process_of_its_own(check: str, tmp_path: Path) -> None:
    """Run `check(config, root)` of this module in a new interpreter with one thread, as the CLI is
    when it forks its workers (this test process may run other threads, left by earlier tests)."""
    config = write_demo(tmp_path / "demo")
    env = {**os.environ, "DAGSTER_HOME": str(ensure_dagster_home(tmp_path / "home"))}
    script = f"from vlm_assets_tests.test_worker_processes import {check}; {check}({str(config)!r}, {str(tmp_path / 'root')!r})"
    result = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]


def test_workers_are_forked_at_the_first_task_with_what_they_run_loaded_and_frozen(tmp_path):
    _in_a_process_of_its_own("forked_workers_start_loaded", tmp_path)


def forked_workers_start_loaded(config: str, root: str) -> None:
    with start_workers(config, 2, import_energon=True) as pool:
        assert pool.workers == []  # a run with nothing to build forks none
        # eval: a builtin, so the worker runs it without importing anything of this test's.
        worker, energon = pool.submit(eval, _loaded(WORKER_MODULE)), pool.submit(eval, _loaded(ENERGON_MODULE))
        frozen = pool.submit(gc.get_freeze_count)
        enabled = pool.submit(gc.isenabled)
        assert len(pool.workers) == 2 and all(worker.pid != os.getpid() for worker in pool.workers)
        assert worker.result() is True and energon.result() is True
        # Dagster and the definitions' modules alone are hundreds of thousands of objects.
        assert frozen.result() > 100_000
        assert enabled.result() is True


def test_a_forked_worker_holds_none_of_its_parents_locks_and_has_a_token_of_its_own(tmp_path):
    _in_a_process_of_its_own("forked_worker_holds_nothing_of_its_parents", tmp_path)


def forked_worker_holds_nothing_of_its_parents(config: str, root: str) -> None:
    token = process_token(Path(root))
    with file_lock(Path(root), "held-by-the-parent"), start_workers(config, 1) as pool:
        own = pool.submit(process_token, Path(root)).result()
        assert own != token and process_alive(own)
        # The parent holds the lock: the worker, holding nothing of its parent's, waits for it.
        assert pool.submit(_enters, Path(root), "held-by-the-parent").result() is False
    assert not process_alive(own)  # its token went with the worker


def _enters(root: Path, name: str) -> bool:
    """Whether this process gets into `file_lock(root, name)` within a second."""
    entered = threading.Event()

    def take() -> None:
        with file_lock(root, name):
            entered.set()

    threading.Thread(target=take, daemon=True).start()
    return entered.wait(1.0)


def test_a_caller_running_other_threads_gets_workers_started_afresh(tmp_path, monkeypatch):
    config = write_demo(tmp_path / "demo")
    monkeypatch.setenv("DAGSTER_HOME", str(ensure_dagster_home(tmp_path / "home")))
    done = threading.Event()
    other = threading.Thread(target=done.wait)
    other.start()
    try:
        with start_workers(str(config), 1, import_energon=True) as pool:
            # Not forked mid-work of that thread: a new process, which imports what it runs itself.
            assert pool.submit(eval, _loaded(ENERGON_MODULE)).result() is False
            assert pool.submit(eval, _loaded(WORKER_MODULE)).result() is True
    finally:
        done.set()
        other.join()


def test_a_worker_creates_its_log_folder_when_it_went_before_the_pool_started(tmp_path):
    _in_a_process_of_its_own("workers_create_their_log_folder", tmp_path)


def workers_create_their_log_folder(config: str, root: str) -> None:
    with start_workers(config, 2) as pool:
        # As Dagster's telemetry upload (dagster-webserver on the same instance) moves a `logs` folder away.
        shutil.rmtree(pool.log_path.parent)
        assert pool.submit(print, "written by a worker", flush=True).result() is None
    assert "written by a worker" in pool.log_path.read_text()


def test_a_pool_whose_workers_cannot_start_says_why_in_one_line(tmp_path):
    _in_a_process_of_its_own("workers_that_cannot_start", tmp_path)


def workers_that_cannot_start(config: str, root: str) -> None:
    with start_workers(config, 2) as pool:
        folder = pool.log_path.parent
        shutil.rmtree(folder)
        folder.write_text("a file where the log folder was\n")
        first = pool.submit(eval, "1")
        assert isinstance(first.exception(timeout=120), concurrent.futures.process.BrokenProcessPool)
        # A call made once the pool is known broken fails the same way instead of raising.
        assert isinstance(pool.submit(eval, "1").exception(timeout=120), concurrent.futures.process.BrokenProcessPool)
        why = pool.why_broken()
    assert why.startswith("the worker processes could not start: FileExistsError: ") and str(folder) in why, why
    assert "\n" not in why


def test_imports_without_gc_pauses_the_collector_and_freezes_what_was_made():
    assert gc.isenabled()
    before = gc.get_freeze_count()
    try:
        with imports_without_gc():
            assert not gc.isenabled()
            made = [[] for _ in range(1000)]
            with imports_without_gc():  # nested: the collector stays off until the outer one ends
                pass
            assert not gc.isenabled()
        assert gc.isenabled()
        assert gc.get_freeze_count() >= before + len(made)
        gc.disable()
        with imports_without_gc():
            pass
        assert not gc.isenabled()  # left as it was found
    finally:
        gc.enable()
        gc.unfreeze()
