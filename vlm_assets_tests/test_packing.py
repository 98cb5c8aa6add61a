"""Packing lineage: bins, packed records, WebDataset shards, Energon dataset."""

from __future__ import annotations

import hashlib
import io
import json
import os
import re
import signal
import subprocess
import sys
import tarfile
import textwrap
from pathlib import Path

import av
import dagster as dg
import numpy as np
import pandas as pd
import pyarrow as pa
import pytest
from PIL import Image

from vlm_assets.atomic import write_parquet
from vlm_assets.catalog.lookup import SampleLookup
from vlm_assets.catalog.schema import CATALOG_COLUMNS, LENGTH_COLUMNS, media_type_of
from vlm_assets.defs.packing.assets import energon_dataset, packed_json, packed_wds_shards, packing_bins
from vlm_assets.defs.packing.checks import energon_loads_every_sample
from vlm_assets.defs.resources import SOURCES_PARTITIONS, VlmConfig
from vlm_assets.layout import StorageLayout
from vlm_assets.packing.binpack import best_fit_decreasing, lower_bound
from vlm_assets.packing.energon import prepare_energon_dataset
from vlm_assets.packing.energon_loader import load_all_ids
from vlm_assets.packing.plan import (
    CATEGORY_CATALOG,
    CATEGORY_LENGTH,
    CATEGORY_MEDIA_KIND,
    CATEGORY_MISSING_LENGTH,
    CATEGORY_OVER_MAX,
    BinsOnDisk,
    PackingInputError,
)
from vlm_assets.packing.sample_ids import IdIndex
from vlm_assets.packing.records import build_records, record_id, write_jsonl
from vlm_assets.packing.verify import (
    CheckedShards,
    MemberCheck,
    accounting_problems,
    check_shard_members,
)
from vlm_assets.packing.wds import list_shards
from vlm_assets_tests.packing_support import (
    first_fit_decreasing,
    pack_files,
    pack_frames,
    read_records,
    samples_by_id,
    write_source_shards,
)

MAX = 100


# ---------------------------------------------------------------- test inputs


