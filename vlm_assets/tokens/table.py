"""A source's token-length table, computed chunk by chunk, on one process or several.

The catalogue is read a chunk of rows at a time and the table written a chunk at a time, so a
source of any size needs memory for a few chunks only (plus one integer per ok sample for the
summary). Chunks go to worker processes in order and come back in order: the table has the
same rows, in the same order, whatever the number of processes.

Chunk processes measure the samples the fast path counts (text tokens, image sizes) without the
processor once its text spec and profile are on disk (vlm_assets.tokens.text, .profile), so they
count from the first second; this process loads the processor meanwhile, in a thread, and turns
the measurements into token lengths. Samples of a modality the fast path is not proven for are
counted by the exact path in the chunk processes themselves, so that work is split over them too.
"""

from __future__ import annotations

import contextlib
import hashlib
import random
import threading
from collections import Counter, deque
from collections.abc import Callable, Iterator, Mapping
from dataclasses import astuple, dataclass, field
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from vlm_assets.atomic import atomic_path
from vlm_assets.catalog.schema import LENGTH_COLUMNS, STATUS_OK, STATUS_REJECTED
from vlm_assets.config import FrameCacheConfig, ModelConfig
from vlm_assets.frames.spool import MosaicSpool
from vlm_assets.media.checks import verify_medium_stamp
from vlm_assets.parallel import ordered_map, ray_address
from vlm_assets.tokens.chunk_plan import STORE_ROWS
from vlm_assets.tokens.consumer import NOT_CARRIED_BY, CountingRule
from vlm_assets.parquet_batches import aligned_batches, batch_bytes, parquet_batches, parquet_rows
from vlm_assets.tokens.lengths import (
    PROCESSOR_CALL_FAILED,
    LengthCounter,
    LengthResult,
    MeasuredSample,
    Modalities,
    SampleForLength,
    completed_length,
    fast_path_counts,
    measure_samples,
)
from vlm_assets.tokens.profile import (
    ProcessorProfile,
    length_counter,
    processor_profile,
    store_media_tokens,
    stored_media_tokens,
    stored_modalities,
)
from vlm_assets.tokens.processor import processor_fingerprint, transformers_version
from vlm_assets.tokens.text import TextCounter, spec_text, stored_text_spec
from vlm_assets.tokens.video_tokens import usable_clip_facts

LENGTH_CHUNK_ROWS = STORE_ROWS
# A pool costs a start-up (a process spawned, its imports, the text spec's tokenizer built; a processor
# load where no text spec is stored): seconds, which fewer chunks than this take to measure on one process.
POOL_MIN_CHUNKS = 8
CATALOG_COLUMNS_READ = ["sample_id", "status", "reason", "messages", "media_kinds", "media_refs", "media_stamps",
                        "media_views"]
LENGTH_SCHEMA = pa.schema(
    [(column, pa.string()) for column in LENGTH_COLUMNS[:3]] + [(column, pa.int64()) for column in LENGTH_COLUMNS[3:]]
)

# (rows done, rows in the catalogue)
LengthProgress = Callable[[int, int], None]
# Told what the loaded processor is as soon as it is loaded; raising stops the step.
OnProcessorLoaded = Callable[[ProcessorProfile], None]


@dataclass(frozen=True)
class LengthTableSummary:
    samples: int
    processes: int
    ok_token_lens: np.ndarray  # token_len of every ok row, in table order
    profile: ProcessorProfile | None  # None: no processor was loaded (a chunk completed from stored media tokens)
    reused_rows: int = 0  # rows whose lengths came from the chunk store, not measured again


