"""One big source split into chunks over several processes gives the tables one process gives."""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import dagster as dg
import pandas as pd
import pytest
import yaml
from PIL import Image

from vlm_assets.catalog.build import MediaValidator, iter_catalog_chunks
from vlm_assets_tests.catalog_support import build_catalog, read_catalog
from vlm_assets.catalog.lookup import SampleLookup
from vlm_assets.media.checks import MediaCheckLog
from vlm_assets.catalog.schema import STATUS_OK
from vlm_assets.catalog.table import reason_kind, write_catalog
from vlm_assets.config import FrameCacheConfig, ModelConfig, SourceConfig
from vlm_assets.dedup.decisions import removed_reasons
from vlm_assets.packing.records import RECORD_COLUMNS
from vlm_assets.parallel import STEP_PROCESSES_ENV_VAR, ordered_map, step_processes
from vlm_assets.parquet_batches import rows_with_ids
from vlm_assets.tokens.consumer import CountingRule
from vlm_assets.tokens.lengths import LengthCounter, SampleForLength
from vlm_assets.tokens.processor import shared_processor
from vlm_assets.tokens.table import (
    LENGTH_CHUNK_ROWS,
    POOL_MIN_CHUNKS,
    RECHECK_MAX_TOKENS,
    ChunkStore,
    rows_to_recheck,
    sample_kind,
    write_length_table,
)
from vlm_assets_tests.packing_support import samples_by_id
from vlm_assets_tests.run_support import initialised_home, run, start_run

MODEL = ModelConfig(processor_kwargs={"min_pixels": 3136, "max_pixels": 1003520})
FRAME_CACHE = FrameCacheConfig()
CHUNK_ROWS = 32


@pytest.fixture(scope="module")
def big_source(tmp_path_factory) -> SourceConfig:
    """A jsonl source of 150 samples: text only, one or two images of assorted sizes, a few broken."""
    root = tmp_path_factory.mktemp("big_source")
    rng = random.Random(7)
    for number in range(12):
        size = (rng.randint(40, 900), rng.randint(40, 900))
        Image.new("RGB", size, (number * 20, 90, 160)).save(root / f"img{number}.jpg")
    lines = []
    for number in range(150):
        images = [f"img{rng.randrange(12)}.jpg" for _ in range(rng.choice([0, 1, 1, 2]))]
        if number % 37 == 5:
            images = ["missing.jpg"]
        prompt = "<image>" * len(images) + " ".join(["word"] * rng.randint(1, 300))
        lines.append(json.dumps({
            "id": f"s{number}",
            "images": images,
            "messages": [{"role": "user", "content": prompt}, {"role": "assistant", "content": "answer " * number}],
        }))
    lines.append(lines[10])  # a duplicate id: rejected, under a distinct id, in both modes
    (root / "train.jsonl").write_text("\n".join(lines) + "\n")
    return SourceConfig("big", "jsonl", root / "train.jsonl", root)


