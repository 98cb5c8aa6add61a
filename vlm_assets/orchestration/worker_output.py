"""Where the worker processes of `vlm-assets run` print: one log file per `vlm-assets run`.

Under $DAGSTER_HOME/logs, beside the failed runs' logs: Dagster's console log of the workers' runs,
libraries' own prints (Energon's "Saving info to …"), a crashed worker's last words. The terminal
keeps the CLI's own lines; a failed run's line still gives its cause and its own log, which names
this file. Nothing heavy is imported: the workers set this up before they load Dagster.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

LOG_FOLDER = "logs"

# In a worker process: the file its output goes to (None elsewhere, e.g. on a Celery worker).
_output_log: Path | None = None


def workers_log_path(home: Path) -> Path:
    """A new file for the output of one `vlm-assets run`'s workers, named by when and by which process it started."""
    return home / LOG_FOLDER / f"workers-{time.strftime('%Y%m%d-%H%M%S', time.gmtime())}-{os.getpid()}.log"


def output_log() -> Path | None:
    """The file this worker process's output goes to; None outside the workers of `vlm-assets run`."""
    return _output_log


def send_output_to(log_path: str) -> None:
    """Point this process's stdout and stderr (the file descriptors: C libraries and child processes
    such as Dagster's compute-log `tail` write there too) at the end of `log_path`."""
    global _output_log
    sys.stdout.flush()
    sys.stderr.flush()
    log = os.open(log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(log)
    # Line by line, as on a terminal: a worker killed with its run loses no finished line.
    sys.stdout.reconfigure(line_buffering=True)
    sys.stderr.reconfigure(line_buffering=True)
    _output_log = Path(log_path)
