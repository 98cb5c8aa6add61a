"""The training mix: per-source Energon datasets blended by weight in packed_wds/metadataset.yaml."""

from __future__ import annotations

import json
import random
import textwrap
from pathlib import Path

import dagster as dg
import pytest
import yaml
from PIL import Image

from vlm_assets.config import ConfigError, load_config
from vlm_assets.definitions import build_definitions
from vlm_assets.defs.automation.sensors import inbox_sensor
from vlm_assets.defs.resources import SOURCES_PARTITIONS
from vlm_assets.layout import StorageLayout
from vlm_assets.packing.energon import MAIN_FOLDER_NAME
from vlm_assets.packing.mix import SHARE_SIGMAS

SOURCES = {  # name: (sample_type, weight)
    "chat": ("packed_multi_mix_qa", 1),
    "vqa": ("packed_vqa", 3),
    "captions": ("packed_captioning", 2),
}
SOURCE_LINEAGE = ["sample_catalog", "sample_dedup", "sample_lengths", "packing_bins", "packed_json", "packed_wds_shards",
                  "energon_dataset"]


def flat_source(directory: Path, samples: int, seed: int, text_only: int = 0) -> Path:
    """`samples` one-turn image conversations (plus `text_only` without media) as a flat_dir source."""
    rng = random.Random(seed)
    directory.mkdir(parents=True)
    for index in range(samples + text_only):
        stem = f"{index:04d}"
        record: dict = {"messages": [
            {"role": "user", "content": ("" if index >= samples else "<image>") + f"Question {index}: what is shown?"},
            {"role": "assistant", "content": " ".join(f"word{rng.randrange(50)}" for _ in range(rng.randrange(4, 30)))},
        ]}
        if index < samples:
            Image.new("RGB", (rng.choice([56, 84, 112]), 56), tuple(rng.randrange(256) for _ in range(3))).save(
                directory / f"{stem}.png")
            record["images"] = [f"{stem}.png"]
        (directory / f"{stem}.json").write_text(json.dumps(record))
    return directory


def write_config(site: Path, sources: str) -> Path:
    path = site / "vlm_assets.yaml"
    path.write_text(textwrap.dedent(f"""\
        storage: {{root: {site / "data"}}}
        inbox: {site / "inbox"}
        model:
          processor: embedded
          processor_kwargs: {{min_pixels: 3136, max_pixels: 50176}}
        sample: {{sample_type: packed_multi_mix_qa, max_token_len: 160}}
        packing: {{min_fill_ratio: 0.0}}
        wds: {{maxcount: 3, maxsize: 1000000}}
        """) + sources)
    return path


def materialize(defs, instance, selection, partition_key=None) -> dg.ExecuteInProcessResult:
    result = dg.materialize(
        list(defs.assets) + list(defs.asset_checks or []), selection=selection, partition_key=partition_key,
        instance=instance, resources=defs.resources, raise_on_error=False,
    )
    assert result.success, [event.message for event in result.all_events if event.is_failure]
    return result


def inbox_tick(defs, instance, cursor=None) -> dg.SensorResult:
    """One inbox_sensor evaluation, registering the partitions it asks for as the daemon does."""
    with dg.build_sensor_context(instance_ref=instance.get_ref(), cursor=cursor, definitions=defs,
                                 resources=defs.resources) as context:
        result = inbox_sensor.evaluate_tick(context)
    for request in result.dynamic_partitions_requests or []:
        instance.add_dynamic_partitions(request.partitions_def_name, list(request.partition_keys))
    return result


def metadata_files(layout: StorageLayout, source: str) -> dict[str, tuple[bytes, int, int]]:
    """Every Energon metadata file of a source: bytes, inode and mtime (unchanged only if never rewritten)."""
    root = layout.packed_wds(source)
    files = [*(root / MAIN_FOLDER_NAME).rglob("*"), *root.glob("*.tar.idx")]
    return {str(p.relative_to(root)): (p.read_bytes(), p.stat().st_ino, p.stat().st_mtime_ns) for p in files if p.is_file()}


@pytest.fixture(scope="module")
def mix_site(tmp_path_factory):
    """Three sources with different sample types and weights, built up to the training mix and its check."""
    site = tmp_path_factory.mktemp("mix_site")
    flat_source(site / "chat", samples=6, seed=1, text_only=4)
    flat_source(site / "vqa", samples=10, seed=2)
    flat_source(site / "captions", samples=8, seed=3)
    (site / "inbox").mkdir()
    config = write_config(site, "sources:\n" + "".join(
        f"  - {{name: {name}, kind: flat_dir, path: ./{name}, sample_type: {sample_type}, weight: {weight}"
        + (", subflavors: {language: en}}\n" if name == "chat" else "}\n")
        for name, (sample_type, weight) in SOURCES.items()
    ))
    defs = build_definitions(config)
    with dg.instance_for_test() as instance:
        instance.add_dynamic_partitions(SOURCES_PARTITIONS.name, list(SOURCES))
        for name in SOURCES:
            materialize(defs, instance, SOURCE_LINEAGE, name)
        mix = materialize(defs, instance, ["training_mix"])
        yield config, defs, instance, mix


