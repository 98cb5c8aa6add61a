"""Ordered fan-out of chunks of one step's work to worker processes.

One big source is one partition, so its heavy per-sample work would otherwise run on one core.
The step splits it into chunks, hands them to a pool of processes and consumes the results in
input order, so the output is the same whatever the number of processes. At most a few chunks
per process are in flight: memory stays bounded by the chunk size, not by the source's size.

With $VLM_ASSETS_RAY_ADDRESS set (`vlm-assets run --executor ray`) the chunks are Ray tasks on that
cluster instead, on whichever nodes have a free core; the results still come back in input order,
so the output is the same again. A task whose node is lost is run again elsewhere by Ray.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import gc
import logging
import multiprocessing
import os
import sys
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ProcessPoolExecutor
from typing import Any, Generic, NoReturn, TypeVar

STEP_PROCESSES_ENV_VAR = "VLM_ASSETS_STEP_PROCESSES"
# The Ray cluster a step's chunks go to (`auto`, `HOST:PORT`, `ray://HOST:PORT`); unset: local processes.
RAY_ADDRESS_ENV_VAR = "VLM_ASSETS_RAY_ADDRESS"
# Times Ray runs a chunk again whose worker or node died under it (its system failures, not the
# chunk's own errors, which fail the step at once as they do locally).
RAY_TASK_RETRIES = 3
# Chunks done or underway, per process, whose results wait for earlier ones: bounds memory.
CHUNKS_IN_FLIGHT_PER_PROCESS = 4
# Chunks the pool holds per process: one running and three ready, enough to keep it working while
# this process does a chunk of its own (a video's takes a second or more) and cannot hand out more.
CHUNKS_QUEUED_PER_POOL_PROCESS = 4
KILLED_CHILD_JOIN_S = 10.0

Item = TypeVar("Item")
Result = TypeVar("Result")


def step_processes() -> int:
    """Processes one step may use: `$VLM_ASSETS_STEP_PROCESSES`, else 1.

    `vlm-assets run` and `vlm-assets worker` set it from the workers they have. Elsewhere (runs the
    daemon launches) one process is the safe default: a chunk process may load the model's
    processor (about 1 GB), and many runs may be splitting their work at the same time.
    """
    value = os.environ.get(STEP_PROCESSES_ENV_VAR, "").strip()
    if not value:
        return 1
    try:
        processes = int(value)
    except ValueError:
        raise ValueError(f"{STEP_PROCESSES_ENV_VAR} must be a whole number of processes, not {value!r}") from None
    if processes < 1:
        raise ValueError(f"{STEP_PROCESSES_ENV_VAR} must be at least 1, not {processes}")
    return processes


# A process that reads media from object storage spends about as long waiting on each request as
# computing: a step doing that runs this many such processes per process it was given.
STORE_READERS_PER_PROCESS = 2


def store_reading_processes(processes: int) -> int:
    """Processes for a step's work that reads media from object storage, given `processes` (one stays one)."""
    return processes * STORE_READERS_PER_PROCESS if processes > 1 else processes


