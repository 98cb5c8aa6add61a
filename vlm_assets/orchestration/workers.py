"""The worker processes of `vlm-assets run`, started before the CLI itself imports Dagster.

Each worker loads the code location and opens the instance. Started first, they do it while the
CLI loads its own copy, on the cores the CLI would otherwise leave idle, so this module imports
nothing heavy. They are forked from one server process that imported the code (seconds) for all
of them.

What the workers print goes to a log file (orchestration.worker_output), not the terminal.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import multiprocessing
import multiprocessing.forkserver
import os
import select
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

from vlm_assets.config import CONFIG_ENV_VAR
from vlm_assets.orchestration.outage import is_outage
from vlm_assets.orchestration.worker_output import send_output_to, workers_log_path
from vlm_assets.parallel import skip_teardown_at_exit

CLI_WATCH_S = 1.0
# The one module the fork server imports itself: it imports those named in PRELOAD_ENV_VAR.
FORK_SERVER_MODULE = "vlm_assets.orchestration.fork_server"
PRELOAD_ENV_VAR = "VLM_ASSETS_FORK_SERVER_PRELOAD"
# What a worker runs (orchestration.task), imported by the process the workers are forked from; and
# there too, when the run needs them: Megatron-Energon (with torch), and the model's processor with
# what measuring token lengths reads.
WORKER_MODULE = "vlm_assets.orchestration.task"
ENERGON_MODULE = "vlm_assets.packing.energon_loader"
PROCESSOR_MODULE = "vlm_assets.tokens.preload"


def default_workers() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def _worker_init(config_path: str, log_path: str, cli_pid: int) -> None:
    # Its own session: a Ctrl-C in the terminal reaches only the CLI, which then launches nothing
    # more and lets the steps in flight finish.
    os.setsid()
    send_output_to(log_path)
    os.environ[CONFIG_ENV_VAR] = config_path
    threading.Thread(target=_die_with, args=(cli_pid,), daemon=True, name="watch-cli").start()
    skip_teardown_at_exit()


def _die_with(cli_pid: int) -> None:
    """Kill this worker's session once the CLI process is gone, however it went (kill -9 included).

    The CLI itself is watched, not the fork server the worker came from: every forked worker holds
    the pipe end whose closing tells the fork server that the CLI is gone, so the fork server
    outlives the CLI as long as a worker does. The whole session goes: a step's helpers (Dagster's
    compute-log `tail -F`) would otherwise outlive it and hold the CLI's stdout open. Their runs are
    failed by the next sweep.
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


class WorkerPool(concurrent.futures.ProcessPoolExecutor):
    """The workers of one `vlm-assets run`. Left because the instance became unreachable, it kills
    them with their runs rather than wait: those runs can no longer record their end (the next run
    fails them as dead), and a long step would keep the CLI waiting without a word."""

    log_path: Path  # where the workers' output goes
    _started: list[multiprocessing.process.BaseProcess]
    _starting: threading.Thread | None = None
    _given_work = False  # a task other than the workers' own start was submitted

    def start(self, config_path: str, count: int) -> None:
        """Start `count` workers, each loading the code location, in the background: a start waits
        for the fork server to have imported what the workers run (a second or more), which the
        CLI's own imports then overlap."""
        self._started = []

        def start_all() -> None:
            others = set(multiprocessing.active_children())
            try:
                for _ in range(count):
                    # A failed load is not reported here: the first run in that process fails with the error.
                    self.submit(_load_code_location, config_path)
            except Exception:  # a broken pool: the CLI's first submit raises why
                pass
            # Each submit above starts one worker, until there are `count` of them.
            self._started = [child for child in multiprocessing.active_children() if child not in others]

        self._starting = threading.Thread(target=start_all, name="start-workers", daemon=True)
        self._starting.start()

    @property
    def workers(self) -> list[multiprocessing.process.BaseProcess]:
        """The worker processes, once started."""
        if self._starting is not None:
            self._starting.join()
        return self._started

    def submit(self, fn, /, *args, **kwargs) -> concurrent.futures.Future:
        if fn is not _load_code_location:
            self._given_work = True
        return super().submit(fn, *args, **kwargs)

    def __exit__(self, exc_type, exc, traceback) -> bool:
        if not self._given_work:
            # Nothing was run: all up to date, or the run stopped before its first step (an unknown
            # partition, no Celery worker answering, Ctrl-C). Neither the workers nor the fork server
            # still loading what they would have run (a processor: seconds) are waited for.
            for pid in _fork_servers_of(os.getpid()):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            self.stop_workers()
            return False
        if self._starting is not None:
            self._starting.join()
        if exc is not None and is_outage(exc):
            self.stop_workers()
            return False
        return super().__exit__(exc_type, exc, traceback)

    def stop_workers(self) -> None:
        """Kill the workers and what they run now, and shut the pool down."""
        for worker in (worker for worker in self.workers if worker.is_alive()):
            try:
                # Its whole session (see _worker_init): the step's own helper processes too.
                os.killpg(worker.pid, signal.SIGKILL)
            except ProcessLookupError:  # not yet in a session of its own
                worker.kill()
        self.shutdown(wait=True, cancel_futures=True)


