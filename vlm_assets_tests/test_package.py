"""Training packages: round trips, integrity, hostile archives, truncation, workdir reuse, CLI."""

from __future__ import annotations

import argparse
import io
import json
import os
import subprocess
import sys
import tarfile
import zlib
from pathlib import Path

import pytest
import zstandard

from vlm_assets.package import (
    MANIFEST_NAME,
    PackageError,
    PackagePart,
    PackageSpec,
    detect_compression,
    extract_package,
    prepare_workdir,
    read_manifest,
    train_from_package,
    verify_package,
    write_package,
)
from vlm_assets.package import cli as package_cli
from vlm_assets.package.compression import StoredSegment, stored_frame

CREATED_AT = "2024-01-02T03:04:05Z"


def make_dataset(root: Path) -> dict[str, bytes]:
    """A small packed_wds-like tree (a source's shards and .nv-meta, the metadataset) and a frame-cache-like
    tree; returns relpath -> bytes."""
    # Random bytes stand in for JPEG-heavy shards (stored uncompressed), text for compressible ones.
    files = {
        "packed_wds/src_a/pretrain-000000.tar": os.urandom(300_000),
        "packed_wds/src_a/pretrain-000001.tar": b"shard " * 40_000,
        "packed_wds/src_a/.nv-meta/dataset.yaml": b"__class__: CrudeWebdataset\nsubflavors: {sample_type: packed_vqa}\n",
        "packed_wds/src_a/.nv-meta/split.yaml": b"split_parts: {train: [pretrain-000000.tar]}\n",
        "packed_wds/metadataset.yaml": b"__class__: MetadatasetV2\nsplits: {train: {blend: [{path: src_a}]}}\n",
        "frame_cache/part-00000.tar": os.urandom(200_000),
        "frame_cache/index.jsonl": b'{"video": "v/a.mp4", "shard": 0}\n',
        "frame_cache/empty.txt": b"",
    }
    for name, data in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
    (root / "packed_wds" / "src_a" / ".pretrain-000002.tar.abc123.tmp").write_bytes(b"half-written")
    return files


def make_spec(root: Path, compress: str, **overrides) -> PackageSpec:
    fields = {
        "name": "run",
        "compress": compress,
        "parts": (PackagePart("packed_wds", root / "packed_wds"), PackagePart("frame_cache", root / "frame_cache")),
        "hyperparameters": {"learning_rate": 1e-5, "epochs": 2},
        "train_command": "",
    }
    fields.update(overrides)
    return PackageSpec(**fields)


@pytest.fixture
def dataset(tmp_path: Path) -> tuple[Path, dict[str, bytes]]:
    root = tmp_path / "storage"
    return root, make_dataset(root)


def decompressed_tar(path: Path) -> bytes:
    raw = path.read_bytes()
    if detect_compression(path) == "zstd":
        return zstandard.ZstdDecompressor().stream_reader(io.BytesIO(raw), read_across_frames=True).read()
    import gzip

    return gzip.decompress(raw)


@pytest.mark.parametrize("compress", ["gzip", "zstd"])
def test_round_trip(tmp_path: Path, dataset, compress: str) -> None:
    root, files = dataset
    out = tmp_path / f"run.{compress}.nnpkg"
    result = write_package(make_spec(root, compress), out, created_at=CREATED_AT, threads=2)

    assert detect_compression(out) == compress
    manifest = read_manifest(out)
    assert manifest == result.manifest
    assert (manifest.name, manifest.created_at, manifest.compress) == ("run", CREATED_AT, compress)
    assert manifest.hyperparameters == {"learning_rate": 1e-5, "epochs": 2}
    assert {entry.archive_path: entry.role for entry in manifest.files} == {
        "data/" + name: name.split("/")[0] for name in files
    }, "temp files of atomic writers are left out; .nv-meta is kept"
    assert result.data_bytes == sum(len(data) for data in files.values())

    with tarfile.open(fileobj=io.BytesIO(decompressed_tar(out))) as tar:
        members = tar.getmembers()
    assert members[0].name == MANIFEST_NAME
    assert [m.name for m in members[1:]] == sorted("data/" + name for name in files)
    assert {(m.mtime, m.uid, m.gid, m.uname, m.gname, m.mode) for m in members} == {(0, 0, 0, "", "", 0o644)}
    assert json.loads(tar.extractfile(members[0]).read() if False else decompressed_tar(out)[512 : 512 + members[0].size])[
        "format_version"
    ] == 1

    report = verify_package(out)
    assert report.ok and report.checked_files == len(files)

    target = tmp_path / "x"
    extract_package(out, target)
    for name, data in files.items():
        assert (target / "data" / name).read_bytes() == data
    assert not list(target.rglob("*.tmp"))