def ordered_map(
    function: Callable[[Item], Result],
    chunks: Iterable[Item],
    processes: int,
    initializer: Callable[..., None] | None = None,
    initargs: tuple[Any, ...] = (),
    may_work_here: Callable[[], bool] | None = None,
    reads_local_files: bool = False,
) -> Iterator[Result]:
    """`function` over `chunks`, results in input order, on `processes` processes: this one and spawned ones.

    `initializer(*initargs)` prepares each process (for example loads a model once), this one too:
    it works on chunks as well, so one process fewer is started and what it set up (a model a check
    needs next) stays at hand. With one process everything runs here, without a pool. While
    `may_work_here()` is false this process only hands out chunks (its core is busy otherwise).
    With a Ray cluster set ($VLM_ASSETS_RAY_ADDRESS) the chunks go to it, unless `reads_local_files`:
    chunks that read files only this machine has (an index it just wrote) stay on its processes.
    """
    if initializer is None:
        initializer = _nothing
    if processes <= 1:
        initializer(*initargs)
        yield from map(function, chunks)
        return
    address = ray_address()
    if address is not None and not reads_local_files:
        yield from _ordered_map_on_ray(function, chunks, processes, initializer, initargs, address)
        return
    # spawn, not fork: the caller may hold threads (Dagster's, a decoder's) that fork would copy mid-state.
    context = multiprocessing.get_context("spawn")
    window = processes * CHUNKS_IN_FLIGHT_PER_PROCESS
    # The pool gets only what keeps its processes busy: what it has been given it hands to them
    # soon after, out of reach, so this process would find nothing left to take over.
    pool_share = (processes - 1) * CHUNKS_QUEUED_PER_POOL_PROCESS
    others = set(multiprocessing.active_children())
    with ProcessPoolExecutor(max_workers=processes - 1, mp_context=context, initializer=_start_pool_process,
                             initargs=(initializer, initargs)) as pool:
        slots: deque[_Slot[Item, Result]] = deque()
        source = iter(chunks)
        set_up_here = False
        try:
            while True:
                while (len(slots) < window and sum(slot.in_pool() for slot in slots) < pool_share
                       and (chunk := next(source, _END)) is not _END):
                    slots.append(_Slot(chunk, pool.submit(function, chunk)))
                if not set_up_here:
                    # Only now: the first submit starts the pool's processes, so their set-up
                    # (seconds for a model) overlaps this one's instead of following it.
                    initializer(*initargs)
                    set_up_here = True
                if not slots:
                    return
                if not slots[0].ready() and (may_work_here is None or may_work_here()):
                    # Work here rather than wait: the next chunk, else one the pool has not started.
                    if len(slots) < window and (chunk := next(source, _END)) is not _END:
                        slots.append(_Slot(chunk, None))
                        slots[-1].run_here(function)
                        continue
                    idle = next((slot for slot in slots if slot.take_back()), None)
                    if idle is not None:
                        idle.run_here(function)
                        continue
                yield slots.popleft().result()
        except BaseException:
            # A failed chunk (or a consumer that stops early) ends the step: queued chunks are dropped
            # and the pool's processes killed, not waited for. One still working on a long chunk, or
            # stuck starting, would otherwise keep the failed step (and its CLI) from ending.
            pool.shutdown(wait=False, cancel_futures=True)
            killed = set(multiprocessing.active_children()) - others
            for child in killed:
                child.kill()
            for child in killed:
                child.join(KILLED_CHILD_JOIN_S)
            raise
        finally:
            pool.shutdown(cancel_futures=True)


def ray_address() -> str | None:
    """The Ray cluster this process's chunked steps use ($VLM_ASSETS_RAY_ADDRESS), or None for local processes."""
    return os.environ.get(RAY_ADDRESS_ENV_VAR, "").strip() or None


def connect_to_ray(address: str) -> None:
    """Join the Ray cluster at `address` as a driver, once per process."""
    import ray

    if not ray.is_initialized():
        # The tasks' output comes back to this process's output (a step's captured log, which the UI
        # shows), not only to the node's own log folder.
        ray.init(address=address, logging_level=logging.WARNING, log_to_driver=True)


def _ordered_map_on_ray(function: Callable[[Item], Result], chunks: Iterable[Item], processes: int,
                        initializer: Callable[..., None], initargs: tuple[Any, ...], address: str) -> Iterator[Result]:
    """ordered_map's chunks as Ray tasks: at most `processes` × CHUNKS_IN_FLIGHT_PER_PROCESS in flight.

    Each task's worker process runs `initializer(*initargs)` before its first chunk of this call (the
    arguments travel once, through Ray's object store); this process does too, as on the local path.
    A chunk's failure is re-raised here as its own error, with a note naming the node it ran on. The
    chunks still in flight then are not waited for, nor cancelled: they finish on their own and their
    results are dropped. (Cancelling them, forced or not, crashes this process now and then in Ray
    2.60: "Tried to complete task that was not pending".)
    """
    import ray

    connect_to_ray(address)
    setup = ray.put((initializer, initargs))
    # Named by what it runs: the Ray dashboard lists the tasks of each kind of chunk apart.
    task = _ray_chunk_task().options(name=f"{function.__module__}.{function.__qualname__}")
    window = processes * CHUNKS_IN_FLIGHT_PER_PROCESS
    in_flight: deque[Any] = deque()
    source = iter(chunks)
    set_up_here = False
    while True:
        while len(in_flight) < window and (chunk := next(source, _END)) is not _END:
            in_flight.append(task.remote(function, setup.hex(), setup, chunk))
        if not set_up_here:
            initializer(*initargs)  # after the first submits, so the cluster's set-up overlaps it
            set_up_here = True
        if not in_flight:
            return
        try:
            result = ray.get(in_flight[0])
        except ray.exceptions.RayTaskError as error:
            raise error.cause from None  # the chunk's own error, as on the local path
        in_flight.popleft()
        yield result


