"""Packages: extraction never harms what a folder held, identical inputs give identical bytes, unready inputs are named."""

from __future__ import annotations

import hashlib
import io
import json
import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
import yaml

from vlm_assets_tests.test_package_asset import write_config

from vlm_assets.config import load_config
from vlm_assets.frames.plan import PlannedVideo, write_plan
from vlm_assets.layout import StorageLayout
from vlm_assets.package import MANIFEST_NAME, PackageError, extract_package, prepare_workdir, read_manifest, write_package
from vlm_assets.package.compression import package_file_name
from vlm_assets.package.readiness import frame_cache_gaps, input_problems, missing_shards
from vlm_assets.package.writer import source_date_epoch
from vlm_assets.root_owner import claim_storage_root
from vlm_assets_tests.test_package import (
    CREATED_AT,
    _member,
    dataset,  # noqa: F401 (fixture)
    decompressed_tar,
    hostile_package,
    make_spec,
    recompress,
    run_cli,
)


def snapshot(root: Path) -> dict[str, object]:
    """Every entry below `root` (hidden ones too): file bytes, symlink targets, folders."""
    entries: dict[str, object] = {}
    for path in sorted(root.rglob("*")):
        name = path.relative_to(root).as_posix()
        if path.is_symlink():
            entries[name] = ("symlink", os.readlink(path))
        elif path.is_dir():
            entries[name] = "dir"
        else:
            entries[name] = path.read_bytes()
    return entries


def populated(target: Path, package: Path) -> dict[str, object]:
    """`target` holding an earlier extraction of `package`, edited, plus files of the user's own."""
    extract_package(package, target)
    (target / "data/packed_wds/src_a/pretrain-000001.tar").write_bytes(b"an older shard the package would replace")
    (target / "notes.txt").write_bytes(b"my notes")
    (target / "data/packed_wds/src_a/.keep.tmp").write_bytes(b"looks like a temp file, is not ours")
    (target / "checkpoints").mkdir()
    (target / "checkpoints/step-100.pt").write_bytes(os.urandom(1000))
    return snapshot(target)


def tampered(good: Path, out: Path) -> Path:
    tar_bytes = bytearray(decompressed_tar(good))
    with tarfile.open(fileobj=io.BytesIO(bytes(tar_bytes))) as tar:
        victim = tar.getmember("data/packed_wds/src_a/pretrain-000001.tar")
    tar_bytes[victim.offset_data + 100] ^= 0x01
    return recompress(bytes(tar_bytes), out)


def truncated(good: Path, out: Path) -> Path:
    out.write_bytes(good.read_bytes()[: int(good.stat().st_size * 0.9)])
    return out


@pytest.fixture
def good_package(tmp_path: Path, dataset) -> Path:  # noqa: F811 (fixture)
    root, _ = dataset
    return write_package(make_spec(root, "zstd"), tmp_path / "run.nnpkg.zst", created_at=CREATED_AT).path


@pytest.mark.parametrize(
    ("damage", "reason"),
    [(tampered, "checksum verification failed"), (truncated, "truncated")],
)
def test_failed_forced_extraction_leaves_a_populated_folder_as_it_was(tmp_path: Path, good_package: Path, damage, reason: str) -> None:
    target = tmp_path / "target"
    before = populated(target, good_package)
    bad = damage(good_package, tmp_path / "bad.nnpkg.zst")
    with pytest.raises(PackageError, match=reason):
        extract_package(bad, target, force=True)
    assert snapshot(target) == before, "every file that was there keeps its bytes; nothing is added"


def test_failed_extraction_of_a_hostile_package_leaves_a_populated_folder_as_it_was(tmp_path: Path) -> None:
    target = tmp_path / "target"
    (target / "data/packed_wds").mkdir(parents=True)
    (target / "data/packed_wds/ok.txt").write_bytes(b"the package would replace this")
    (target / "notes.txt").write_bytes(b"my notes")
    before = snapshot(target)
    package = hostile_package(tmp_path / "evil.nnpkg", _member("data/packed_wds/link", tarfile.SYMTYPE, "/etc"))
    with pytest.raises(PackageError, match="symbolic link"):
        extract_package(package, target, force=True)
    assert snapshot(target) == before


