"""Turn a source's catalogue and length table into packing bins and a rejects table.

Every catalogue row ends up in exactly one of the two: a bin, or a reject with a reason and a
category (for counting in the UI). Nothing is dropped silently. A bin holds one media type (image,
video or text): the consumer's packed encoders take one per pack.

Both tables are read a batch at a time and side by side: the length table holds the catalogue's
rows in the catalogue's order. What stays for the whole source is each packable sample's id (in
Arrow) and length and the packing's index arrays, tens of bytes per sample; rejects are written as
they are found.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from vlm_assets.atomic import atomic_path
from vlm_assets.media.checks import MediaCheckLog
from vlm_assets.catalog.schema import STATUS_OK
from vlm_assets.packing.binpack import Bins, best_fit_decreasing
from vlm_assets.packing.sample_ids import IdIndex, id_hashes
from vlm_assets.parquet_batches import parquet_batches

BIN_SCHEMA = pa.schema([("bin_id", pa.int64()), ("sample_ids", pa.list_(pa.string())),
                        ("lengths", pa.list_(pa.int64())), ("total_len", pa.int64()),
                        ("content_hashes", pa.list_(pa.uint64()))])
# What a sample's packed record and shard sample are made of (besides its id and length): with its
# media's stamps, hashed into `content_hashes`, so that an append finds a kept sample changed.
CONTENT_COLUMNS = ("messages", "media_files", "media_kinds", "media_refs", "media_keys")
_FIELD_SEPARATOR, _ITEM_SEPARATOR = "\x1e", "\x1f"
REJECT_SCHEMA = pa.schema([("sample_id", pa.string()), ("reason", pa.string()), ("category", pa.string())])
LENGTHS_READ = pa.schema([("sample_id", pa.string()), ("status", pa.string()), ("reason", pa.string()),
                          ("token_len", pa.int64())])
BATCH_ROWS = 8192
BINS_PER_ROW_GROUP = 8192
RELEASE_EVERY_BATCHES = 16
NAMED_CHANGES = 10  # kept samples named when their content changed

# Which catalogue media_type each sample_type accepts (never "mixed": a pack holds one media type).
ALLOWED_MEDIA_TYPES = {
    "packed_vqa": frozenset({"image"}),
    "packed_captioning": frozenset({"image"}),
    "packed_multi_mix_qa": frozenset({"image", "video", "text"}),
    "packed_chat_mix": frozenset({"image", "video", "text"}),
}

CATEGORY_CATALOG = "catalog_rejected"
CATEGORY_LENGTH = "length_rejected"
CATEGORY_MISSING_LENGTH = "missing_length"
CATEGORY_OVER_MAX = "over_max_token_len"
CATEGORY_MEDIA_KIND = "wrong_media_kind"


class PackingInputError(ValueError):
    """The catalogue and length table cannot be packed together (names the file)."""


@dataclass(frozen=True)
class PackingOutcome:
    bins: int
    bins_kept: int
    packed: int
    rejected: int


def pack_source(
    catalog: Path,
    lengths: Path,
    bins_target: Path,
    rejects_target: Path,
    sample_type: str,
    max_token_len: int,
    *,
    keep_written_bins: bool = False,
    media_checks: Path | None = None,
) -> PackingOutcome:
    """Write the bins of the packable samples to `bins_target`, a reject (with its reason) for every
    other catalogue row to `rejects_target` (in catalogue order); both atomically, or neither.

    With `keep_written_bins` (packing.mode append), the bins already at `bins_target` stay as they
    are, first; only the packable samples not in them are packed, into new bins numbered after them.
    A kept sample that is no longer packable with the same length or whose content changed (its
    catalogue row, or the stamp of a medium in the catalogue's `media_checks` log), or a kept bin over
    `max_token_len`, is a PackingInputError: bins already written cannot change.
    """
    if sample_type not in ALLOWED_MEDIA_TYPES:
        raise ValueError(f"unknown sample_type {sample_type!r} (known: {', '.join(ALLOWED_MEDIA_TYPES)})")
    kept = KeptBins.read(bins_target, max_token_len) if keep_written_bins and bins_target.exists() else None
    judge = _Judge(catalog, lengths, sample_type, max_token_len, kept)
    with contextlib.ExitStack() as outputs:
        log = outputs.enter_context(contextlib.closing(MediaCheckLog(media_checks, append=False))) \
            if media_checks is not None else None
        rejects_writer = pq.ParquetWriter(outputs.enter_context(atomic_path(rejects_target)), REJECT_SCHEMA)
        with rejects_writer:
            ids, token_lens, media_types, hashes = judge.packable(rejects_writer, log)
        if kept is not None:
            kept.raise_problems()
        kept_bins = len(kept.bin_totals) if kept else 0
        next_bin_id = kept_bins
        with pq.ParquetWriter(outputs.enter_context(atomic_path(bins_target)), BIN_SCHEMA) as bins_writer:
            if kept is not None:
                kept.copy_to(bins_writer)
            for media_type in sorted(set(media_types.tolist())):
                chosen = media_types == media_type
                bins = best_fit_decreasing(token_lens[chosen], max_token_len)
                _write_bins(bins_writer, ids.filter(pa.array(chosen)), token_lens[chosen], hashes[chosen], bins,
                            next_bin_id)
                next_bin_id += len(bins)
    return PackingOutcome(next_bin_id, kept_bins, len(token_lens) + (len(kept.index) if kept else 0), judge.rejected)


class _Judge:
    """Each catalogue row's verdict, a batch at a time: packable (id and length), or a reject."""

    def __init__(self, catalog: Path, lengths: Path, sample_type: str, max_token_len: int, kept: KeptBins | None):
        self.catalog, self.lengths = catalog, lengths
        self.sample_type, self.max_token_len, self.kept = sample_type, max_token_len, kept
        self.allowed = ALLOWED_MEDIA_TYPES[sample_type]
        self.rejected = 0

    def packable(self, rejects_writer: pq.ParquetWriter,
                 media_checks: MediaCheckLog | None) -> tuple[pa.Array, np.ndarray, np.ndarray, np.ndarray]:
        """Ids, lengths, media types and content hashes of the packable samples (not in kept bins), in
        catalogue order; rejects written."""
        ids: list[pa.Array] = []
        token_lens: list[np.ndarray] = []
        media_types: list[np.ndarray] = []
        hashes: list[np.ndarray] = []
        length_rows = _LengthRowsInStep(self.lengths, self.catalog)
        allowed = pa.array(sorted(self.allowed))
        for number, batch in enumerate(parquet_batches(self.catalog, ["sample_id", "status", "reason", "media_type",
                                                                      *CONTENT_COLUMNS], BATCH_ROWS)):
            if number % RELEASE_EVERY_BATCHES == 0:
                # Arrow's allocator (mimalloc) keeps the pages each batch freed until told to return them.
                pa.default_memory_pool().release_unused()
            sample_ids = batch.column(0)
            found = length_rows.take(sample_ids)
            token_len = pc.fill_null(found.column("token_len"), 0).to_numpy()
            accepted = (_true(pc.equal(batch.column(1), STATUS_OK)) & _true(pc.equal(found.column("status"), STATUS_OK))
                        & _true(pc.is_in(batch.column(3), value_set=allowed))
                        & (token_len >= 1) & (token_len <= self.max_token_len))
            rejects = self._rejects(batch, found, ~accepted)
            if rejects:
                rejects_writer.write_batch(pa.RecordBatch.from_pylist(rejects, schema=REJECT_SCHEMA))
                self.rejected += len(rejects)
            chosen = pa.array(accepted)
            batch_ids, batch_lens = sample_ids.filter(chosen), token_len[accepted]
            batch_media = np.asarray(batch.column(3).filter(chosen).to_pylist(), dtype=object)
            batch_hashes = content_hashes(batch.filter(chosen), media_checks)
            if self.kept is not None:
                new = self.kept.take_new(batch_ids, batch_lens, batch_hashes)
                batch_ids, batch_lens, batch_media = batch_ids.filter(pa.array(new)), batch_lens[new], batch_media[new]
                batch_hashes = batch_hashes[new]
            ids.append(batch_ids)
            token_lens.append(batch_lens.astype(np.int32))
            media_types.append(batch_media)
            hashes.append(batch_hashes)
        length_rows.finish()
        return (pa.concat_arrays(ids) if ids else pa.array([], type=pa.string()),
                np.concatenate(token_lens) if token_lens else np.zeros(0, dtype=np.int32),
                np.concatenate(media_types) if media_types else np.zeros(0, dtype=object),
                np.concatenate(hashes) if hashes else np.zeros(0, dtype=np.uint64))

    def _rejects(self, batch: pa.RecordBatch, found: pa.Table, rejected: np.ndarray) -> list[dict]:
        if not rejected.any():
            return []
        chosen = pa.array(rejected)
        rows = zip(*(column.filter(chosen).to_pylist() for column in (*batch.columns[:4], *found.columns)))
        rejects = []
        for sample_id, status, reason, media_type, _, length_status, length_reason, token_len in rows:
            reason, category = self._verdict(status, reason, media_type, length_status, length_reason, token_len)
            rejects.append({"sample_id": sample_id, "reason": reason, "category": category})
        if self.kept is not None:
            self.kept.take_rejected(batch.column(0).filter(chosen), [reject["reason"] for reject in rejects])
        return rejects

    def _verdict(self, status, reason, media_type, length_status, length_reason, token_len) -> tuple[str, str]:
        if status != STATUS_OK:
            return reason or f"catalog status {status!r}", CATEGORY_CATALOG
        if length_status is None:
            return f"no token length in {self.lengths}", CATEGORY_MISSING_LENGTH
        if length_status != STATUS_OK:
            return length_reason or f"length status {length_status!r}", CATEGORY_LENGTH
        if media_type not in self.allowed:
            needs = "/".join(sorted(self.allowed))
            return (f"{media_type} sample not allowed in {self.sample_type} (needs {needs}; a pack holds one "
                    "media type)"), CATEGORY_MEDIA_KIND
        if token_len > self.max_token_len:
            return f"token_len {token_len} > max_token_len {self.max_token_len}", CATEGORY_OVER_MAX
        return f"token_len {token_len} is not positive", CATEGORY_LENGTH


def _true(mask: pa.Array | pa.ChunkedArray) -> np.ndarray:
    """A boolean mask as numpy, null as False."""
    return pc.fill_null(mask, False).to_numpy(zero_copy_only=False)


def content_hashes(batch: pa.RecordBatch, media_checks: MediaCheckLog | None) -> np.ndarray:
    """A 64-bit hash of each catalogue row's CONTENT_COLUMNS and of its media's stamps as the
    catalogue's check log holds them (size and modification time or ETag: the bytes are not read
    again; "" without a log). A kept sample whose hash changed would have another record or shard sample."""
    refs = batch.column("media_refs").to_pylist()
    stamps = [_ITEM_SEPARATOR.join(media_checks.identity(ref) for ref in row) if media_checks is not None and row
              else "" for row in refs]
    fields = [batch.column("messages"),
              *(pc.binary_join(batch.column(name).cast(pa.list_(pa.string())), _ITEM_SEPARATOR)
                for name in CONTENT_COLUMNS[1:]),
              pa.array(stamps, type=pa.string())]
    joined = pc.binary_join_element_wise(*(pc.fill_null(field.cast(pa.large_string()), "") for field in fields),
                                         pa.scalar(_FIELD_SEPARATOR, pa.large_string()))
    return id_hashes(joined)


class _LengthRowsInStep:
    """The length table's rows, taken beside the catalogue's: a catalogue row the table skips has no
    length (a reject); a length row that is not some next catalogue row's is an error, since the table
    was then made from another catalogue."""

    def __init__(self, path: Path, catalog: Path):
        self.path, self.catalog = path, catalog
        self._batches = parquet_batches(path, LENGTHS_READ.names, BATCH_ROWS)
        self._pending: pa.Table | None = None

    def _fill(self, rows: int) -> pa.Table:
        parts = [self._pending] if self._pending is not None else []
        have = sum(part.num_rows for part in parts)
        while have < rows:
            batch = next(self._batches, None)
            if batch is None:
                break
            parts.append(pa.Table.from_batches([batch]))
            have += batch.num_rows
        self._pending = pa.concat_tables(parts) if parts else None
        return self._pending

    def take(self, ids: pa.Array) -> pa.Table:
        """The length rows of catalogue rows `ids` (the next ones), a row of nulls where there is none."""
        pending = self._fill(len(ids))
        if pending is None:
            return pa.Table.from_arrays([pa.nulls(len(ids), type=field.type) for field in LENGTHS_READ], schema=LENGTHS_READ)
        head = pending.slice(0, len(ids))
        if head.num_rows == len(ids) and head.column(0).equals(pa.chunked_array([ids])):
            self._pending = pending.slice(len(ids))
            return head.combine_chunks()
        head_ids = head.column(0).to_pylist()
        matched, position = [], 0
        for sample_id in ids.to_pylist():
            if position < len(head_ids) and head_ids[position] == sample_id:
                matched.append(position)
                position += 1
            else:
                matched.append(None)
        self._pending = pending.slice(position)
        return head.take(pa.array(matched, type=pa.int64())).combine_chunks()

    def finish(self) -> None:
        pending = self._fill(1)
        if pending is not None and pending.num_rows:
            raise PackingInputError(
                f"{self.path}: its row of {pending.column(0)[0].as_py()!r} is not the length of a row of "
                f"{self.catalog} in that table's order: the length table was made from another catalogue; "
                "materialise sample_lengths again")


class KeptBins:
    """packing.mode append: the bins written before, which stay as they are."""

    def __init__(self, path: Path, index: IdIndex, lengths: np.ndarray, hashes: np.ndarray, bin_totals: np.ndarray,
                 max_token_len: int):
        self.path, self.index, self.lengths, self.hashes = path, index, lengths, hashes
        self.bin_totals, self.max_token_len = bin_totals, max_token_len
        self.seen = np.zeros(len(index), dtype=bool)
        self.problem_count = 0
        self.first_problem: str | None = None
        self.changed: list[str] = []  # the first kept samples found with another content

    @classmethod
    def read(cls, path: Path, max_token_len: int) -> KeptBins:
        if "content_hashes" not in pq.read_schema(path).names:
            raise PackingInputError(
                f"{path}: packing.mode append keeps these bins, but they were written by an earlier version that "
                "recorded no content hashes of their samples, so a change to a kept sample could not be found; "
                "set packing.mode: full once to pack every sample afresh")
        ids, lengths, hashes, totals = [], [], [], []
        for batch in parquet_batches(path, ["sample_ids", "lengths", "content_hashes", "total_len"], BATCH_ROWS):
            ids.append(pc.list_flatten(batch.column(0)))
            lengths.append(pc.list_flatten(batch.column(1)).to_numpy().astype(np.int32))
            hashes.append(pc.list_flatten(batch.column(2)).to_numpy())
            totals.append(batch.column(3).to_numpy())
        return cls(path, IdIndex.of(ids), np.concatenate(lengths) if lengths else np.zeros(0, dtype=np.int32),
                   np.concatenate(hashes) if hashes else np.zeros(0, dtype=np.uint64),
                   np.concatenate(totals) if totals else np.zeros(0, dtype=np.int64), max_token_len)

    def _problem(self, text: str, count: int = 1) -> None:
        self.problem_count += count
        self.first_problem = self.first_problem or text

    def take_new(self, ids: pa.Array, token_lens: np.ndarray, hashes: np.ndarray) -> np.ndarray:
        """Which of these packable samples are new (in no kept bin); a kept one must keep its length
        and its content hash."""
        positions = self.index.positions(ids)
        held = positions >= 0
        self.seen[positions[held]] = True
        changed = np.flatnonzero(held & (self.lengths[np.maximum(positions, 0)] != token_lens))
        if changed.size:
            row = int(changed[0])
            self._problem(f"{ids[row].as_py()}: its length is now {int(token_lens[row])}, "
                          f"was {int(self.lengths[positions[row]])}", changed.size)
        rewritten = np.flatnonzero(held & (self.hashes[np.maximum(positions, 0)] != hashes))
        if rewritten.size:
            self.changed.extend(ids.take(pa.array(rewritten[:NAMED_CHANGES - len(self.changed)])).to_pylist())
            self._problem(f"{ids[int(rewritten[0])].as_py()}: its text or media changed since its bin was written",
                          rewritten.size)
        return ~held

    def take_rejected(self, ids: pa.Array, reasons: list[str]) -> None:
        """These samples are rejected now: none may be in a kept bin."""
        positions = self.index.positions(ids)
        held = np.flatnonzero(positions >= 0)
        if held.size:
            self.seen[positions[held]] = True
            self._problem(f"{ids[int(held[0])].as_py()}: {reasons[int(held[0])]}", held.size)

    def raise_problems(self) -> None:
        """After every catalogue row was taken: a kept sample not seen is gone from the catalogue."""
        gone = np.flatnonzero(~self.seen)
        if gone.size:
            self._problem(f"{self.index.id_at(int(gone[0]))}: no longer in the catalogue", gone.size)
        over = np.flatnonzero(self.bin_totals > self.max_token_len)
        if over.size:
            self.problem_count += over.size
            self.first_problem = f"a bin of {int(self.bin_totals[over[0]])} tokens is over max_token_len {self.max_token_len}"
        if self.problem_count:
            changed = f"; samples whose text or media changed: {', '.join(self.changed)}" if self.changed else ""
            raise PackingInputError(
                f"packing.mode append keeps the bins written before, but {self.problem_count} of their samples or "
                f"bins no longer hold (first: {self.first_problem}{changed}); their records and shards cannot "
                "change, so set packing.mode: full to pack every sample afresh")

    def copy_to(self, writer: pq.ParquetWriter) -> None:
        for batch in parquet_batches(self.path, BIN_SCHEMA.names, BINS_PER_ROW_GROUP):
            writer.write_batch(batch.cast(BIN_SCHEMA))


def _write_bins(writer: pq.ParquetWriter, ids: pa.Array, token_lens: np.ndarray, hashes: np.ndarray, bins: Bins,
                first_bin_id: int) -> None:
    for first in range(0, len(bins), BINS_PER_ROW_GROUP):
        last = min(first + BINS_PER_ROW_GROUP, len(bins))
        low, high = bins.starts[first], bins.starts[last]
        items = bins.items[low:high]
        offsets = pa.array(bins.starts[first:last + 1] - low, type=pa.int32())
        lengths = token_lens[items].astype(np.int64)
        writer.write_batch(pa.record_batch([
            pa.array(np.arange(first_bin_id + first, first_bin_id + last, dtype=np.int64)),
            pa.ListArray.from_arrays(offsets, ids.take(pa.array(items))),
            pa.ListArray.from_arrays(offsets, pa.array(lengths, type=pa.int64())),
            pa.array(np.add.reduceat(lengths, bins.starts[first:last] - low), type=pa.int64()),
            pa.ListArray.from_arrays(offsets, pa.array(hashes[items], type=pa.uint64())),
        ], schema=BIN_SCHEMA))


def iter_bins(path: Path, batch_rows: int = 8192) -> Iterator[tuple[int, list[str], list[int]]]:
    """`(bin_id, sample_ids, lengths)` of every bin, in order, a batch at a time from the file."""
    for batch in parquet_batches(path, ["bin_id", "sample_ids", "lengths"], batch_rows):
        data = batch.to_pydict()
        yield from zip(data["bin_id"], data["sample_ids"], data["lengths"])


def packed_sample_ids(path: Path) -> set[str]:
    """The ids of the samples packed in the bins at `path` (none where there are no bins yet)."""
    if not path.exists():
        return set()
    return {sample_id for _, sample_ids, _ in iter_bins(path) for sample_id in sample_ids}


@dataclass(frozen=True)
class BinsOnDisk:
    """What a bins file holds, as numbers: per bin and per packed sample, read a batch at a time."""

    bin_ids: np.ndarray
    total_len: np.ndarray  # per bin, as written
    sample_counts: np.ndarray  # per bin
    lengths: np.ndarray  # each packed sample's (int32), bin after bin
    miscounted: list[int]  # bin ids whose total_len is not the sum of their lengths

    @classmethod
    def read(cls, path: Path) -> BinsOnDisk:
        bin_ids, totals, counts, lengths, miscounted = [], [], [], [], []
        for batch in parquet_batches(path, ["bin_id", "lengths", "total_len"], BINS_PER_ROW_GROUP):
            batch_counts = pc.list_value_length(batch.column(1)).to_numpy(zero_copy_only=False).astype(np.int64)
            batch_lengths = pc.list_flatten(batch.column(1)).to_numpy()
            sums = np.zeros(batch.num_rows, dtype=np.int64)
            filled = batch_counts > 0
            starts = np.concatenate([[0], np.cumsum(batch_counts)[:-1]])
            sums[filled] = np.add.reduceat(batch_lengths, starts[filled]) if filled.any() else 0
            batch_lengths = batch_lengths.astype(np.int32)  # the one array as long as the source: half the bytes
            batch_ids, batch_totals = batch.column(0).to_numpy(), batch.column(2).to_numpy()
            miscounted.extend(batch_ids[sums != batch_totals].tolist())
            bin_ids.append(batch_ids)
            totals.append(batch_totals)
            counts.append(batch_counts)
            lengths.append(batch_lengths)

        def joined(parts: list[np.ndarray]) -> np.ndarray:
            return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)

        return cls(joined(bin_ids), joined(totals), joined(counts), joined(lengths), miscounted)

    @property
    def bins(self) -> int:
        return int(self.total_len.size)

    @property
    def packed(self) -> int:
        return int(self.lengths.size)

    @property
    def tokens(self) -> int:
        return int(self.total_len.sum())

    def oversized(self, max_token_len: int) -> list[int]:
        """Bins over the maximum, or whose total is not the sum of their lengths."""
        over = self.bin_ids[self.total_len > max_token_len].tolist()
        return sorted(set(over) | set(self.miscounted))

    def fill_ratio(self, max_token_len: int) -> float:
        """Share of the bins' token budget that holds real tokens (1.0 = no padding)."""
        return self.tokens / (self.bins * max_token_len) if self.bins else 0.0


def reject_categories(path: Path) -> Counter[str]:
    counts: Counter[str] = Counter()
    for batch in parquet_batches(path, ["category"], BATCH_ROWS):
        counts.update(batch.column(0).to_pylist())
    return counts
