"""A source's dedup decisions on disk: `dedup/<source>.parquet`, one row per removed sample
(sample_id, kind, kept_id, distance, jaccard, reason), in keep order; the token lengths make each
a rejected row with its reason."""

from __future__ import annotations

import hashlib
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from vlm_assets.atomic import atomic_path

# Duplicate kinds, as counted and named in reasons (vlm_assets.dedup.decide).
EXACT = "exact"
NEAR_IMAGE = "near_image"
NEAR_VIDEO = "near_video"
NEAR_TEXT = "near_text"
SAME_MEDIA = "same_media"  # media_only
KINDS = (EXACT, NEAR_IMAGE, NEAR_VIDEO, NEAR_TEXT, SAME_MEDIA)
# Kinds of equal bytes, which no distance or threshold decides: not judged by the share check.
COPIES = frozenset({EXACT, SAME_MEDIA})

@dataclass(frozen=True)
class Removal:
    """One removed sample, a row of the decisions file."""

    sample_id: str
    kind: str
    kept_id: str
    distance: float  # bits (images, videos), 0 for exact and same media
    jaccard: float  # of the texts; 1 when equal
    reason: str


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


def removed_kinds(path: Path) -> Counter[str]:
    """Samples removed from the source whose decisions are at `path`, by kind of duplicate (none without decisions)."""
    if not path.exists():
        return Counter()
    return Counter(pq.read_table(path, columns=["kind"]).column("kind").to_pylist())
