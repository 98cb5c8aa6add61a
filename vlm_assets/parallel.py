"""Ordered fan-out of chunks of one step's work to worker processes.

One big source is one partition, so its heavy per-sample work would otherwise run on one core.
The step splits it into chunks, hands them to a pool of processes and consumes the results in
input order, so the output is the same whatever the number of processes. At most a few chunks
per process are in flight: memory stays bounded by the chunk size, not by the source's size.
"""

from __future__ import annotations

import atexit
import contextlib
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
) -> Iterator[Result]:
    """`function` over `chunks`, results in input order, on `processes` processes: this one and spawned ones.

    `initializer(*initargs)` prepares each process (for example loads a model once), this one too:
    it works on chunks as well, so one process fewer is started and what it set up (a model a check
    needs next) stays at hand. With one process everything runs here, without a pool. While
    `may_work_here()` is false this process only hands out chunks (its core is busy otherwise).
    """
    if initializer is None:
        initializer = _nothing
    if processes <= 1:
        initializer(*initargs)
        yield from map(function, chunks)
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