def crafted_package(path: Path, files: dict[str, bytes]) -> Path:
    """A package with a valid manifest for `files` (role 'r'), members in the given order."""
    entries = [
        {"role": "r", "path": name, "size": len(data), "sha256": hashlib.sha256(data).hexdigest()} for name, data in files.items()
    ]
    manifest = json.dumps({"format_version": 1, "name": "x", "created_at": None, "compress": "zstd", "files": entries}).encode()
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as tar:
        for name, data in {MANIFEST_NAME: manifest, **files}.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return recompress(buffer.getvalue(), path)


def test_a_rename_that_fails_puts_back_the_files_already_replaced(tmp_path: Path) -> None:
    # 'data/r/x' is both a file and a folder: only the rename into place can fail, after 'data/r/a' was replaced.
    package = crafted_package(tmp_path / "clash.nnpkg.zst", {"data/r/a": b"new a", "data/r/x": b"file x", "data/r/x/y": b"y"})
    target = tmp_path / "target"
    (target / "data/r").mkdir(parents=True)
    (target / "data/r/a").write_bytes(b"old a")
    before = snapshot(target)
    with pytest.raises(PackageError, match=r"cannot move .*data/r/x into place"):
        extract_package(package, target, force=True)
    assert snapshot(target) == before


def test_extraction_into_a_folder_that_is_not_empty_needs_force(tmp_path: Path, good_package: Path, capsys) -> None:
    target = tmp_path / "target"
    before = populated(target, good_package)
    with pytest.raises(PackageError, match=r"target: directory is not empty; pass --force"):
        extract_package(good_package, target)
    assert snapshot(target) == before

    assert run_cli("extract", str(good_package), "-o", str(target)) == 2
    assert f"{target}: directory is not empty; pass --force" in capsys.readouterr().err
    assert snapshot(target) == before

    assert run_cli("extract", str(good_package), "-o", str(target), "--force") == 0
    after = snapshot(target)
    assert after["data/packed_wds/src_a/pretrain-000001.tar"] == b"shard " * 40_000, "the package's file replaces the old one"
    assert {name: after[name] for name in ("notes.txt", "checkpoints/step-100.pt", "data/packed_wds/src_a/.keep.tmp")} == {
        name: before[name] for name in ("notes.txt", "checkpoints/step-100.pt", "data/packed_wds/src_a/.keep.tmp")
    }, "files the package does not list are not touched"
    assert set(after) == set(before)


def test_empty_or_missing_folder_needs_no_force_and_a_failure_removes_the_folders_it_made(tmp_path: Path, good_package: Path) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    extract_package(good_package, empty)
    assert (empty / "data/frame_cache/empty.txt").read_bytes() == b""

    bad = truncated(good_package, tmp_path / "bad.nnpkg.zst")
    with pytest.raises(PackageError, match="truncated"):
        extract_package(bad, tmp_path / "new" / "deeper" / "target")
    assert not (tmp_path / "new").exists()

    not_a_folder = tmp_path / "file"
    not_a_folder.write_bytes(b"x")
    with pytest.raises(PackageError, match=r"file: exists and is not a directory"):
        extract_package(good_package, not_a_folder, force=True)


def test_train_re_extracts_into_its_workdir_beside_other_files(tmp_path: Path, dataset, monkeypatch) -> None:  # noqa: F811 (fixture)
    root, _ = dataset
    package = write_package(make_spec(root, "zstd"), tmp_path / "run.nnpkg.zst").path
    monkeypatch.chdir(tmp_path)
    workdir = tmp_path / "run.d"
    workdir.mkdir()
    (workdir / "train.log").write_bytes(b"log")
    assert prepare_workdir(package).extracted is True, "a workdir with the run's own files is extracted into"
    write_package(make_spec(root, "zstd", hyperparameters={"epochs": 3}), package)
    assert prepare_workdir(package).extracted is True
    assert (workdir / "train.log").read_bytes() == b"log"


def copy_with_other_metadata(root: Path, copy: Path) -> None:
    shutil.copytree(root, copy)
    for path in copy.rglob("*"):
        os.utime(path, (1_000_000_000, 1_000_000_000))
        if path.is_file():
            path.chmod(0o600)


