"""The processes `vlm-assets run` works in: what its workers start with, and the collector around imports."""

from __future__ import annotations

import gc

from vlm_assets.demo import write_demo
from vlm_assets.orchestration.home import ensure_dagster_home
from vlm_assets.orchestration.workers import ENERGON_MODULE, WORKER_MODULE, start_workers
from vlm_assets.parallel import imports_without_gc


def _loaded(module: str) -> str:
    return f"{module!r} in __import__('sys').modules"


def test_workers_start_with_the_fork_servers_imports_loaded_and_frozen(tmp_path, monkeypatch):
    config = write_demo(tmp_path / "demo")
    monkeypatch.setenv("DAGSTER_HOME", str(ensure_dagster_home(tmp_path / "home")))
    with start_workers(str(config), 1) as pool:
        # eval: a builtin, so the worker runs it without importing anything of this test's.
        worker, energon = pool.submit(eval, _loaded(WORKER_MODULE)), pool.submit(eval, _loaded(ENERGON_MODULE))
        frozen = pool.submit(gc.get_freeze_count)
        enabled = pool.submit(gc.isenabled)
        assert worker.result() is True
        assert energon.result() is False  # not asked for: this run runs no Energon
        # Dagster and the definitions' modules alone are hundreds of thousands of objects.
        assert frozen.result() > 100_000
        assert enabled.result() is True


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