@pytest.mark.parametrize("compress", ["gzip", "zstd"])
def test_same_inputs_give_identical_bytes(tmp_path: Path, dataset, compress: str) -> None:
    root, _ = dataset
    first = write_package(make_spec(root, compress), tmp_path / "a", created_at=CREATED_AT, threads=2).path
    second = write_package(make_spec(root, compress), tmp_path / "b", created_at=CREATED_AT, threads=1).path
    assert first.read_bytes() == second.read_bytes()


@pytest.mark.parametrize("compress", ["gzip", "zstd"])
@pytest.mark.parametrize("store_incompressible", [True, False])
def test_gnu_tar_reads_packages(tmp_path: Path, dataset, compress: str, store_incompressible: bool) -> None:
    root, files = dataset
    package = write_package(make_spec(root, compress), tmp_path / "run", store_incompressible=store_incompressible).path
    target = tmp_path / "gnu"
    target.mkdir()
    flag = "-z" if compress == "gzip" else "--zstd"
    subprocess.run(["tar", flag, "-xf", str(package)], cwd=target, check=True)
    listing = subprocess.run(["tar", flag, "-tf", str(package)], check=True, capture_output=True, text=True).stdout.split()
    assert listing[0] == MANIFEST_NAME
    for name, data in files.items():
        assert (target / "data" / name).read_bytes() == data
    assert verify_package(package).ok


@pytest.mark.parametrize("compress", ["gzip", "zstd"])
def test_stored_segments_of_any_length_decode_with_default_memory(compress: str) -> None:
    out = io.BytesIO()
    segment = StoredSegment(out, compress, 3 << 30)  # larger than any decoder's default window limit
    segment.write(b"x" * 1000)
    if compress == "zstd":
        assert zstandard.ZstdDecompressor().decompressobj().decompress(out.getvalue()) == b"x" * 1000
    else:
        assert zlib.decompressobj(wbits=31).decompress(out.getvalue()) == b"x" * 1000
    for length in (0, 5, 131_072, 131_073, 300_000):
        data = os.urandom(length)
        frame = stored_frame(data, compress)
        tool = ["zstd", "-dc"] if compress == "zstd" else ["gzip", "-dc"]
        assert subprocess.run(tool, input=frame, capture_output=True, check=True).stdout == data


def test_magic_number_decides_not_the_name(tmp_path: Path, dataset) -> None:
    root, _ = dataset
    zstd_named_gzip = write_package(make_spec(root, "zstd"), tmp_path / "run.nnpkg", created_at=CREATED_AT).path
    assert detect_compression(zstd_named_gzip) == "zstd"
    assert read_manifest(zstd_named_gzip).compress == "zstd"
    assert verify_package(zstd_named_gzip).ok

    junk = tmp_path / "junk.nnpkg"
    junk.write_bytes(b"PK\x03\x04 definitely a zip")
    with pytest.raises(PackageError, match=r"junk\.nnpkg: not a training package"):
        read_manifest(junk)
    plain_tar = tmp_path / "plain.nnpkg"
    with tarfile.open(plain_tar, "w") as tar:
        tar.add(root / "frame_cache" / "index.jsonl", arcname="x")
    with pytest.raises(PackageError, match="not a training package"):
        read_manifest(plain_tar)


def recompress(tar_bytes: bytes, out: Path, compress: str = "zstd") -> Path:
    if compress == "zstd":
        out.write_bytes(zstandard.ZstdCompressor().compress(tar_bytes))
    else:
        import gzip

        out.write_bytes(gzip.compress(tar_bytes))
    return out


