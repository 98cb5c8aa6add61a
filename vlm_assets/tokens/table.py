"""A source's token-length table, computed chunk by chunk, on one process or several.

The catalogue is read a chunk of rows at a time and the table written a chunk at a time, so a
source of any size needs memory for a few chunks only (plus one integer per ok sample for the
summary). Chunks go to worker processes in order and come back in order: the table has the
same rows, in the same order, whatever the number of processes.

Chunk processes measure samples (text tokens, image sizes) without the processor once its text
spec is on disk (vlm_assets.tokens.text), so they count from the first second; this process loads
the processor meanwhile, in a thread, and turns the measurements into token lengths.
"""

from __future__ import annotations

import random
import threading
from collections.abc import Callable
from dataclasses import astuple, dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from vlm_assets.atomic import atomic_path
from vlm_assets.catalog.schema import LENGTH_COLUMNS, STATUS_OK
from vlm_assets.config import FrameCacheConfig, ModelConfig
from vlm_assets.parallel import ordered_map
from vlm_assets.parquet_batches import parquet_batches, parquet_rows
from vlm_assets.tokens.lengths import (
    LengthCounter,
    LengthResult,
    MeasuredSample,
    SampleForLength,
    measure_samples,
    supports_fast_path,
)
from vlm_assets.tokens.processor import shared_processor
from vlm_assets.tokens.text import SpecText, TextCounter, store_text_spec, stored_text_spec, text_spec_of

LENGTH_CHUNK_ROWS = 2048
CATALOG_COLUMNS_READ = ["sample_id", "status", "reason", "messages", "media_kinds", "media_refs"]
LENGTH_SCHEMA = pa.schema(
    [(column, pa.string()) for column in LENGTH_COLUMNS[:3]] + [(column, pa.int64()) for column in LENGTH_COLUMNS[3:]]
)

# (rows done, rows in the catalogue)
LengthProgress = Callable[[int, int], None]

# This process's way of measuring a chunk's samples, set up by _start_measuring: text without the
# processor (or with it), or, for a processor without the fast path, the exact counter.
_text: TextCounter | None = None
_exact: LengthCounter | None = None


@dataclass(frozen=True)
class LengthTableSummary:
    samples: int
    processes: int
    ok_token_lens: np.ndarray  # token_len of every ok row, in table order


def _start_measuring(model: ModelConfig, frame_cache: FrameCacheConfig) -> None:
    global _text, _exact
    spec = stored_text_spec(model)
    if spec is not None:
        _text, _exact = SpecText(spec), None
        return
    counter = LengthCounter(shared_processor(model), frame_cache)
    if supports_fast_path(counter.processor):
        _text, _exact = counter.text, None
    else:
        _text, _exact = None, counter


def _measure_rows(catalog_rows: list[dict]) -> list[LengthResult | MeasuredSample]:
    ok_samples = [
        SampleForLength(row["sample_id"], row["messages"], row["media_kinds"], row["media_refs"])
        for row in catalog_rows if row["status"] == STATUS_OK
    ]
    if _text is not None:
        measured = iter(measure_samples(ok_samples, _text))
    else:
        assert _exact is not None, "_start_measuring runs first in every process"
        measured = iter([_exact.exact(sample) for sample in ok_samples])
    # Every ok sample is answered, in order; a catalogue reject keeps its reason.
    return [
        next(measured) if row["status"] == STATUS_OK else LengthResult.rejected(row["sample_id"], row["reason"])
        for row in catalog_rows
    ]


