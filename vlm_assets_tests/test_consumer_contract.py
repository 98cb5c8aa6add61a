"""Packed shards laid out for their consumer (LoongForge's VLM task encoder), per sample type, on real
shared data: built through the graph, read back through Energon with the contract cookers."""

from __future__ import annotations

import json
import math
import tarfile
from pathlib import Path

import dagster as dg
import pandas as pd
import pytest
import yaml

from vlm_assets.config import TrainerConfig
from vlm_assets.defs.catalog.assets import lengths_match_processor, sample_catalog, sample_lengths
from vlm_assets.defs.packing.assets import energon_dataset, packed_json, packed_wds_shards, packing_bins
from vlm_assets.defs.packing.checks import energon_loads_every_sample
from vlm_assets.defs.resources import SOURCES_PARTITIONS, HFProcessor, VlmConfig
from vlm_assets.layout import StorageLayout
from vlm_assets.packing.contract import contract_problems
from vlm_assets.packing.wds import list_shards
from vlm_assets.tokens.consumer import CountingRule, sampled_frame_count, smart_resize

DOG = "xtuner/tests/resource/mscoco_dog_000000319154.jpg"
CATS = "xtuner/tests/resource/mscoco_twocat_000000039769.jpg"
HOPPER = "Pillow/Tests/images/hopper.webp"
CLIP = "LLaMA-Factory/data/mllm_demo_data/4.mp4"
PANCAKE = "decord/examples/flipping_a_pancake.mkv"


def _turns(*texts: str) -> list[dict[str, str]]:
    return [{"role": "user" if index % 2 == 0 else "assistant", "content": text} for index, text in enumerate(texts)]


# id -> record; what each sample type makes of it is in EXPECTED_PACKED below.
RECORDS = {
    "one_image": {"messages": _turns("<image>What animal is this?", "A dog."), "images": [DOG]},
    "webp": {"messages": _turns("Who is this? <image>", "Grace Hopper."), "images": [HOPPER]},
    "two_images": {"messages": _turns("<image> and <image>: which has cats?", "The second.",
                                      "How many?", "Two."), "images": [DOG, CATS]},
    "multi_turn": {"messages": _turns("<image>Describe it.", "A dog on grass.", "What colour is it?", "Brown.",
                                      "Is it happy?", "It seems so."), "images": [DOG]},
    "video": {"messages": _turns("<video>What happens?", "Someone moves."), "videos": [CLIP]},
    "mkv": {"messages": _turns("<video>What is cooked?", "A pancake."), "videos": [PANCAKE]},
    "text": {"messages": _turns("Say hi.", "Hi.", "Again.", "Hi again.")},
    "mixed": {"messages": _turns("<image> then <video>: same place?", "No."), "images": [DOG], "videos": [CLIP]},
    "system": {"messages": [{"role": "system", "content": "You are a vet."}, *_turns("<image>Healthy?", "Yes.")],
               "images": [DOG]},
}
EXPECTED_PACKED = {
    "packed_captioning": {"one_image", "webp"},
    "packed_vqa": {"one_image", "webp"},
    "packed_multi_mix_qa": {"one_image", "webp", "two_images", "multi_turn", "video", "mkv", "text"},
    "packed_chat_mix": {"one_image", "webp", "two_images", "multi_turn", "video", "mkv", "text", "system"},
}
SAMPLE_TYPES = tuple(EXPECTED_PACKED)


@pytest.fixture(scope="module")
def built(shared_data: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, StorageLayout]:
    """One source per sample type, all reading the same records, built through the graph."""
    root = tmp_path_factory.mktemp("contract")
    records = root / "records.jsonl"
    records.write_text("".join(json.dumps({"id": key, **record}) + "\n" for key, record in RECORDS.items()))
    config = {
        "storage": {"root": str(root / "out")}, "inbox": str(root / "inbox"),
        "sources": [{"name": sample_type.removeprefix("packed_"), "kind": "jsonl", "path": str(records),
                     "media_root": str(shared_data), "sample_type": sample_type} for sample_type in SAMPLE_TYPES],
        "sample": {"max_token_len": 8192}, "wds": {"maxcount": 3, "maxsize": 100_000_000},
        "frame_cache": {"num_frames": 4, "rows": 2, "cols": 2, "frame_size": 56},
    }
    (root / "cfg.yaml").write_text(yaml.safe_dump(config))
    vlm_config = VlmConfig(config_path=str(root / "cfg.yaml"))
    instance = dg.DagsterInstance.ephemeral()
    names = [sample_type.removeprefix("packed_") for sample_type in SAMPLE_TYPES]
    instance.add_dynamic_partitions(SOURCES_PARTITIONS.name, names)
    resources = {"vlm_config": vlm_config, "hf_processor": HFProcessor(vlm_config=vlm_config)}
    for name in names:
        result = dg.materialize(
            [sample_catalog, sample_lengths, lengths_match_processor, packing_bins, packed_json, packed_wds_shards,
             energon_dataset, energon_loads_every_sample],
            partition_key=name, instance=instance, resources=resources,
        )
        assert result.success
        failed = [c.check_name for c in result.get_asset_check_evaluations()
                  if not c.passed and c.severity == dg.AssetCheckSeverity.ERROR]
        assert not failed, (name, failed)
    layout = StorageLayout(root / "out")
    return {sample_type: layout for sample_type in SAMPLE_TYPES}


