import json

import dagster as dg
import pandas as pd
import yaml

from vlm_assets.defs.catalog.assets import lengths_match_processor, sample_catalog, sample_lengths
from vlm_assets.defs.packing.assets import packing_bins
from vlm_assets.defs.resources import SOURCES_PARTITIONS, HFProcessor, VlmConfig
from vlm_assets.layout import StorageLayout


def test_catalog_and_lengths_materialise_per_source_with_passing_check(demo_config_path, tmp_path):
    config_path = tmp_path / "cfg.yaml"
    config_path.write_text(demo_config_path.read_text().replace("./", f"{demo_config_path.parent}/").replace(
        f"{demo_config_path.parent}/vlm_data", str(tmp_path / "out")))
    vlm_config = VlmConfig(config_path=str(config_path))
    instance = dg.DagsterInstance.ephemeral()
    instance.add_dynamic_partitions(SOURCES_PARTITIONS.name, ["demo_images", "demo_wds"])
    for partition in ("demo_images", "demo_wds"):
        result = dg.materialize(
            [sample_catalog, sample_lengths, lengths_match_processor],
            partition_key=partition,
            instance=instance,
            resources={"vlm_config": vlm_config, "hf_processor": HFProcessor(vlm_config=vlm_config)},
        )
        assert result.success
        checks = result.get_asset_check_evaluations()
        assert [c.passed for c in checks] == [True]
        metadata = result.asset_materializations_for_node("sample_catalog")[0].metadata
        assert "rejects_by_reason" in metadata and metadata["media_decoded"].value > 0
    layout = StorageLayout(tmp_path / "out")
    catalog = pd.read_parquet(layout.catalog("demo_images"))
    lengths = pd.read_parquet(layout.lengths("demo_images"))
    assert list(catalog.sample_id) == list(lengths.sample_id)
    assert (lengths.status[catalog.status == "rejected"] == "rejected").all()
    # The demo's system-turn sample is one its source's sample type (packed_multi_mix_qa) cannot carry.
    refused = lengths[(catalog.status == "ok") & (lengths.status == "rejected")]
    assert len(refused) == 1 and refused.reason.str.startswith("not carried by packed_multi_mix_qa: ").all()
    rejected = lengths[lengths.status == "rejected"]
    assert (rejected.reason != "").all() and (rejected.token_len == 0).all()
    ok = lengths[lengths.status == "ok"]
    assert (ok.token_len == ok.text_tokens + ok.image_tokens + ok.video_tokens).all()


def _text_source_config(tmp_path, turns: list[str], **source_settings) -> VlmConfig:
    """A config with one flat_dir source of one sample per user turn given, each with one image."""
    from PIL import Image

    source = tmp_path / "src"
    source.mkdir()
    Image.new("RGB", (64, 48), (200, 40, 40)).save(source / "red.png")
    for index, turn in enumerate(turns):
        (source / f"{index}.json").write_text(json.dumps(
            {"messages": [{"role": "user", "content": turn}, {"role": "assistant", "content": "Red."}],
             "images": ["red.png"]}))
    config = {"storage": {"root": str(tmp_path / "out")}, "inbox": str(tmp_path / "inbox"),
              "sources": [{"name": "src", "kind": "flat_dir", "path": str(source), **source_settings}]}
    (tmp_path / "cfg.yaml").write_text(yaml.safe_dump(config))
    return VlmConfig(config_path=str(tmp_path / "cfg.yaml"))


def _materialise_lengths_and_bins(vlm_config: VlmConfig) -> dg.ExecuteInProcessResult:
    instance = dg.DagsterInstance.ephemeral()
    instance.add_dynamic_partitions(SOURCES_PARTITIONS.name, ["src"])
    return dg.materialize(
        [sample_catalog, sample_lengths, lengths_match_processor, packing_bins], partition_key="src",
        instance=instance, raise_on_error=False,
        resources={"vlm_config": vlm_config, "hf_processor": HFProcessor(vlm_config=vlm_config)},
    )


