"""Where the worker processes of `vlm-assets run` print: one log file per `vlm-assets run`.

Under $DAGSTER_HOME/vlm_assets_logs, beside the failed runs' logs: Dagster's console log of the
workers' runs, libraries' own prints (Energon's "Saving info to …"), a crashed worker's last words.
The terminal keeps the CLI's own lines; a failed run's line still gives its cause and its own log,
which names this file. Nothing heavy is imported: the workers set this up before they load Dagster.

Not $DAGSTER_HOME/logs: that folder is Dagster's telemetry queue. `dagster-webserver` and
`dagster-daemon` on the same instance, whatever `telemetry: enabled` says, move a non-empty `logs`
to `.logs_queue`, post its files to Dagster's telemetry server and delete them.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

LOG_FOLDER = "vlm_assets_logs"

# In a worker process: the file its output goes to (None elsewhere, e.g. on a Celery worker).
_output_log: Path | None = None


def log_folder(home: Path) -> Path:
    """Where `vlm-assets run` writes its logs (its workers' output, the failed runs' logs, progress) for instance `home`."""
    return home / LOG_FOLDER


def workers_log_path(home: Path) -> Path:
    """A new file for the output of one `vlm-assets run`'s workers, named by when and by which process it started."""
    return log_folder(home) / f"workers-{time.strftime('%Y%m%d-%H%M%S', time.gmtime())}-{os.getpid()}.log"


def output_log() -> Path | None:
    """The file this worker process's output goes to; None outside the workers of `vlm-assets run`."""
    return _output_log


def send_output_to(log_path: str) -> None:
    """Point this process's stdout and stderr (the file descriptors: C libraries and child processes
    such as Dagster's compute-log `tail` write there too) at the end of `log_path`, creating its folder
    if it has gone since the CLI made it."""
    global _output_log
    sys.stdout.flush()
    sys.stderr.flush()
    os.makedirs(os.path.dirname(log_path), exist_ok=True)
    log = os.open(log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(log)
    # Line by line, as on a terminal: a worker killed with its run loses no finished line.
    sys.stdout.reconfigure(line_buffering=True)
    sys.stderr.reconfigure(line_buffering=True)
    _output_log = Path(log_path)