@contextlib.contextmanager
def _environment(settings: dict[str, str]) -> Iterator[None]:
    before = {name: os.environ.get(name) for name in settings}
    os.environ.update(settings)
    try:
        yield
    finally:
        for name, value in before.items():
            if value is None:
                del os.environ[name]
            else:
                os.environ[name] = value


def _fork_servers_of(pid: int) -> list[int]:
    """The fork server processes `pid` started, read from /proc (none found where there is none)."""
    servers = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            parent = int(stat.read_text().rsplit(")", 1)[1].split()[1])
            if parent == pid and b"multiprocessing.forkserver" in (stat.parent / "cmdline").read_bytes():
                servers.append(int(stat.parent.name))
        except (OSError, ValueError, IndexError):  # gone meanwhile
            continue
    return servers


def start_workers(config_path: str, workers: int, import_energon: bool = False, load_processor: bool = False) -> WorkerPool:
    """`workers` worker processes for `run_graph`, started in the background (WorkerPool.start), each
    then loading the code location; their output goes to a new file under $DAGSTER_HOME/logs
    (`pool.log_path`). `import_energon`, `load_processor`: the runs will run Megatron-Energon, load
    the model's processor, in them.

    $DAGSTER_HOME must be set first (see `vlm_assets.orchestration.home`): the workers open that instance.
    """
    log_path = workers_log_path(Path(os.environ["DAGSTER_HOME"]))
    # Here, not in the workers: a home we cannot write to is one error in the CLI, not a broken pool.
    log_path.parent.mkdir(parents=True, exist_ok=True)
    log_path.touch()
    # The workers are forked from a server process that imported what they run (Dagster, the
    # definitions' modules: seconds of a core) once, rather than each importing it; the server
    # holds no thread a fork could copy mid-state, as the CLI may.
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload([FORK_SERVER_MODULE])
    preload = [WORKER_MODULE, *([ENERGON_MODULE] if import_energon else []), *([PROCESSOR_MODULE] if load_processor else [])]
    # Started here, with what it imports and the config in its environment (PROCESSOR_MODULE loads
    # that config's processor), and those settings taken back from this process's own.
    with _environment({PRELOAD_ENV_VAR: ",".join(preload), CONFIG_ENV_VAR: config_path}):
        multiprocessing.forkserver.ensure_running()
    pool = WorkerPool(
        max_workers=max(1, workers), mp_context=context, initializer=_worker_init,
        initargs=(config_path, str(log_path), os.getpid()),
    )
    pool.log_path = log_path
    pool.start(config_path, max(1, workers))
    return pool
