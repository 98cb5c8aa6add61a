"""Energon metadata: prepared aside, published atomically, byte-identical for identical shards."""

from __future__ import annotations

import io
import json
import os
import socket
import subprocess
import sys
import tarfile
import textwrap
import uuid
from pathlib import Path

import pytest

from vlm_assets.packing.energon import STAGING_PREFIX, prepare_energon_dataset
from vlm_assets.packing.energon_loader import load_all_ids

SHARDS = {"src_a": 3, "src_b": 2}  # source -> shard count
PER_SHARD = 5
SUBFLAVORS = {"sample_type": "packed_chat_mix", "source": "src"}


def text_record(key: str) -> dict:
    """A one-child text record of the consumer's packed_chat_mix layout."""
    return {"id": key, "sample_type": "packed_chat_mix", "sample_ids": [f"src/{key}"], "lengths": [20],
            "messages": [{"messages": [{"role": "user", "content": "Hi."}, {"role": "assistant", "content": "Hello."}]}],
            "media_files": [[]], "media_keys": [[]], "media_type": "text",
            "_meta": {"pack_id": key, "sample_ids": [f"src/{key}"], "token_lens": [20], "total_token_len": 20}}


def write_shard(path: Path, keys: list[str]) -> Path:
    """A small tar of `<key>.json` records, as the packer writes them."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with tarfile.open(path, "w", format=tarfile.USTAR_FORMAT) as tar:
        for key in keys:
            data = json.dumps(text_record(key)).encode()
            member = tarfile.TarInfo(f"{key}.json")
            member.size = len(data)
            tar.addfile(member, io.BytesIO(data))
    return path


def write_shards(root: Path) -> tuple[list[Path], list[str]]:
    """Every source's shards under `root`; returns shards and record ids."""
    shards, ids = [], []
    for source, count in SHARDS.items():
        for number in range(count):
            keys = [f"{source}-{number}-{index}" for index in range(PER_SHARD)]
            shards.append(write_shard(root / source / f"pretrain-{number:06d}.tar", keys))
            ids += keys
    return shards, ids


def write_numbered_shards(root: Path, numbers: range) -> list[Path]:
    """One source's shards `numbers`, shard n holding n + 1 records."""
    return [write_shard(root / f"pretrain-{n:06d}.tar", [f"s-{n}-{i}" for i in range(n + 1)]) for n in numbers]


def metadata_bytes(root: Path) -> dict[str, bytes]:
    """Every file Energon reads besides the shards: .nv-meta/* and the .tar.idx files."""
    files = [path for path in (root / ".nv-meta").rglob("*") if path.is_file()] + list(root.rglob("*.tar.idx"))
    return {path.relative_to(root).as_posix(): path.read_bytes() for path in files}


def staging_dirs(root: Path) -> list[str]:
    return sorted(path.name for path in root.glob(f"{STAGING_PREFIX}*"))


def test_identical_shards_give_byte_identical_metadata_in_any_root_with_any_workers(tmp_path):
    first_root, second_root = tmp_path / "first", tmp_path / "second" / "packed_wds"
    first_shards, ids = write_shards(first_root)
    second_shards, _ = write_shards(second_root)

    first = prepare_energon_dataset(first_root, first_shards, SUBFLAVORS, workers=1)
    second = prepare_energon_dataset(second_root, second_shards, SUBFLAVORS, workers=4)

    reference = metadata_bytes(first_root)
    assert sorted(reference) == sorted(
        [f".nv-meta/{name}" for name in (".info.json", "dataset.yaml", "index.sqlite", "index.uuid", "split.yaml")]
        + [f"{path.relative_to(first_root).as_posix()}.idx" for path in first_shards]
    )
    assert metadata_bytes(second_root) == reference
    assert uuid.UUID(reference[".nv-meta/index.uuid"].decode()).version == 5
    assert first.sample_count == second.sample_count == len(ids)
    assert sorted(load_all_ids(second_root)) == sorted(ids)

    # A re-prepare over existing metadata swaps in the same bytes and leaves nothing behind.
    prepare_energon_dataset(first_root, first_shards, SUBFLAVORS, workers=2)
    assert metadata_bytes(first_root) == reference
    assert staging_dirs(first_root) == staging_dirs(second_root) == []


