"""`packing.mode: append`: records appended to a source go into new bins and new shards; what trainers
already read is never rewritten, and Energon loads old and new together."""

from __future__ import annotations

import json
import os

import dagster as dg
import pandas as pd
import pytest
import yaml
from PIL import Image

from vlm_assets.packing.energon_loader import load_all_ids
from vlm_assets.packing.plan import PackingInputError
from vlm_assets.packing.records import kept_records
from vlm_assets.packing.wds import list_shards
from vlm_assets_tests.packing_support import pack_frames
from vlm_assets_tests.run_support import run


def _chat_lines(first: int, count: int) -> str:
    return "".join(json.dumps({"id": f"c{number}", "messages": [
        {"role": "user", "content": f"question {number} " + "why " * (number % 25 + 1)},
        {"role": "assistant", "content": "because " * (number % 40 + 3)}]}) + "\n" for number in range(first, first + count))


def _frames(ids: list[str], lengths: list[int]) -> tuple[pd.DataFrame, pd.DataFrame]:
    catalog = pd.DataFrame({"sample_id": ids, "status": "ok", "reason": "", "media_type": "text"})
    return catalog, pd.DataFrame({"sample_id": ids, "status": "ok", "reason": "", "token_len": lengths})


def test_kept_bins_stay_first_and_only_new_samples_are_packed_after_them(tmp_path):
    first = pack_frames(*_frames(["a", "b", "c"], [60, 50, 30]), tmp_path, "packed_multi_mix_qa", 100)
    kept = first.bins_path.read_bytes()
    grown = pack_frames(*_frames(["a", "b", "c", "d", "e"], [60, 50, 30, 40, 70]), tmp_path, "packed_multi_mix_qa", 100,
                        append=True)
    assert grown.bins.iloc[:len(first.bins)].to_dict("list") == first.bins.to_dict("list")
    new = grown.bins.iloc[len(first.bins):]
    assert sorted(sample for ids in new["sample_ids"] for sample in ids) == ["d", "e"]
    assert list(grown.bins["bin_id"]) == list(range(len(grown.bins)))
    assert (grown.outcome.bins_kept, grown.outcome.packed) == (len(first.bins), 5)

    def refused(ids: list[str], lengths: list[int], max_token_len: int, reason: str) -> None:
        first.bins_path.write_bytes(kept)
        with pytest.raises(PackingInputError, match=reason):
            pack_frames(*_frames(ids, lengths), tmp_path, "packed_multi_mix_qa", max_token_len, append=True)
        assert first.bins_path.read_bytes() == kept  # nothing written

    refused(["a", "c"], [60, 30], 100, "b: no longer in the catalogue.*packing.mode: full")
    refused(["a", "b", "c"], [60, 55, 30], 100, "its length is now 55, was 50")
    refused(["a", "b", "c"], [60, 50, 30], 70, "over max_token_len 70")
    refused(["a", "b", "c"], [60, 50, 300], 100, "c: token_len 300 > max_token_len 100")

    # The same length, another text: its packed record would differ.
    first.bins_path.write_bytes(kept)
    catalog, lengths = _frames(["a", "b", "c"], [60, 50, 30])
    catalog["messages"] = ["[]", "[]", '[{"role":"user","content":"edited"}]']
    with pytest.raises(PackingInputError, match="samples whose text or media changed: c\\).*packing.mode: full"):
        pack_frames(catalog, lengths, tmp_path, "packed_multi_mix_qa", 100, append=True)


