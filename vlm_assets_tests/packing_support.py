"""Packing a catalogue and a length table given as frames, read back as frames for assertions."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from vlm_assets.atomic import write_parquet
from vlm_assets.catalog.lookup import SampleLookup
from vlm_assets.packing.binpack import Bins
from vlm_assets.packing.plan import PackingOutcome, pack_source
from vlm_assets.packing.records import RECORD_COLUMNS, PackedRecord, SampleRows, record_of_line
from vlm_assets.packing.wds import ShardInfo, write_shards_from_jsonl


@dataclass(frozen=True)
class Packed:
    outcome: PackingOutcome
    bins: pd.DataFrame  # sample_ids and lengths as lists
    rejects: pd.DataFrame
    bins_path: Path
    rejects_path: Path


def read_packed(outcome: PackingOutcome, bins_path: Path, rejects_path: Path) -> Packed:
    bins = pd.read_parquet(bins_path)
    bins["sample_ids"] = bins["sample_ids"].map(list)
    bins["lengths"] = bins["lengths"].map(lambda values: [int(value) for value in values])
    bins["content_hashes"] = bins["content_hashes"].map(lambda values: [int(value) for value in values])
    return Packed(outcome, bins, pd.read_parquet(rejects_path), bins_path, rejects_path)


def pack_files(catalog: Path, lengths: Path, out: Path, sample_type: str, max_token_len: int,
               append: bool = False) -> Packed:
    bins_path, rejects_path = out / "bins.parquet", out / "rejects.parquet"
    outcome = pack_source(catalog, lengths, bins_path, rejects_path, sample_type, max_token_len,
                          keep_written_bins=append)
    return read_packed(outcome, bins_path, rejects_path)


def pack_frames(catalog: pd.DataFrame, lengths: pd.DataFrame, out: Path, sample_type: str, max_token_len: int,
                append: bool = False) -> Packed:
    out.mkdir(parents=True, exist_ok=True)
    # What a record is made of, when the test leaves it out: no text, no media.
    catalog = catalog.assign(**{column: [default] * len(catalog) for column, default in
                                (("messages", "[]"), ("media_files", []), ("media_kinds", []), ("media_refs", []),
                                 ("media_keys", []), ("media_stamps", []), ("media_views", [])) if column not in catalog})
    write_parquet(catalog, out / "catalog.parquet")
    write_parquet(lengths, out / "lengths.parquet")
    return pack_files(out / "catalog.parquet", out / "lengths.parquet", out, sample_type, max_token_len, append)


def samples_by_id(catalog: pd.DataFrame) -> dict[str, dict[str, Any]]:
    """A whole catalogue frame as the SampleRows packing reads (the product keeps a big one on disk:
    vlm_assets.catalog.lookup)."""
    columns = [column for column in RECORD_COLUMNS if column in catalog]
    return catalog.set_index("sample_id")[columns].to_dict("index")


def read_records(jsonl_path: Path, samples: SampleRows) -> Iterator[PackedRecord]:
    """The packed records of a `packed_json` file, each member's media ref looked up in `samples`."""
    with open(jsonl_path, "rb") as handle:
        for line_number, line in enumerate(handle, start=1):
            yield record_of_line(line, samples, jsonl_path, line_number)


def write_source_shards(jsonl_path: Path, catalog_path: Path, directory: Path, maxcount: int, maxsize: int = 10**9,
                        **options) -> list[ShardInfo]:
    """The shards of a `packed_json` file as packed_wds_shards writes them, media refs looked up in the
    catalogue at `catalog_path`; `options` go to write_shards_from_jsonl."""
    with SampleLookup(catalog_path, ["media_refs", "media_stamps"], near=jsonl_path) as samples:
        return write_shards_from_jsonl(jsonl_path, samples, directory, maxcount, maxsize, **options)


def first_fit_decreasing(lengths: np.ndarray, capacity: int) -> Bins:
    """Plain first-fit decreasing: the baseline packing is compared against (tests, bench/packing.py).
    A max-segment-tree over the bins' room finds the first bin that fits in log time."""
    values = np.asarray(lengths, dtype=np.int64)
    order = np.argsort(-values, kind="stable")
    size = 1
    while size < values.size:
        size *= 2
    tree = [0] * (2 * size)
    bin_of_sorted = np.zeros(values.size, dtype=np.int64)
    opened = 0
    for position, length in enumerate(values[order].tolist()):
        if tree[1] >= length:
            node = 1
            while node < size:
                node = 2 * node if tree[2 * node] >= length else 2 * node + 1
            target = node - size
        else:
            target, opened = opened, opened + 1
            node = target + size
            tree[node] = capacity
        tree[node] -= length
        node //= 2
        while node:
            tree[node] = max(tree[2 * node], tree[2 * node + 1])
            node //= 2
        bin_of_sorted[position] = target
    items = order[np.argsort(bin_of_sorted, kind="stable")]
    starts = np.zeros(int(bin_of_sorted.max(initial=-1)) + 2, dtype=np.int64)
    np.cumsum(np.bincount(bin_of_sorted), out=starts[1:])
    return Bins(items, starts)
