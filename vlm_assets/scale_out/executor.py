"""Celery: runs that `vlm-assets worker` processes execute, through the broker.

$VLM_ASSETS_CELERY_BROKER (e.g. redis://127.0.0.1:6379/0) names the broker; it is also the result
backend, so a worker needs nothing else to answer the process that sent it work. Two kinds of work:

- a whole run of `vlm-assets run --executor celery` (`execute_on_workers`): one task, executed by
  one worker's pool process with the in-process executor;
- a step of a run that the daemon or the UI launch (`code_location_executor`): dagster-celery's
  executor sends each step as a task, and the worker rebuilds the job from the code location.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import warnings
from pathlib import Path
from typing import TYPE_CHECKING

import dagster as dg

if TYPE_CHECKING:
    from celery import Celery

    from vlm_assets.runner import TaskOutcome

CELERY_BROKER_ENV = "VLM_ASSETS_CELERY_BROKER"
PING_TIMEOUT_S = 2.0
RUN_TASK = "vlm_assets.execute_run"
# The queue dagster-celery's workers consume (dagster_celery.make_app); `vlm-assets worker` serves only it.
WORKER_QUEUE = "dagster"
START_WORKERS_HINT = "start workers with `vlm-assets worker --config FILE` (README \"Scaling out\")"


def broker_url() -> str | None:
    return os.environ.get(CELERY_BROKER_ENV) or None


def require_broker() -> str:
    broker = broker_url()
    if not broker:
        raise ValueError(f"the celery executor needs a broker: set {CELERY_BROKER_ENV} "
                         f"(e.g. redis://127.0.0.1:6379/0) and {START_WORKERS_HINT}")
    return broker


def printable_url(url: str) -> str:
    """`url` with any password masked, for messages."""
    from kombu.utils.url import maybe_sanitize_url

    return maybe_sanitize_url(url)


def code_location_executor() -> dg.ExecutorDefinition:
    """Celery when $VLM_ASSETS_CELERY_BROKER is set, so runs the daemon launches use the workers too."""
    if not broker_url():
        return dg.in_process_executor
    from celery.exceptions import DuplicateTaskNameWarning
    from dagster_celery import celery_executor

    # dagster-celery registers its step task again for every step it sends; the task is the same.
    warnings.filterwarnings("ignore", "Task name 'execute_plan' is already registered", DuplicateTaskNameWarning)
    # Environment references, resolved in each run's process: a URL with a password is never stored in a run.
    broker = {"env": CELERY_BROKER_ENV}
    return celery_executor.configured({"broker": broker, "backend": broker}, name="celery")


def answering_workers(broker: str) -> list[str]:
    """Names of the Celery workers that answer a ping on `broker`."""
    from celery import Celery
    from kombu.exceptions import OperationalError

    with Celery("vlm-assets", broker=broker, set_as_current=False) as app:
        try:
            replies = app.control.ping(timeout=PING_TIMEOUT_S)
        except OperationalError as error:
            raise ValueError(f"cannot reach the Celery broker {printable_url(broker)} (${CELERY_BROKER_ENV}): {error}") from None
    return sorted(name for reply in replies for name in reply)


def file_sha256(path: str) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def execute_on_workers(config_path: str, asset: str, partition: str | None, log_dir: str) -> TaskOutcome:
    """One run of `asset` (that partition) with its checks, executed whole by one worker.

    One task per run rather than dagster-celery's one per step: its executor looks for finished
    steps once a second and that period is not configurable, so a run of an asset and its checks
    took about 2.7 s more than in-process; a task's result arrives as soon as it is stored.
    """
    from celery import Celery

    from vlm_assets.runner import TaskOutcome

    broker = require_broker()
    with Celery("vlm-assets", broker=broker, backend=broker, set_as_current=False) as app:
        result = app.send_task(RUN_TASK, args=(config_path, file_sha256(config_path), asset, partition, log_dir),
                               queue=WORKER_QUEUE)
        try:
            fields = result.get()
        except Exception as error:  # the worker could not run it: its pool process died, a config error, ...
            return TaskOutcome(asset, partition, failure=f"{error} ({type(error).__name__} on a Celery worker)")
    fields["checks"] = [tuple(check) for check in fields["checks"]]
    return TaskOutcome(**fields)


def execute_run(config_path: str, config_sha256: str, asset: str, partition: str | None,
                log_dir: str) -> dict[str, object]:
    """A worker's side of `execute_on_workers`: the run, in this pool process, summarised as JSON fields.

    `config_sha256` makes sure the worker reads the file the run was started with, not an edited
    one nor another file at that path on its machine.
    """
    from vlm_assets.config import ConfigError
    from vlm_assets.runner import execute_task

    if file_sha256(config_path) != config_sha256:
        raise ConfigError(f"{config_path}: not the file the run was started with (edited since, or a different "
                          "file at this path on this machine); restart the run")
    return dataclasses.asdict(execute_task(config_path, asset, partition, log_dir))


def register_run_task(app: Celery) -> None:
    app.task(name=RUN_TASK)(execute_run)