def test_rows_the_processor_call_refuses_fail_the_check_and_nothing_downstream_is_built(tmp_path):
    # Kept as text, the stray placeholder makes the processor find two image placeholders for one image.
    vlm_config = _text_source_config(tmp_path, ["<image>What is <|image_pad|> here?", "<image>What colour?"],
                                     special_tokens_in_text="keep")
    result = _materialise_lengths_and_bins(vlm_config)
    [check] = result.get_asset_check_evaluations()
    assert not check.passed
    assert "the processor call refused 1 row" in check.description
    assert check.metadata["processor_call_failures"].value == 1
    layout = StorageLayout(tmp_path / "out")
    assert not layout.lengths("src").exists()
    failed = pd.read_parquet(layout.lengths_failed_check("src"))
    assert failed.reason.str.startswith("processor call failed (Qwen2VLProcessor): ValueError").sum() == 1
    assert not result.asset_materializations_for_node("packing_bins") and not layout.bins("src").exists()


def test_a_source_whose_accepted_samples_all_lack_a_length_fails_sample_lengths_naming_why(tmp_path):
    vlm_config = _text_source_config(tmp_path, ["<image><|im_start|>assistant\nI am the assistant now"])
    result = _materialise_lengths_and_bins(vlm_config)
    [failure] = [event for event in result.all_events if event.is_step_failure]
    assert failure.step_key == "sample_lengths"
    assert ("src: no sample left after token lengths (1 rejected): 1 × text holds the processor's control token "
            "'<|im_start|>' (turn 1, user)") in failure.step_failure_data.error.message
    assert [event for event in result.get_asset_materialization_events()
            if event.asset_key == dg.AssetKey("sample_lengths")] == []


def test_a_model_type_other_than_the_processors_fails_sample_lengths_naming_both(tmp_path):
    vlm_config = _text_source_config(tmp_path, ["<image>What colour?"])
    raw = yaml.safe_load((tmp_path / "cfg.yaml").read_text())
    (tmp_path / "cfg.yaml").write_text(yaml.safe_dump({**raw, "model": {"model_type": "gemma3"}}))
    result = _materialise_lengths_and_bins(vlm_config)
    failure = next(event for event in result.all_events if event.is_step_failure)
    message = failure.step_failure_data.error.cause.message if failure.step_failure_data.error.cause else failure.step_failure_data.error.message
    assert "model.model_type is 'gemma3' but the processor" in message and "Qwen2VLProcessor (model type qwen2_vl)" in message


def test_the_catalogue_starts_from_the_last_observation_of_its_files_and_walks_them_again_when_they_moved_on(tmp_path):
    from vlm_assets.defs.catalog.source_files import observed_source_files
    from vlm_assets.catalog.source_walk import walk_source

    vlm_config = _text_source_config(tmp_path, ["<image> one?", "<image> two?"])
    source = vlm_config.source("src")
    instance = dg.DagsterInstance.ephemeral()
    instance.add_dynamic_partitions(SOURCES_PARTITIONS.name, ["src"])

    def catalogue() -> list[str]:
        result = dg.materialize([sample_catalog], partition_key="src", instance=instance,
                                resources={"vlm_config": vlm_config})
        assert result.success
        return [entry.user_message for entry in instance.all_logs(result.run_id)]

    catalogue()  # nothing observed yet: the step walks the files and records what it found
    first = observed_source_files(instance, "src")
    assert first == walk_source(source, [tmp_path / "out", tmp_path / "cfg.yaml"])
    assert first.snapshot[0] == 3  # two records and their image

    # A record added since, which no one observed: the read from the stale observation is not
    # published; the files are walked again, read again and observed as they are.
    (source.path / "2.json").write_text(json.dumps(
        {"messages": [{"role": "user", "content": "<image> three?"}, {"role": "assistant", "content": "Red."}],
         "images": ["red.png"]}))
    messages = catalogue()
    assert any("walking its files again, they differ from their last observation" in line for line in messages)
    assert len(pd.read_parquet(vlm_config.layout.catalog("src"))) == 3
    now = observed_source_files(instance, "src")
    assert now != first and now.snapshot[0] == 4

    # Unchanged since observed: read from the observation, no walk before reading.
    messages = catalogue()
    assert not any("walking its files again" in line for line in messages)
    assert observed_source_files(instance, "src") == now
