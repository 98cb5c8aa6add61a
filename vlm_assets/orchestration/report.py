"""What a `vlm-assets run` says: each run's outcome as it arrives, the summary, the outputs on disk."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from vlm_assets.config import AppConfig
from vlm_assets.layout import StorageLayout
from vlm_assets.orchestration.task import TaskOutcome
from vlm_assets.wording import plural


@dataclass
class RunSummary:
    runs: int = 0
    failed_runs: list[str] = field(default_factory=list)
    failed_checks: list[str] = field(default_factory=list)
    check_warnings: list[str] = field(default_factory=list)  # failed WARN checks: reported, not blocking
    materialized: list[str] = field(default_factory=list)
    up_to_date: list[str] = field(default_factory=list)
    blocked: list[str] = field(default_factory=list)
    dead_runs_failed: list[str] = field(default_factory=list)
    interrupted: bool = False

    @property
    def ok(self) -> bool:
        return not (self.failed_runs or self.failed_checks or self.blocked or self.interrupted)


def report_outcome(outcome: TaskOutcome, summary: RunSummary, echo: Callable[[str], None]) -> None:
    for reason in outcome.retried:
        echo(f"  ↻ {outcome.label}: {reason}")
    if outcome.materialized:
        summary.materialized.append(outcome.label)
        echo(f"  ✓ materialised {outcome.label}")
    for name, passed, severity in outcome.checks:
        echo(f"  {'✓' if passed else '✗'} check {outcome.asset}:{name} {'passed' if passed else f'FAILED ({severity})'}")
    summary.failed_checks.extend(f"{outcome.asset}:{name} ({outcome.label})" for name in outcome.failed_checks)
    summary.check_warnings.extend(f"{outcome.asset}:{name} ({outcome.label})" for name in outcome.warned_checks)
    if not outcome.success:
        where = f"; full log: {outcome.log_path}" if outcome.log_path else ""
        summary.failed_runs.append(f"{outcome.label}: {outcome.failure}" + (f" (run {outcome.run_id}{where})" if outcome.run_id else ""))
        echo(f"  ✗ {outcome.label} failed: {outcome.failure}{where}")


def print_outputs(app: AppConfig, echo: Callable[[str], None] = print) -> None:
    if app.storage_url is not None:
        echo(f"outputs published to {app.storage_url} (Energon: msc://_s3-{app.storage_url.bucket}/{app.storage_url.key}/packed_wds/…), "
             "built in the working copy:")
    echo(f"outputs under {app.storage_root}:")
    for path in StorageLayout(app.storage_root).output_folders:
        if path.exists():
            count = sum(1 for item in path.rglob("*") if item.is_file())
            echo(f"  {path}  ({plural(count, 'file')})")