def _image(path: Path, color: tuple[int, int, int], fmt: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new("RGB", (24, 16), color).save(path, format=fmt)


def _video(path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with av.open(str(path), "w", format="mp4") as container:
        stream = container.add_stream("mpeg4", rate=4)
        stream.width, stream.height, stream.pix_fmt = 32, 32, "yuv420p"
        for index in range(4):
            frame = av.VideoFrame.from_ndarray(np.full((32, 32, 3), index * 40, np.uint8), format="rgb24")
            container.mux(stream.encode(frame))
        container.mux(stream.encode())


def _messages(prompt: str, answer: str, media: list[str], turns: int = 1) -> str:
    placeholders = "".join(f"<{kind}>\n" for kind in media)
    messages = [{"role": "user", "content": f"{placeholders}{prompt}"}, {"role": "assistant", "content": answer}]
    for turn in range(1, turns):
        messages += [{"role": "user", "content": f"follow-up {turn}"}, {"role": "assistant", "content": f"reply {turn}"}]
    return json.dumps(messages)


def _stamp(path: Path) -> str:
    """The stamp the catalogue records of a medium ("" for one the test never wrote)."""
    from vlm_assets.media.checks import medium_stamp

    return medium_stamp(str(path)) if path.exists() else ""


def build_source(root: Path, source: str, samples: list[dict]) -> StorageLayout:
    """Write media, catalog and lengths parquet for `samples`.

    Each sample: id, media [(relative path, kind)], token_len, optionally status/reason
    (catalog), length_status, turns.
    """
    media_root = root / "media" / source
    layout = StorageLayout(root / "store")
    catalog_rows, length_rows = [], []
    for spec in samples:
        kinds = [kind for _, kind in spec.get("media", [])]
        ok = spec.get("status", "ok") == "ok"
        catalog_rows.append(
            {
                "sample_id": f"{source}/{spec['id']}",
                "source": source,
                "origin": f"{media_root}/{spec['id']}.json",
                "status": spec.get("status", "ok"),
                "reason": spec.get("reason", ""),
                "messages": _messages(f"question {spec['id']}", f"answer {spec['id']}", kinds, spec.get("turns", 1)) if ok else "[]",
                "n_turns": 2 * spec.get("turns", 1) if ok else 0,
                "media_files": [Path(rel).name for rel, _ in spec.get("media", [])],
                "media_kinds": kinds,
                "media_refs": [str(media_root / rel) for rel, _ in spec.get("media", [])],
                "media_keys": [f"{source}/{rel}" for rel, _ in spec.get("media", [])],
                "media_stamps": [_stamp(media_root / rel) for rel, _ in spec.get("media", [])],
                "media_views": ["" for _ in spec.get("media", [])],
                "media_type": media_type_of(kinds),
            }
        )
        if spec.get("length_status") != "missing":
            length_ok = ok and spec.get("length_status", "ok") == "ok"
            length_rows.append(
                {
                    "sample_id": f"{source}/{spec['id']}",
                    "status": "ok" if length_ok else "rejected",
                    "reason": "" if length_ok else spec.get("reason", "processor failed"),
                    "token_len": spec["token_len"] if length_ok else 0,
                    "text_tokens": spec["token_len"] if length_ok else 0,
                    "image_tokens": 0,
                    "video_tokens": 0,
                }
            )
    write_parquet(pd.DataFrame(catalog_rows, columns=list(CATALOG_COLUMNS)), layout.catalog(source))
    write_parquet(pd.DataFrame(length_rows, columns=list(LENGTH_COLUMNS)), layout.lengths(source))
    return layout


@pytest.fixture(scope="module")
def media(tmp_path_factory) -> Path:
    """Shared media: same basename in two folders, a PNG named .jpg, a tiny mp4."""
    root = tmp_path_factory.mktemp("packing_inputs")
    for source in ("mix", "vqa"):
        base = root / "media" / source
        _image(base / "a" / "0001.jpg", (255, 0, 0), "JPEG")
        _image(base / "b" / "0001.jpg", (0, 0, 255), "JPEG")
        _image(base / "c" / "photo.jpg", (0, 255, 0), "PNG")  # misnamed: content is PNG
        _video(base / "clips" / "clip.mp4")
    return root


MIX_SAMPLES = [
    {"id": "dup_a", "media": [("a/0001.jpg", "image")], "token_len": 40},
    {"id": "dup_b", "media": [("b/0001.jpg", "image")], "token_len": 40},
    {"id": "png", "media": [("c/photo.jpg", "image")], "token_len": 30, "turns": 3},
    {"id": "video", "media": [("clips/clip.mp4", "video")], "token_len": 55},
    {"id": "both", "media": [("a/0001.jpg", "image"), ("clips/clip.mp4", "video")], "token_len": 45},
    {"id": "text", "token_len": 20},
    {"id": "text2", "token_len": 100},
    {"id": "long", "media": [("a/0001.jpg", "image")], "token_len": 101},
    {"id": "broken", "status": "rejected", "reason": "unreadable image 'x.jpg' [mix/broken.json]", "token_len": 0},
    {"id": "nolen", "token_len": 5, "length_status": "missing"},
    {"id": "lenfail", "length_status": "rejected", "reason": "processor failed: boom", "token_len": 0},
]


@pytest.fixture(scope="module")
def mix_layout(media) -> StorageLayout:
    return build_source(media, "mix", MIX_SAMPLES)


def _catalog(layout: StorageLayout, source: str) -> pd.DataFrame:
    from vlm_assets_tests.catalog_support import read_catalog

    return read_catalog(layout.catalog(source))


def _plan(layout: StorageLayout, source: str, sample_type: str, max_len: int = MAX):
    return pack_files(layout.catalog(source), layout.lengths(source), layout.root / "plans" / f"{source}-{sample_type}-{max_len}",
                      sample_type, max_len)


def _records(layout: StorageLayout, source: str, sample_type: str):
    plan = _plan(layout, source, sample_type)
    return list(build_records(source, zip(plan.bins.bin_id, plan.bins.sample_ids, plan.bins.lengths), samples_by_id(_catalog(layout, source)), sample_type))


def _digests(directory: Path) -> dict[str, str]:
    return {path.name: hashlib.sha256(path.read_bytes()).hexdigest() for path in sorted(directory.iterdir())}


# ---------------------------------------------------------------- bin packing


def test_bfd_respects_capacity_covers_every_item_and_is_deterministic():
    rng = np.random.default_rng(7)
    lengths = np.clip(rng.lognormal(np.log(1200), 0.8, 20_000).round(), 1, 8192).astype(np.int64)
    bins = best_fit_decreasing(lengths, 8192)
    assert sorted(np.concatenate(bins).tolist()) == list(range(lengths.size))
    assert max(int(lengths[b].sum()) for b in bins) <= 8192
    again = best_fit_decreasing(lengths, 8192)
    assert all(np.array_equal(x, y) for x, y in zip(bins, again)) and len(bins) == len(again)
    assert lower_bound(lengths, 8192) <= len(bins) <= len(first_fit_decreasing(lengths, 8192))
    assert len(bins) <= 1.01 * lower_bound(lengths, 8192)


def test_bfd_picks_the_tightest_bin_and_rejects_out_of_range_lengths():
    # Decreasing: 60 | 50 | 40 -> best fit for 40 is the 60-bin (remaining 40), not the 50-bin.
    bins = best_fit_decreasing(np.array([50, 60, 40]), 100)
    assert sorted(sorted(b.tolist()) for b in bins) == [[0], [1, 2]]
    assert len(best_fit_decreasing(np.array([], dtype=np.int64), 100)) == 0
    with pytest.raises(ValueError):
        best_fit_decreasing(np.array([101]), 100)
    with pytest.raises(ValueError):
        best_fit_decreasing(np.array([0]), 100)


# ---------------------------------------------------------------- plan + rejects


def test_plan_multi_mix_packs_text_and_video_apart_and_rejects_mixed_with_reasons(mix_layout):
    plan = _plan(mix_layout, "mix", "packed_multi_mix_qa")
    rejects = dict(zip(plan.rejects.sample_id, zip(plan.rejects.category, plan.rejects.reason)))
    assert rejects["mix/long"][0] == CATEGORY_OVER_MAX and "101 > max_token_len 100" in rejects["mix/long"][1]
    assert rejects["mix/broken"] == (CATEGORY_CATALOG, "unreadable image 'x.jpg' [mix/broken.json]")
    assert rejects["mix/nolen"][0] == CATEGORY_MISSING_LENGTH
    assert "processor failed: boom" in rejects["mix/lenfail"][1]
    assert rejects["mix/both"][0] == CATEGORY_MEDIA_KIND and "one media type" in rejects["mix/both"][1]
    assert len(rejects) == 5
    packed = {sample_id for ids in plan.bins.sample_ids for sample_id in ids}
    assert {"mix/text", "mix/text2", "mix/video"} <= packed
    kinds = dict(zip(_catalog(mix_layout, "mix").sample_id, _catalog(mix_layout, "mix").media_type))
    assert all(len({kinds[sample_id] for sample_id in ids}) == 1 for ids in plan.bins.sample_ids)
    assert accounting_problems(mix_layout.catalog("mix"), plan.bins_path, plan.rejects_path) == []
    assert plan.bins.total_len.max() <= MAX
    assert plan.bins.total_len.tolist() == [sum(lengths) for lengths in plan.bins.lengths]


def test_plan_rejects_a_length_that_is_not_positive_and_keeps_table_order(tmp_path):
    catalog = pd.DataFrame({"sample_id": ["z", "a", "m", "b"], "status": ["ok"] * 4, "reason": [""] * 4,
                            "media_type": ["text"] * 4})
    lengths = pd.DataFrame({"sample_id": ["z", "a", "m", "b"], "status": ["ok"] * 4, "reason": [""] * 4,
                            "token_len": [30, 0, 40, -2]})
    plan = pack_frames(catalog, lengths, tmp_path, "packed_multi_mix_qa", 100)
    assert plan.rejects.values.tolist() == [["a", "token_len 0 is not positive", CATEGORY_LENGTH],
                                            ["b", "token_len -2 is not positive", CATEGORY_LENGTH]]
    assert plan.bins.sample_ids.tolist() == [["m", "z"]] and plan.bins.lengths.tolist() == [[40, 30]]


def test_plan_image_only_types_reject_video_mixed_and_text(mix_layout):
    for sample_type in ("packed_vqa", "packed_captioning"):
        plan = _plan(mix_layout, "mix", sample_type)
        kinds = dict(zip(plan.rejects.sample_id, plan.rejects.category))
        for sample_id in ("mix/video", "mix/both", "mix/text", "mix/text2"):
            assert kinds[sample_id] == CATEGORY_MEDIA_KIND
        packed = {sample_id for ids in plan.bins.sample_ids for sample_id in ids}
        assert packed == {"mix/dup_a", "mix/dup_b", "mix/png"}
        assert accounting_problems(mix_layout.catalog("mix"), plan.bins_path, plan.rejects_path) == []


def test_accounting_problems_detects_lost_and_double_counted_samples(mix_layout, tmp_path):
    plan = _plan(mix_layout, "mix", "packed_multi_mix_qa")
    catalog = mix_layout.catalog("mix")

    def problems(rejects: pd.DataFrame) -> list[str]:
        write_parquet(rejects, tmp_path / "rejects.parquet")
        return accounting_problems(catalog, plan.bins_path, tmp_path / "rejects.parquet")

    first = plan.rejects.sample_id.iloc[0]
    assert problems(plan.rejects.iloc[1:]) == [f"1 catalogue ids neither packed nor rejected: {first!r}"]
    doubled = pd.concat([plan.rejects, pd.DataFrame({"sample_id": ["mix/text"], "reason": ["x"], "category": ["x"]})])
    assert problems(doubled) == ["1 ids both packed and rejected: 'mix/text'"]
    twice = pd.concat([plan.rejects, plan.rejects.iloc[:1]])
    assert problems(twice) == [f"1 ids appear more than once in rejects: {first!r}"]
    stranger = pd.concat([plan.rejects, pd.DataFrame({"sample_id": ["mix/stranger"], "reason": ["x"], "category": ["x"]})])
    assert problems(stranger) == ["1 ids not in the catalogue: 'mix/stranger'"]


def test_a_length_table_made_from_another_catalogue_is_refused(tmp_path):
    catalog = pd.DataFrame({"sample_id": ["a", "b", "c"], "status": "ok", "reason": "", "media_type": "text"})
    lengths = pd.DataFrame({"sample_id": ["a", "c", "b"], "status": "ok", "reason": "", "token_len": [10, 20, 30]})
    with pytest.raises(PackingInputError, match="'b' is not the length of a row of .*catalog.parquet.*sample_lengths again"):
        pack_frames(catalog, lengths, tmp_path, "packed_multi_mix_qa", 100)
    assert not (tmp_path / "bins.parquet").exists() and not (tmp_path / "rejects.parquet").exists()
    empty = pack_frames(catalog, lengths.iloc[:0], tmp_path, "packed_multi_mix_qa", 100)
    assert empty.rejects.category.tolist() == [CATEGORY_MISSING_LENGTH] * 3 and empty.bins.empty


def test_an_id_index_finds_each_id_by_hash_and_confirms_it_by_the_id():
    index = IdIndex(pa.array(["a", "b", "a", "c"]))  # "a" twice: its hash is shared, looked up by the id
    assert index.positions(pa.array(["a", "c", "zz", "b"])).tolist() == [0, 3, -1, 1]
    assert index.id_at(3) == "c" and len(index) == 4
    assert IdIndex.of([]).positions(pa.array(["a"])).tolist() == [-1]


def test_bins_on_disk_flags_a_bin_whose_total_is_not_the_sum_of_its_lengths(tmp_path):
    bins = pd.DataFrame({"bin_id": [0, 1, 2], "sample_ids": [["a"], ["b", "c"], ["d"]],
                         "lengths": [[60], [30, 20], [120]], "total_len": [60, 40, 120]})
    write_parquet(bins, tmp_path / "bins.parquet")
    read = BinsOnDisk.read(tmp_path / "bins.parquet")
    assert read.oversized(100) == [1, 2]  # 1: 30 + 20 is not 40; 2: over 100
    assert (read.bins, read.packed, read.tokens) == (3, 4, 220)
    assert read.sample_counts.tolist() == [1, 2, 1] and read.fill_ratio(100) == 220 / 300


# ---------------------------------------------------------------- packed records


def test_records_keep_full_messages_and_name_members_by_flat_index(mix_layout):
    records = _records(mix_layout, "mix", "packed_multi_mix_qa")
    by_sample = {sid: (packed, i) for packed in records for i, sid in enumerate(packed.record["sample_ids"])}
    packed, index = by_sample["mix/png"]
    record = packed.record
    assert record["id"].startswith("mix_ps_") and len(record["id"]) == len("mix_ps_00000000")
    assert len(record["messages"][index]["messages"]) == 6  # three turns kept whole
    assert record["texts"]["prompts"][index][0] == "<image>\nquestion png"  # placeholder kept
    assert record["texts"]["captions"][index][0] == "answer png"
    assert len(record["texts"]["prompts"][index]) == 3  # every user turn
    assert record["media_files"][index][0].endswith(".png")  # extension from content, not name
    assert record["media_keys"][index] == ["mix/c/photo.jpg"]
    assert sum(record["lengths"]) <= MAX and len(record["lengths"]) == len(record["sample_ids"])
    flat = [name for names in record["media_files"] for name in names]
    assert flat == [f"{'vid' if name.startswith('vid') else 'img'}{k}.{name.split('.')[1]}" for k, name in enumerate(flat)]
    text_record = by_sample["mix/text"][0].record
    assert text_record["media_files"][by_sample["mix/text"][1]] == []
    assert {r.record["media_type"] for r in records} <= {"image", "video", "text"}
    assert "images" not in record


def test_duplicate_basenames_in_one_bin_get_distinct_members(media):
    layout = build_source(media, "vqa", [
        {"id": "first", "media": [("a/0001.jpg", "image")], "token_len": 40},
        {"id": "second", "media": [("b/0001.jpg", "image")], "token_len": 40},
    ])
    [packed] = _records(layout, "vqa", "packed_vqa")
    assert packed.record["media_files"] == [["img0.jpg"], ["img1.jpg"]]
    assert packed.record["images"] == ["img0.jpg", "img1.jpg"]
    assert packed.record["media_keys"] == [["vqa/a/0001.jpg"], ["vqa/b/0001.jpg"]]
    assert packed.record["media_type"] == "image" and packed.record["sample_type"] == "packed_vqa"
    refs = [item.ref for item in packed.media]
    assert refs[0] != refs[1] and refs[0].endswith("a/0001.jpg") and refs[1].endswith("b/0001.jpg")


def test_packed_json_built_by_two_processes_is_the_bytes_one_process_writes(mix_layout, tmp_path, monkeypatch):
    import io

    import vlm_assets.packing.records as records

    plan = _plan(mix_layout, "mix", "packed_multi_mix_qa")
    bins = list(zip(plan.bins.bin_id, plan.bins.sample_ids, plan.bins.lengths))
    in_memory = io.BytesIO()
    write_jsonl(_records(mix_layout, "mix", "packed_multi_mix_qa"), in_memory)
    monkeypatch.setattr(records, "RECORD_CHUNK_SAMPLES", 1)  # one bin per chunk: both processes get several
    written = {}
    with SampleLookup(mix_layout.catalog("mix"), records.RECORD_COLUMNS, near=tmp_path / "packed.jsonl") as samples:
        for processes in (1, 2):
            handle = io.BytesIO()
            count = records.write_packed_jsonl("mix", bins, samples, "packed_multi_mix_qa", handle, processes)
            assert count == len(bins) > 2
            written[processes] = handle.getvalue()
    assert written[1] == written[2] == in_memory.getvalue()


# ---------------------------------------------------------------- WebDataset shards


def _write_packed(layout: StorageLayout, source: str, sample_type: str) -> Path:
    path = layout.packed_json(source)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as handle:
        write_jsonl(_records(layout, source, sample_type), handle)
    return path


def test_shards_hold_original_bytes_split_by_maxcount_and_rerun_is_byte_identical(mix_layout, tmp_path):
    jsonl = _write_packed(mix_layout, "mix", "packed_multi_mix_qa")
    records = list(read_records(jsonl, samples_by_id(_catalog(mix_layout, "mix"))))
    out = tmp_path / "mix"
    shards = write_source_shards(jsonl, mix_layout.catalog("mix"), out, maxcount=2)
    assert [len(s.keys) for s in shards] == [2] * (len(records) // 2) + ([1] if len(records) % 2 else [])
    assert check_shard_members(list_shards(out), jsonl).problems == []
    with tarfile.open(shards[0].path) as archive:
        members = archive.getmembers()
        assert [m.name for m in members] == sorted(m.name for m in members)
        assert {(m.mtime, m.uid, m.gid, m.uname) for m in members} == {(0, 0, 0, "")}
        for packed in records[:2]:
            assert json.loads(archive.extractfile(f"{packed.key}.json").read()) == packed.record
            for item in packed.media:
                assert archive.extractfile(f"{packed.key}.{item.member}").read() == Path(item.ref).read_bytes()
    first = _digests(out)
    write_source_shards(jsonl, mix_layout.catalog("mix"), out, maxcount=2)
    assert _digests(out) == first

    # Fewer, bigger shards: the earlier run's extra shards must not linger.
    (out / "pretrain-000001.tar.idx").write_bytes(b"stale energon index")
    write_source_shards(jsonl, mix_layout.catalog("mix"), out, maxcount=1000)
    assert sorted(_digests(out)) == ["pretrain-000000.tar"]
    assert check_shard_members(list_shards(out), jsonl).problems == []


def test_a_medium_replaced_after_the_catalogue_fails_the_shards_naming_it(media, tmp_path):
    """Its length was measured from the bytes the catalogue checked: shipping other bytes beside it
    could overflow the trainer's sequence. Same size and modification time, other bytes (`cp -p` of
    another file): the change time tells."""
    import shutil

    from vlm_assets.media.checks import MediumChanged

    root = tmp_path / "site"
    shutil.copytree(media / "media", root / "media")
    layout = build_source(root, "mix", MIX_SAMPLES)
    jsonl = _write_packed(layout, "mix", "packed_multi_mix_qa")
    replaced = root / "media" / "mix" / "a" / "0001.jpg"
    stat = replaced.stat()
    replaced.write_bytes(bytes(reversed(replaced.read_bytes())))
    os.utime(replaced, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    with pytest.raises(MediumChanged, match=f"{re.escape(str(replaced))}: changed since the catalogue was built"):
        write_source_shards(jsonl, layout.catalog("mix"), tmp_path / "shards", maxcount=2)
    replaced.unlink()
    with pytest.raises(MediumChanged, match=f"{re.escape(str(replaced))}.*No such file"):
        write_source_shards(jsonl, layout.catalog("mix"), tmp_path / "shards", maxcount=2)
    assert not list((tmp_path / "shards").glob("*.tar"))


def test_shard_members_are_checked_against_records_written_in_any_key_order(mix_layout, tmp_path):
    jsonl = _write_packed(mix_layout, "mix", "packed_multi_mix_qa")
    records = list(read_records(jsonl, samples_by_id(_catalog(mix_layout, "mix"))))
    out = tmp_path / "mix"
    write_source_shards(jsonl, mix_layout.catalog("mix"), out, maxcount=2)
    lines = [json.loads(line) for line in jsonl.read_bytes().splitlines()]
    # A conversation that spells the key the check looks for, as text (quotes escaped in a string).
    lines[0]["messages"][0]["messages"][0]["content"] = 'see ,"media_files":[["x.jpg"]] and ,"sample_type":"y"'
    # A file written by another tool: keys in another order, media_files first.
    reordered = tmp_path / "reordered.jsonl"
    reordered.write_text("".join(json.dumps(dict(sorted(record.items(), key=lambda item: item[0] != "media_files")))
                                 + "\n" for record in lines))
    assert check_shard_members(list_shards(out), reordered).problems == []
    lines[-1]["media_files"][-1].append("img9.jpg")
    reordered.write_text("".join(json.dumps(record, separators=(",", ":")) + "\n" for record in lines))
    [problem] = check_shard_members(list_shards(out), reordered).problems
    assert "whose members differ from their record" in problem and "img9.jpg" in problem


def test_shard_members_are_read_as_webdataset_reads_them(mix_layout, tmp_path):
    """A member the trainers' reader would not hand over (a link in place of a medium's bytes) is
    missing from its sample, though Python's tarfile lists its name."""
    jsonl = _write_packed(mix_layout, "mix", "packed_multi_mix_qa")
    out = tmp_path / "mix"
    write_source_shards(jsonl, mix_layout.catalog("mix"), out, maxcount=2)
    shard = list_shards(out)[0]
    with tarfile.open(shard) as archive:
        members = [(member, archive.extractfile(member).read()) for member in archive.getmembers()]
    linked = next(member for member, _ in members if not member.name.endswith(".json"))
    with tarfile.open(shard, "w", format=tarfile.PAX_FORMAT) as archive:
        for member, data in members:
            if member is linked:
                member = tarfile.TarInfo(member.name)
                member.type, member.linkname = tarfile.SYMTYPE, "elsewhere.jpg"
                archive.addfile(member)
            else:
                archive.addfile(member, io.BytesIO(data))
    [problem] = check_shard_members(list_shards(out), jsonl).problems
    assert "whose members differ from their record" in problem and linked.name.split(".", 1)[1] in problem


def test_shards_checked_before_are_not_read_again_while_they_and_their_records_are_unchanged(mix_layout, tmp_path):
    jsonl = _write_packed(mix_layout, "mix", "packed_multi_mix_qa")
    records = list(read_records(jsonl, samples_by_id(_catalog(mix_layout, "mix"))))
    out = tmp_path / "mix"
    write_source_shards(jsonl, mix_layout.catalog("mix"), out, maxcount=2)
    shards = list_shards(out)
    checked = CheckedShards(tmp_path / "checked.json")

    assert check_shard_members(shards, jsonl, checked=checked) == MemberCheck([], len(shards))
    again = CheckedShards(tmp_path / "checked.json")
    assert [again.sample_count(shard) for shard in shards] == [2] * (len(records) // 2) + [1] * (len(records) % 2)
    assert check_shard_members(shards, jsonl, checked=again) == MemberCheck([], 0)

    os.utime(shards[1], ns=(0, 0))  # a shard written again
    assert check_shard_members(shards, jsonl, checked=again) == MemberCheck([], 1)

    # packed_json's second record names a member its shard does not hold: found, and nothing kept as checked.
    lines = jsonl.read_bytes().splitlines(keepends=True)
    record = json.loads(lines[1])
    record["media_files"].append(["extra.jpg"])
    jsonl.write_bytes(b"".join([lines[0], (json.dumps(record) + "\n").encode(), *lines[2:]]))
    failed = check_shard_members(shards, jsonl, checked=again)
    assert failed.shards_read == 1 and "members differ from their record" in failed.problems[0]
    assert CheckedShards(tmp_path / "checked.json").entries == {}


def test_maxsize_splits_and_no_empty_shards(mix_layout, tmp_path):
    jsonl = _write_packed(mix_layout, "mix", "packed_multi_mix_qa")
    records = list(read_records(jsonl, samples_by_id(_catalog(mix_layout, "mix"))))
    shards = write_source_shards(jsonl, mix_layout.catalog("mix"), tmp_path / "s", maxcount=1000, maxsize=1024)  # every sample exceeds 1 KiB
    assert [len(s.keys) for s in shards] == [1] * len(records)
    empty = tmp_path / "empty.jsonl"
    empty.write_bytes(b"")
    assert write_source_shards(empty, mix_layout.catalog("mix"), tmp_path / "s", maxcount=10) == []
    assert list_shards(tmp_path / "s") == []


def test_shards_prepared_by_two_processes_are_the_bytes_one_process_writes(mix_layout, tmp_path, monkeypatch):
    import vlm_assets.packing.wds as wds

    jsonl = _write_packed(mix_layout, "mix", "packed_multi_mix_qa")
    monkeypatch.setattr(wds, "JSONL_CHUNK_BYTES", 1)  # one record per chunk: both processes get several
    one, two = tmp_path / "one", tmp_path / "two"
    reported: list[str] = []
    with SampleLookup(mix_layout.catalog("mix"), ["media_refs"], near=jsonl) as samples:
        single = wds.write_shards_from_jsonl(jsonl, samples, one, maxcount=1, maxsize=10**9)
        several = wds.write_shards_from_jsonl(jsonl, samples, two, maxcount=1, maxsize=10**9,
                                              on_sample=reported.append, processes=2)
    assert len(single) > 3 and [shard.keys for shard in several] == [shard.keys for shard in single]
    assert sorted(reported) == sorted(key for shard in single for key in shard.keys)
    assert _digests(two) == _digests(one)
    assert check_shard_members(list_shards(two), jsonl, processes=2).problems == []

    # A record whose sample left the catalogue: the error names packed_json's line, from a chunk process too.
    lines = jsonl.read_bytes().splitlines(keepends=True)
    record = json.loads(lines[2])
    record["sample_ids"][0] = "not-in-the-catalogue"
    jsonl.write_bytes(b"".join(lines[:2] + [json.dumps(record).encode() + b"\n"] + lines[3:]))
    with SampleLookup(mix_layout.catalog("mix"), ["media_refs"], near=jsonl) as samples:
        with pytest.raises(KeyError, match=f"{jsonl.name}:3: sample 'not-in-the-catalogue'"):
            wds.write_shards_from_jsonl(jsonl, samples, two, maxcount=1, maxsize=10**9, processes=2)
    assert _digests(two) == _digests(one)  # the earlier shards stay whole


def test_appended_records_go_into_new_shards_read_from_a_lookup_of_their_samples_alone(mix_layout, tmp_path):
    import vlm_assets.packing.wds as wds

    jsonl = _write_packed(mix_layout, "mix", "packed_multi_mix_qa")
    lines = jsonl.read_bytes().splitlines(keepends=True)
    assert len(lines) > 3
    whole, appended = tmp_path / "whole", tmp_path / "appended"
    with SampleLookup(mix_layout.catalog("mix"), ["media_refs"], near=jsonl) as samples:
        wds.write_shards_from_jsonl(jsonl, samples, whole, maxcount=1, maxsize=10**9)
        assert len(samples) == len(_catalog(mix_layout, "mix").query("status == 'ok'"))
        jsonl.write_bytes(b"".join(lines[:2]))  # the first build saw two records
        wds.write_shards_from_jsonl(jsonl, samples, appended, maxcount=1, maxsize=10**9)
    before = {path.name: path.stat().st_mtime_ns for path in list_shards(appended)}
    checked = CheckedShards(tmp_path / "checked.json")
    assert check_shard_members(list_shards(appended), jsonl, checked=checked).problems == []

    jsonl.write_bytes(b"".join(lines))
    kept = wds.kept_shards(appended, checked.sample_count)
    assert kept == wds.KeptShards(list_shards(appended), 2)
    needed = wds.sample_ids_after(jsonl, kept.records)
    assert needed == {sample_id for line in lines[2:] for sample_id in json.loads(line)["sample_ids"]}
    with SampleLookup(mix_layout.catalog("mix"), ["media_refs"], near=jsonl, only=needed) as samples:
        assert sorted(samples) == sorted(needed)
        written = wds.write_shards_from_jsonl(jsonl, samples, appended, maxcount=1, maxsize=10**9, processes=2,
                                              kept=kept)
    assert [shard.path.name for shard in written] == [wds.shard_name(index) for index in range(2, len(lines))]
    assert before == {path.name: path.stat().st_mtime_ns for path in list_shards(appended)[:2]}
    assert _digests(appended) == _digests(whole)

    # The samples of records after the kept shards' must be in the lookup.
    with SampleLookup(mix_layout.catalog("mix"), ["media_refs"], near=jsonl, only=set()) as samples:
        assert len(samples) == 0
        with pytest.raises(KeyError, match=f"{jsonl.name}:3: sample"):
            wds.write_shards_from_jsonl(jsonl, samples, tmp_path / "failed", maxcount=1, maxsize=10**9, kept=kept)


def test_exception_mid_write_leaves_no_half_shard_and_rerun_recovers(mix_layout, tmp_path):
    jsonl = _write_packed(mix_layout, "mix", "packed_multi_mix_qa")
    catalog = samples_by_id(_catalog(mix_layout, "mix"))
    clean = tmp_path / "clean"
    write_source_shards(jsonl, mix_layout.catalog("mix"), clean, maxcount=2)

    out = tmp_path / "out"
    write_source_shards(jsonl, mix_layout.catalog("mix"), out, maxcount=1)  # an earlier, different run
    calls = []

    def explode(key: str) -> None:
        calls.append(key)
        if len(calls) == 3:  # first sample of the second shard
            raise RuntimeError("injected failure")

    with pytest.raises(RuntimeError, match="injected"):
        write_source_shards(jsonl, mix_layout.catalog("mix"), out, maxcount=2, on_sample=explode)
    assert not list(out.glob(".*.tmp"))
    for shard in list_shards(out):  # whatever is there is a complete tar
        with tarfile.open(shard) as archive:
            assert archive.getnames()
    write_source_shards(jsonl, mix_layout.catalog("mix"), out, maxcount=2)
    assert _digests(out) == _digests(clean)


KILL_SCRIPT = textwrap.dedent(
    """
    import os, signal, sys
    from pathlib import Path
    from vlm_assets_tests.packing_support import write_source_shards

    jsonl, catalog, out = sys.argv[1:4]
    seen = []
    def die(key):
        seen.append(key)
        if len(seen) == 3:
            os.kill(os.getpid(), signal.SIGKILL)
    write_source_shards(Path(jsonl), Path(catalog), Path(out), 2, on_sample=die)
    """
)


def test_process_killed_mid_write_then_rerun_is_identical_to_a_clean_run(mix_layout, tmp_path):
    jsonl = _write_packed(mix_layout, "mix", "packed_multi_mix_qa")
    catalog = samples_by_id(_catalog(mix_layout, "mix"))
    clean = tmp_path / "clean"
    write_source_shards(jsonl, mix_layout.catalog("mix"), clean, maxcount=2)

    out = tmp_path / "out"
    result = subprocess.run(
        [sys.executable, "-c", KILL_SCRIPT, str(jsonl), str(mix_layout.catalog("mix")), str(out)],
        capture_output=True,
    )
    assert result.returncode == -signal.SIGKILL, result.stderr.decode()
    assert list(out.glob(".pretrain-000001.tar~*.tmp")), "the killed writer should leave only a temp file"
    assert [p.name for p in list_shards(out)] == ["pretrain-000000.tar"]
    write_source_shards(jsonl, mix_layout.catalog("mix"), out, maxcount=2)
    assert _digests(out) == _digests(clean)


# ---------------------------------------------------------------- Energon


def test_energon_prepare_and_loader_see_every_sample(media, tmp_path):
    layout = build_source(media, "vqa", [
        {"id": f"s{i}", "media": [(("a/0001.jpg", "b/0001.jpg", "c/photo.jpg")[i % 3], "image")], "token_len": 30 + i}
        for i in range(7)
    ])
    jsonl = _write_packed(layout, "vqa", "packed_vqa")
    shards = write_source_shards(jsonl, layout.catalog("vqa"), layout.packed_wds("vqa"), 2)
    dataset = prepare_energon_dataset(layout.packed_wds("vqa"), [s.path for s in shards], {"sample_type": "packed_vqa"})
    meta = dataset.meta_dir
    for name in ("dataset.yaml", "split.yaml", ".info.json", "index.sqlite"):
        assert (meta / name).is_file(), name
    assert "CrudeWebdataset" in (meta / "dataset.yaml").read_text()
    assert "sample_type: packed_vqa" in (meta / "dataset.yaml").read_text()
    assert all(Path(str(s.path) + ".idx").is_file() for s in shards)
    expected = [json.loads(line)["id"] for line in jsonl.read_text().splitlines()]
    assert dataset.sample_count == len(expected)
    assert sorted(load_all_ids(layout.packed_wds("vqa"))) == sorted(expected)


# ---------------------------------------------------------------- Dagster assets


def _config(tmp_path: Path, storage: Path, sample_type: str, maxcount: int = 2) -> Path:
    path = tmp_path / "config.yaml"
    path.write_text(
        textwrap.dedent(
            f"""
            storage: {{root: {storage}}}
            sources:
              - {{name: mix, kind: flat_dir, path: {tmp_path}}}
            sample: {{sample_type: {sample_type}, max_token_len: {MAX}}}
            packing: {{min_fill_ratio: 0.99}}
            wds: {{maxcount: {maxcount}, maxsize: 1000000}}
            """
        )
    )
    return path


def test_assets_materialize_with_checks_metadata_and_energon_load(mix_layout, tmp_path):
    config = _config(tmp_path, mix_layout.root, "packed_multi_mix_qa")
    instance = dg.DagsterInstance.ephemeral()
    instance.add_dynamic_partitions(SOURCES_PARTITIONS.name, ["mix"])
    resources = {"vlm_config": VlmConfig(config_path=str(config))}
    result = dg.materialize(
        [packing_bins, packed_json, packed_wds_shards], resources=resources, partition_key="mix", instance=instance
    )
    assert result.success
    checks = {c.check_name: c for c in result.get_asset_check_evaluations()}
    assert checks["every_sample_accounted_for"].passed
    assert checks["bins_within_max_token_len"].passed
    assert checks["tar_members_match_records"].passed
    assert {check.partition for check in checks.values()} == {"mix"}  # the UI shows each result's source
    fill = checks["fill_ratio"]  # min_fill_ratio 0.99 is deliberately unreachable here
    assert not fill.passed and fill.severity == dg.AssetCheckSeverity.WARN
    bins_meta = result.asset_materializations_for_node("packing_bins")[0].metadata
    assert "rejected: over_max_token_len" in bins_meta["outcomes"].value
    assert "token_len" in bins_meta["length_histogram"].value and "fill ratio" in bins_meta["fill_summary"].value
    shard_meta = result.asset_materializations_for_node("packed_wds_shards")[0].metadata
    assert shard_meta["shards"].value == len(list_shards(mix_layout.packed_wds("mix")))

    result = dg.materialize(
        [energon_dataset, energon_loads_every_sample], resources=resources, partition_key="mix", instance=instance
    )
    assert result.success
    [evaluation] = result.get_asset_check_evaluations()
    assert evaluation.passed and evaluation.metadata["loaded"].value == evaluation.metadata["expected"].value > 0
    assert evaluation.partition == "mix"
    bins = pd.read_parquet(mix_layout.bins("mix"))
    assert sorted(load_all_ids(mix_layout.packed_wds("mix"))) == sorted(record_id("mix", b) for b in bins.bin_id)