@pytest.mark.parametrize("compress", ["gzip", "zstd"])
def test_tampered_file_is_named(tmp_path: Path, dataset, compress: str) -> None:
    root, _ = dataset
    good = write_package(make_spec(root, compress), tmp_path / "good", created_at=CREATED_AT).path
    tar_bytes = bytearray(decompressed_tar(good))
    with tarfile.open(fileobj=io.BytesIO(bytes(tar_bytes))) as tar:
        victim = tar.getmember("data/packed_wds/src_a/pretrain-000001.tar")
    tar_bytes[victim.offset_data + 100] ^= 0x01
    bad = recompress(bytes(tar_bytes), tmp_path / "bad.nnpkg", compress)

    report = verify_package(bad)
    assert not report.ok
    assert report.problems == ("data/packed_wds/src_a/pretrain-000001.tar: " + report.problems[0].split(": ", 1)[1],)
    assert "sha256 mismatch" in report.problems[0]
    assert report.checked_files == len(read_manifest(good).files)

    target = tmp_path / "target"
    with pytest.raises(PackageError, match=r"checksum verification failed: data/packed_wds/src_a/pretrain-000001\.tar"):
        extract_package(bad, target)
    assert not [p for p in target.rglob("*") if p.is_file()], "a failed extraction leaves nothing behind"


@pytest.mark.parametrize("compress", ["gzip", "zstd"])
@pytest.mark.parametrize("where", [0.3, 0.5, 0.7, 0.95])
def test_damaged_package_bytes_are_detected(tmp_path: Path, dataset, compress: str, where: float) -> None:
    root, _ = dataset
    path = write_package(make_spec(root, compress), tmp_path / "run", created_at=CREATED_AT).path
    data = bytearray(path.read_bytes())
    data[int(len(data) * where)] ^= 0xFF
    path.write_bytes(bytes(data))
    try:
        report = verify_package(path)
    except PackageError as error:
        assert "run" in str(error)
    else:
        assert not report.ok, "damage must surface as an error or as named problems"


@pytest.mark.parametrize("compress", ["gzip", "zstd"])
@pytest.mark.parametrize("keep", [0.5, 0.9, -4])
def test_truncated_package_gives_clear_error(tmp_path: Path, dataset, compress: str, keep: float) -> None:
    root, _ = dataset
    path = write_package(make_spec(root, compress), tmp_path / "run", created_at=CREATED_AT).path
    data = path.read_bytes()
    cut = int(len(data) * keep) if keep > 0 else len(data) + int(keep)
    path.write_bytes(data[:cut])
    with pytest.raises(PackageError, match="truncated"):
        verify_package(path)
    target = tmp_path / "target"
    with pytest.raises(PackageError, match="truncated"):
        extract_package(path, target)
    assert not [p for p in target.rglob("*") if p.is_file()]


@pytest.mark.parametrize("compress", ["gzip", "zstd"])
def test_package_cut_at_a_frame_boundary_is_incomplete(tmp_path: Path, dataset, compress: str) -> None:
    root, files = dataset
    path = write_package(make_spec(root, compress), tmp_path / "run", created_at=CREATED_AT).path
    with tarfile.open(fileobj=io.BytesIO(decompressed_tar(path)), mode="r") as tar:
        first_data = tar.getmembers()[1].offset
    manifest_frame = len(stored_frame(decompressed_tar(path)[:first_data], compress))
    path.write_bytes(path.read_bytes()[:manifest_frame])

    assert read_manifest(path).name == "run", "the manifest alone is intact"
    report = verify_package(path)
    assert len(report.problems) == len(files)
    assert all("missing from the archive (truncated or incomplete package)" in problem for problem in report.problems)
    with pytest.raises(PackageError, match="truncated or incomplete"):
        extract_package(path, tmp_path / "target")


def hostile_package(path: Path, member: tarfile.TarInfo, data: bytes = b"", listed: str = "data/packed_wds/ok.txt") -> Path:
    """A package whose manifest is valid but whose archive carries `member` (after one good file)."""
    good = b"fine\n"
    import hashlib

    manifest = {
        "format_version": 1,
        "name": "evil",
        "created_at": CREATED_AT,
        "compress": "zstd",
        "hyperparameters": {},
        "files": [{"role": "packed_wds", "path": listed, "size": len(good), "sha256": hashlib.sha256(good).hexdigest()}],
    }
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.GNU_FORMAT) as tar:
        raw = json.dumps(manifest).encode()
        info = tarfile.TarInfo(MANIFEST_NAME)
        info.size = len(raw)
        tar.addfile(info, io.BytesIO(raw))
        info = tarfile.TarInfo(listed)
        info.size = len(good)
        tar.addfile(info, io.BytesIO(good))
        member.size = len(data) if member.isreg() else 0
        tar.addfile(member, io.BytesIO(data) if member.isreg() else None)
    return recompress(buffer.getvalue(), path)


def _member(name: str, kind: bytes = tarfile.REGTYPE, linkname: str = "") -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type = kind
    info.linkname = linkname
    return info