@dataclass(frozen=True)
class ChunkStore:
    """The length rows of every catalogue chunk measured, kept until a build no longer needs them.

    A chunk's entry is named by the digest of its catalogue rows and of `settings` (what else its
    lengths follow from: the processor, the model type, the frame-cache settings, the source's
    control-token rule). A build interrupted after some chunks (a kill, a lost machine) measures
    only the others when run again, and a catalogue with records appended measures only its new
    chunks (and the last old one, which grew): the table is the same, byte for byte.
    """

    directory: Path
    settings: str
    reuse: bool = True  # False: every chunk is measured again (and stored afresh)

    def key(self, rows: pa.RecordBatch) -> str:
        digest = hashlib.sha256(self.settings.encode() + b"\0")
        digest.update(batch_bytes(rows))
        return digest.hexdigest()[:32]

    def load(self, key: str) -> pa.Table | None:
        if not self.reuse:
            return None
        path = self.directory / f"{key}.parquet"
        try:
            return pq.read_table(path, schema=LENGTH_SCHEMA).replace_schema_metadata(None)
        except (FileNotFoundError, pa.ArrowInvalid, OSError):
            return None  # never stored, or unreadable: measured again

    def save(self, key: str, table: pa.Table) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        with atomic_path(self.directory / f"{key}.parquet") as tmp:
            pq.write_table(table, tmp)

    def keep_only(self, keys: set[str]) -> None:
        for path in self.directory.glob("*.parquet") if self.directory.is_dir() else []:
            if path.stem not in keys:
                path.unlink(missing_ok=True)


class _ChunkMeasurer:
    """How this process measures a chunk's samples, set up by start_measuring.

    Samples the fast path counts are measured with the text alone (the stored text spec, no
    processor), to be completed where the processor is loaded; the others are counted here by
    the exact path, with the processor loaded on the first such sample. A clip's facts (for a
    family whose video text follows them) come from the mosaic spool at `clip_spool`.
    """

    def __init__(self, model: ModelConfig, frame_cache: FrameCacheConfig, reject_control_tokens: bool,
                 rule: CountingRule | None, clip_spool: Path | None = None) -> None:
        self.model, self.frame_cache, self.reject_control_tokens = model, frame_cache, reject_control_tokens
        self.rule = rule
        self.settings = (processor_fingerprint(model), model, frame_cache, reject_control_tokens, rule, clip_spool)
        self.clip_facts = MosaicSpool(clip_spool, frame_cache).sampled if clip_spool is not None else None
        spec, modalities = stored_text_spec(model), stored_modalities(model, frame_cache)
        self._exact: LengthCounter | None = None
        if spec is None or modalities is None:
            self._exact = length_counter(model, frame_cache, reject_control_tokens, rule=rule)
            # Stored by it where it stands in for the processor: long texts are then counted in pieces.
            spec = spec or stored_text_spec(model)
        self.text: TextCounter = spec_text(spec) if spec is not None else self.exact_counter().text
        self.modalities: Modalities = modalities if modalities is not None else self.exact_counter().modalities
        if rule is not None:
            self.rule = rule.bound_to(self.modalities.processor_class)

    def exact_counter(self) -> LengthCounter:
        if self._exact is None:
            self._exact = length_counter(self.model, self.frame_cache, self.reject_control_tokens, rule=self.rule)
        return self._exact

    def measure(self, catalog_rows: list[dict]) -> list[LengthResult | MeasuredSample]:
        ok_samples = [
            SampleForLength(row["sample_id"], row["messages"], row["media_kinds"], row["media_refs"], row["media_views"])
            for row in catalog_rows if row["status"] == STATUS_OK
        ]
        clip_facts = usable_clip_facts(self.clip_facts, self.frame_cache) if self.clip_facts else None
        fast = [fast_path_counts(sample, self.modalities, self.text, self.reject_control_tokens, self.rule, clip_facts)
                for sample in ok_samples]
        measured = iter(measure_samples([sample for sample, quick in zip(ok_samples, fast) if quick], self.text,
                                        self.modalities, self.reject_control_tokens, self.rule, clip_facts))
        ok = iter(zip(ok_samples, fast))
        results: list[LengthResult | MeasuredSample] = []
        # Every ok sample is answered, in order; a catalogue reject keeps its reason.
        for row in catalog_rows:
            if row["status"] != STATUS_OK:
                results.append(LengthResult.rejected(row["sample_id"], row["reason"]))
                continue
            sample, quick = next(ok)
            results.append(next(measured) if quick else self.exact_counter().counted(sample))
        # After the media were read: one changed while it was read is caught too.
        for row in catalog_rows:
            for ref, stamp in zip(row["media_refs"], row["media_stamps"]):
                verify_medium_stamp(ref, stamp)
        return results


