"""Packing a catalogue and a length table given as frames, read back as frames for assertions."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pandas as pd

from vlm_assets.atomic import write_parquet
from vlm_assets.packing.plan import PackingOutcome, pack_source


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
                                 ("media_keys", [])) if column not in catalog})
    write_parquet(catalog, out / "catalog.parquet")
    write_parquet(lengths, out / "lengths.parquet")
    return pack_files(out / "catalog.parquet", out / "lengths.parquet", out, sample_type, max_token_len, append)
