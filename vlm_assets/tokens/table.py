"""A source's token-length table, computed chunk by chunk, on one process or several.

The catalogue is read a chunk of rows at a time and the table written a chunk at a time, so a
source of any size needs memory for a few chunks only (plus one integer per ok sample for the
summary). Chunks go to worker processes in order and come back in order: the table has the
same rows, in the same order, whatever the number of processes.
"""

from __future__ import annotations

import random
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
from vlm_assets.tokens.lengths import LengthCounter, LengthResult, SampleForLength
from vlm_assets.tokens.processor import shared_processor

LENGTH_CHUNK_ROWS = 2048
CATALOG_COLUMNS_READ = ["sample_id", "status", "reason", "messages", "media_kinds", "media_refs"]
LENGTH_SCHEMA = pa.schema(
    [(column, pa.string()) for column in LENGTH_COLUMNS[:3]] + [(column, pa.int64()) for column in LENGTH_COLUMNS[3:]]
)

# (rows done, rows in the catalogue)
LengthProgress = Callable[[int, int], None]

_counter: LengthCounter | None = None  # this process's counter, set up by _start_counter


@dataclass(frozen=True)
class LengthTableSummary:
    samples: int
    processes: int
    ok_token_lens: np.ndarray  # token_len of every ok row, in table order


def _start_counter(model: ModelConfig, frame_cache: FrameCacheConfig) -> None:
    global _counter
    _counter = LengthCounter(shared_processor(model), frame_cache)


def _length_rows(catalog_rows: list[dict]) -> list[tuple]:
    assert _counter is not None, "_start_counter runs first in every process"
    ok_rows = [row for row in catalog_rows if row["status"] == STATUS_OK]
    counted = iter(_counter.fast_many([
        SampleForLength(row["sample_id"], row["messages"], row["media_kinds"], row["media_refs"]) for row in ok_rows
    ]))
    # fast_many answers every sample, in order; a catalogue reject keeps its reason.
    return [
        astuple(next(counted) if row["status"] == STATUS_OK else LengthResult.rejected(row["sample_id"], row["reason"]))
        for row in catalog_rows
    ]


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
    # A pool costs each process a processor load (seconds); a single chunk is not worth it.
    processes = processes if total > chunk_rows else 1
    done, ok_lengths = 0, []
    with atomic_path(target) as tmp, pq.ParquetWriter(tmp, LENGTH_SCHEMA) as writer:
        for rows in ordered_map(_length_rows, chunks, processes, _start_counter, (model, frame_cache)):
            columns = list(zip(*rows))
            writer.write_table(pa.table(dict(zip(LENGTH_COLUMNS, columns)), schema=LENGTH_SCHEMA))
            status, token_len = np.asarray(columns[1]), np.asarray(columns[3], dtype=np.int64)
            ok_lengths.append(token_len[status == STATUS_OK])
            done += len(rows)
            if progress:
                progress(done, total)
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
