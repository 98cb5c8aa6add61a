"""The Celery executor: runs whose steps go to `vlm-assets worker` processes through the broker.

$VLM_ASSETS_CELERY_BROKER (e.g. redis://127.0.0.1:6379/0) names the broker; it is also the result
backend, so a worker needs nothing else to answer the run that sent it a step. A worker rebuilds
the job it is sent from a pointer: the code location (`vlm_assets.definitions`, for runs the daemon
or the UI launch) or `celery_asset_job` (for `vlm-assets run --executor celery`).
"""

from __future__ import annotations

import hashlib
import os
import re
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path

import dagster as dg

CELERY_BROKER_ENV = "VLM_ASSETS_CELERY_BROKER"
PARTITION_TAG = "dagster/partition"
PING_TIMEOUT_S = 2.0
# A step that no worker finished, in the error dagster-celery fails the run with.
WORKER_ERROR = re.compile(r"^\[(?P<step>[^\]]+)\]: (?:[\w.]*\.)?(?P<cls>\w+): (?P<error>.+)$", re.MULTILINE)
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


def celery_asset_job(config_path: str, asset: str, config_sha256: str) -> dg.JobDefinition:
    """`asset` with its checks, as a job of the code location built from `config_path`.

    A worker rebuilds it from these arguments to execute a step; `config_sha256` makes sure it reads
    the file the run was started with (not an edited one, nor another file at that path on its
    machine), and keys Dagster's per-process cache of the rebuilt job. Dagster refuses to rebuild
    the implicit asset job outside its code location, hence one named job per asset.
    """
    from vlm_assets.config import ConfigError
    from vlm_assets.definitions import build_definitions

    if file_sha256(config_path) != config_sha256:
        raise ConfigError(f"{config_path}: not the file the run was started with (edited since, or a different "
                          "file at this path on this machine); restart the run")
    job = dg.define_asset_job(f"{asset}_job", selection=dg.AssetSelection.assets(asset))
    return dg.Definitions.merge(build_definitions(config_path), dg.Definitions(jobs=[job])).resolve_job_def(job.name)


def file_sha256(path: str) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def execute_on_workers(config_path: str, asset: str, partition: str | None, instance: dg.DagsterInstance,
                       run_config: Mapping[str, object], tags: Mapping[str, str]) -> dg.JobExecutionResult:
    """One run of `asset` (that partition) with its checks, orchestrated here, each step on a worker."""
    # Without a broker the code location's executor is the in-process one: the steps would quietly run here.
    require_broker()
    job = dg.build_reconstructable_job(__name__, celery_asset_job.__name__,
                                       reconstructable_args=(config_path, asset, file_sha256(config_path)))
    return dg.execute_job(job, instance=instance, run_config=run_config,
                          tags={**tags, **({PARTITION_TAG: partition} if partition else {})})


def worker_failure(events: Sequence[dg.DagsterEvent]) -> str:
    """One line for a step that no worker finished (its process died, or it could not rebuild the job)."""
    for event in events:
        if event.event_type_value != "PIPELINE_FAILURE":
            continue
        error = getattr(event.event_specific_data, "error", None)
        found = WORKER_ERROR.search(error.message) if error is not None else None
        if found:
            return f"{found['error']} ({found['cls']}; step {found['step']} on a Celery worker)"
    return ""