def test_changed_shards_change_the_index_uuid(tmp_path):
    shards, _ = write_shards(tmp_path)
    prepare_energon_dataset(tmp_path, shards, SUBFLAVORS)
    before = (tmp_path / ".nv-meta" / "index.uuid").read_bytes()
    prepare_energon_dataset(tmp_path, shards[:-1], SUBFLAVORS)
    assert (tmp_path / ".nv-meta" / "index.uuid").read_bytes() != before


def test_appended_shards_are_indexed_alone_and_the_metadata_equals_a_full_prepare(tmp_path):
    grown, reference_root = tmp_path / "grown", tmp_path / "reference"
    first = prepare_energon_dataset(grown, write_numbered_shards(grown, range(3)), SUBFLAVORS)
    assert first.kept_shards == 0 and first.read_in_full == "no earlier prepare recorded"
    old_indexes = {path: path.stat().st_mtime_ns for path in grown.glob("*.tar.idx")}

    write_numbered_shards(grown, range(3, 5))
    extended = prepare_energon_dataset(grown, sorted(grown.glob("*.tar")), SUBFLAVORS, previous=first.record)
    full = prepare_energon_dataset(reference_root, write_numbered_shards(reference_root, range(5)), SUBFLAVORS)

    assert (extended.kept_shards, extended.record.kept_samples, extended.record.extends) == (3, 1 + 2 + 3, first.record.index_uuid)
    assert metadata_bytes(grown) == metadata_bytes(reference_root)
    assert extended.sample_count == full.sample_count == 15
    assert {path: path.stat().st_mtime_ns for path in old_indexes} == old_indexes
    every_id = [f"s-{n}-{i}" for n in range(5) for i in range(n + 1)]
    assert sorted(load_all_ids(grown)) == sorted(every_id)
    assert load_all_ids(grown, start=extended.record.kept_samples) == every_id[6:]


def test_entries_are_read_again_when_the_indexed_shards_or_metadata_changed(tmp_path):
    shards = write_numbered_shards(tmp_path, range(2))
    first = prepare_energon_dataset(tmp_path, shards, SUBFLAVORS)
    shards += write_numbered_shards(tmp_path, range(2, 3))

    same = prepare_energon_dataset(tmp_path, shards[:2], SUBFLAVORS, previous=first.record)
    assert same.read_in_full == "the shards are not the indexed ones followed by new ones"
    fewer = prepare_energon_dataset(tmp_path, shards[:1], SUBFLAVORS, previous=first.record)
    assert fewer.read_in_full == "the shards are not the indexed ones followed by new ones"
    # The metadata in place is now `fewer`'s, not the one `first` recorded.
    stale = prepare_energon_dataset(tmp_path, shards, SUBFLAVORS, previous=first.record)
    assert stale.read_in_full == "the Energon metadata in place is not the one last recorded"

    os.utime(shards[0], ns=(0, 0))
    rewritten = prepare_energon_dataset(tmp_path, [*shards, *write_numbered_shards(tmp_path, range(3, 4))],
                                        SUBFLAVORS, previous=stale.record)
    assert (rewritten.kept_shards, rewritten.read_in_full) == (0, "pretrain-000000.tar changed since it was indexed")
    assert rewritten.sample_count == 1 + 2 + 3 + 4


LOADER_AND_PREPARER = textwrap.dedent(
    """
    import sys
    from pathlib import Path
    from vlm_assets.packing.energon import prepare_energon_dataset

    root = Path(sys.argv[1])
    shards = sorted(root.glob("src_*/pretrain-*.tar"))
    for _ in range(int(sys.argv[2])):
        prepare_energon_dataset(root, shards, {"sample_type": "packed_chat_mix"}, workers=2)
    """
)


