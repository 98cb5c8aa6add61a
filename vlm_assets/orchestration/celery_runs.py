"""Runs of `vlm-assets run --executor celery`, each executed whole by a `vlm-assets worker` process.

$VLM_ASSETS_CELERY_BROKER (e.g. redis://127.0.0.1:6379/0) names the broker; it is also the result
backend, so a worker needs nothing else to answer the process that sent it work. The steps of
runs the daemon or the UI launch go to the same workers through the code location's executor
(vlm_assets.defs.executor).
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from vlm_assets.config import ConfigError
from vlm_assets.defs.executor import CELERY_BROKER_ENV, broker_url
from vlm_assets.orchestration.task import CheckOutcome, Submission, TaskOutcome, execute_task
from vlm_assets.package.writer import sha256_file

if TYPE_CHECKING:
    from celery import Celery
    from celery.result import AsyncResult

PING_TIMEOUT_S = 2.0
# A worker that executes a run and answers no ping for this long is lost (machine gone, process
# group killed); its run is sent again, at most RUN_ATTEMPTS times in all. Pings are LOST_POLL_S apart.
LOST_AFTER_ENV_VAR = "VLM_ASSETS_WORKER_LOST_AFTER_S"
LOST_AFTER_S = float(os.environ.get(LOST_AFTER_ENV_VAR, "60"))
LOST_POLL_S = 5.0
RUN_ATTEMPTS = 3
RUN_TASK = "vlm_assets.execute_run"
# The queue dagster-celery's workers consume (dagster_celery.make_app); `vlm-assets worker` serves only it.
WORKER_QUEUE = "dagster"
START_WORKERS_HINT = "start workers with `vlm-assets worker --config FILE` (docs/scaling-out.md)"


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
    """Names of the Celery workers that answer a ping on `broker` (within PING_TIMEOUT_S)."""
    return sorted(name for reply in _ping(broker) for name in reply)


def worker_answers(broker: str, name: str) -> bool:
    """Whether the worker `name` answers a ping on `broker`: known as soon as its reply comes, where a
    ping of every worker waits PING_TIMEOUT_S for replies (a finished run's result waited that long)."""
    return any(name in reply for reply in _ping(broker, destination=[name], limit=1))


def _ping(broker: str, **options: object) -> list[dict]:
    from celery import Celery
    from kombu.exceptions import OperationalError

    with Celery("vlm-assets", broker=broker, set_as_current=False) as app:
        try:
            return app.control.ping(timeout=PING_TIMEOUT_S, **options)
        except OperationalError as error:
            raise ValueError(f"cannot reach the Celery broker {printable_url(broker)} (${CELERY_BROKER_ENV}): {error}") from None


def require_celery_workers(echo: Callable[[str], None]) -> None:
    """Refuse to start when no worker would take the runs: they would wait for ever."""
    broker = require_broker()
    workers = answering_workers(broker)
    if not workers:
        raise ValueError(f"no Celery worker answers on {printable_url(broker)} ($VLM_ASSETS_CELERY_BROKER); "
                         f"{START_WORKERS_HINT}")
    echo(f"steps go to {len(workers)} Celery worker(s): {', '.join(workers)}")


class WorkerLost(Exception):
    """The worker executing a run stopped answering (its machine or its whole process group gone)."""


def execute_on_workers(config_path: str, asset: str, partition: str | None, log_dir: str,
                       processes: int | None = None, force: bool = False) -> TaskOutcome:
    """One run of `asset` (that partition) with its checks, executed whole by one worker; this process waits.

    `processes` is not passed on: a worker gives each run its own share of its machine's cores.
    One task per run rather than dagster-celery's one per step: its executor looks for finished
    steps once a second and that period is not configurable, so a run of an asset and its checks
    took about 2.7 s more than in-process; a task's result arrives as soon as it is stored.

    A worker that is lost while it executes the run is noticed within $VLM_ASSETS_WORKER_LOST_AFTER_S
    (see wait_for_result): the run's Dagster run is failed as dead and the task sent again, at most
    RUN_ATTEMPTS times in all.
    """
    from celery import Celery

    broker = require_broker()
    lost: list[str] = []
    with Celery("vlm-assets", broker=broker, backend=broker, set_as_current=False) as app:
        config_sha256 = sha256_file(Path(config_path))
        while True:
            result = app.send_task(RUN_TASK, args=(config_path, config_sha256, asset, partition, log_dir, force),
                                   queue=WORKER_QUEUE)
            try:
                fields = wait_for_result(result, broker)
                break
            except WorkerLost as error:
                lost.append(str(error))
                # Should the lost worker's message come back from the broker, the workers drop it.
                app.control.revoke(result.id)
                fail_runs_of_lost_workers()
                if len(lost) == RUN_ATTEMPTS:
                    return TaskOutcome(asset, partition, failure=f"{'; '.join(lost)}; not sent again after {RUN_ATTEMPTS} attempts")
            except Exception as error:  # the worker could not run it: a config error, ...
                return TaskOutcome(asset, partition, failure=f"{error} ({type(error).__name__} on a Celery worker)")
    fields["checks"] = [CheckOutcome(*check) for check in fields["checks"]]
    fields["retried"] = [f"{reason}; sent again" for reason in lost]
    return TaskOutcome(**fields)


def wait_for_result(result: AsyncResult, broker: str) -> dict:
    """The task's result once stored; WorkerLost when the worker that started it has not answered a
    ping for LOST_AFTER_S. A task still queued waits as long as it takes: the workers are busy, not lost."""
    from celery.exceptions import TimeoutError as ResultTimeout

    silent_since: float | None = None
    while True:
        try:
            return result.get(timeout=LOST_POLL_S)
        except ResultTimeout:
            pass
        info = result.info if result.state == "STARTED" else None
        host = info.get("hostname") if isinstance(info, dict) else None
        if host is None or worker_answers(broker, host):
            silent_since = None
            continue
        silent_since = silent_since or time.monotonic()
        if time.monotonic() - silent_since >= LOST_AFTER_S:
            raise WorkerLost(f"worker {host} stopped answering while it executed the run")


def fail_runs_of_lost_workers() -> None:
    """Fail the lost worker's Dagster run (its liveness file is free now), so its pool slots do not
    hold back the run sent in its place."""
    from vlm_assets.defs.automation.dead_runs import fail_dead_runs
    from vlm_assets.orchestration.instance import open_instance

    with open_instance(Path(os.environ["DAGSTER_HOME"])) as instance:
        fail_dead_runs(instance)


CELERY = Submission(execute_on_workers, require_celery_workers)


def execute_run(config_path: str, config_sha256: str, asset: str, partition: str | None,
                log_dir: str, force: bool = False) -> dict[str, object]:
    """A worker's side of `execute_on_workers`: the run, in this pool process, summarised as JSON fields.

    `config_sha256` makes sure the worker reads the file the run was started with, not an edited
    one nor another file at that path on its machine.
    """
    if sha256_file(Path(config_path)) != config_sha256:
        raise ConfigError(f"{config_path}: not the file the run was started with (edited since, or a different "
                          "file at this path on this machine); restart the run")
    return dataclasses.asdict(execute_task(config_path, asset, partition, log_dir, force=force))


def register_run_task(app: Celery) -> None:
    """The run task on a worker's app. Acknowledged when done, not on receipt, and put back in the
    queue when the pool process executing it dies: another process or worker takes it. The worker
    records when it starts a run, and where (what wait_for_result watches)."""
    app.conf.update(task_track_started=True)
    app.task(name=RUN_TASK, acks_late=True, reject_on_worker_lost=True)(execute_run)