@pytest.mark.parametrize("compress", ["gzip", "zstd"])
def test_identical_inputs_give_identical_packages_without_a_created_at(tmp_path: Path, dataset, compress: str) -> None:  # noqa: F811
    root, _ = dataset
    copy = tmp_path / "copy"
    copy_with_other_metadata(root, copy)
    first = write_package(make_spec(root, compress), tmp_path / "one" / "run.nnpkg").path
    second = write_package(make_spec(copy, compress), tmp_path / "two" / "run.nnpkg", threads=1).path
    assert first.read_bytes() == second.read_bytes(), "no clock, path, mtime, mode or thread count in the bytes"
    assert read_manifest(first).created_at is None
    assert b'"created_at": null' in decompressed_tar(first)[:4096]


def test_source_date_epoch(monkeypatch) -> None:
    monkeypatch.delenv("SOURCE_DATE_EPOCH", raising=False)
    assert source_date_epoch() is None
    monkeypatch.setenv("SOURCE_DATE_EPOCH", "1700000000")
    assert source_date_epoch() == "2023-11-14T22:13:20Z"
    for bad in ("yesterday", "-5", "1e9", "9" * 30):
        monkeypatch.setenv("SOURCE_DATE_EPOCH", bad)
        with pytest.raises(PackageError, match="SOURCE_DATE_EPOCH=.*whole seconds since 1970"):
            source_date_epoch()


def test_cli_pack_records_a_time_and_info_shows_a_missing_one(tmp_path: Path, dataset, capsys, monkeypatch) -> None:  # noqa: F811
    root, _ = dataset
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(yaml.safe_dump({"name": "demo", "data": {"packed_wds": str(root / "packed_wds")}}))
    monkeypatch.setenv("SOURCE_DATE_EPOCH", "1700000000")
    assert run_cli("pack", str(recipe)) == 0
    assert read_manifest(tmp_path / "demo.nnpkg.zst").created_at == "2023-11-14T22:13:20Z"
    monkeypatch.delenv("SOURCE_DATE_EPOCH")
    assert run_cli("pack", str(recipe)) == 0
    assert read_manifest(tmp_path / "demo.nnpkg.zst").created_at.endswith("Z")

    unstamped = write_package(make_spec(root, "gzip"), tmp_path / "plain.nnpkg").path
    capsys.readouterr()
    assert run_cli("info", str(unstamped)) == 0
    assert "created_at:  (not recorded)" in capsys.readouterr().out


def app_config(tmp_path: Path, include: list[str], sources: list[str]) -> Path:
    return write_config(tmp_path, tuple(sources), include=include)


def test_every_configured_source_needs_packed_shards(tmp_path: Path) -> None:
    app = load_config(app_config(tmp_path, ["packed_wds"], ["alpha", "beta"]))
    layout = StorageLayout(app.storage_root)
    (layout.packed_wds("alpha")).mkdir(parents=True)
    (layout.packed_wds("alpha") / "pretrain-000000.tar").write_bytes(b"")
    (layout.packed_wds("beta")).mkdir(parents=True)
    (layout.packed_wds("beta") / "pretrain-000000.tar.idx").write_bytes(b"")
    assert input_problems(app, layout) == [
        f"source 'beta' has no packed shards: no pretrain-*.tar in {layout.packed_wds('beta')} "
        "(materialise packed_wds_shards for it, or remove it from the config)",
        f"no training mix: {layout.metadataset} does not exist (materialise training_mix)",
    ]
    assert missing_shards(layout, ["alpha"]) == []
    frames_only = load_config(app_config(tmp_path, ["frame_cache"], ["alpha", "beta"]))
    assert input_problems(frames_only, layout) == [], "shards matter only when packed_wds is packaged"


def planned(cache_dir: Path, keys: list[str]) -> None:
    write_plan(cache_dir, [PlannedVideo(video_id=f"v{i}", ref=f"/media/{key}.mp4", keys=[key], shard="part-00000") for i, key in enumerate(keys)])


def indexed(cache_dir: Path, keys: list[str]) -> None:
    (cache_dir / "index.jsonl").write_text("".join(json.dumps({"video": key}) + "\n" for key in keys))


