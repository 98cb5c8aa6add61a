"""A failed step's cause in one line, for the CLI's report and the sensors' logs."""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Collection
from pathlib import Path

import dagster as dg

from vlm_assets.catalog.schema import STATUS_OK
from vlm_assets.packing.empty import EmptySource, may_be_empty
from vlm_assets.parquet_batches import parquet_batches
from vlm_assets.wording import plural

ERRNO_MESSAGE = re.compile(r"\[Errno \d+\] (?P<reason>[^:']+): '(?P<path>[^']*)'")


# Errors of ours whose message says all: their class's name adds nothing to the line.
SELF_EXPLAINED = frozenset({"Failure", "ConfigError", "MediumChanged"})


def root_cause(error) -> str:
    """One line naming what went wrong: the first of the chained errors that is not Dagster's wrapper."""
    if error is None:
        return "unknown error"
    while error.cause is not None and error.cls_name.startswith("Dagster"):
        error = error.cause
    message = (error.message or "").strip()
    first = message.splitlines()[0] if message else error.cls_name
    first = re.sub(rf"^[\w.]+(Error|Exception|Failure|\.{re.escape(error.cls_name)}): ", "", first)
    # Only an OS error's own message is recast: one quoted further on (a rejected sample's reason, in a
    # failure that counts the reasons) is part of a message that says more from its start.
    found = ERRNO_MESSAGE.match(first)
    if found:
        return f"{found['reason']}: {found['path']}"
    return first if error.cls_name in SELF_EXPLAINED else f"{first} ({error.cls_name})"


# The events whose error says why a run failed: a step's own, or its resources' (a storage root on an
# object store that stopped answering fails the resource that opens it, before the step starts).
FAILURE_EVENT_TYPES = frozenset({dg.DagsterEventType.STEP_FAILURE, dg.DagsterEventType.RESOURCE_INIT_FAILURE})


def failure_of(event: dg.DagsterEvent) -> str | None:
    """The one-line cause a failure event gives (see FAILURE_EVENT_TYPES); None for any other event."""
    return root_cause(event.event_specific_data.error) if event.event_type in FAILURE_EVENT_TYPES else None


# Reasons named in one line: a step's that left a source without samples, a source's in a run's summary.
NAMED_REASONS = 3
REASON_BATCH_ROWS = 65536


def reasons_in(table: Path, status_column: str | None = "status", ok_status: str = STATUS_OK) -> Counter[str]:
    """The `reason` column's values of a catalogue, lengths or rejects table, rows not `ok` only
    (every row when there is no status column)."""
    columns = ["reason"] + ([status_column] if status_column else [])
    reasons: Counter[str] = Counter()
    for batch in parquet_batches(table, columns, REASON_BATCH_ROWS):
        values = batch.column(0).to_pylist()
        statuses = batch.column(1).to_pylist() if status_column else [None] * len(values)
        reasons.update(reason for reason, status in zip(values, statuses) if status != ok_status)
    return reasons


def nothing_left(source: str, step: str, reasons: Counter[str], reasons_md: str) -> dg.Failure:
    """The failure of the step after which a source has no sample left: here, not at a later step
    that would find nothing to write. Its commonest reasons in the line, all of them in the metadata."""
    total = sum(reasons.values())
    return dg.Failure(
        description=f"{source}: no sample left after {step} ({total} rejected): {commonest_reasons(reasons) or 'no records'}",
        metadata={"rejected": total, "rejects_by_reason": dg.MetadataValue.md(reasons_md)},
    )


def emptied(source: str, step: str, reasons: Counter[str], duplicate_reasons: Collection[str],
            reasons_md: str) -> EmptySource:
    """A source `step` left with no sample, built empty where deduplication removed any of its samples
    (`duplicate_reasons`: the reasons it gave them); else the failure naming its reasons (nothing_left)."""
    duplicates = sum(count for reason, count in reasons.items() if reason in duplicate_reasons)
    if not may_be_empty(duplicates):
        raise nothing_left(source, step, reasons, reasons_md)
    return EmptySource(source, sum(reasons.values()), duplicates)


def commonest_reasons(reasons: Counter[str], named: int = NAMED_REASONS) -> str:
    """The `named` commonest reasons in one line, each with its count ("" for none)."""
    # Reasons that differ only in their numbers (each sample's own length) count as one, shown by an example.
    grouped: Counter[str] = Counter()
    example: dict[str, str] = {}
    for reason, count in reasons.items():
        shape = re.sub(r"\d+", "N", reason)
        grouped[shape] += count
        example.setdefault(shape, reason)
    ranked = grouped.most_common()
    line = "; ".join(f"{count} × {example[shape]}" + (" (and the like)" if count > reasons[example[shape]] else "")
                     for shape, count in ranked[:named])
    rest = ranked[named:]
    return line + (f"; {plural(len(rest), 'more reason')} ({plural(sum(count for _, count in rest), 'sample')})"
                   if rest else "")