@pytest.mark.processes
def test_appended_records_go_into_new_shards_and_the_old_shards_keep_their_bytes(tmp_path):
    manifest = tmp_path / "chat.jsonl"
    manifest.write_text(_chat_lines(0, 120))
    config = tmp_path / "vlm_assets.yaml"
    config.write_text(yaml.safe_dump({
        "storage": {"root": str(tmp_path / "vlm_data")},
        "sources": [{"name": "chat", "kind": "jsonl", "path": str(manifest)}],
        "sample": {"max_token_len": 512},
        "packing": {"mode": "append", "min_fill_ratio": 0.0},
        "wds": {"maxcount": 8},
    }))
    home, shards_dir = tmp_path / "home", tmp_path / "vlm_data" / "packed_wds" / "chat"
    first = run(config, home, "--select", "energon_dataset")
    assert first.returncode == 0, first.stdout[-3000:]
    before = {path.name: (path.read_bytes(), os.stat(path).st_mtime_ns) for path in list_shards(shards_dir)}
    first_bins = pd.read_parquet(tmp_path / "vlm_data" / "packing" / "chat.bins.parquet")
    first_records = (tmp_path / "vlm_data" / "packed_json" / "chat.jsonl").read_bytes()
    assert len(before) >= 2

    with manifest.open("a") as appended:
        appended.write(_chat_lines(120, 60))
    second = run(config, home, "--select", "energon_dataset")
    assert second.returncode == 0, second.stdout[-3000:]

    after = list_shards(shards_dir)
    assert [path.name for path in after[:len(before)]] == sorted(before)
    assert len(after) > len(before)
    for path in after[:len(before)]:
        assert (path.read_bytes(), os.stat(path).st_mtime_ns) == before[path.name], f"{path.name} was rewritten"
    bins = pd.read_parquet(tmp_path / "vlm_data" / "packing" / "chat.bins.parquet")
    assert [list(ids) for ids in bins["sample_ids"][:len(first_bins)]] == [list(ids) for ids in first_bins["sample_ids"]]
    packed = [json.loads(line)["id"] for line in (tmp_path / "vlm_data" / "packed_json" / "chat.jsonl").read_text().splitlines()]
    assert len(packed) == len(bins) and sorted(load_all_ids(shards_dir)) == sorted(packed)
    with dg.DagsterInstance.from_config(str(home)) as instance:
        written = instance.get_latest_materialization_event(dg.AssetKey("packed_wds_shards"))
        metadata = written.asset_materialization.metadata
        assert metadata["shards_kept"].value == len(before) and metadata["shards"].value == len(after) - len(before)
        # The member check read only the new shards: the kept ones passed it before, unchanged since.
        [members] = instance.all_logs(written.run_id, of_type=dg.DagsterEventType.ASSET_CHECK_EVALUATION)
        members = members.dagster_event.event_specific_data
        assert members.passed and members.metadata["shards_read"].value == len(after) - len(before)
        # Only the new lines were catalogued, only the new bins' records built.
        catalogue = instance.get_latest_materialization_event(dg.AssetKey("sample_catalog")).asset_materialization.metadata
        assert catalogue["rows_kept"].value == 120
        records = instance.get_latest_materialization_event(dg.AssetKey("packed_json")).asset_materialization.metadata
        assert records["records_kept"].value == len(first_bins) and records["records"].value == len(bins)
        # Energon indexed only the new shards, and its load check loaded only their samples.
        prepared = instance.get_latest_materialization_event(dg.AssetKey("energon_dataset"))
        energon = prepared.asset_materialization.metadata
        assert energon["shards_kept"].value == len(before) and energon["samples"].value == len(bins)
        [check] = instance.all_logs(prepared.run_id, of_type=dg.DagsterEventType.ASSET_CHECK_EVALUATION)
        evaluation = check.dagster_event.event_specific_data
        assert evaluation.passed and evaluation.metadata["loaded_from"].value == len(first_bins)
        assert evaluation.metadata["loaded"].value == len(bins) - len(first_bins)
    assert (tmp_path / "vlm_data" / "packed_json" / "chat.jsonl").read_bytes().startswith(first_records)
    samples = sum(len(ids) for ids in bins["sample_ids"])
    assert samples == 180  # every record of the source is packed once


def test_packed_records_are_kept_only_when_they_are_the_first_bins_records(tmp_path):
    bins = [(0, ["a", "b"], [1, 2]), (1, ["c"], [3]), (2, ["d"], [4])]
    path = tmp_path / "chat.jsonl"

    def write(*records: tuple[int, list[str]], end: str = "\n", sample_type: str = "packed_multi_mix_qa") -> int:
        path.write_text("".join(json.dumps({"id": f"chat_ps_{bin_id:08d}", "sample_type": sample_type,
                                            "sample_ids": ids, "lengths": [1] * len(ids)}, separators=(",", ":")) + "\n"
                                for bin_id, ids in records).rstrip("\n") + end)
        return kept_records(path, bins, "chat", "packed_multi_mix_qa")

    assert write((0, ["a", "b"]), (1, ["c"])) == 2
    assert write((0, ["a", "b"]), (1, ["c", "x"])) == 0  # another bin's records
    assert write((0, ["a", "b"]), (2, ["d"])) == 0
    assert write((0, ["a", "b"]), (1, ["c"]), (2, ["d"]), (3, ["e"])) == 0  # more records than bins
    assert write((0, ["a", "b"]), (1, ["c"]), end="") == 0  # its last line cut short
    assert write((0, ["a", "b"]), sample_type="captioning") == 0  # records of another sample type

    # Copied as they are checked: all of them, or nothing.
    for end, kept in (("\n", 2), ("", 0)):
        write((0, ["a", "b"]), (1, ["c"]), end=end)
        with open(tmp_path / "copy.jsonl", "w+b") as copy:
            assert kept_records(path, bins, "chat", "packed_multi_mix_qa", copy_to=copy) == kept
        assert (tmp_path / "copy.jsonl").read_bytes() == (path.read_bytes() if kept else b"")  # its last line cut short


