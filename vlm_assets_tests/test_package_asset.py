"""The `training_package` asset and its `package_verifies` check, through Dagster."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import dagster as dg
import yaml

from vlm_assets.defs.package.assets import training_package
from vlm_assets.defs.package.checks import package_verifies
from vlm_assets.defs.resources import VlmConfig
from vlm_assets.frames.plan import PlannedVideo, write_plan
from vlm_assets.package import extract_package, read_manifest


def write_config(tmp_path: Path, sources: tuple[str, ...] = (), **package) -> Path:
    config = tmp_path / "vlm_assets.yaml"
    for name in sources:
        (tmp_path / "raw" / name).mkdir(parents=True, exist_ok=True)
    settings = {"name": "exp1", "compress": "zstd", "include": ["packed_wds", "frame_cache"], "hyperparameters": {"lr": 0.001}}
    settings.update(package)
    config.write_text(
        yaml.safe_dump(
            {
                "storage": {"root": "./data"},
                "inbox": "./inbox",
                "frame_cache": {"num_frames": 4, "frame_size": 56, "rows": 1, "cols": 4},
                "sources": [{"name": name, "kind": "flat_dir", "path": f"./raw/{name}"} for name in sources],
                "package": settings,
            }
        )
    )
    return config


METADATASET = b"__class__: MetadatasetV2\nsplits:\n  train:\n    blend:\n    - {path: demo, weight: 1.0}\n"


def make_outputs(root: Path, frame_cache: bool = True) -> None:
    files = {
        "packed_wds/demo/pretrain-000000.tar": os.urandom(50_000),
        "packed_wds/demo/.nv-meta/dataset.yaml": b"__class__: CrudeWebdataset\n",
        "packed_wds/demo/.nv-meta/.info.json": b"{}",
        "packed_wds/metadataset.yaml": METADATASET,
        # A source renamed since: the mix no longer names its folder, so no package ships it.
        "packed_wds/renamed/pretrain-000000.tar": os.urandom(1_000),
    }
    if frame_cache:
        files["frame_cache/56/4/part-00000.tar"] = b"frames" * 10_000
        files["frame_cache/56/4/metadata.json"] = b'{"num_frames": 4}'
    for name, data in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_bytes(data)


def materialize(config: Path) -> dg.ExecuteInProcessResult:
    return dg.materialize(
        [training_package, package_verifies],
        resources={"vlm_config": VlmConfig(config_path=str(config))},
        instance=dg.DagsterInstance.ephemeral(),
        raise_on_error=False,
    )


def test_asset_writes_verified_package_with_metadata(tmp_path: Path) -> None:
    config = write_config(tmp_path)
    make_outputs(tmp_path / "data")
    result = materialize(config)
    assert result.success

    package = tmp_path / "data/packages/exp1.nnpkg.zst"
    metadata = result.asset_materializations_for_node("training_package")[0].metadata
    assert metadata["file_count"].value == 6
    assert metadata["size_bytes"].value == package.stat().st_size
    assert metadata["compression_ratio"].value > 1.0
    [check] = result.get_asset_check_evaluations()
    assert check.passed and check.metadata["files_checked"].value == 6

    manifest = read_manifest(package)
    assert manifest.hyperparameters == {"lr": 0.001}
    assert {entry.role for entry in manifest.files} == {"packed_wds", "frame_cache"}
    target = tmp_path / "x"
    extract_package(package, target)
    assert (target / "data/packed_wds/demo/.nv-meta/dataset.yaml").read_bytes() == b"__class__: CrudeWebdataset\n"
    assert (target / "data/packed_wds/metadataset.yaml").read_bytes() == METADATASET
    assert not (target / "data/packed_wds/renamed").exists()
    assert (target / "data/frame_cache/part-00000.tar").exists()


def test_missing_part_is_skipped_and_compression_switch_replaces_file(tmp_path: Path) -> None:
    make_outputs(tmp_path / "data", frame_cache=False)
    assert materialize(write_config(tmp_path)).success
    assert {entry.role for entry in read_manifest(tmp_path / "data/packages/exp1.nnpkg.zst").files} == {"packed_wds"}

    result = materialize(write_config(tmp_path, compress="gzip"))
    assert result.success
    assert sorted(p.name for p in (tmp_path / "data/packages").iterdir()) == ["exp1.nnpkg"]


def test_check_fails_on_a_damaged_package(tmp_path: Path) -> None:
    config = write_config(tmp_path)
    make_outputs(tmp_path / "data")
    assert materialize(config).success
    package = tmp_path / "data/packages/exp1.nnpkg.zst"
    package.write_bytes(package.read_bytes()[:-50])
    result = dg.materialize(
        [training_package, package_verifies],
        resources={"vlm_config": VlmConfig(config_path=str(config))},
        instance=dg.DagsterInstance.ephemeral(),
        selection=dg.AssetSelection.checks_for_assets(training_package),
        raise_on_error=False,
    )
    [check] = result.get_asset_check_evaluations()
    assert not check.passed and "truncated" in check.metadata["error"].value
    assert not result.success  # the check blocks: nothing downstream may use a damaged package


def test_nothing_to_package_fails_clearly(tmp_path: Path) -> None:
    result = materialize(write_config(tmp_path))
    assert not result.success
    assert "nothing to package" in str(result.get_step_failure_events()[0].event_specific_data.error)


def failure_message(result: dg.ExecuteInProcessResult) -> str:
    return str(result.get_step_failure_events()[0].event_specific_data.error)


def test_identical_inputs_give_byte_identical_packages(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.delenv("SOURCE_DATE_EPOCH", raising=False)
    make_outputs(tmp_path / "one/data")
    shutil.copytree(tmp_path / "one/data", tmp_path / "two/data")
    packages = []
    for run in ("one", "two"):
        assert materialize(write_config(tmp_path / run)).success
        packages.append(tmp_path / run / "data/packages/exp1.nnpkg.zst")
    assert packages[0].read_bytes() == packages[1].read_bytes()
    assert read_manifest(packages[0]).created_at is None

    monkeypatch.setenv("SOURCE_DATE_EPOCH", "1700000000")
    assert materialize(write_config(tmp_path / "one")).success
    assert read_manifest(packages[0]).created_at == "2023-11-14T22:13:20Z"


def test_a_source_without_shards_is_refused_before_anything_is_written(tmp_path: Path) -> None:
    make_outputs(tmp_path / "data")
    result = materialize(write_config(tmp_path, sources=("demo", "late")))
    assert not result.success
    message = failure_message(result)
    assert "inputs are not ready, nothing written" in message
    assert f"source 'late' has no packed shards: no pretrain-*.tar in {tmp_path / 'data/packed_wds/late'}" in message
    assert "'demo'" not in message
    assert not (tmp_path / "data/packages").exists()


def test_a_frame_cache_missing_planned_videos_is_refused(tmp_path: Path) -> None:
    make_outputs(tmp_path / "data")
    cache_dir = tmp_path / "data/frame_cache/56/4"
    write_plan(cache_dir, [PlannedVideo(f"v{i}", f"/media/{i}.mp4", [f"clip{i}"], "part-00000") for i in range(3)])
    (cache_dir / "index.jsonl").write_text(json.dumps({"video": "clip0"}) + "\n")
    result = materialize(write_config(tmp_path))
    assert not result.success
    message = failure_message(result)
    assert "2 key(s) not covered by its index" in message and "clip1: neither cached nor failed" in message
    assert not (tmp_path / "data/packages").exists()

    assert materialize(write_config(tmp_path, include=["packed_wds"])).success, "a cache that is not packaged is not checked"