@pytest.mark.parametrize(
    ("member", "reason"),
    [
        (_member("/tmp/vlm_assets_evil_abs"), "absolute path"),
        (_member("data/packed_wds/../../../evil"), r"'\.\.'"),
        (_member("../evil"), r"'\.\.'"),
        (_member("data/packed_wds/link", tarfile.SYMTYPE, "../../../outside"), "symbolic link"),
        (_member("data/packed_wds/hard", tarfile.LNKTYPE, "/etc/passwd"), "hard link"),
        (_member("data/packed_wds/dev", tarfile.CHRTYPE), "device node"),
        (_member("data/packed_wds/fifo", tarfile.FIFOTYPE), "not a regular file"),
        (_member("data/packed_wds/sub", tarfile.DIRTYPE), "not a regular file"),
        (_member("data/packed_wds/extra.txt"), "not listed in the manifest"),
        (_member("data/packed_wds/ok.txt"), "appears twice"),
    ],
)
def test_hostile_members_are_refused(tmp_path: Path, member: tarfile.TarInfo, reason: str) -> None:
    package = hostile_package(tmp_path / "evil.nnpkg", member, b"pwned\n")
    target = tmp_path / "area" / "target"
    before = {p for p in tmp_path.rglob("*")}
    with pytest.raises(PackageError, match=reason):
        extract_package(package, target)
    after = {p for p in tmp_path.rglob("*")}
    new = after - before
    assert all(path in (target, target.parent) or target in path.parents for path in new), sorted(new)
    assert not [path for path in new if path.is_file()], f"nothing may be written: {sorted(new)}"
    assert not Path("/tmp/vlm_assets_evil_abs").exists()

    report = verify_package(package)
    assert not report.ok and any(member.name in problem or reason.strip("\\'") in problem for problem in report.problems)


def test_symlink_already_in_target_is_not_followed(tmp_path: Path, dataset) -> None:
    root, _ = dataset
    package = write_package(make_spec(root, "zstd"), tmp_path / "run.nnpkg.zst", created_at=CREATED_AT).path
    outside = tmp_path / "outside"
    outside.mkdir()
    target = tmp_path / "target"
    target.mkdir()
    (target / "data").symlink_to(outside, target_is_directory=True)
    with pytest.raises(PackageError, match="refusing to write through symlink"):
        extract_package(package, target, force=True)
    assert not list(outside.iterdir())


def test_manifest_with_unsafe_paths_is_rejected(tmp_path: Path) -> None:
    package = hostile_package(tmp_path / "evil.nnpkg", _member("data/packed_wds/x"), listed="data/packed_wds/../../x")
    with pytest.raises(PackageError, match="manifest lists"):
        read_manifest(package)


def test_missing_part_is_a_clear_error(tmp_path: Path) -> None:
    spec = PackageSpec("run", "zstd", (PackagePart("packed_wds", tmp_path / "nope"),))
    with pytest.raises(PackageError, match="nope: data for role 'packed_wds' does not exist"):
        write_package(spec, tmp_path / "run.nnpkg.zst")
    assert not list(tmp_path.iterdir())


COMMAND = (
    f"{sys.executable} -c \"import json, os, sys; "
    "open(os.path.join(os.environ['VLM_PACKAGE_WORKDIR'], 'calls.jsonl'), 'a').write(json.dumps(sys.argv[1:]) + '\\n'); "
    "sys.exit(int(os.environ.get('EXIT_WITH', '0')))\" {packed_wds} {metadataset} {frame_cache} {hp[learning_rate]} "
    "{hyperparameters}"
)