def test_loads_and_prepares_running_alongside_a_re_preparing_process_never_fail(tmp_path):
    root = tmp_path / "packed_wds"
    shards, ids = write_shards(root)
    prepare_energon_dataset(root, shards, SUBFLAVORS)
    reference = metadata_bytes(root)

    other = subprocess.Popen(
        [sys.executable, "-c", LOADER_AND_PREPARER, str(root), "6"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    rounds = 0
    try:
        while other.poll() is None or rounds < 2:
            assert sorted(load_all_ids(root)) == sorted(ids)
            prepare_energon_dataset(root, shards, SUBFLAVORS, workers=3)
            rounds += 1
    finally:
        output, _ = other.communicate(timeout=120)
    assert other.returncode == 0, output
    assert metadata_bytes(root) == reference
    assert staging_dirs(root) == []


def test_stale_staging_of_a_dead_writer_is_removed_and_a_live_ones_kept(tmp_path):
    shards, _ = write_shards(tmp_path)
    finished = subprocess.Popen(["true"])
    finished.wait()
    host = socket.gethostname()
    dead = tmp_path / f"{STAGING_PREFIX}{host}-{finished.pid}-0a1b2c3d"
    live = tmp_path / f"{STAGING_PREFIX}{host}-{os.getpid()}-0a1b2c3d"
    elsewhere = tmp_path / f"{STAGING_PREFIX}other-host-{finished.pid}-0a1b2c3d"
    for directory in (dead, live, elsewhere):
        (directory / ".nv-meta").mkdir(parents=True)
        (directory / ".nv-meta" / "index.sqlite").write_bytes(b"half written")

    prepare_energon_dataset(tmp_path, shards, SUBFLAVORS)

    assert staging_dirs(tmp_path) == sorted([live.name, elsewhere.name])


def test_a_failed_prepare_keeps_the_published_metadata_and_cleans_up(tmp_path):
    shards, ids = write_shards(tmp_path)
    prepare_energon_dataset(tmp_path, shards, SUBFLAVORS)
    reference = metadata_bytes(tmp_path)
    empty = tmp_path / "src_c" / "pretrain-000000.tar"
    empty.parent.mkdir()
    tarfile.open(empty, "w").close()

    # One worker: with two, Energon's pool may wait forever for the other worker, whose results it stopped
    # reading at the failure (the worker cannot exit with them still queued), a hang seen in CI.
    with pytest.raises(AssertionError, match="has no samples"):
        prepare_energon_dataset(tmp_path, [*shards, empty], SUBFLAVORS, workers=1)

    assert metadata_bytes(tmp_path) == reference
    assert staging_dirs(tmp_path) == []
    assert sorted(load_all_ids(tmp_path)) == sorted(ids)


def test_the_file_names_we_spell_out_are_energons():
    """The prepare module names Energon's files itself (importing Energon costs seconds); they must match."""
    from megatron.energon import CrudeWebdataset
    from megatron.energon.flavors.webdataset import config
    from megatron.energon.flavors.webdataset.itar import ITAR_SUFFIX

    from vlm_assets.packing import energon

    assert (energon.MAIN_FOLDER_NAME, energon.INDEX_SQLITE_FILENAME, energon.INDEX_UUID_FILENAME,
            energon.INFO_JSON_FILENAME, energon.SPLIT_YAML_FILENAME, energon.ITAR_SUFFIX, energon.DATASET_CLASS) == (
        config.MAIN_FOLDER_NAME, config.INDEX_SQLITE_FILENAME, config.INDEX_UUID_FILENAME,
        config.INFO_JSON_FILENAME, config.SPLIT_YAML_FILENAME, ITAR_SUFFIX, CrudeWebdataset.__name__)