def _packed(layout: StorageLayout, source: str) -> list[dict]:
    return [json.loads(line) for line in layout.packed_json(source).read_text().splitlines()]


def _members(layout: StorageLayout, source: str) -> dict[str, set[str]]:
    members: dict[str, set[str]] = {}
    for shard in list_shards(layout.packed_wds(source)):
        with tarfile.open(shard) as tar:
            for name in tar.getnames():
                key, member = name.split(".", 1)
                members.setdefault(key, set()).add(member)
    return members


@pytest.mark.parametrize("sample_type", SAMPLE_TYPES)
def test_every_sample_is_packed_or_rejected_with_a_reason_naming_its_type(built, sample_type):
    layout, source = built[sample_type], sample_type.removeprefix("packed_")
    packed = {sample_id.split("/", 1)[1] for record in _packed(layout, source) for sample_id in record["sample_ids"]}
    rejects = pd.read_parquet(layout.rejects(source))
    rejected = {row.sample_id.split("/", 1)[1]: row.reason for row in rejects.itertuples()}
    assert packed == EXPECTED_PACKED[sample_type]
    assert set(rejected) == set(RECORDS) - packed and not packed & set(rejected)
    assert rejected["mixed"].startswith(f"not carried by {sample_type}: ") and "both images and videos" in rejected["mixed"]
    if sample_type != "packed_chat_mix":
        assert rejected["system"].startswith(f"not carried by {sample_type}: ") and "system turn" in rejected["system"]


@pytest.mark.parametrize("sample_type", SAMPLE_TYPES)
def test_records_hold_the_fields_members_and_turns_the_consumer_reads(built, sample_type):
    layout, source = built[sample_type], sample_type.removeprefix("packed_")
    members = _members(layout, source)
    for record in _packed(layout, source):
        children = len(record["sample_ids"])
        assert record["media_type"] in ("image", "video", "text")
        assert record["_meta"] == {"pack_id": record["id"], "sample_ids": record["sample_ids"],
                                   "token_lens": record["lengths"], "total_token_len": sum(record["lengths"])}
        assert members[record["id"]] == {"json"} | {name for names in record["media_files"] for name in names}
        assert contract_problems(record, members[record["id"]]) == []
        conversations = [entry["messages"] for entry in record["messages"]]
        for child, (conversation, names) in enumerate(zip(conversations, record["media_files"])):
            original = RECORDS[record["sample_ids"][child].split("/", 1)[1]]
            assert conversation == original["messages"]  # every turn, placeholders kept
            placeholders = sum(turn["content"].count("<image>") + turn["content"].count("<video>")
                               for turn in conversation)
            assert placeholders == len(names) == len(original.get("images", [])) + len(original.get("videos", []))
        if sample_type in ("packed_vqa", "packed_captioning"):
            assert record["images"] == [f"img{i}.jpg" for i in range(children)]
            assert record["prompts"] == [conversation[0]["content"] for conversation in conversations]
            assert record["captions"] == [conversation[1]["content"] for conversation in conversations]
            assert all(prompt.count("<image>") == 1 for prompt in record["prompts"])
        elif sample_type == "packed_multi_mix_qa":
            assert record["texts"]["prompts"] == [[t["content"] for t in c if t["role"] == "user"] for c in conversations]
            assert record["texts"]["captions"] == [[t["content"] for t in c if t["role"] == "assistant"]
                                                   for c in conversations]
        names = [name for group in record["media_files"] for name in group]
        if record["media_type"] == "video":
            assert all(name.rsplit(".", 1)[1] in ("mp4", "webm") for name in names)
        if record["media_type"] == "image" and sample_type in ("packed_multi_mix_qa", "packed_chat_mix"):
            assert {name.rsplit(".", 1)[1] for name in names} <= {"jpg", "webp"}