@functools.cache
def _ray_chunk_task() -> Any:
    import ray

    return ray.remote(max_retries=RAY_TASK_RETRIES, retry_exceptions=False)(_run_chunk)


# The ordered_map call whose initializer this Ray worker process last ran (its setup's object id).
_set_up_for: list[str] = []


def _run_chunk(function: Callable[[Item], Result], setup_id: str, setup: tuple[Callable[..., None], tuple[Any, ...]],
               chunk: Item) -> Result:
    if _set_up_for != [setup_id]:
        initializer, initargs = setup
        with imports_without_gc():
            initializer(*initargs)
        _set_up_for[:] = [setup_id]
    try:
        return function(chunk)
    except Exception as error:
        import ray

        error.add_note(f"(in a Ray task on node {ray.util.get_node_ip_address()}, process {os.getpid()})")
        raise


@contextlib.contextmanager
def helper_processes(count: int) -> Iterator[ProcessPoolExecutor | None]:
    """`count` spawned processes for one step's side tasks (None for none), started on first use and
    shared by those tasks: each start is a new interpreter and its imports, on the step's own time.
    On exit, tasks not started are dropped and the step does not wait for one still running."""
    if count < 1:
        yield None
        return
    pool = ProcessPoolExecutor(max_workers=count, mp_context=multiprocessing.get_context("spawn"),
                               initializer=skip_teardown_at_exit)
    try:
        yield pool
    finally:
        pool.shutdown(wait=False, cancel_futures=True)


_END: Any = object()


def _nothing() -> None:
    pass


def _start_pool_process(initializer: Callable[..., None], initargs: tuple[Any, ...]) -> None:
    skip_teardown_at_exit()
    with imports_without_gc():  # an initializer loads what the chunks need: a processor, its libraries
        initializer(*initargs)


@contextlib.contextmanager
def imports_without_gc() -> Iterator[None]:
    """Run a process's heavy imports (Dagster, torch, transformers) with the cyclic garbage collector
    off, then exempt every object they made from its later passes (`gc.freeze`).

    Those imports make hundreds of thousands of long-lived objects and next to no garbage, and every
    pass of the collector over its oldest generation walks all of them again. Frozen, they are also
    left alone by the collections of the processes forked from this one, so their pages stay shared.
    """
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        gc.freeze()
        if enabled:
            gc.enable()


def skip_teardown_at_exit() -> None:
    """Let this worker process, once it exits normally, skip the interpreter's teardown.

    Tearing down what its work loaded (torch, transformers, Dagster) takes seconds of a core, and
    whoever shut the pool down waits for it. Called first thing in the process, the handler runs
    after every exit handler registered later.
    """
    atexit.register(_exit_now)


def _exit_now() -> None:
    exit_without_teardown(0)


def exit_without_teardown(code: int) -> NoReturn:
    """End this process with `code` now: logs and standard streams flushed, nothing unloaded."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


class _Slot(Generic[Item, Result]):
    """One chunk, worked on by the pool (`future`) or here (`value`)."""

    def __init__(self, chunk: Item, future: Future[Result] | None) -> None:
        self.chunk = chunk
        self.future: Future[Result] | None = future
        self.value: Result | None = None

    def in_pool(self) -> bool:
        """True while the pool holds this chunk, queued or running."""
        return self.future is not None and not self.future.done()

    def ready(self) -> bool:
        return self.future is None or self.future.done()

    def take_back(self) -> bool:
        """True if the pool had not started this chunk (it now never will)."""
        return self.future is not None and self.future.cancel()

    def run_here(self, function: Callable[[Item], Result]) -> None:
        self.value, self.future = function(self.chunk), None

    def result(self) -> Result:
        return self.future.result() if self.future is not None else self.value  # type: ignore[return-value]