def test_train_reuses_workdir_until_manifest_changes(tmp_path: Path, dataset, monkeypatch) -> None:
    root, files = dataset
    package = tmp_path / "run.nnpkg.zst"
    write_package(make_spec(root, "zstd", train_command=COMMAND), package, created_at=CREATED_AT)
    workdir = tmp_path / "work"

    assert train_from_package(package, workdir=workdir) == 0
    calls = [json.loads(line) for line in (workdir / "calls.jsonl").read_text().splitlines()]
    assert calls == [[str(workdir / "data/packed_wds"), str(workdir / "data/packed_wds/metadataset.yaml"),
                      str(workdir / "data/frame_cache"), "1e-05", '{"epochs": 2, "learning_rate": 1e-05}']]
    assert (workdir / "data/packed_wds/metadataset.yaml").read_bytes() == files["packed_wds/metadataset.yaml"]
    meta = "packed_wds/src_a/.nv-meta/dataset.yaml"
    assert (workdir / "data" / meta).read_bytes() == files[meta]

    shard = workdir / "data/packed_wds/src_a/pretrain-000000.tar"
    stamp = shard.stat().st_mtime_ns
    monkeypatch.setenv("EXIT_WITH", "3")
    assert train_from_package(package, workdir=workdir, extra_args=["--resume"]) == 3
    assert shard.stat().st_mtime_ns == stamp, "same manifest: the workdir is reused, not re-extracted"
    assert prepare_workdir(package, workdir).extracted is False

    write_package(make_spec(root, "zstd", train_command=COMMAND, hyperparameters={"learning_rate": 2e-5}), package)
    prepared = prepare_workdir(package, workdir)
    assert prepared.extracted is True
    assert (workdir / "calls.jsonl").exists(), "only data/ and the manifest marker are replaced"

    shard.unlink()
    assert prepare_workdir(package, workdir).extracted is True, "an incomplete workdir is re-extracted"


def test_train_without_command_or_unknown_placeholder(tmp_path: Path, dataset, monkeypatch) -> None:
    root, _ = dataset
    monkeypatch.chdir(tmp_path)  # where the default workdirs go
    package = write_package(make_spec(root, "gzip"), tmp_path / "run.nnpkg", created_at=CREATED_AT).path
    with pytest.raises(PackageError, match="no training command"):
        train_from_package(package)
    with pytest.raises(PackageError, match=r"'nope'.*\{packed_wds\}, \{metadataset\}"):
        train_from_package(package, command="train --x {nope}")
    frames_only = make_spec(root, "gzip", parts=(PackagePart("frame_cache", root / "frame_cache"),))
    package = write_package(frames_only, tmp_path / "frames.nnpkg", created_at=CREATED_AT).path
    with pytest.raises(PackageError, match=r"placeholder 'metadataset' is not available \(available: \{frame_cache\}"):
        train_from_package(package, command="train --mix {metadataset}")


def run_cli(*argv: str) -> int:
    parser = argparse.ArgumentParser(prog="vlm-assets")
    package_cli.register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["package", *argv])
    return args.func(args)


def test_cli_end_to_end(tmp_path: Path, dataset, capsys) -> None:
    _, files = dataset
    recipe = tmp_path / "recipe.yaml"
    assert run_cli("new", "-o", str(recipe), "--name", "demo") == 0
    text = recipe.read_text()
    text = text.replace("./vlm_data/packed_wds", "./storage/packed_wds").replace("./vlm_data/frame_cache/384/64", "./storage/frame_cache")
    recipe.write_text(text)
    assert run_cli("new", "-o", str(recipe)) == 2, "an existing recipe is not overwritten"

    assert run_cli("pack", str(recipe)) == 0
    package = tmp_path / "demo.nnpkg.zst"
    assert package.exists()
    capsys.readouterr()

    assert run_cli("info", str(package)) == 0
    info = capsys.readouterr().out
    assert "name:        demo" in info and "learning_rate: 1e-05" in info and "packed_wds: 5 files" in info

    assert run_cli("list", str(package)) == 0
    listing = capsys.readouterr().out
    assert "data/packed_wds/metadataset.yaml" in listing and len(listing.splitlines()) == len(files)

    assert run_cli("verify", str(package)) == 0
    assert "OK" in capsys.readouterr().out

    assert run_cli("pack", str(recipe), "--compress", "gzip", "-o", str(tmp_path / "g.nnpkg")) == 0
    assert detect_compression(tmp_path / "g.nnpkg") == "gzip"

    out_dir = tmp_path / "out"
    assert run_cli("extract", str(package), "-o", str(out_dir)) == 0
    assert (out_dir / "data/frame_cache/part-00000.tar").read_bytes() == files["frame_cache/part-00000.tar"]

    exit_with_argc = f"{sys.executable} -c \"import sys; sys.exit(len(sys.argv))\""
    workdir = str(tmp_path / "w")
    assert run_cli("train", "--workdir", workdir, "--command", exit_with_argc, str(package), "--a", "b") == 3
    assert run_cli("train", "--workdir", workdir, "--command", exit_with_argc, str(package), "--", "--a") == 2

    truncated = tmp_path / "cut.nnpkg"
    truncated.write_bytes(package.read_bytes()[:-100])
    capsys.readouterr()
    assert run_cli("verify", str(truncated)) == 1
    assert "truncated" in capsys.readouterr().err
