"""Independent re-reads of the packing outputs, each returning the problems it found."""

from __future__ import annotations

import json
import tarfile
from collections import Counter
from collections.abc import Iterable
from pathlib import Path

import pandas as pd

from vlm_assets.parallel import ordered_map
from vlm_assets.wording import plural

MAX_LISTED = 5
SHARDS_PER_PROCESS_FOR_A_POOL = 4


def _listed(values: Iterable[str]) -> str:
    values = list(values)
    more = f" (+{len(values) - MAX_LISTED} more)" if len(values) > MAX_LISTED else ""
    return ", ".join(repr(value) for value in values[:MAX_LISTED]) + more


def accounting_problems(catalog_ids: Iterable[str], bins: pd.DataFrame, rejects: pd.DataFrame) -> list[str]:
    """catalogue = packed ∪ rejects, disjoint, every id exactly once."""
    catalog_ids = list(catalog_ids)
    packed = [sample_id for ids in bins["sample_ids"] for sample_id in ids]
    rejected = list(rejects["sample_id"])
    problems = []
    for name, ids in (("packed", packed), ("rejects", rejected)):
        repeated = [sample_id for sample_id, count in Counter(ids).items() if count > 1]
        if repeated:
            problems.append(f"{len(repeated)} ids appear more than once in {name}: {_listed(repeated)}")
    packed_set, rejected_set, catalog_set = set(packed), set(rejected), set(catalog_ids)
    both = packed_set & rejected_set
    if both:
        problems.append(f"{len(both)} ids both packed and rejected: {_listed(sorted(both))}")
    missing = catalog_set - packed_set - rejected_set
    if missing:
        problems.append(f"{len(missing)} catalogue ids neither packed nor rejected: {_listed(sorted(missing))}")
    unknown = (packed_set | rejected_set) - catalog_set
    if unknown:
        problems.append(f"{len(unknown)} ids not in the catalogue: {_listed(sorted(unknown))}")
    return problems


def oversized_bins(bins: pd.DataFrame, max_token_len: int) -> list[int]:
    """Bins whose total (recomputed from the per-sample lengths) exceeds the maximum."""
    totals = bins["lengths"].map(sum)
    bad = (totals > max_token_len) | (totals != bins["total_len"])
    return [int(bin_id) for bin_id in bins.loc[bad, "bin_id"]]


def _member_names(shard: Path) -> list[str]:
    with tarfile.open(shard, "r:") as archive:
        return archive.getnames()


def expected_members(jsonl_path: Path) -> dict[str, set[str]]:
    """For each record id in `packed_json`, the tar member names its sample must have."""
    expected: dict[str, set[str]] = {}
    with open(jsonl_path, "rb") as handle:
        for line in handle:
            record = json.loads(line)
            key = record["id"]
            expected[key] = {f"{key}.json"} | {f"{key}.{name}" for names in record["media_files"] for name in names}
    return expected


def shard_problems(shards: list[Path], jsonl_path: Path, processes: int = 1) -> list[str]:
    """The shards hold exactly the records of `packed_json`, each with exactly its members.

    Python's tarfile reads the shards' member lists, `processes` shards at a time.
    """
    if len(shards) < SHARDS_PER_PROCESS_FOR_A_POOL * processes:
        processes = 1  # a pool's start-up (a second) would cost more than it saves
    expected = expected_members(jsonl_path)
    found: dict[str, set[str]] = {}
    home: dict[str, str] = {}
    problems = []
    for shard, names in zip(shards, ordered_map(_member_names, shards, processes)):
        if not names:
            problems.append(f"{shard.name} is empty")
        if names != sorted(names):
            problems.append(f"{shard.name}: members are not sorted")
        for name in names:
            key = name.split(".", 1)[0]
            if home.setdefault(key, shard.name) != shard.name:
                problems.append(f"sample {key!r} appears in both {home[key]} and {shard.name}")
            found.setdefault(key, set()).add(name)
    missing = sorted(set(expected) - set(found))
    if missing:
        problems.append(f"{plural(len(missing), 'record')} missing from the shards: {_listed(missing)}")
    extra = sorted(set(found) - set(expected))
    if extra:
        problems.append(f"{plural(len(extra), 'tar sample')} not in packed_json: {_listed(extra)}")
    mismatched = sorted(key for key in set(found) & set(expected) if found[key] != expected[key])
    if mismatched:
        key = mismatched[0]
        problems.append(
            f"{plural(len(mismatched), 'sample')} whose members differ from their record, e.g. {key!r}: "
            f"tar has {sorted(found[key])}, record names {sorted(expected[key])}"
        )
    return problems