_measurer: _ChunkMeasurer | None = None


def start_measuring(model: ModelConfig, frame_cache: FrameCacheConfig, reject_control_tokens: bool,
                    rule: CountingRule | None = None, clip_spool: Path | None = None) -> None:
    """Set this process up to measure chunks of samples (the text spec's tokenizer built): each
    process of `write_length_table` does first."""
    global _measurer
    # Kept for the next run in this process (a worker measures chunk after chunk): building it parses
    # the stored text spec and a tokenizer, a second of work and memory that each run left behind.
    # Its processor's files are part of the key: a processor edited in place has a text spec of its own.
    if _measurer is None or _measurer.settings != (processor_fingerprint(model), model, frame_cache,
                                                   reject_control_tokens, rule, clip_spool):
        _measurer = _ChunkMeasurer(model, frame_cache, reject_control_tokens, rule, clip_spool)


def _measure_rows(catalog_rows: list[dict]) -> list[LengthResult | MeasuredSample]:
    assert _measurer is not None, "start_measuring runs first in every process"
    return _measurer.measure(catalog_rows)


class _CounterLoad:
    """This process's LengthCounter, loaded in a thread while chunks are measured; keeps the text spec.

    With `eager` false it is loaded only when a measured sample needs a size (or a video count) that
    the stored media tokens (tokens.profile.MediaTokens) do not hold: a chunk of an appended source
    is then completed without the processor's few seconds of loading.
    """

    def __init__(self, model: ModelConfig, frame_cache: FrameCacheConfig, reject_control_tokens: bool,
                 rule: CountingRule | None, on_loaded: OnProcessorLoaded | None, eager: bool = True) -> None:
        self._args = (model, frame_cache, reject_control_tokens)
        self._rule = rule
        self._on_loaded = on_loaded
        self._counter: LengthCounter | None = None
        self._error: BaseException | None = None
        self.media_tokens = stored_media_tokens(model, frame_cache)
        self._thread = threading.Thread(target=self._load, name="processor-load", daemon=True)
        self.started = False
        if eager or not self.media_tokens.by_size:
            self._start()

    def _start(self) -> None:
        if not self.started:
            self.started = True
            self._thread.start()

    def _load(self) -> None:
        try:
            counter = length_counter(*self._args, tokens_per_clip=self.media_tokens.per_clip, rule=self._rule)
            if self._on_loaded is not None:
                self._on_loaded(processor_profile(counter))
            self._counter = counter
        except BaseException as error:  # re-raised where the counter is needed
            self._error = error

    def ready(self) -> bool:
        return not self._thread.is_alive()

    def counter(self) -> LengthCounter:
        self._start()
        self._thread.join()
        if self._error is not None:
            raise self._error
        assert self._counter is not None
        return self._counter

    def complete(self, item: LengthResult | MeasuredSample) -> LengthResult:
        if not isinstance(item, MeasuredSample):
            return item
        if self.media_tokens.covers(item):
            return completed_length(item, self.media_tokens.image_tokens, self.media_tokens.tokens_per_clip)
        return self.counter().complete(item)


