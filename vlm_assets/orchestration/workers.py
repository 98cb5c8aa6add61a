"""The worker processes of `vlm-assets run`, forked from the CLI process itself at its first run.

By then the CLI has imported what the workers run (Dagster, the definitions' modules, the storage
libraries an instance opens with), and it imports the rest just before forking: Megatron-Energon
when the run builds Energon datasets or the training mix, and the model's processor when it may
measure token lengths. Each worker starts with all of that in memory, loaded once for all of them.
A run with nothing to build (everything up to date, an unknown partition, Ctrl-C before the first
step) forks none and loads none of it.

The fork comes from the CLI's main thread, between its steps, with no other thread of the CLI's
running: the workers copy no lock held mid-work. What a process holds that a forked child must
not share (its liveness token and file locks, object-store connections) each module drops in the
child itself (`os.register_at_fork`). A caller running other threads gets workers started afresh
instead (each imports what it runs).

What the workers print goes to a log file (orchestration.worker_output), not the terminal.
"""

from __future__ import annotations

import concurrent.futures
import importlib
import multiprocessing
import os
import select
import signal
import sys
import threading
import time
from pathlib import Path

from vlm_assets.config import CONFIG_ENV_VAR
from vlm_assets.orchestration.outage import is_outage
from vlm_assets.orchestration.worker_output import send_output_to, workers_log_path
from vlm_assets.parallel import imports_without_gc, skip_teardown_at_exit

CLI_WATCH_S = 1.0
# What a worker runs (orchestration.task), imported before the workers are forked; and then too,
# when the run needs it, Megatron-Energon (with torch).
WORKER_MODULE = "vlm_assets.orchestration.task"
ENERGON_MODULE = "vlm_assets.packing.energon_loader"


def default_workers() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def _worker_init(config_path: str, log_path: str, cli_pid: int, start_failures: multiprocessing.SimpleQueue) -> None:
    try:
        # Its own session: a Ctrl-C in the terminal reaches only the CLI, which then launches nothing
        # more and lets the steps in flight finish.
        os.setsid()
        # The CLI's own handlers (stop after the steps in flight) are not the worker's.
        signal.signal(signal.SIGINT, signal.default_int_handler)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        send_output_to(log_path)
        os.environ[CONFIG_ENV_VAR] = config_path
        threading.Thread(target=_die_with, args=(cli_pid,), daemon=True, name="watch-cli").start()
        skip_teardown_at_exit()
    except BaseException as error:
        # The reason goes to the CLI, which names it on each step's line. Raised, it would print a
        # traceback on the terminal (this worker's output may not be redirected yet) and still
        # break the pool for the same reason.
        start_failures.put(f"{type(error).__name__}: {error}")
        os._exit(1)


def _die_with(cli_pid: int) -> None:
    """Kill this worker's session once the CLI process is gone, however it went (kill -9 included).

    The whole session goes: a step's helpers (Dagster's compute-log `tail -F`) would otherwise
    outlive it and hold the CLI's stdout open. Their runs are failed by the next sweep.
    """
    try:
        cli = os.pidfd_open(cli_pid)  # refers to that process, never to a later one given its pid
    except (AttributeError, OSError):  # no pidfd (an old kernel, another OS): poll the pid
        while _alive(cli_pid):
            time.sleep(CLI_WATCH_S)
    else:
        select.select([cli], [], [])  # readable once the process has exited
    os.killpg(0, signal.SIGKILL)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _load_code_location(config_path: str) -> None:
    from vlm_assets.orchestration.task import worker_state

    worker_state(config_path)


