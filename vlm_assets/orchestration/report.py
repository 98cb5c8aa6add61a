"""What a `vlm-assets run` says: each run's outcome as it arrives, the summary, the outputs on disk."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

import dagster as dg

from vlm_assets.catalog.table import reason_kind
from vlm_assets.config import AppConfig
from vlm_assets.dedup.decisions import removal_kinds
from vlm_assets.defs.failures import commonest_reasons, reasons_in
from vlm_assets.defs.resources import latest_materialization
from vlm_assets.inbox import inbox_sources
from vlm_assets.layout import StorageLayout
from vlm_assets.orchestration.task import CheckOutcome, TaskOutcome
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
    for check in outcome.checks:
        echo(f"  ✓ check {outcome.asset}:{check.name} passed" if check.passed else _failed_check_line(outcome.asset, check))
    summary.failed_checks.extend(_summary_line(outcome, check) for check in outcome.failed_checks)
    summary.check_warnings.extend(_summary_line(outcome, check) for check in outcome.warned_checks)
    if not outcome.success:
        where = f"; full log: {outcome.log_path}" if outcome.log_path else ""
        summary.failed_runs.append(f"{outcome.label}: {outcome.failure}" + (f" (run {outcome.run_id}{where})" if outcome.run_id else ""))
        echo(f"  ✗ {outcome.label} failed: {outcome.failure}{where}")


def report_up_to_date(outcome: TaskOutcome, summary: RunSummary, echo: Callable[[str], None]) -> None:
    """An asset partition not run again: its WARN checks that failed when it was built still stand,
    so they are reported as this run's warnings (passing checks are not repeated)."""
    summary.up_to_date.append(outcome.label)
    echo(f"= {outcome.label}: up to date")
    for check in outcome.warned_checks:
        echo(_failed_check_line(outcome.asset, check, when=" in its last build"))
    summary.check_warnings.extend(_summary_line(outcome, check) for check in outcome.warned_checks)


def _failed_check_line(asset: str, check: CheckOutcome, when: str = "") -> str:
    return (f"  ✗ check {asset}:{check.name} FAILED ({check.severity}){when}"
            + (f": {check.description}" if check.description else ""))


def _summary_line(outcome: TaskOutcome, check: CheckOutcome) -> str:
    return f"{outcome.asset}:{check.name} ({outcome.label})" + (f": {check.description}" if check.description else "")


def print_outputs(app: AppConfig, echo: Callable[[str], None] = print) -> None:
    if app.storage_url is not None:
        echo(f"outputs published to {app.storage_url} (Energon: msc://_s3-{app.storage_url.bucket}/{app.storage_url.key}/packed_wds/…), "
             "built in the working copy:")
    echo(f"outputs under {app.storage_root}:")
    for path in StorageLayout(app.storage_root).output_folders:
        if path.exists():
            count = sum(1 for item in path.rglob("*") if item.is_file())
            echo(f"  {path}  ({plural(count, 'file')})")


def samples_by_source(app: AppConfig, instance: dg.DagsterInstance) -> list[str]:
    """Per configured source, then per inbox source packed so far, its samples packed and rejected, with
    the commonest reasons, as its latest packing_bins recorded them: every record read ends up in one or
    the other. A source left with no sample (packing.empty) is said to be empty."""
    layout = StorageLayout(app.storage_root)
    lines = [f"samples by source, as packing_bins last counted them (each rejected one with its reason: "
             f"{layout.rejects('SOURCE')}):"]
    configured = [source.name for source in app.sources]
    inbox = [source.name for source in inbox_sources(app.inbox)]
    for name in configured + [name for name in inbox if name not in configured]:
        record = latest_materialization(instance, "packing_bins", name)
        materialization = record.asset_materialization if record is not None else None
        if materialization is None:
            if name in configured:
                lines.append(f"  {name}: not packed yet")
            continue
        lines.append(_source_line(layout, name, materialization))
    return lines


def _source_line(layout: StorageLayout, name: str, materialization: dg.AssetMaterialization) -> str:
    """What one source's packing_bins recorded, in one line."""
    packed, rejected = (materialization.metadata[key].value for key in ("packed_samples", "rejected_samples"))
    rejects = layout.rejects(name)
    reasons: Counter[str] = Counter()
    if rejected and rejects.exists():
        # Each duplicate's reason names the sample kept: they are counted together, by kind.
        duplicate_kinds, duplicates = removal_kinds(layout.dedup(name)), Counter[str]()
        for reason, count in reasons_in(rejects, status_column=None).items():
            if reason in duplicate_kinds:
                duplicates[duplicate_kinds[reason].replace("_", " ")] += count
            else:
                reasons[reason_kind(reason)] += count
        if duplicates:
            by_kind = ", ".join(f"{count} {kind}" for kind, count in duplicates.most_common())
            reasons[f"removed as duplicates ({by_kind})"] = sum(duplicates.values())
    empty = " (empty: every sample was a duplicate or rejected, it adds nothing to the shards)" \
        if "empty" in materialization.metadata else ""
    return f"  {name}: {packed} packed{empty}, {rejected} rejected" + (f": {commonest_reasons(reasons)}" if reasons else "")