def write_length_table(
    catalog: Path,
    target: Path | None,
    model: ModelConfig,
    frame_cache: FrameCacheConfig,
    processes: int = 1,
    progress: LengthProgress | None = None,
    chunk_rows: int = LENGTH_CHUNK_ROWS,
    reject_control_tokens: bool = True,
    on_processor_loaded: OnProcessorLoaded | None = None,
    store: ChunkStore | None = None,
    rows: range | None = None,
    rule: CountingRule | None = None,
    clip_spool: Path | None = None,
    removed: Mapping[str, str] | None = None,
) -> LengthTableSummary:
    """Write the length table of the catalogue at `catalog` to `target` (atomically).

    With a `store`, chunks measured by an earlier build are taken from it, and each chunk measured
    now is added to it as soon as it is written; once the table is complete, only its chunks stay.
    With `rows` (whole chunks of `chunk_rows` from a chunk's start) and no `target`, only those rows
    are measured, into the store: one chunk of a source measured apart (tokens.chunk_plan).
    `rule`: what the source's packed shards' consumer encodes of each sample (vlm_assets.tokens.consumer).
    `clip_spool`: the mosaic spool the catalogue's decoding pass kept each video's frame count, fps and
    sampled indices in (vlm_assets.frames.spool), for a family whose video text follows them; without
    it, or for a video it does not hold, such a sample is counted by the exact path (decoded).
    `removed`: sample id -> reason of the samples deduplication removed (vlm_assets.dedup), rejected
    in the table with that reason; the chunk store keeps their measured lengths, so a changed
    decision rewrites the table without measuring again.
    """
    if target is None and (store is None or rows is None):
        raise ValueError("measuring without a target table needs a chunk store and a row range")
    total = len(rows) if rows is not None else parquet_rows(catalog)
    start, stop = (rows.start, rows.stop) if rows is not None else (0, None)
    # One entry per chunk, in catalogue order, appended as the pool takes chunks: (key, stored rows or None).
    order: deque[tuple[str, pa.Table | None]] = deque()
    used_keys: set[str] = set()

    def chunks_to_measure() -> Iterator[list[dict]]:
        for batch in aligned_batches(catalog, CATALOG_COLUMNS_READ, chunk_rows, start, stop):
            key = store.key(batch) if store is not None else ""
            used_keys.add(key)
            stored = store.load(key) if store is not None else None
            order.append((key, stored))
            if stored is None:
                yield batch.to_pylist()

    # A cluster's worker processes are started already: there two chunks are worth sending out.
    processes = processes if total > (1 if ray_address() else POOL_MIN_CHUNKS) * chunk_rows else 1
    done, reused, ok_lengths = 0, 0, []
    # A table of the whole source reports its processor (and its check loads it anyway); a chunk needs it only for what
    # the stored media tokens lack.
    load = _CounterLoad(model, frame_cache, reject_control_tokens, rule, on_processor_loaded, eager=target is not None)
    # Chunks in table order waiting for the processor (measured ones: seconds' worth), so the pool stays fed.
    waiting: list[tuple[str, pa.Table | list[LengthResult | MeasuredSample]]] = []
    with contextlib.ExitStack() as outputs:
        writer = None
        if target is not None:
            # The release that counted travels with the table (the UI shows it too, see sample_lengths).
            schema = LENGTH_SCHEMA.with_metadata({"transformers": transformers_version()})
            writer = outputs.enter_context(pq.ParquetWriter(outputs.enter_context(atomic_path(target)), schema))

        def write(key: str, chunk: pa.Table | list[LengthResult | MeasuredSample]) -> None:
            nonlocal done, reused
            if isinstance(chunk, pa.Table):
                table = chunk
                reused += table.num_rows
            else:
                rows = [astuple(load.complete(item)) for item in chunk]
                table = pa.table(dict(zip(LENGTH_COLUMNS, zip(*rows))), schema=LENGTH_SCHEMA)
                if store is not None:
                    store.save(key, table)
            if removed:
                table = _rejected_as_removed(table, removed)
            if writer is not None:
                writer.write_table(table)
            status, token_len = table.column("status").to_numpy(), table.column("token_len").to_numpy()
            ok_lengths.append(token_len[status == STATUS_OK].astype(np.int64))
            done += table.num_rows
            if progress:
                progress(done, total)

        def flush() -> None:
            for key, chunk in waiting:
                write(key, chunk)
            waiting.clear()

        # The load is Python (imports) and needs this process's interpreter: measuring here would halve its pace.
        for measured in ordered_map(_measure_rows, chunks_to_measure(), processes, start_measuring,
                                    (model, frame_cache, reject_control_tokens, rule, clip_spool),
                                    may_work_here=load.ready):
            while order[0][1] is not None:  # stored chunks before this one
                waiting.append(order.popleft())  # type: ignore[arg-type]
            waiting.append((order.popleft()[0], measured))
            if load.ready():
                flush()
        waiting.extend(order)  # type: ignore[arg-type]  # stored chunks after the last measured one
        flush()
    if store is not None and target is not None:
        store.keep_only(used_keys)
    lengths = np.concatenate(ok_lengths) if ok_lengths else np.zeros(0, dtype=np.int64)
    profile = None
    if load.started:
        store_media_tokens(model, frame_cache, load.counter(), load.media_tokens)
        profile = processor_profile(load.counter())
    return LengthTableSummary(total, processes, lengths, profile, reused)