class WorkerPool:
    """The workers of one `vlm-assets run`, forked at the first `submit` (see the module's doc). Left
    because the instance became unreachable, it kills them with their runs rather than wait: those
    runs can no longer record their end (the next run fails them as dead), and a long step would
    keep the CLI waiting without a word."""

    def __init__(self, config_path: str, count: int, log_path: Path, import_energon: bool, load_processor: bool) -> None:
        self.config_path, self.count = config_path, count
        self.modules = [WORKER_MODULE, *([ENERGON_MODULE] if import_energon else [])]
        self.load_processor = load_processor
        self.log_path = log_path  # where the workers' output goes
        self.workers: list[multiprocessing.process.BaseProcess] = []  # once forked
        self._executor: concurrent.futures.ProcessPoolExecutor | None = None
        self._start_failures: multiprocessing.SimpleQueue | None = None  # reasons workers could not start
        self._start_failure = ""

    def submit(self, fn, /, *args, **kwargs) -> concurrent.futures.Future:
        """`fn(*args, **kwargs)` in a worker; a pool already broken gives a future failed with
        BrokenProcessPool, as for the calls in flight when it broke."""
        if self._executor is None:
            self._executor = self._start()
        try:
            return self._executor.submit(fn, *args, **kwargs)
        except concurrent.futures.process.BrokenProcessPool as broken:
            failed: concurrent.futures.Future = concurrent.futures.Future()
            failed.set_exception(broken)
            return failed

    def why_broken(self) -> str:
        """Why a call failed with BrokenProcessPool, in one line: the first reason a worker could not
        start, if one could not, else the death of a worker (a kill, out of memory)."""
        while not self._start_failure and self._start_failures is not None and not self._start_failures.empty():
            self._start_failure = self._start_failures.get()
        if self._start_failure:
            return f"the worker processes could not start: {self._start_failure}"
        return "the worker process running it died (killed or out of memory)"

    def _start(self) -> concurrent.futures.ProcessPoolExecutor:
        alone = threading.active_count() == 1
        if alone:
            self._load()
            sys.stdout.flush()  # else each worker would print what this process had not yet
            sys.stderr.flush()
        others = set(multiprocessing.active_children())
        context = multiprocessing.get_context("fork" if alone else "spawn")
        self._start_failures = context.SimpleQueue()
        executor = concurrent.futures.ProcessPoolExecutor(
            max_workers=self.count, mp_context=context, initializer=_worker_init,
            initargs=(self.config_path, str(self.log_path), os.getpid(), self._start_failures))
        # The first submit forks every worker, before the executor starts its own thread; each then
        # opens the instance while this process goes on.
        for _ in range(self.count):
            try:
                executor.submit(_load_code_location, self.config_path)
            except concurrent.futures.process.BrokenProcessPool:
                break  # a worker could not start, and died before all were asked: the caller's submit says why
        self.workers = [child for child in multiprocessing.active_children() if child not in others]
        return executor

    def _load(self) -> None:
        """Import and load what the workers will run, for all of them. What fails here is left to the
        worker that needs it: it loads it again, and its run fails saying why."""
        with imports_without_gc():
            for name in self.modules:
                try:
                    importlib.import_module(name)
                except ImportError:
                    pass
            if self.load_processor:
                from vlm_assets.tokens.preload import load_for_measuring

                try:
                    load_for_measuring(self.config_path)
                except Exception:  # any load error: the step that needs the processor reports it
                    pass

    def __enter__(self) -> WorkerPool:
        return self

    def __exit__(self, exc_type, exc, traceback) -> bool:
        if self._executor is not None:
            if exc is not None and is_outage(exc):
                self.stop_workers()
            else:
                self._executor.shutdown(wait=True)
        return False

    def stop_workers(self) -> None:
        """Kill the workers and what they run now, and shut the pool down."""
        for worker in (worker for worker in self.workers if worker.is_alive()):
            try:
                # Its whole session (see _worker_init): the step's own helper processes too.
                os.killpg(worker.pid, signal.SIGKILL)
            except ProcessLookupError:  # not yet in a session of its own
                worker.kill()
        if self._executor is not None:
            self._executor.shutdown(wait=True, cancel_futures=True)


def start_workers(config_path: str, workers: int, import_energon: bool = False, load_processor: bool = False) -> WorkerPool:
    """`workers` worker processes for `run_graph`, forked at its first run (WorkerPool), each then
    loading the code location; their output goes to a new file under $DAGSTER_HOME/vlm_assets_logs
    (`pool.log_path`). `import_energon`, `load_processor`: the runs will run Megatron-Energon, load
    the model's processor, in them.

    $DAGSTER_HOME must be set first (see `vlm_assets.orchestration.home`): the workers open that instance.
    """
    log_path = workers_log_path(Path(os.environ["DAGSTER_HOME"]))
    # Here too, not only in the workers: a home we cannot write to is one error in the CLI, not a broken pool.
    log_path.parent.mkdir(parents=True, exist_ok=True)
    log_path.touch()
    return WorkerPool(config_path, max(1, workers), log_path, import_energon, load_processor)
