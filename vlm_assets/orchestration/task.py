"""One asset partition materialised as one run, in a worker process: the task, its outcome, its log.

`Submission` says where the tasks of a `vlm-assets run` execute: `IN_WORKER_PROCESS` here, in the
local worker processes (orchestration.workers); orchestration.celery_runs.CELERY on Celery workers.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

import dagster as dg

from vlm_assets.atomic import atomic_write_text
from vlm_assets.defs.failures import failure_of
from vlm_assets.defs.resources import VlmConfig, latest_materialization
from vlm_assets.defs.tags import ALIVE_TAG, ASSET_TAG, FORCE_TAG, LAUNCHED_BY_CLI, LAUNCHED_BY_TAG
from vlm_assets.locks import process_token
from vlm_assets.orchestration.instance import open_instance
from vlm_assets.orchestration.worker_output import output_log
from vlm_assets.package.writer import sha256_file
from vlm_assets.parallel import STEP_PROCESSES_ENV_VAR

# Steps' INFO lines on the console logger: in a worker of `vlm-assets run` that is the workers' log
# file (orchestration.worker_output), not the terminal.
RUN_LOGGING = {"loggers": {"console": {"config": {"log_level": "INFO"}}}}


def label(asset: str, partition: str | None) -> str:
    return asset + (f" [{partition}]" if partition else "")


class CheckOutcome(NamedTuple):
    name: str
    passed: bool
    severity: str  # ERROR or WARN
    description: str  # what the check found, and for a failed one what to do; "" when it says nothing

    @classmethod
    def of(cls, evaluation: dg.AssetCheckEvaluation) -> CheckOutcome:
        # A check that gives no description (or one recorded before it gave one) still shows its figures.
        figures = ", ".join(f"{key} {entry.value:g}" for key, entry in evaluation.metadata.items()
                            if isinstance(entry.value, (int, float)) and not isinstance(entry.value, bool))
        return cls(evaluation.check_name, evaluation.passed, evaluation.severity.value, evaluation.description or figures)


@dataclass
class TaskOutcome:
    asset: str
    partition: str | None
    run_id: str = ""
    success: bool = False
    materialized: bool = False
    checks: list[CheckOutcome] = field(default_factory=list)
    failure: str = ""  # root cause, one line
    log_path: str = ""
    retried: list[str] = field(default_factory=list)  # why it was sent again (a lost Celery worker)

    @property
    def label(self) -> str:
        return label(self.asset, self.partition)

    @property
    def failed_checks(self) -> list[CheckOutcome]:
        return [check for check in self.checks if not check.passed and check.severity == "ERROR"]

    @property
    def warned_checks(self) -> list[CheckOutcome]:
        return [check for check in self.checks if not check.passed and check.severity == "WARN"]


# Executes one task: (config path, asset, partition, log folder, processes, force) -> its outcome.
Execute = Callable[[str, str, str | None, str, int | None, bool], TaskOutcome]


@dataclass(frozen=True)
class Submission:
    """Where runs execute: `execute` is what a local worker process does with each task (it must
    pickle: a module-level function); `check_ready` refuses to start when nothing would take them."""

    execute: Execute
    check_ready: Callable[[Callable[[str], None]], None] = lambda echo: None


# Per config path, with the sha256 of the file it was built from: a Celery worker's pool process
# lives on and may execute runs of several configs, and of a config edited since its last run.
_worker: dict[str, tuple[str, tuple[dg.Definitions, dg.DagsterInstance, VlmConfig]]] = {}


def worker_state(config_path: str) -> tuple[dg.Definitions, dg.DagsterInstance, VlmConfig]:
    sha256 = sha256_file(Path(config_path))
    if config_path not in _worker or _worker[config_path][0] != sha256:
        from vlm_assets.definitions import build_definitions

        defs = build_definitions(config_path)
        # Under the lock: the CLI and its other workers open a new instance at the same moment.
        instance = open_instance(Path(os.environ["DAGSTER_HOME"]))
        _worker[config_path] = (sha256, (defs, instance, defs.resources["vlm_config"]))
    return _worker[config_path][1]


def execute_task(config_path: str, asset: str, partition: str | None, log_dir: str,
                 processes: int | None = None, force: bool = False) -> TaskOutcome:
    """Materialise one asset partition (and its checks) as one run in this process; summarise what happened.

    `processes`: how many processes a chunked step of this run may use (None: as the environment says;
    on a Celery worker, its own share of its machine's cores).
    """
    if processes is not None:
        os.environ[STEP_PROCESSES_ENV_VAR] = str(processes)
    defs, instance, vlm_config = worker_state(config_path)
    token = process_token(vlm_config.app.storage_root)
    result = dg.materialize(
        list(defs.assets or []) + list(defs.asset_checks or []),
        selection=dg.AssetSelection.assets(asset),
        partition_key=partition,
        instance=instance,
        resources=defs.resources or {},
        run_config=RUN_LOGGING,
        raise_on_error=False,
        tags={LAUNCHED_BY_TAG: LAUNCHED_BY_CLI, ASSET_TAG: asset, ALIVE_TAG: str(token),
              **({FORCE_TAG: "true"} if force else {})},
    )
    outcome = TaskOutcome(asset, partition, run_id=result.run_id, success=result.success)
    for event in result.all_events:
        if event.event_type_value == "ASSET_MATERIALIZATION":
            outcome.materialized = True
        elif event.event_type_value == "ASSET_CHECK_EVALUATION":
            outcome.checks.append(CheckOutcome.of(event.event_specific_data))
        elif not outcome.failure:
            outcome.failure = failure_of(event) or ""
    if not result.success:
        outcome.failure = outcome.failure or "the run failed (see its log)"
        outcome.log_path = str(write_run_log(instance, result.run_id, Path(log_dir)))
    return outcome


IN_WORKER_PROCESS = Submission(execute_task)


def checks_of_latest_build(instance: dg.DagsterInstance, asset: str, partition: str | None) -> list[CheckOutcome]:
    """The checks evaluated in the run that made the asset partition's latest materialisation: what an
    up-to-date asset partition, not run again, was last found to be."""
    record = latest_materialization(instance, asset, partition)
    if record is None:
        return []
    entries = instance.all_logs(record.run_id, of_type=dg.DagsterEventType.ASSET_CHECK_EVALUATION)
    return [CheckOutcome.of(entry.dagster_event.event_specific_data) for entry in entries]


def write_run_log(instance: dg.DagsterInstance, run_id: str, log_dir: Path) -> Path:
    """Every event of the run, with full tracebacks, in one text file, after where to find what
    else the run's process printed."""
    output = output_log()
    lines = [f"what the worker processes printed (libraries' own output too): {output}"] if output else []
    for entry in instance.all_logs(run_id):
        stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(entry.timestamp))
        lines.append(f"{stamp} {entry.step_key or '-'}: {entry.user_message or entry.message or ''}")
        event = entry.dagster_event
        error = getattr(event.event_specific_data, "error", None) if event is not None else None
        if error is not None:
            lines.append(error.to_string())
    path = log_dir / f"run-{run_id}.log"
    atomic_write_text(path, "\n".join(lines) + "\n")
    return path
