"""Turn a source's catalogue and length table into packing bins and a rejects table.

Every catalogue row ends up in exactly one of the two: a bin, or a reject with
a reason and a category (for counting in the UI). Nothing is dropped silently.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd

from vlm_assets.catalog.schema import STATUS_OK
from vlm_assets.packing.binpack import best_fit_decreasing
from vlm_assets.parquet_batches import parquet_batches

BIN_COLUMNS = ("bin_id", "sample_ids", "lengths", "total_len")
REJECT_COLUMNS = ("sample_id", "reason", "category")

# Which catalogue media_type each sample_type accepts.
ALLOWED_MEDIA_TYPES = {
    "packed_vqa": frozenset({"image"}),
    "packed_captioning": frozenset({"image"}),
    "packed_multi_mix_qa": frozenset({"image", "video", "mixed", "text"}),
}

CATEGORY_CATALOG = "catalog_rejected"
CATEGORY_LENGTH = "length_rejected"
CATEGORY_MISSING_LENGTH = "missing_length"
CATEGORY_OVER_MAX = "over_max_token_len"
CATEGORY_MEDIA_KIND = "wrong_media_kind"


class PackingInputError(ValueError):
    """The catalogue and length table cannot be packed together (names the file)."""


@dataclass(frozen=True)
class PackingPlan:
    bins: pd.DataFrame  # BIN_COLUMNS
    rejects: pd.DataFrame  # REJECT_COLUMNS

    @property
    def packed_count(self) -> int:
        return int(self.bins["lengths"].map(len).sum()) if len(self.bins) else 0


def plan_packing(
    catalog: pd.DataFrame,
    lengths: pd.DataFrame,
    sample_type: str,
    max_token_len: int,
    *,
    catalog_name: str = "catalog",
    lengths_name: str = "lengths",
    kept_bins: pd.DataFrame | None = None,
) -> PackingPlan:
    """Bins for the packable samples, rejects (with reasons) for every other one.

    `kept_bins` (packing.mode append: the bins written before) stay as they are, first; only the
    packable samples not in them are packed, into new bins numbered after them. A kept sample that
    is no longer packable with the same length, or a kept bin over `max_token_len`, is a
    PackingInputError: bins already written cannot change.
    """
    if sample_type not in ALLOWED_MEDIA_TYPES:
        raise ValueError(f"unknown sample_type {sample_type!r} (known: {', '.join(ALLOWED_MEDIA_TYPES)})")
    for frame, name in ((catalog, catalog_name), (lengths, lengths_name)):
        repeated = frame["sample_id"][frame["sample_id"].duplicated()]
        if len(repeated):
            raise PackingInputError(f"{name}: duplicate sample_id {repeated.iloc[0]!r}")
    joined = catalog[["sample_id", "status", "reason", "media_type"]].merge(
        lengths[["sample_id", "status", "reason", "token_len"]].rename(
            columns={"status": "length_status", "reason": "length_reason"}
        ),
        on="sample_id",
        how="left",
        sort=False,
    )
    allowed = ALLOWED_MEDIA_TYPES[sample_type]
    token_lens = pd.to_numeric(joined["token_len"], errors="coerce").to_numpy(dtype=np.float64, na_value=np.nan)
    # Most rows are packable: found in bulk, so only the rejects are looked at one by one.
    accepted = ((joined["status"] == STATUS_OK) & (joined["length_status"] == STATUS_OK)
                & joined["media_type"].isin(list(allowed))).to_numpy(dtype=bool, na_value=False)
    accepted = accepted & (token_lens <= max_token_len) & (token_lens >= 1)
    packable_ids: list[str] = joined["sample_id"].to_numpy(dtype=object)[accepted].tolist()
    packable_lengths: list[int] = token_lens[accepted].astype(np.int64).tolist()
    rejects: list[tuple[str, str, str]] = []
    for sample_id, status, reason, media_type, length_status, length_reason, token_len in joined[~accepted].itertuples(
        index=False, name=None
    ):
        if status != STATUS_OK:
            rejects.append((sample_id, reason or f"catalog status {status!r}", CATEGORY_CATALOG))
        elif not isinstance(length_status, str):
            rejects.append((sample_id, f"no token length in {lengths_name}", CATEGORY_MISSING_LENGTH))
        elif length_status != STATUS_OK:
            rejects.append((sample_id, length_reason or f"length status {length_status!r}", CATEGORY_LENGTH))
        elif media_type not in allowed:
            needs = "/".join(sorted(allowed))
            rejects.append((sample_id, f"{media_type} sample not allowed in {sample_type} (needs {needs})", CATEGORY_MEDIA_KIND))
        elif token_len > max_token_len:
            rejects.append((sample_id, f"token_len {int(token_len)} > max_token_len {max_token_len}", CATEGORY_OVER_MAX))
        else:
            rejects.append((sample_id, f"token_len {token_len} is not positive", CATEGORY_LENGTH))

    rejects_frame = pd.DataFrame(rejects, columns=list(REJECT_COLUMNS))
    if kept_bins is None or not len(kept_bins):
        return PackingPlan(bins_frame(packable_ids, np.asarray(packable_lengths, dtype=np.int64), max_token_len), rejects_frame)
    packable = dict(zip(packable_ids, packable_lengths))
    _check_kept(kept_bins, packable, rejects_frame, max_token_len)
    kept = {sample_id for ids in kept_bins["sample_ids"] for sample_id in ids}
    new_ids = [sample_id for sample_id in packable_ids if sample_id not in kept]
    new_bins = bins_frame(new_ids, np.asarray([packable[i] for i in new_ids], dtype=np.int64), max_token_len)
    new_bins["bin_id"] += len(kept_bins)
    bins = pd.concat([kept_bins[list(BIN_COLUMNS)], new_bins], ignore_index=True)
    return PackingPlan(bins, rejects_frame)


def _check_kept(kept_bins: pd.DataFrame, packable: dict[str, int], rejects: pd.DataFrame, max_token_len: int) -> None:
    why_rejected = dict(zip(rejects["sample_id"], rejects["reason"]))
    problems = []
    for ids, lengths, total in zip(kept_bins["sample_ids"], kept_bins["lengths"], kept_bins["total_len"]):
        if total > max_token_len:
            problems.append(f"a bin of {int(total)} tokens is over max_token_len {max_token_len}")
        for sample_id, length in zip(ids, lengths):
            if sample_id not in packable:
                problems.append(f"{sample_id}: {why_rejected.get(sample_id, 'no longer in the catalogue')}")
            elif packable[sample_id] != length:
                problems.append(f"{sample_id}: its length is now {packable[sample_id]}, was {length}")
    if problems:
        raise PackingInputError(
            f"packing.mode append keeps the bins written before, but {len(problems)} of them no longer hold "
            f"(first: {problems[0]}); set packing.mode: full to pack every sample afresh")


def bins_frame(sample_ids: list[str], lengths: np.ndarray, max_token_len: int) -> pd.DataFrame:
    groups = best_fit_decreasing(lengths, max_token_len)
    ids = np.asarray(sample_ids, dtype=object)
    rows = {
        "bin_id": np.arange(len(groups), dtype=np.int64),
        "sample_ids": [ids[group].tolist() for group in groups],
        "lengths": [lengths[group].tolist() for group in groups],
        "total_len": np.asarray([int(lengths[group].sum()) for group in groups], dtype=np.int64),
    }
    return pd.DataFrame(rows, columns=list(BIN_COLUMNS))


def iter_bins(path: Path, batch_rows: int = 8192) -> Iterator[tuple[int, list[str], list[int]]]:
    """`(bin_id, sample_ids, lengths)` of every bin, in order, a batch at a time from the file."""
    for batch in parquet_batches(path, ["bin_id", "sample_ids", "lengths"], batch_rows):
        data = batch.to_pydict()
        yield from zip(data["bin_id"], data["sample_ids"], data["lengths"])


def read_bins(path: Path) -> pd.DataFrame:
    frame = pd.read_parquet(path)
    frame["sample_ids"] = frame["sample_ids"].map(list)
    frame["lengths"] = frame["lengths"].map(lambda values: [int(value) for value in values])
    return frame


def fill_ratio(bins: pd.DataFrame, max_token_len: int) -> float:
    """Share of the bins' token budget that holds real tokens (1.0 = no padding)."""
    if not len(bins):
        return 0.0
    return float(bins["total_len"].sum()) / (len(bins) * max_token_len)