def test_the_contract_check_names_what_the_consumer_would_miss(built):
    layout = built["packed_multi_mix_qa"]
    record = next(r for r in _packed(layout, "multi_mix_qa") if r["media_type"] == "image")
    members = _members(layout, "multi_mix_qa")[record["id"]]
    lost_turn = json.loads(json.dumps(record))
    lost_turn["texts"]["prompts"][0] = lost_turn["texts"]["prompts"][0][:1] + ["extra"]
    stripped = json.loads(json.dumps(record))
    stripped["messages"][0]["messages"][0]["content"] = stripped["messages"][0]["messages"][0]["content"].replace("<image>", "")
    assert any("user turns" in problem for problem in contract_problems(lost_turn, members))
    assert any("placeholders" in problem for problem in contract_problems(stripped, members))
    assert any("missing" in problem for problem in contract_problems(record, members - {record["media_files"][0][0]}))
    no_meta = {key: value for key, value in record.items() if key != "_meta"}
    assert contract_problems(no_meta, members) == ["`_meta` is missing"]
    vqa = _packed(built["packed_vqa"], "vqa")[0]
    flat = {key: value for key, value in vqa.items() if key != "prompts"}
    assert any("`prompts`" in problem for problem in contract_problems(flat, {"json", "img0.jpg", "img1.jpg"}))


def _by_hand_resize(height: int, width: int, lo: float, hi: float) -> tuple[int, int]:
    """The Qwen-VL resize rule written out step by step, apart from the product's version."""
    h, w = max(28, 28 * round(height / 28)), max(28, 28 * round(width / 28))
    if h * w > hi:
        beta = math.sqrt(height * width / hi)
        h, w = 28 * math.floor(height / beta / 28), 28 * math.floor(width / beta / 28)
    elif h * w < lo:
        beta = math.sqrt(lo / (height * width))
        h, w = 28 * math.ceil(height * beta / 28), 28 * math.ceil(width * beta / 28)
    return h, w


@pytest.mark.parametrize("chat_template", ["qwen2-vl", "qwen3-vl", "qwen2.5-vl-hf", "qwen3-vl-hf", "processor"])
@pytest.mark.parametrize("size", [(480, 640), (375, 500), (128, 128), (20, 30), (4000, 3000), (1080, 1920), (28, 5000),
                                  (30, 1200)])
def test_consumer_media_arithmetic_matches_a_by_hand_version(size, chat_template):
    trainer = TrainerConfig(chat_template=chat_template)
    height, width = size
    assert smart_resize(height, width, 28, trainer.min_pixels, trainer.max_pixels) == _by_hand_resize(
        height, width, trainer.min_pixels, trainer.max_pixels)
    rule = CountingRule("packed_multi_mix_qa", trainer)
    h, w = _by_hand_resize(height, width, trainer.min_pixels, trainer.max_pixels)
    if max(h, w) > 512:
        factor = 512 / max(h, w)  # the consumer scales by this factor, then truncates: 672 × (512 / 672) → 511
        h, w = int(h * factor), int(w * factor)
    # Qwen3-VL's media plugin raises the shorter side to 32 (its patch 16 × merge 2), Qwen2-VL's to 28:
    # (30, 1200) reaches (11, 512) after the cap.
    shortest = 32 if chat_template.startswith("qwen3") else 28
    h, w = max(h, shortest), max(w, shortest)
    assert rule.image_size(height, width) == (h, w)
    assert max(rule.image_size(height, width)) <= 512
    assert CountingRule("packed_vqa", trainer).image_size(height, width) == (height, width)
    for frames in (4, 120, 768):
        budget = min(trainer.frame_max_pixels, trainer.video_max_pixels / frames * 2)
        assert rule.frame_size(frames, height, width) == _by_hand_resize(
            height, width, int(trainer.frame_min_pixels * 1.05), budget)


@pytest.mark.parametrize(("total", "fps", "expected"), [
    (1500, 25.0, 120),   # a minute at 25 fps: 2 frames a second
    (30, 30.0, 4),       # one second: the 4-frame minimum
    (3, 30.0, 2),        # fewer frames than the minimum: the clip's own, in pairs
    (100_000, 30.0, 768),  # capped at fps_max_frames
    (91, 30.0, 6),       # 6.07 rounded down to pairs
])
def test_sampled_frame_count_follows_the_consumer(total, fps, expected):
    assert sampled_frame_count(total, fps, TrainerConfig()) == expected


def test_a_clip_too_short_to_sample_is_refused():
    with pytest.raises(ValueError, match="sampled frames"):
        sampled_frame_count(1, 30.0, TrainerConfig())


def test_trainer_settings_are_part_of_the_lengths_fingerprint(built, tmp_path):
    from vlm_assets.config import load_config
    from vlm_assets.fingerprints import code_versions

    raw = yaml.safe_load((built["packed_vqa"].root.parent / "cfg.yaml").read_text())
    base = code_versions(load_config(built["packed_vqa"].root.parent / "cfg.yaml"), "p")
    raw["trainer"] = {"fps": 1.0}
    (tmp_path / "cfg.yaml").write_text(yaml.safe_dump(raw))
    changed = code_versions(load_config(tmp_path / "cfg.yaml"), "p")
    assert changed["sample_lengths"] != base["sample_lengths"] and changed["packed_json"] == base["packed_json"]