def test_each_source_is_its_own_energon_dataset_with_its_sample_type(mix_site):
    config, _, _, mix = mix_site
    layout = StorageLayout(load_config(config).storage_root)
    assert not (layout.packed_wds_root / MAIN_FOLDER_NAME).exists(), "no dataset over every source"
    for name, (sample_type, _) in SOURCES.items():
        dataset_yaml = yaml.safe_load((layout.packed_wds(name) / MAIN_FOLDER_NAME / "dataset.yaml").read_text())
        assert dataset_yaml["subflavors"]["sample_type"] == sample_type and dataset_yaml["subflavors"]["source"] == name
        split = yaml.safe_load((layout.packed_wds(name) / MAIN_FOLDER_NAME / "split.yaml").read_text())
        assert all("/" not in shard for shard in split["split_parts"]["train"]), "shard paths relative to the source"
        record = json.loads(next(layout.packed_json(name).open()))
        assert record["sample_type"] == sample_type
    loads = [e for e in mix.get_asset_check_evaluations() if e.check_name == "energon_loads_every_sample"]
    assert loads == []  # the per-source load check runs with each source's lineage, not with the mix


def test_metadataset_blends_every_source_by_weight(mix_site):
    config, _, _, mix = mix_site
    layout = StorageLayout(load_config(config).storage_root)
    metadataset = yaml.safe_load(layout.metadataset.read_text())
    assert (metadataset["__module__"], metadataset["__class__"]) == ("megatron.energon", "MetadatasetV2")
    blend = metadataset["splits"]["train"]["blend"]
    assert [(entry["path"], entry["weight"]) for entry in blend] == [(name, float(w)) for name, (_, w) in SOURCES.items()]
    assert blend[0]["subflavors"] == {"language": "en", "sample_type": "packed_multi_mix_qa", "source": "chat"}
    assert all(entry["subflavors"]["sample_type"] == SOURCES[entry["path"]][0] for entry in blend)

    metadata = mix.asset_materializations_for_node("training_mix")[0].metadata
    table = metadata["mix"].value
    assert "| source | weight | samples | bins | % bins | % tokens |" in table
    assert "| vqa | 3 |" in table and "| 50.0% |" in table  # vqa: weight 3 of 6
    assert metadata["subflavors"].value["chat"] == blend[0]["subflavors"]
    assert metadata["tokens_by_source"].value["vqa"] > 0
    shares = metadata["token_shares"].value
    assert set(shares) == set(SOURCES) and abs(sum(shares.values()) - 1) < 1e-5


def test_energon_draws_match_the_weights(mix_site):
    *_, mix = mix_site
    [check] = [e for e in mix.get_asset_check_evaluations() if e.check_name == "training_mix_draws_match_weights"]
    assert check.passed, check.metadata["problems"].value
    draws = check.metadata["draws"].value
    assert draws >= 2000 and check.metadata["sigmas"].value == SHARE_SIGMAS
    table = check.metadata["shares"].value
    for name, (_, weight) in SOURCES.items():
        row = next(line for line in table.splitlines() if line.startswith(f"| {name} |"))
        expected, drawn, share, tolerance = (float(cell) for cell in row.strip("| ").split(" | ")[1:])
        assert expected == pytest.approx(weight / 6, abs=1e-4) and drawn > 0
        assert abs(share - expected) <= tolerance


def test_an_inbox_source_reprepares_only_its_own_metadata(mix_site):
    config, defs, instance, _ = mix_site
    layout = StorageLayout(load_config(config).storage_root)
    before = {name: metadata_files(layout, name) for name in SOURCES}
    assert all(before.values())
    flat_source(config.parent / "inbox" / "extra", samples=5, seed=4)

    first = inbox_tick(defs, instance)  # an inbox entry is picked up once unchanged for a tick
    [request] = inbox_tick(defs, instance, first.cursor).run_requests
    assert request.partition_key == "inbox-extra"
    assert [key.to_user_string() for key in request.asset_selection] == SOURCE_LINEAGE
    materialize(defs, instance, request.asset_selection, request.partition_key)
    mix = materialize(defs, instance, ["training_mix"])

    assert {name: metadata_files(layout, name) for name in SOURCES} == before
    assert (layout.packed_wds("inbox-extra") / MAIN_FOLDER_NAME / "index.sqlite").is_file()
    blend = yaml.safe_load(layout.metadataset.read_text())["splits"]["train"]["blend"]
    inbox_entry = next(entry for entry in blend if entry["path"] == "inbox-extra")
    assert inbox_entry["weight"] == 1.0 and inbox_entry["subflavors"]["sample_type"] == "packed_multi_mix_qa"
    [check] = [e for e in mix.get_asset_check_evaluations() if e.check_name == "training_mix_draws_match_weights"]
    assert check.passed, check.metadata["problems"].value
    assert "| inbox-extra |" in check.metadata["shares"].value


