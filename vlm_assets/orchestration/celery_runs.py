"""Runs of `vlm-assets run --executor celery`, each executed whole by a `vlm-assets worker` process.

$VLM_ASSETS_CELERY_BROKER (e.g. redis://127.0.0.1:6379/0) names the broker; it is also the result
backend, so a worker needs nothing else to answer the process that sent it work. The steps of
runs the daemon or the UI launch go to the same workers through the code location's executor
(vlm_assets.defs.executor).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from vlm_assets.config import ConfigError
from vlm_assets.defs.executor import CELERY_BROKER_ENV, broker_url
from vlm_assets.orchestration.task import Submission, TaskOutcome, execute_task
from vlm_assets.package.writer import sha256_file

if TYPE_CHECKING:
    from celery import Celery

PING_TIMEOUT_S = 2.0
RUN_TASK = "vlm_assets.execute_run"
# The queue dagster-celery's workers consume (dagster_celery.make_app); `vlm-assets worker` serves only it.
WORKER_QUEUE = "dagster"
START_WORKERS_HINT = "start workers with `vlm-assets worker --config FILE` (README \"Scaling out\")"


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


def require_celery_workers(echo: Callable[[str], None]) -> None:
    """Refuse to start when no worker would take the runs: they would wait for ever."""
    broker = require_broker()
    workers = answering_workers(broker)
    if not workers:
        raise ValueError(f"no Celery worker answers on {printable_url(broker)} ($VLM_ASSETS_CELERY_BROKER); "
                         f"{START_WORKERS_HINT}")
    echo(f"steps go to {len(workers)} Celery worker(s): {', '.join(workers)}")


def execute_on_workers(config_path: str, asset: str, partition: str | None, log_dir: str,
                       processes: int | None = None) -> TaskOutcome:
    """One run of `asset` (that partition) with its checks, executed whole by one worker; this process waits.

    `processes` is not passed on: a worker gives each run its own share of its machine's cores.
    One task per run rather than dagster-celery's one per step: its executor looks for finished
    steps once a second and that period is not configurable, so a run of an asset and its checks
    took about 2.7 s more than in-process; a task's result arrives as soon as it is stored.
    """
    from celery import Celery

    broker = require_broker()
    with Celery("vlm-assets", broker=broker, backend=broker, set_as_current=False) as app:
        config_sha256 = sha256_file(Path(config_path))
        result = app.send_task(RUN_TASK, args=(config_path, config_sha256, asset, partition, log_dir), queue=WORKER_QUEUE)
        try:
            fields = result.get()
        except Exception as error:  # the worker could not run it: its pool process died, a config error, ...
            return TaskOutcome(asset, partition, failure=f"{error} ({type(error).__name__} on a Celery worker)")
    fields["checks"] = [tuple(check) for check in fields["checks"]]
    return TaskOutcome(**fields)


CELERY = Submission(execute_on_workers, require_celery_workers)


def execute_run(config_path: str, config_sha256: str, asset: str, partition: str | None,
                log_dir: str) -> dict[str, object]:
    """A worker's side of `execute_on_workers`: the run, in this pool process, summarised as JSON fields.

    `config_sha256` makes sure the worker reads the file the run was started with, not an edited
    one nor another file at that path on its machine.
    """
    if sha256_file(Path(config_path)) != config_sha256:
        raise ConfigError(f"{config_path}: not the file the run was started with (edited since, or a different "
                          "file at this path on this machine); restart the run")
    return dataclasses.asdict(execute_task(config_path, asset, partition, log_dir))


def register_run_task(app: Celery) -> None:
    app.task(name=RUN_TASK)(execute_run)