def _rejected_as_removed(table: pa.Table, removed: Mapping[str, str]) -> pa.Table:
    """`table` with the rows of `removed` samples rejected with their reason, their counts 0."""
    hit = np.array([sample_id in removed for sample_id in table.column("sample_id").to_pylist()], dtype=bool)
    if not hit.any():
        return table
    mask = pa.array(hit)
    columns = {
        "status": pc.if_else(mask, STATUS_REJECTED, table.column("status")),
        "reason": pa.array([removed[sample_id] if drop else reason for sample_id, reason, drop in zip(
            table.column("sample_id").to_pylist(), table.column("reason").to_pylist(), hit)], pa.string()),
        **{name: pc.if_else(mask, 0, table.column(name)) for name in LENGTH_COLUMNS[3:]},
    }
    return pa.table({name: columns.get(name, table.column(name)) for name in LENGTH_COLUMNS}, schema=LENGTH_SCHEMA)


def sample_kind(media_kinds: list[str]) -> str:
    """The kind of row `lengths_match_processor` samples separately."""
    images, videos = media_kinds.count("image"), media_kinds.count("video")
    if images and videos:
        return "mixed"
    if videos:
        return "video"
    return {0: "text", 1: "single_image"}.get(images, "multi_image")


SAMPLE_KINDS = ("text", "single_image", "multi_image", "video", "mixed")
# The longest sample the exact path rechecks: the processor's call holds about 300 bytes per token
# of its text (its tokenizer's encoding of the whole), 3 GB for a conversation of 10 million tokens,
# where the length being checked was counted a piece at a time (tokens.text.PIECE_CHARS).
RECHECK_MAX_TOKENS = 1 << 18


@dataclass
class RecheckSelection:
    """Rows of a length table chosen for recomputation, and what the table says about itself."""

    chosen: dict[str, int] = field(default_factory=dict)  # sample id -> stored token_len
    kind_of: dict[str, str] = field(default_factory=dict)  # sample id -> sample_kind
    catalog_ok: int = 0  # rows the catalogue accepted
    not_carried: int = 0  # of those, rows the source's sample type cannot carry (tokens.consumer)
    ok_by_kind: Counter[str] = field(default_factory=Counter)
    processor_failures: list[dict[str, str]] = field(default_factory=list)  # a few rows the processor call refused
    processor_failure_count: int = 0
    too_long: int = 0  # ok rows left out for their length (RECHECK_MAX_TOKENS)