def test_a_weighted_source_without_bins_is_a_clear_error(tmp_path):
    flat_source(tmp_path / "good", samples=4, seed=5)
    flat_source(tmp_path / "textonly", samples=0, seed=6, text_only=3)  # packed_vqa rejects every sample
    config = write_config(tmp_path, textwrap.dedent("""\
        sources:
          - {name: good, kind: flat_dir, path: ./good}
          - {name: textonly, kind: flat_dir, path: ./textonly, sample_type: packed_vqa, weight: 2}
        """))
    defs = build_definitions(config)
    with dg.instance_for_test() as instance:
        instance.add_dynamic_partitions(SOURCES_PARTITIONS.name, ["good", "textonly"])
        materialize(defs, instance, SOURCE_LINEAGE, "good")
        emptied = dg.materialize(list(defs.assets), selection=SOURCE_LINEAGE[:-1], partition_key="textonly",
                                 instance=instance, resources=defs.resources, raise_on_error=False)
        [lengths_failure] = [event for event in emptied.all_events if event.is_step_failure]
        assert lengths_failure.step_key == "sample_lengths"
        assert ("textonly: no sample left after token lengths (3 rejected): 3 × not carried by packed_vqa"
                in lengths_failure.step_failure_data.error.message)
        result = dg.materialize(list(defs.assets), selection=["training_mix"], instance=instance,
                                resources=defs.resources, raise_on_error=False)
    assert not result.success
    [failure] = [event for event in result.all_events if event.is_step_failure]
    message = failure.step_failure_data.error.message
    assert "source 'textonly' has weight 2 but no packed bins" in message and "set its weight to 0" in message


def test_a_source_packing_leaves_empty_fails_at_packing_bins_naming_why(tmp_path):
    flat_source(tmp_path / "long", samples=3, seed=7)
    config = write_config(tmp_path, "sources:\n  - {name: long, kind: flat_dir, path: ./long}\n")
    config.write_text(config.read_text().replace("max_token_len: 160", "max_token_len: 24"))
    defs = build_definitions(config)
    with dg.instance_for_test() as instance:
        instance.add_dynamic_partitions(SOURCES_PARTITIONS.name, ["long"])
        result = dg.materialize(list(defs.assets), selection=SOURCE_LINEAGE[:4], partition_key="long",
                                instance=instance, resources=defs.resources, raise_on_error=False)
    [failure] = [event for event in result.all_events if event.is_step_failure]
    assert failure.step_key == "packing_bins"
    message = failure.step_failure_data.error.message
    assert "long: no sample left after packing (3 rejected): 3 × " in message and "24" in message, message
    assert [event.asset_key.path for event in result.get_asset_materialization_events()
            if event.asset_key.path == ["packing_bins"]] == []


@pytest.mark.parametrize(
    ("weights", "key", "message"),
    [
        ([-1, 1], "sources[0].weight", "must be a finite number >= 0"),
        (["heavy", 1], "sources[0].weight", "expected a number"),
        ([1, True], "sources[1].weight", "expected a number"),
        ([0, 0], "sources[*].weight", "every source has weight 0"),
    ],
)
def test_bad_weights_are_config_errors_naming_the_key(tmp_path, weights, key, message):
    config = tmp_path / "vlm_assets.yaml"
    config.write_text(yaml.safe_dump({
        "storage": {"root": str(tmp_path / "data")},
        "sources": [{"name": f"s{i}", "kind": "flat_dir", "path": str(tmp_path), "weight": w} for i, w in enumerate(weights)],
    }))
    with pytest.raises(ConfigError) as error:
        load_config(config)
    assert f"{config}: {key}: {message}" in str(error.value)


def test_subflavors_the_mix_sets_are_reserved(tmp_path):
    config = tmp_path / "vlm_assets.yaml"
    config.write_text(yaml.safe_dump({"storage": {"root": str(tmp_path / "data")}, "sources": [
        {"name": "a", "kind": "flat_dir", "path": str(tmp_path), "subflavors": {"source": "b"}}]}))
    with pytest.raises(ConfigError, match=r"sources\[0\]\.subflavors\.source: a subflavor name other than"):
        load_config(config)