def test_frame_cache_must_cover_its_plan(tmp_path: Path) -> None:
    cache_dir = tmp_path / "cache"
    assert frame_cache_gaps(cache_dir) == [], "no cache, no plan: nothing was planned"
    cache_dir.mkdir()
    keys = [f"k{i}" for i in range(8)]
    planned(cache_dir, keys)
    indexed(cache_dir, keys[:1])
    [problem] = frame_cache_gaps(cache_dir)
    assert problem.startswith(f"frame cache {cache_dir}: 7 key(s) not covered by its index")
    assert "k1: neither cached nor failed; k2" in problem and "k5: neither cached nor failed; …" in problem
    assert "k6" not in problem
    indexed(cache_dir, keys)
    assert frame_cache_gaps(cache_dir) == []


def test_frame_cache_is_checked_only_when_packaged(tmp_path: Path) -> None:
    shards_only = load_config(app_config(tmp_path, ["packed_wds"], []))
    layout = StorageLayout(shards_only.storage_root)
    cache_dir = layout.frame_cache(56, 4)
    cache_dir.mkdir(parents=True)
    planned(cache_dir, ["k0"])
    layout.metadataset.parent.mkdir(parents=True)
    layout.metadataset.write_text("__class__: MetadatasetV2\n")
    assert input_problems(shards_only, layout) == []
    both = load_config(app_config(tmp_path, ["packed_wds", "frame_cache"], []))
    assert len(input_problems(both, layout)) == 1


@pytest.mark.parametrize("order", ["options first", "options after the package"])
def test_train_takes_its_options_before_or_after_the_package(
    tmp_path: Path, dataset, capfd, monkeypatch, order: str,  # noqa: F811 (fixture)
) -> None:
    from vlm_assets.cli import main

    root, _ = dataset
    package = str(write_package(make_spec(root, "zstd"), tmp_path / "run.nnpkg.zst").path)
    monkeypatch.chdir(tmp_path)
    command = [sys.executable, "-c", "import sys; print('ARGS', sys.argv[1:])"]
    options = ["--command", subprocess.list2cmdline(command) + " {workdir}"]
    line = [*options, package] if order == "options first" else [package, *options]
    assert main(["package", "train", *line, "--", "--epochs", "3"]) == 0
    assert f"ARGS ['{tmp_path / 'run.d'}', '--epochs', '3']" in capfd.readouterr().out


@pytest.mark.parametrize("compress", ["zstd", "gzip"])
def test_train_unpacks_into_the_current_directory_never_among_the_outputs(
    tmp_path: Path, dataset, capfd, monkeypatch, compress: str,  # noqa: F811 (fixture)
) -> None:
    root, _ = dataset
    claim_storage_root(root, tmp_path / "vlm_assets.yaml")
    packages = StorageLayout(root).packages
    package = str(write_package(make_spec(root, compress), packages / package_file_name("run", compress)).path)
    print_workdir = ["--command", subprocess.list2cmdline([sys.executable, "-c", "import sys; print('WORKDIR', sys.argv[1])"]) + " {workdir}"]
    here = tmp_path / "training"
    here.mkdir()
    monkeypatch.chdir(here)

    assert run_cli("train", package, *print_workdir) == 0
    assert f"WORKDIR {here / 'run.d'}\n" in capfd.readouterr().out
    assert (here / "run.d" / MANIFEST_NAME).is_file()
    assert sorted(path.name for path in packages.iterdir()) == [Path(package).name], "nothing unpacked beside the package"
    assert run_cli("train", package, *print_workdir) == 0
    assert f"reusing {here / 'run.d'} (manifest unchanged)" in capfd.readouterr().err

    assert run_cli("extract", package) == 2, "extract's default is the same folder, not empty now"
    assert f"{here / 'run.d'}" in capfd.readouterr().err

    monkeypatch.chdir(packages)
    assert run_cli("train", package, *print_workdir) == 2
    error = capfd.readouterr().err
    assert f"the default workdir {packages / 'run.d'} would lie inside the storage root {root}" in error and "--workdir" in error
    assert sorted(path.name for path in packages.iterdir()) == [Path(package).name]
    elsewhere = tmp_path / "explicit"
    assert run_cli("train", "--workdir", str(elsewhere), package, *print_workdir) == 0
    assert f"WORKDIR {elsewhere}\n" in capfd.readouterr().out
