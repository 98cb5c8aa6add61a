"""A source's dedup decisions on disk: `dedup/<source>.parquet`, one row per removed sample
(sample_id, kind, kept_id, distance, jaccard, reason), in keep order; the token lengths make each
a rejected row with its reason."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import TYPE_CHECKING

import pyarrow as pa
import pyarrow.parquet as pq

from vlm_assets.atomic import atomic_path

if TYPE_CHECKING:  # the decisions' reader (the token lengths) need not import the deciding and its libraries
    from vlm_assets.dedup.decide import Removal

DECISION_SCHEMA = pa.schema([
    ("sample_id", pa.string()),
    ("kind", pa.string()),
    ("kept_id", pa.string()),
    ("distance", pa.float64()),
    ("jaccard", pa.float64()),
    ("reason", pa.string()),
])


def write_decisions(path: Path, removed: list[Removal]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    table = pa.table({name: [getattr(removal, name) for removal in removed] for name in DECISION_SCHEMA.names},
                     schema=DECISION_SCHEMA)
    with atomic_path(path) as tmp:
        pq.write_table(table, tmp)


def decisions_digest(path: Path) -> str:
    """sha256 of the decisions file's bytes ("" without one): what the token lengths read of it."""
    return hashlib.sha256(path.read_bytes()).hexdigest() if path.is_file() else ""


def removal_kinds(path: Path) -> dict[str, str]:
    """Each reason a sample of the source at `path` was removed for -> its kind of duplicate (none where
    the source has no decisions yet)."""
    if not path.exists():
        return {}
    table = pq.read_table(path, columns=["reason", "kind"])
    return dict(zip(table.column("reason").to_pylist(), table.column("kind").to_pylist()))


def removed_reasons(path: Path) -> dict[str, str]:
    """Sample id -> why it was removed, of the source whose decisions are at `path` (none where it has none yet)."""
    if not path.exists():
        return {}
    table = pq.read_table(path, columns=["sample_id", "reason"])
    return dict(zip(table.column("sample_id").to_pylist(), table.column("reason").to_pylist()))
