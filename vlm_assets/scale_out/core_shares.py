"""A machine's cores shared among the tasks that its Celery workers execute at the same moment.

While a worker's pool process executes a task (a run of `vlm-assets run --executor celery`, or a
step of a run the daemon launched), it holds a lock on a file of its own in a folder per user of
the machine; the kernel drops the lock when the task ends or the process dies. The task's steps
may use the machine's cores divided by the tasks holding such a lock, its own included.

Several workers on one machine so split its cores instead of each taking all of them: two chunk
runs that each started a second process on a 2-core machine ran 4 processes on 2 cores, and paid
a process start-up per chunk. A run alone on the machine (a big source's catalogue, which the
other workers wait for) still has every core.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path

from vlm_assets.locks import LOCK_DIR, file_lock, process_alive
from vlm_assets.orchestration.workers import default_workers
from vlm_assets.parallel import STEP_PROCESSES_ENV_VAR


def busy_folder() -> Path:
    return Path(tempfile.gettempdir()) / f"vlm-assets-busy-tasks-{os.getuid()}"


_busy = contextlib.ExitStack()


def busy_tasks(folder: Path) -> int:
    """Tasks of this machine's workers that hold their busy lock in `folder` now."""
    locks = folder / LOCK_DIR
    return sum(process_alive(path) for path in locks.glob("*.lock")) if locks.is_dir() else 0


def share_of_cores(cores: int, busy: int) -> int:
    return max(1, cores // max(1, busy))


def start_task(**_: object) -> None:
    """Celery's task_prerun, in the pool process: mark this process busy, give the task's steps its share."""
    folder = busy_folder()
    # One file per pool process, kept between its tasks: reusing it leaves nothing to clean up.
    _busy.enter_context(file_lock(folder, str(os.getpid())))
    os.environ[STEP_PROCESSES_ENV_VAR] = str(share_of_cores(default_workers(), busy_tasks(folder)))


def end_task(**_: object) -> None:
    """Celery's task_postrun: this process is idle again."""
    _busy.close()