def rows_to_recheck(catalog: Path, lengths: Path, per_kind: int, seed: int = 0) -> RecheckSelection:
    """Up to `per_kind` ok rows of each sample kind, chosen at random (`seed`), read a chunk at a time.

    The catalogue and the length table have the same rows in the same order, so they are read
    side by side, by column: a first pass counts the ok rows of each kind, the chosen ones (by
    their rank among their kind) are taken in a second. Memory holds a batch and the chosen rows
    whatever the source's size. Rows over RECHECK_MAX_TOKENS are not chosen.
    """
    selection = RecheckSelection()
    ok_by_kind = np.zeros(len(SAMPLE_KINDS), dtype=np.int64)
    eligible_by_kind = np.zeros(len(SAMPLE_KINDS), dtype=np.int64)
    for catalog_batch, length_batch, kinds, ok in _recheck_batches(catalog, lengths):
        selection.catalog_ok += pc.sum(pc.equal(catalog_batch.column("status"), STATUS_OK)).as_py() or 0
        failed = pc.starts_with(length_batch.column("reason"), PROCESSOR_CALL_FAILED).fill_null(False)
        selection.processor_failure_count += pc.sum(failed).as_py() or 0
        not_carried = pc.starts_with(length_batch.column("reason"), NOT_CARRIED_BY).fill_null(False)
        selection.not_carried += pc.sum(not_carried).as_py() or 0
        for row in length_batch.filter(failed).slice(0, 5 - len(selection.processor_failures)).to_pylist():
            selection.processor_failures.append({"sample_id": row["sample_id"], "reason": row["reason"]})
        ok_by_kind += np.bincount(kinds[ok], minlength=len(SAMPLE_KINDS))
        eligible = ok & _recheckable(length_batch)
        eligible_by_kind += np.bincount(kinds[eligible], minlength=len(SAMPLE_KINDS))
    selection.too_long = int(ok_by_kind.sum() - eligible_by_kind.sum())
    rng = random.Random(seed)
    ranks = [np.sort(rng.sample(range(count), min(per_kind, count))) for count in eligible_by_kind.tolist()]
    chosen: list[list[tuple[str, int]]] = [[] for _ in SAMPLE_KINDS]
    seen = np.zeros(len(SAMPLE_KINDS), dtype=np.int64)
    for _catalog_batch, length_batch, kinds, ok in _recheck_batches(catalog, lengths):
        eligible = ok & _recheckable(length_batch)
        for kind in range(len(SAMPLE_KINDS)):
            rows = np.flatnonzero(eligible & (kinds == kind))
            picked = rows[np.isin(np.arange(seen[kind], seen[kind] + len(rows)), ranks[kind])]
            seen[kind] += len(rows)
            if len(picked):
                taken = length_batch.select(["sample_id", "token_len"]).take(pa.array(picked))
                chosen[kind].extend(zip(taken.column("sample_id").to_pylist(), taken.column("token_len").to_pylist()))
    for kind, rows in zip(SAMPLE_KINDS, chosen):
        if ok_by_kind[SAMPLE_KINDS.index(kind)]:
            selection.ok_by_kind[kind] = int(ok_by_kind[SAMPLE_KINDS.index(kind)])
        for sample_id, token_len in rows:
            selection.chosen[sample_id] = token_len
            selection.kind_of[sample_id] = kind
    return selection


def _recheckable(length_batch: pa.RecordBatch) -> np.ndarray:
    return pc.less_equal(length_batch.column("token_len"), RECHECK_MAX_TOKENS).fill_null(False).to_numpy(zero_copy_only=False)


def _recheck_batches(catalog: Path, lengths: Path) -> Iterator[tuple[pa.RecordBatch, pa.RecordBatch, np.ndarray, np.ndarray]]:
    """(catalogue batch, length batch, each row's index in SAMPLE_KINDS, whether its length is ok)."""
    batch_rows = LENGTH_CHUNK_ROWS * 8
    catalog_batches = parquet_batches(catalog, ["sample_id", "status", "media_kinds"], batch_rows)
    length_batches = parquet_batches(lengths, ["sample_id", "status", "reason", "token_len"], batch_rows)
    for catalog_batch, length_batch in zip(catalog_batches, length_batches, strict=True):
        same = pc.equal(catalog_batch.column("sample_id"), length_batch.column("sample_id")).fill_null(False)
        if not pc.all(same).as_py():
            row = int(np.flatnonzero(~same.to_numpy(zero_copy_only=False))[0])
            raise ValueError(f"{lengths}: row {length_batch.column('sample_id')[row].as_py()!r} stands where the "
                             f"catalogue has {catalog_batch.column('sample_id')[row].as_py()!r}")
        ok = pc.equal(length_batch.column("status"), STATUS_OK).fill_null(False).to_numpy(zero_copy_only=False)
        yield catalog_batch, length_batch, _kind_indices(catalog_batch.column("media_kinds")), ok


def _kind_indices(media_kinds: pa.Array) -> np.ndarray:
    """`sample_kind` of every row, as its index in SAMPLE_KINDS, counted by column."""
    rows = len(media_kinds)
    flat, parents = pc.list_flatten(media_kinds), pc.list_parent_indices(media_kinds).to_numpy()

    def per_row(kind: str) -> np.ndarray:
        return np.bincount(parents[pc.equal(flat, kind).fill_null(False).to_numpy(zero_copy_only=False)], minlength=rows)

    images, videos = per_row("image"), per_row("video")
    by_images = np.minimum(images, 2)  # text, single_image, multi_image
    return np.where(videos > 0, np.where(images > 0, 4, 3), by_images)