def _image_lines(first: int, count: int, ids: bool = True) -> str:
    return "".join(json.dumps({**({"id": f"p{number}"} if ids else {}), "images": [f"{number % 3}.bmp"], "messages": [
        {"role": "user", "content": f"<image>What is in picture {number}?"},
        {"role": "assistant", "content": f"A red box, number {number}."}]}) + "\n" for number in range(first, first + count))


def _append_config(tmp_path, manifest) -> tuple:
    for number in range(3):  # BMP: another picture of the same size is the same number of bytes
        Image.new("RGB", (32, 24), (number * 80, 0, 0)).save(tmp_path / f"{number}.bmp")
    config = tmp_path / "vlm_assets.yaml"
    config.write_text(yaml.safe_dump({
        "storage": {"root": str(tmp_path / "vlm_data")},
        "sources": [{"name": "pics", "kind": "jsonl", "path": str(manifest), "media_root": str(tmp_path)}],
        "sample": {"max_token_len": 512},
        "packing": {"mode": "append", "min_fill_ratio": 0.0},
        "wds": {"maxcount": 2},
    }))
    return config, tmp_path / "home", tmp_path / "vlm_data" / "packed_wds" / "pics"


@pytest.mark.processes
def test_a_kept_samples_text_or_image_changed_fails_the_append_naming_it(tmp_path):
    manifest = tmp_path / "pics.jsonl"
    manifest.write_text(_image_lines(0, 12))
    config, home, _ = _append_config(tmp_path, manifest)
    assert (first := run(config, home, "--select", "energon_dataset")).returncode == 0, first.stdout[-3000:]

    # Another text of the same token length: the kept record and shard would keep the old one.
    manifest.write_text(_image_lines(0, 12).replace("A red box, number 4.", "A tan box, number 4.") + _image_lines(12, 2))
    edited = run(config, home, "--select", "energon_dataset")
    assert edited.returncode != 0 and "samples whose text or media changed: pics/p4" in edited.stdout, edited.stdout[-3000:]
    assert "set packing.mode: full" in edited.stdout

    # The text as it was, an image's bytes replaced (same name, same size): its shards hold the old bytes.
    manifest.write_text(_image_lines(0, 14))
    image = tmp_path / "1.bmp"
    before = image.read_bytes()
    Image.new("RGB", (32, 24), (0, 0, 200)).save(image)
    assert len(image.read_bytes()) == len(before) and image.read_bytes() != before
    swapped = run(config, home, "--select", "energon_dataset")
    assert swapped.returncode != 0, swapped.stdout[-3000:]
    named = next(line for line in swapped.stdout.splitlines() if "samples whose text or media changed" in line)
    assert all(f"pics/p{number}" in named for number in (1, 4, 7, 10)) and "pics/p0," not in named


@pytest.mark.processes
def test_records_without_ids_and_an_interrupted_append_keep_every_sample_shipped_once(tmp_path):
    manifest = tmp_path / "pics.jsonl"
    manifest.write_text(_image_lines(0, 12, ids=False))
    config, home, shards_dir = _append_config(tmp_path, manifest)
    assert (first := run(config, home, "--select", "energon_dataset")).returncode == 0, first.stdout[-3000:]
    kept = {path.name: path.read_bytes() for path in list_shards(shards_dir)}

    # A line inserted at the top: the other records keep their ids (by content, not by line).
    manifest.write_text(_image_lines(100, 1, ids=False) + _image_lines(0, 12, ids=False) + _image_lines(12, 6, ids=False))
    assert (second := run(config, home, "--select", "energon_dataset")).returncode == 0, second.stdout[-3000:]
    shards = list_shards(shards_dir)
    assert {path.name: path.read_bytes() for path in shards[:len(kept)]} == kept

    # An append cut short leaves a later shard finished and an earlier one missing: the next run resumes.
    shards[len(kept)].unlink()
    with manifest.open("a") as appended:
        appended.write(_image_lines(18, 2, ids=False))
    assert (third := run(config, home, "--select", "energon_dataset")).returncode == 0, third.stdout[-3000:]
    assert {path.name: path.read_bytes() for path in list_shards(shards_dir)[:len(kept)]} == kept
    records = [json.loads(line) for line in (tmp_path / "vlm_data" / "packed_json" / "pics.jsonl").read_text().splitlines()]
    shipped = [sample for record in records for sample in record["sample_ids"]]
    assert len(shipped) == len(set(shipped)) == 21  # every record once, none twice
    assert sorted(load_all_ids(shards_dir)) == sorted(record["id"] for record in records)