@pytest.fixture(scope="module")
def catalog(big_source, tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("catalog") / "catalog.parquet"
    write_catalog(big_source, path, "messages", MediaValidator(), 2, chunk_work=CHUNK_ROWS)
    return path


def test_catalogue_on_two_processes_equals_one_process(big_source, catalog, tmp_path):
    checks = tmp_path / "media_checks.sqlite"
    one = tmp_path / "one.parquet"
    summary = write_catalog(big_source, one, "messages", MediaValidator(check_log=MediaCheckLog(checks)), 1)
    assert one.read_bytes() == catalog.read_bytes()
    frame = read_catalog(one)
    pd.testing.assert_frame_equal(frame, build_catalog(big_source))
    assert (summary.samples, summary.ok, summary.rejected) == (151, 146, 5)
    assert frame.sample_id.is_unique
    # Counted by kind, as the UI's table shows them (shortened where a long temporary path makes them long).
    assert summary.reject_reasons == {
        reason_kind(f"missing media: 'missing.jpg' not found (looked in {big_source.media_root})"): 4,
        reason_kind(f"duplicate sample id 'big/s10', first read from {big_source.path}:11"): 1,
    }

    # Workers report the media they checked; the build records them once, so a rebuild on two
    # processes decodes nothing and the log still lists every image the catalogue uses.
    again = MediaValidator(check_log=MediaCheckLog(checks))
    write_catalog(big_source, tmp_path / "again.parquet", "messages", again, 2, chunk_work=CHUNK_ROWS)
    assert again.decoded == 0 and again.remembered >= 12  # each worker looks its images up once
    assert len(list(MediaCheckLog(checks, append=False).passes())) == 12
    assert (tmp_path / "again.parquet").read_bytes() == catalog.read_bytes()


@pytest.mark.parametrize("ids", ["all", "some"])
def test_a_big_jsonl_read_in_ranges_by_the_processes_gives_the_one_reader_catalogue(tmp_path, monkeypatch, ids):
    """Each process reads and parses its own ranges of lines: same rows, numbers, duplicates and rejects."""
    Image.new("RGB", (64, 48), (10, 20, 30)).save(tmp_path / "a.jpg")
    lines = []
    for number in range(400):
        record = {"messages": [{"role": "user", "content": "<image>what " * (number % 3 > 0) + f"q{number}"},
                               {"role": "assistant", "content": "a " * (number % 50)}],
                  "images": ["a.jpg"] * (number % 3 > 0)}
        if ids == "all" or number % 7:
            record["id"] = f"r{number % 390}"  # the last ten repeat earlier ids
        lines.append(json.dumps(record))
    lines[50] = "{not json"
    lines[120] = ""  # a blank line: not a record
    lines[200] = json.dumps({"id": "big", "messages": [{"role": "user", "content": "x" * 5000}]})  # over the limit
    lines[300] = json.dumps({"id": "r300", "messages": [{"role": "user", "content": "<image>"}], "images": ["gone.jpg"]})
    lines[399] = lines[1]  # the same record again
    (tmp_path / "train.jsonl").write_text("\n".join(lines) + "\n")
    source = SourceConfig("ranges", "jsonl", tmp_path / "train.jsonl", tmp_path, max_record_bytes=4096)
    one = tmp_path / "one.parquet"
    write_catalog(source, one, "messages", MediaValidator(), 1)

    import vlm_assets.catalog.build as build

    monkeypatch.setattr(build, "RANGE_READING_MIN_BYTES", 0)
    monkeypatch.setattr(build, "RANGE_BYTES", (1024, 2048))
    assert build._read_in_ranges(source, 2, build.JsonlPart()) == 1024
    ranged = tmp_path / "ranged.parquet"
    checks = MediaCheckLog(tmp_path / "checks.sqlite")
    summary = write_catalog(source, ranged, "messages", MediaValidator(check_log=checks), 2)
    assert ranged.read_bytes() == one.read_bytes()
    frame = read_catalog(ranged)
    assert frame.sample_id.is_unique and summary.samples == 399
    duplicates = sum(reason.startswith("duplicate sample id") for reason in frame.reason)
    assert duplicates == (10 if ids == "all" else 0)  # without ids on all, records are named by their content
    if ids != "all":
        assert frame.sample_id.iloc[-1] == frame.sample_id.iloc[1] + "-2"  # the copy's occurrence is numbered
    assert len(list(MediaCheckLog(tmp_path / "checks.sqlite", append=False).passes())) == 1  # a.jpg


class Interrupted(Exception):
    pass


def test_a_length_table_cut_short_resumes_from_its_finished_chunks_and_gives_the_same_bytes(catalog, tmp_path):
    clean = tmp_path / "clean.parquet"
    rows = write_length_table(catalog, clean, MODEL, FRAME_CACHE, 1, chunk_rows=CHUNK_ROWS).samples
    store = ChunkStore(tmp_path / "chunks", settings="processor A")

    def cut_after_two_chunks(done: int, total: int) -> None:
        if done >= 2 * CHUNK_ROWS:
            raise Interrupted  # as a kill would, after two chunks were written
    resumed = tmp_path / "resumed.parquet"
    with pytest.raises(Interrupted):
        write_length_table(catalog, resumed, MODEL, FRAME_CACHE, 1, cut_after_two_chunks, chunk_rows=CHUNK_ROWS, store=store)
    assert not resumed.exists()

    summary = write_length_table(catalog, resumed, MODEL, FRAME_CACHE, 2, chunk_rows=CHUNK_ROWS, store=store)
    assert summary.reused_rows == 2 * CHUNK_ROWS  # only the chunks not finished before were measured
    assert resumed.read_bytes() == clean.read_bytes()
    assert list(summary.ok_token_lens) == list(pd.read_parquet(clean).query("status == @STATUS_OK").token_len)

    again = write_length_table(catalog, tmp_path / "again.parquet", MODEL, FRAME_CACHE, 1, chunk_rows=CHUNK_ROWS, store=store)
    assert again.reused_rows == rows and (tmp_path / "again.parquet").read_bytes() == clean.read_bytes()

    fresh = ChunkStore(tmp_path / "chunks", settings="processor A", reuse=False)  # `vlm-assets run --force`
    assert write_length_table(catalog, tmp_path / "fresh.parquet", MODEL, FRAME_CACHE, 1, chunk_rows=CHUNK_ROWS,
                              store=fresh).reused_rows == 0
    assert (tmp_path / "fresh.parquet").read_bytes() == clean.read_bytes()

    # Other settings (another processor): nothing is reused, and the store keeps only what the last build used.
    other = ChunkStore(tmp_path / "chunks", settings="processor B")
    assert write_length_table(catalog, tmp_path / "other.parquet", MODEL, FRAME_CACHE, 1, chunk_rows=CHUNK_ROWS,
                              store=other).reused_rows == 0
    chunks = -(-rows // CHUNK_ROWS)
    assert len(list((tmp_path / "chunks").glob("*.parquet"))) == chunks


def test_chunked_lengths_on_two_processes_equal_one_process_and_the_whole_source_at_once(catalog, tmp_path):
    one, two = tmp_path / "one.parquet", tmp_path / "two.parquet"
    progress: list[tuple[int, int]] = []
    # Chunks small enough for a pool (fewer than POOL_MIN_CHUNKS are measured on one process).
    chunk_rows = 150 // (POOL_MIN_CHUNKS + 2)
    summary_one = write_length_table(catalog, one, MODEL, FRAME_CACHE, 1, chunk_rows=chunk_rows)
    summary_two = write_length_table(
        catalog, two, MODEL, FRAME_CACHE, 2, lambda done, total: progress.append((done, total)), chunk_rows=chunk_rows
    )
    assert summary_two.processes == 2 and summary_one.processes == 1
    assert one.read_bytes() == two.read_bytes()
    rows = summary_one.samples
    assert progress == [(min(done, rows), rows) for done in range(chunk_rows, rows + chunk_rows, chunk_rows)]
    few = write_length_table(catalog, tmp_path / "few.parquet", MODEL, FRAME_CACHE, 2, chunk_rows=CHUNK_ROWS)
    assert few.processes == 1
    pd.testing.assert_frame_equal(pd.read_parquet(tmp_path / "few.parquet"), pd.read_parquet(one))

    # Reference: every sample of the source counted in one call, no chunks.
    frame = pd.read_parquet(catalog)
    counter = LengthCounter(shared_processor(MODEL), FRAME_CACHE)  # the exact path on every sample
    ok = frame[frame.status == STATUS_OK]
    expected = counter.count([
        SampleForLength(row.sample_id, row.messages, list(row.media_kinds), list(row.media_refs))
        for row in ok.itertuples(index=False)
    ])
    table = pd.read_parquet(two)
    assert table.sample_id.tolist() == frame.sample_id.tolist()
    assert table[table.status == STATUS_OK].token_len.tolist() == [result.token_len for result in expected]
    assert summary_two.ok_token_lens.tolist() == [result.token_len for result in expected]
    rejected = table[table.status != STATUS_OK]
    assert rejected.reason.tolist() == frame[frame.status != STATUS_OK].reason.tolist()
    assert rejected.reason.str.contains("missing.jpg").sum() == 4

    # The check's rows, read chunk by chunk: up to the asked number of ok rows of each kind, with their lengths.
    ok_table = table[table.status == STATUS_OK].set_index("sample_id")
    kinds = {row.sample_id: sample_kind(list(row.media_kinds)) for row in ok.itertuples()}
    selection = rows_to_recheck(catalog, two, 3)
    assert selection.catalog_ok == len(ok) and selection.processor_failure_count == 0
    assert selection.ok_by_kind == Counter(kinds.values())
    assert Counter(selection.kind_of.values()) == {kind: min(3, n) for kind, n in Counter(kinds.values()).items()}
    assert selection.chosen == {sample_id: ok_table.token_len[sample_id] for sample_id in selection.chosen}
    assert all(kinds[sample_id] == kind for sample_id, kind in selection.kind_of.items())
    assert rows_to_recheck(catalog, two, 3).chosen == selection.chosen  # seeded
    assert len(rows_to_recheck(catalog, two, 10_000).chosen) == len(ok_table)
    # A row longer than the processor's call on its whole text should be given is never chosen.
    longest = ok_table.token_len.idxmax()
    table.loc[table.sample_id == longest, "token_len"] = RECHECK_MAX_TOKENS + 1
    table.to_parquet(tmp_path / "long.parquet", index=False)
    everything = rows_to_recheck(catalog, tmp_path / "long.parquet", 10_000)
    assert longest not in everything.chosen and len(everything.chosen) == len(ok_table) - 1
    assert everything.too_long == 1 and everything.ok_by_kind == selection.ok_by_kind


def test_step_processes_setting(monkeypatch):
    monkeypatch.setenv(STEP_PROCESSES_ENV_VAR, "3")
    assert step_processes() == 3
    for bad in ("0", "many"):
        monkeypatch.setenv(STEP_PROCESSES_ENV_VAR, bad)
        with pytest.raises(ValueError, match=STEP_PROCESSES_ENV_VAR):
            step_processes()


def _chat_lines(prefix: str, count: int, seed: int) -> str:
    rng = random.Random(seed)
    return "".join(
        json.dumps({"id": f"{prefix}{number}", "messages": [
            {"role": "user", "content": " ".join(rng.choice(["why", "sky", "blue", "light", "scatter"]) for _ in range(rng.randint(1, 80)))},
            {"role": "assistant", "content": "Rayleigh scattering. " * rng.randint(1, 20)},
        ]}) + "\n" for number in range(count))


def _chunk_runs(home: Path) -> list[str]:
    """The partitions of the sample_length_chunk runs on that instance that materialised, oldest first."""
    with dg.DagsterInstance.from_config(str(home)) as instance:
        records = instance.fetch_materializations(dg.AssetKey("sample_length_chunk"), limit=1000, ascending=True).records
        return [record.partition_key for record in records]


@pytest.mark.processes
def test_a_source_cut_into_chunks_measures_them_apart_and_gives_the_one_worker_table(tmp_path):
    """`chunk_rows: 2048` cuts a 4,296-row source into 3 chunk partitions; 1 and 2 workers give one table;
    appended records rerun only the grown last chunk and the new one; --force measures them all again."""
    rows = 2 * LENGTH_CHUNK_ROWS + 200
    manifest = tmp_path / "inputs" / "chat.jsonl"
    manifest.parent.mkdir()
    manifest.write_text(_chat_lines("c", rows, seed=3))
    tables = {}
    for workers in (1, 2):
        site = tmp_path / f"workers{workers}"
        site.mkdir()
        config = site / "vlm_assets.yaml"
        config.write_text(yaml.safe_dump({
            "storage": {"root": str(site / "vlm_data")},
            "sources": [{"name": "chat", "kind": "jsonl", "path": str(manifest), "chunk_rows": LENGTH_CHUNK_ROWS}],
        }))
        result = run(config, site / "home", "--workers", str(workers), "--select", "sample_lengths")
        assert result.returncode == 0, result.stdout[-3000:]
        tables[workers] = (site / "vlm_data" / "lengths" / "chat.parquet").read_bytes()
        assert sorted(_chunk_runs(site / "home")) == ["00000|chat", "00001|chat", "00002|chat"]
        with dg.DagsterInstance.from_config(str(site / "home")) as instance:
            metadata = instance.get_latest_materialization_event(dg.AssetKey("sample_lengths")).asset_materialization.metadata
            assert metadata["rows_reused"].value == rows  # the assembly measured nothing itself
    assert tables[1] == tables[2]
    # One process measuring the whole table in one step (no chunk runs, nothing stored) gives the same bytes.
    # (The generated conversations repeat: those sample_dedup removed are rejected in the table.)
    whole = write_length_table(tmp_path / "workers1" / "vlm_data" / "catalog" / "chat.parquet", tmp_path / "whole.parquet",
                               ModelConfig(), FRAME_CACHE, rule=CountingRule("packed_multi_mix_qa"),
                               removed=removed_reasons(tmp_path / "workers1" / "vlm_data" / "dedup" / "chat.parquet"))
    assert whole.reused_rows == 0 and (tmp_path / "whole.parquet").read_bytes() == tables[1]

    # Records appended: only the grown last chunk and the new one are measured again, each in its own run.
    with manifest.open("a") as appended:
        appended.write(_chat_lines("more", 2100, seed=4))
    site = tmp_path / "workers2"
    result = run(site / "vlm_assets.yaml", site / "home", "--workers", "2", "--select", "sample_lengths")
    assert result.returncode == 0, result.stdout[-3000:]
    assert "= sample_length_chunk [00000|chat]: up to date" in result.stdout
    assert "= sample_length_chunk [00001|chat]: up to date" in result.stdout
    assert sorted(_chunk_runs(site / "home")[3:]) == ["00002|chat", "00003|chat"]
    with dg.DagsterInstance.from_config(str(site / "home")) as instance:
        metadata = instance.get_latest_materialization_event(dg.AssetKey("sample_catalog")).asset_materialization.metadata
        assert metadata["rows_kept"].value == rows and metadata["samples"].value == rows + 2100  # only the new lines read
    full_read = tmp_path / "full_read.parquet"
    write_catalog(SourceConfig("chat", "jsonl", manifest, manifest.parent), full_read, "messages", MediaValidator())
    assert (site / "vlm_data" / "catalog" / "chat.parquet").read_bytes() == full_read.read_bytes()
    appended_table = (site / "vlm_data" / "lengths" / "chat.parquet").read_bytes()
    shutil.rmtree(tmp_path / "workers1" / "vlm_data" / "spool" / "lengths")
    result = run(tmp_path / "workers1" / "vlm_assets.yaml", tmp_path / "workers1" / "home", "--select", "sample_lengths")
    assert result.returncode == 0, result.stdout[-3000:]
    assert (tmp_path / "workers1" / "vlm_data" / "lengths" / "chat.parquet").read_bytes() == appended_table

    # --force measures every chunk again, in the chunks' runs.
    forced = run(site / "vlm_assets.yaml", site / "home", "--workers", "2", "--select", "sample_lengths", "--force")
    assert forced.returncode == 0, forced.stdout[-3000:]
    with dg.DagsterInstance.from_config(str(site / "home")) as instance:
        records = instance.fetch_materializations(dg.AssetKey("sample_length_chunk"), limit=4).records
        assert sorted(record.partition_key for record in records) == [f"0000{index}|chat" for index in range(4)]
        assert all(record.asset_materialization.metadata["rows_reused"].value == 0 for record in records)
        catalogue = instance.get_latest_materialization_event(dg.AssetKey("sample_catalog")).asset_materialization.metadata
        assert catalogue["rows_kept"].value == 0  # every record read again
    assert (site / "vlm_data" / "lengths" / "chat.parquet").read_bytes() == appended_table


def _chat_files(folder: Path, first: int, count: int, seed: int) -> None:
    folder.mkdir(exist_ok=True)
    for number, line in enumerate(_chat_lines("f", count, seed).splitlines(), start=first):
        (folder / f"{number:06d}.json").write_text(line)


@pytest.mark.processes
def test_files_added_to_a_folder_source_are_read_alone_and_measure_only_the_chunks_they_touch(tmp_path):
    """A flat_dir source of 2,100 record files (chunks of 2,048 rows), then 2,100 more sorting after them:
    the catalogue reads only the new files and only the grown chunk and the new one are measured."""
    folder = tmp_path / "chat"
    _chat_files(folder, 0, 2100, seed=5)
    config = tmp_path / "vlm_assets.yaml"
    config.write_text(yaml.safe_dump({
        "storage": {"root": str(tmp_path / "vlm_data")},
        "sources": [{"name": "chat", "kind": "flat_dir", "path": str(folder), "chunk_rows": LENGTH_CHUNK_ROWS}],
    }))
    first = run(config, tmp_path / "home", "--workers", "2", "--select", "sample_lengths")
    assert first.returncode == 0, first.stdout[-3000:]
    assert sorted(_chunk_runs(tmp_path / "home")) == ["00000|chat", "00001|chat"]

    _chat_files(folder, 2100, 2100, seed=6)
    second = run(config, tmp_path / "home", "--workers", "2", "--select", "sample_lengths")
    assert second.returncode == 0, second.stdout[-3000:]
    assert "= sample_length_chunk [00000|chat]: up to date" in second.stdout
    assert sorted(_chunk_runs(tmp_path / "home")[2:]) == ["00001|chat", "00002|chat"]
    with dg.DagsterInstance.from_config(str(tmp_path / "home")) as instance:
        metadata = instance.get_latest_materialization_event(dg.AssetKey("sample_catalog")).asset_materialization.metadata
        assert metadata["rows_kept"].value == 2100 and metadata["samples"].value == 4200
    full_read = tmp_path / "full_read.parquet"
    write_catalog(SourceConfig("chat", "flat_dir", folder, folder), full_read, "messages", MediaValidator())
    assert (tmp_path / "vlm_data" / "catalog" / "chat.parquet").read_bytes() == full_read.read_bytes()


@pytest.mark.processes
def test_a_run_killed_mid_chunks_reruns_only_the_chunks_it_had_not_finished(tmp_path):
    """kill -9 of `vlm-assets run` (its whole process group) once a chunk is done: the rerun measures the
    others only, and the table equals one measured in one pass."""
    manifest = tmp_path / "chat.jsonl"
    manifest.write_text(_chat_lines("c", 5 * LENGTH_CHUNK_ROWS, seed=5))
    config = tmp_path / "vlm_assets.yaml"
    config.write_text(yaml.safe_dump({
        "storage": {"root": str(tmp_path / "vlm_data")},
        "sources": [{"name": "chat", "kind": "jsonl", "path": str(manifest), "chunk_rows": LENGTH_CHUNK_ROWS}],
    }))
    home = initialised_home(tmp_path / "home")
    process = start_run(config, home, "--workers", "1", "--select", "sample_lengths")
    deadline = time.monotonic() + 300
    while not _chunk_runs(home):
        assert process.poll() is None and time.monotonic() < deadline, "no chunk was measured"
        time.sleep(0.5)
    os.killpg(process.pid, signal.SIGKILL)
    process.wait()
    done_before = set(_chunk_runs(home))
    assert 0 < len(done_before) < 5

    result = run(config, home, "--workers", "2", "--select", "sample_lengths")
    assert result.returncode == 0, result.stdout[-3000:]
    rerun = _chunk_runs(home)[len(done_before):]
    assert sorted(done_before | set(rerun)) == [f"0000{index}|chat" for index in range(5)]
    assert not done_before & set(rerun), f"{sorted(done_before & set(rerun))} measured again"
    write_length_table(tmp_path / "vlm_data" / "catalog" / "chat.parquet", tmp_path / "one_pass.parquet", ModelConfig(),
                       FRAME_CACHE, rule=CountingRule("packed_multi_mix_qa"),  # the config's default sample type
                       removed=removed_reasons(tmp_path / "vlm_data" / "dedup" / "chat.parquet"))
    assert (tmp_path / "vlm_data" / "lengths" / "chat.parquet").read_bytes() == (tmp_path / "one_pass.parquet").read_bytes()


def test_sample_lookup_on_disk_answers_like_the_catalogue_in_memory(catalog, tmp_path):
    frame = read_catalog(catalog)
    in_memory = samples_by_id(frame[frame.status == STATUS_OK])
    near = tmp_path / "packed" / "big.jsonl"
    with SampleLookup(catalog, RECORD_COLUMNS, near=near) as lookup:
        assert list(near.parent.iterdir()) == [lookup.path]  # a temporary file of the step's output
        assert len(lookup) == len(in_memory) == 146
        assert {sample_id: lookup[sample_id] for sample_id in lookup} == in_memory
        rejected = frame.sample_id[frame.status != STATUS_OK].iloc[0]
        assert rejected not in lookup
        with pytest.raises(KeyError):
            lookup[rejected]
    assert list(near.parent.iterdir()) == []


def test_video_records_make_small_chunks_and_two_processes_give_the_same_catalogue_and_mosaics(tmp_path):
    """A video's check decodes its sampled frames, so chunks hold few videos: a video source is not one chunk."""
    from vlm_assets.frames.spool import MosaicSpool
    from vlm_assets_tests.test_frames import make_video

    for number in range(7):
        make_video(tmp_path / f"clip{number}.mp4", frames=20 + number)
    lines = []
    for number in range(10):
        record = {"id": f"r{number}", "messages": [{"role": "user", "content": "<video>What happens?"},
                                                      {"role": "assistant", "content": "Stripes move."}]}
        if number < 7:
            record["videos"] = [f"clip{number}.mp4"]
        else:
            record["messages"][0]["content"] = "Just text."
        lines.append(json.dumps(record))
    (tmp_path / "clips.jsonl").write_text("\n".join(lines) + "\n")
    source = SourceConfig("clips", "jsonl", tmp_path / "clips.jsonl", tmp_path)

    # Records the same with one process: chunk boundaries follow the records' work, not the processes.
    chunk_sizes = [len(chunk) for chunk in iter_catalog_chunks(source, "messages", MediaValidator(8))]
    assert chunk_sizes == [1, 1, 1, 1, 1, 1, 4]  # a video each, then the last video with the three text records

    config = FrameCacheConfig(num_frames=8, frame_size=64, rows=2, cols=4)
    tables, spools = [], []
    for processes in (1, 2):
        spool = tmp_path / f"spool{processes}"
        validator = MediaValidator(8, mosaic_spool=MosaicSpool(spool, config))
        summary = write_catalog(source, tmp_path / f"catalog{processes}.parquet", "messages", validator, processes)
        assert (summary.ok, summary.rejected, validator.decoded) == (10, 0, 7)
        tables.append((tmp_path / f"catalog{processes}.parquet").read_bytes())
        spools.append(sorted((path.name, path.read_bytes()) for path in spool.rglob("*") if path.is_file()))
    assert tables[0] == tables[1]
    assert spools[0] == spools[1] and len(spools[0]) >= 7


def _cost_and_process(seconds: float) -> tuple[float, int]:
    time.sleep(seconds)
    return seconds, os.getpid()


def _nothing_to_set_up() -> None:
    pass


def test_ordered_map_keeps_input_order_while_this_process_takes_chunks_the_pool_has_not_started():
    costs = [0.4, 0.0, 0.0, 0.0, 0.3, 0.0, 0.0, 0.2, 0.0]
    results = list(ordered_map(_cost_and_process, costs, 2, _nothing_to_set_up))
    assert [cost for cost, _pid in results] == costs
    # The pool's process starts (a second or so) while this one already works through later chunks.
    workers = {pid for _cost, pid in results}
    assert os.getpid() in workers and len(workers) == 2


def _sleep_or_fail(seconds: float) -> float:
    if seconds < 0:
        raise ValueError("a bad chunk")
    time.sleep(seconds)
    return seconds


# In a process of its own: the pools earlier tests left in the test process may start children meanwhile.
FAILED_CHUNK = """
import multiprocessing, sys, time
from vlm_assets.parallel import ordered_map
from vlm_assets_tests.test_chunked_source import _nothing_to_set_up, _sleep_or_fail
started = time.monotonic()
try:
    list(ordered_map(_sleep_or_fail, [120.0, -1.0], 2, _nothing_to_set_up))
except ValueError as error:
    print(f"raised: {error}")
print(f"seconds: {time.monotonic() - started:.1f}")
# The pool's own thread may still be reaping the killed process, which multiprocessing lists until then
# (seconds on a loaded machine).
deadline = time.monotonic() + 30
while multiprocessing.active_children() and time.monotonic() < deadline:
    time.sleep(0.1)
print(f"children left: {len(multiprocessing.active_children())}")
"""


def test_a_failed_chunk_ends_ordered_map_without_waiting_for_the_pools_long_chunk():
    result = subprocess.run([sys.executable, "-c", FAILED_CHUNK], capture_output=True, text=True, timeout=110,
                            cwd=Path(__file__).parents[1])
    assert result.returncode == 0, result.stderr[-3000:]
    lines = dict(line.split(": ", 1) for line in result.stdout.splitlines())
    assert "a bad chunk" in lines["raised"]
    assert float(lines["seconds"]) < 60  # the 120 s chunk was not waited for
    assert lines["children left"] == "0"


def test_rows_with_ids_reads_just_those_rows_in_table_order(catalog):
    frame = pd.read_parquet(catalog)
    wanted = random.Random(1).sample(frame.sample_id.tolist(), 7) + ["no-such-id"]
    rows = rows_with_ids(catalog, wanted, ["messages", "media_refs"])
    expected = frame[frame.sample_id.isin(wanted)]
    assert [row["sample_id"] for row in rows] == expected.sample_id.tolist()
    assert [row["messages"] for row in rows] == expected.messages.tolist()
    assert [row["media_refs"] for row in rows] == [list(refs) for refs in expected.media_refs]


def test_a_chunk_whose_image_sizes_were_counted_before_needs_no_processor(big_source, catalog, tmp_path, monkeypatch):
    from vlm_assets.tokens import profile
    from vlm_assets.tokens.profile import stored_media_tokens

    whole = tmp_path / "whole.parquet"
    write_length_table(catalog, whole, MODEL, FRAME_CACHE, 1, chunk_rows=CHUNK_ROWS)  # loads the processor
    counter = LengthCounter(shared_processor(MODEL), FRAME_CACHE)
    stored = stored_media_tokens(MODEL, FRAME_CACHE)
    sizes = {(height, width) for path in Path(big_source.media_root).glob("*.jpg") for width, height in [Image.open(path).size]}
    used = {size for size in sizes if size in stored.by_size}
    assert used and all(stored.by_size[size] == counter.image_tokens_for_size(*size) for size in used)
    # A new counter of these processor files takes the clip count from the table: it is the processor's.
    assert stored.per_clip == counter.video_tokens_per_clip

    def no_processor(_model):
        raise AssertionError("the processor was loaded")

    monkeypatch.setattr(profile, "shared_processor", no_processor)
    rows = range(0, 2 * CHUNK_ROWS)
    summary = write_length_table(catalog, None, MODEL, FRAME_CACHE, 1, chunk_rows=CHUNK_ROWS,
                                 store=ChunkStore(tmp_path / "chunks", settings="s"), rows=rows)
    assert summary.profile is None
    expected = pd.read_parquet(whole).iloc[rows.start:rows.stop].query("status == @STATUS_OK").token_len
    assert list(summary.ok_token_lens) == list(expected)
