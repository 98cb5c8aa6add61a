"""A catalogue cut into length chunks: stable cuts, aligned reads, and chunks measured apart giving the one table."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from vlm_assets.config import FrameCacheConfig, ModelConfig
from vlm_assets.parquet_batches import aligned_batches
from vlm_assets.tokens.chunk_plan import (
    DEFAULT_CHUNK_ROWS,
    STORE_ROWS,
    ChunkPlan,
    chunk_partition_key,
    plan_chunks,
    rows_per_chunk,
    split_chunk_partition,
)
from vlm_assets.tokens.table import ChunkStore, write_length_table


def _catalog(path, count: int, row_group: int, edited: int | None = None) -> None:
    """A text-only catalogue of `count` rows written in row groups of `row_group` rows."""
    rows = [{
        "sample_id": f"s{number}", "status": "ok", "reason": "",
        "messages": f'[{{"role": "user", "content": "question {number}{" edited" if number == edited else ""}"}}, '
                    f'{{"role": "assistant", "content": "{"answer " * (number % 13 + 1)}"}}]',
        "media_kinds": [], "media_refs": [], "media_stamps": [], "media_views": [],
    } for number in range(count)]
    table = pa.Table.from_pylist(rows, schema=pa.schema([
        ("sample_id", pa.string()), ("status", pa.string()), ("reason", pa.string()), ("messages", pa.string()),
        ("media_kinds", pa.list_(pa.string())), ("media_refs", pa.list_(pa.string())),
        ("media_stamps", pa.list_(pa.string())), ("media_views", pa.list_(pa.string()))]))
    pq.write_table(table, path, row_group_size=row_group)


def test_aligned_batches_cut_at_multiples_of_the_batch_size_whatever_the_row_groups(tmp_path):
    path = tmp_path / "catalog.parquet"
    _catalog(path, 5000, row_group=700)
    batches = list(aligned_batches(path, ["sample_id"], 2048, 2048, 4500))
    assert [batch.num_rows for batch in batches] == [2048, 404]
    assert batches[0].column(0)[0].as_py() == "s2048" and batches[1].column(0)[-1].as_py() == "s4499"
    whole = list(aligned_batches(path, ["sample_id"], 2048))
    assert [batch.num_rows for batch in whole] == [2048, 2048, 904]
    assert list(aligned_batches(path, ["sample_id"], 2048, 6000, 7000)) == []


def test_appended_rows_leave_the_earlier_chunks_digests_and_an_edit_changes_its_chunk_only(tmp_path):
    _catalog(tmp_path / "first.parquet", 5000, row_group=8192)
    _catalog(tmp_path / "appended.parquet", 7000, row_group=1000)
    _catalog(tmp_path / "edited.parquet", 7000, row_group=8192, edited=2100)
    first = plan_chunks(tmp_path / "first.parquet", STORE_ROWS)
    appended = plan_chunks(tmp_path / "appended.parquet", STORE_ROWS)
    edited = plan_chunks(tmp_path / "edited.parquet", STORE_ROWS)
    assert (len(first), len(appended)) == (3, 4)
    assert appended.digests[:2] == first.digests[:2] and appended.digests[2] != first.digests[2]
    assert [a == b for a, b in zip(appended.digests, edited.digests)] == [True, False, True, True]
    assert appended.row_range(3) == range(6144, 7000)
    first.save(tmp_path / "plan.json")
    assert ChunkPlan.load(tmp_path / "plan.json") == first
    assert ChunkPlan.load(tmp_path / "missing.json") is None


def test_chunk_size_and_partition_keys():
    assert rows_per_chunk(1_000_000) == DEFAULT_CHUNK_ROWS
    assert rows_per_chunk(100_000_000) == DEFAULT_CHUNK_ROWS
    big = rows_per_chunk(500_000_000)
    assert big % STORE_ROWS == 0 and 500_000_000 / big <= 10_000
    assert rows_per_chunk(500_000_000, 4096) == 4096
    assert chunk_partition_key("my-source_2", 12) == "00012|my-source_2"
    assert split_chunk_partition("00012|my-source_2") == ("my-source_2", 12)
    with pytest.raises(ValueError, match="not a chunk partition key"):
        split_chunk_partition("my-source_2")


def test_chunks_measured_apart_in_any_order_assemble_the_table_one_pass_writes(tmp_path):
    catalog = tmp_path / "catalog.parquet"
    _catalog(catalog, 2 * STORE_ROWS + 300, row_group=1500)
    model, frame_cache = ModelConfig(), FrameCacheConfig()
    write_length_table(catalog, tmp_path / "one_pass.parquet", model, frame_cache)
    plan = plan_chunks(catalog, STORE_ROWS)
    store = ChunkStore(tmp_path / "store", settings="test")
    measured = [write_length_table(catalog, None, model, frame_cache, store=store, rows=plan.row_range(index))
                for index in reversed(range(len(plan)))]
    assert [summary.samples for summary in measured] == [300, STORE_ROWS, STORE_ROWS]
    assembled = write_length_table(catalog, tmp_path / "assembled.parquet", model, frame_cache, store=store)
    assert assembled.reused_rows == plan.total_rows
    assert (tmp_path / "assembled.parquet").read_bytes() == (tmp_path / "one_pass.parquet").read_bytes()
    with pytest.raises(ValueError, match="chunk store and a row range"):
        write_length_table(catalog, None, model, frame_cache, store=store)


def test_the_table_records_the_transformers_release_that_counted_and_the_fingerprint_follows_it(tmp_path, monkeypatch):
    from importlib.metadata import version

    from vlm_assets.tokens import processor

    _catalog(tmp_path / "catalog.parquet", 10, row_group=10)
    write_length_table(tmp_path / "catalog.parquet", tmp_path / "lengths.parquet", ModelConfig(), FrameCacheConfig(), 1)
    recorded = pq.read_schema(tmp_path / "lengths.parquet").metadata[b"transformers"].decode()
    assert recorded == version("transformers")
    installed = processor.processor_fingerprint(ModelConfig())
    # Another release in the same environment: what `pip install transformers==…` changes.
    monkeypatch.setattr(processor, "transformers_version", lambda: "5.10.1" if recorded != "5.10.1" else "5.25.0")
    assert processor.processor_fingerprint(ModelConfig()) != installed


def test_a_medium_that_changed_or_vanished_since_the_catalogue_fails_the_chunk_naming_it(tmp_path):
    """Deleted, then restored with its old size and modification time (`cp -p`): never a rejected
    sample, nor a length measured from other bytes than the catalogue checked, but a failure naming
    the file; catalogued anew, the sample is measured again."""
    import json
    import shutil

    from PIL import Image

    from vlm_assets.atomic import write_parquet
    from vlm_assets.config import SourceConfig
    from vlm_assets.media.checks import MediumChanged
    from vlm_assets_tests.catalog_support import build_catalog

    flat = tmp_path / "flat"
    flat.mkdir()
    for number in range(3):
        Image.new("RGB", (64, 64), (number * 60, 90, 200)).save(flat / f"{number}.png")
        (flat / f"{number}.json").write_text(json.dumps({
            "messages": [{"role": "user", "content": "<image>What is it?"}, {"role": "assistant", "content": "A square."}],
            "images": [f"{number}.png"]}))
    source = SourceConfig("f", "flat_dir", flat, flat)
    catalog = tmp_path / "catalog.parquet"
    write_parquet(build_catalog(source), catalog)
    model, frame_cache = ModelConfig(), FrameCacheConfig()
    write_length_table(catalog, tmp_path / "lengths.parquet", model, frame_cache)
    measured = pq.read_table(tmp_path / "lengths.parquet").to_pylist()

    image = flat / "1.png"
    saved = tmp_path / "saved.png"
    shutil.copy2(image, saved)
    image.unlink()
    with pytest.raises(MediumChanged, match=f"{image}: unreadable since the catalogue was built"):
        write_length_table(catalog, tmp_path / "again.parquet", model, frame_cache)
    shutil.copy2(saved, image)
    with pytest.raises(MediumChanged, match=f"{image}: changed since the catalogue was built"):
        write_length_table(catalog, tmp_path / "again.parquet", model, frame_cache)

    write_parquet(build_catalog(source), catalog)
    write_length_table(catalog, tmp_path / "again.parquet", model, frame_cache)
    assert pq.read_table(tmp_path / "again.parquet").to_pylist() == measured


def test_a_decoders_error_is_the_samples_and_the_systems_is_the_machines():
    """PyAV raises FFmpeg's failures as OSErrors with an errno (AVERROR(EPERM) as a PermissionError):
    those are the sample's, a reject; the operating system's own are the machine's, the step fails."""
    import errno

    import av.error

    from vlm_assets.media.checks import medium_read_failure

    assert medium_read_failure(av.error.PermissionError(errno.EPERM, "Operation not permitted"), ["/v.avi"]) is None
    assert medium_read_failure(ValueError("cannot identify image file"), ["/a.png"]) is None
    missing = medium_read_failure(FileNotFoundError(errno.ENOENT, "No such file or directory", "/a.png"), ["/a.png"])
    assert str(missing).startswith("/a.png: unreadable since the catalogue was built (FileNotFoundError")