class _CounterLoad:
    """This process's LengthCounter, loaded in a thread while chunks are measured; keeps the text spec."""

    def __init__(self, model: ModelConfig, frame_cache: FrameCacheConfig) -> None:
        self._model, self._frame_cache = model, frame_cache
        self._counter: LengthCounter | None = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._load, name="processor-load", daemon=True)
        self._thread.start()

    def _load(self) -> None:
        try:
            counter = LengthCounter(shared_processor(self._model), self._frame_cache)
            if supports_fast_path(counter.processor):
                counter.video_tokens_per_clip  # computed once, here, off the counting path
                if stored_text_spec(self._model) is None and (spec := text_spec_of(counter.processor)) is not None:
                    store_text_spec(self._model, spec)
            self._counter = counter
        except BaseException as error:  # re-raised where the counter is needed
            self._error = error

    def ready(self) -> bool:
        return not self._thread.is_alive()

    def counter(self) -> LengthCounter:
        self._thread.join()
        if self._error is not None:
            raise self._error
        assert self._counter is not None
        return self._counter


def write_length_table(
    catalog: Path,
    target: Path,
    model: ModelConfig,
    frame_cache: FrameCacheConfig,
    processes: int = 1,
    progress: LengthProgress | None = None,
    chunk_rows: int = LENGTH_CHUNK_ROWS,
) -> LengthTableSummary:
    """Write the length table of the catalogue at `catalog` to `target` (atomically)."""
    total = parquet_rows(catalog)
    chunks = (batch.to_pylist() for batch in parquet_batches(catalog, CATALOG_COLUMNS_READ, chunk_rows))
    # A pool costs a start-up (a processor load where no text spec is stored); one chunk is not worth it.
    processes = processes if total > chunk_rows else 1
    done, ok_lengths = 0, []
    load = _CounterLoad(model, frame_cache)
    # Chunks measured while the processor loads wait here (seconds' worth), so the pool stays fed.
    measured_chunks: list[list[LengthResult | MeasuredSample]] = []
    with atomic_path(target) as tmp, pq.ParquetWriter(tmp, LENGTH_SCHEMA) as writer:

        def write(chunk: list[LengthResult | MeasuredSample]) -> None:
            nonlocal done
            counter = load.counter()
            rows = [astuple(counter.complete(item) if isinstance(item, MeasuredSample) else item) for item in chunk]
            columns = list(zip(*rows))
            writer.write_table(pa.table(dict(zip(LENGTH_COLUMNS, columns)), schema=LENGTH_SCHEMA))
            status, token_len = np.asarray(columns[1]), np.asarray(columns[3], dtype=np.int64)
            ok_lengths.append(token_len[status == STATUS_OK])
            done += len(rows)
            if progress:
                progress(done, total)

        # The load is Python (imports) and needs this process's interpreter: measuring here would halve its pace.
        for chunk in ordered_map(_measure_rows, chunks, processes, _start_measuring, (model, frame_cache),
                                 may_work_here=load.ready):
            measured_chunks.append(chunk)
            if load.ready():
                for waiting in measured_chunks:
                    write(waiting)
                measured_chunks.clear()
        for waiting in measured_chunks:
            write(waiting)
    return LengthTableSummary(total, processes, np.concatenate(ok_lengths) if ok_lengths else np.zeros(0, dtype=np.int64))


def sample_ok_rows(lengths: Path, count: int, seed: int = 0) -> dict[str, int]:
    """`count` ok rows of a length table, chosen at random (`seed`): sample id -> stored token_len.

    The table is read a chunk at a time, twice (to count the ok rows, then to pick them), so
    memory does not grow with the source. The choice equals `random.Random(seed).sample` of the
    list of ok sample ids.
    """
    ok_rows = sum(
        pc.sum(pc.equal(batch.column(0), STATUS_OK)).as_py() or 0
        for batch in parquet_batches(lengths, ["status"], LENGTH_CHUNK_ROWS * 8)
    )
    wanted = set(random.Random(seed).sample(range(ok_rows), min(count, ok_rows)))
    chosen: dict[str, int] = {}
    rank = 0
    for batch in parquet_batches(lengths, ["sample_id", "status", "token_len"], LENGTH_CHUNK_ROWS * 8):
        for sample_id, status, token_len in zip(*(column.to_pylist() for column in batch.columns)):
            if status == STATUS_OK:
                if rank in wanted:
                    chosen[sample_id] = token_len
                rank += 1
    return chosen
