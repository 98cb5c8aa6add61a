"""Sources and outputs on S3-compatible storage, on a real object store on loopback (SeaweedFS, started
here unless $VLM_ASSETS_TEST_S3_ENDPOINT names one, as `.ci/run` does: vlm_assets_tests/s3_support.py)."""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import dagster as dg
import pandas as pd
import pytest
import yaml

from vlm_assets.media.refs import pinned_object_ref, read_media_bytes
from vlm_assets.config import ConfigError, load_config
from vlm_assets.defs.catalog.assets import sample_catalog, sample_lengths
from vlm_assets.defs.packing.assets import packed_json, packed_wds_shards, packing_bins
from vlm_assets.defs.resources import SOURCES_PARTITIONS, HFProcessor, VlmConfig
from vlm_assets.catalog.source_walk import walk_source
from vlm_assets.layout import OWNER_NAME, StorageLayout
from vlm_assets.object_store import (
    MULTIPART_BYTES, REQUESTS, STORE_READ_TIMEOUT_ENV_VAR, ObjectURL, client, head, list_objects, read_object, read_range,
    read_start, store_read_timeout_s,
)
from vlm_assets.root_owner import StorageRootTaken, claim_object_root
from vlm_assets_tests.run_support import RUN_TIMEOUT_S, start_run
from vlm_assets_tests.s3_support import CREDENTIALS, ENDPOINT_ENV_VAR, free_port, seaweedfs, wait_until_ready

@pytest.fixture(scope="session")
def s3_endpoint(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    if os.environ.get(ENDPOINT_ENV_VAR):
        wait_until_ready(os.environ[ENDPOINT_ENV_VAR])
        yield os.environ[ENDPOINT_ENV_VAR]
        return
    folder = tmp_path_factory.mktemp("s3")
    with seaweedfs(folder / "data", folder / "weed.log") as server:
        yield server.endpoint


@pytest.fixture
def bucket(s3_endpoint: str, monkeypatch: pytest.MonkeyPatch) -> str:
    """A fresh bucket, with the standard AWS variables alone pointing the product at the server."""
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3_endpoint)
    for name, value in CREDENTIALS.items():
        monkeypatch.setenv(name, value)
    name = f"vlm-{uuid.uuid4().hex[:12]}"
    client().create_bucket(Bucket=name)
    return name


def _upload(folder: Path, bucket: str, prefix: str) -> None:
    for path in sorted(folder.rglob("*")):
        if path.is_file():
            client().upload_file(str(path), bucket, f"{prefix}/{path.relative_to(folder).as_posix()}")


def test_urls_stay_below_their_prefix():
    root = ObjectURL.parse("s3://data/vlm/media")
    assert str(root.child("a/b.jpg")) == "s3://data/vlm/media/a/b.jpg"
    assert root.child("a/../b.jpg") == ObjectURL("data", "vlm/media/b.jpg")
    for hostile in ("../other/x.jpg", "../../../../x.jpg", "/etc/passwd", "a/../../x.jpg", "x\x00.jpg"):
        assert root.child(hostile) is None, hostile
    assert not root.contains(ObjectURL("data", "vlm/media-other/x.jpg"))
    assert not root.contains(ObjectURL("other-bucket", "vlm/media/x.jpg"))


def test_a_listing_is_paged(bucket):
    prefix = ObjectURL(bucket, "many")
    for index in range(1500):
        client().put_object(Bucket=bucket, Key=f"many/{index:05d}.jpg", Body=b"x")
    before = REQUESTS["list"]
    keys = [info.url.key for info in list_objects(prefix)]
    assert keys == [f"many/{index:05d}.jpg" for index in range(1500)]
    assert REQUESTS["list"] - before == 2  # 1,000 keys per page


def test_reads_tell_a_missing_object_from_a_missing_bucket_and_a_changed_version_from_the_one_pinned(bucket):
    url = ObjectURL(bucket, "media/a.jpg")
    client().put_object(Bucket=bucket, Key=url.key, Body=b"0123456789")
    info, start = read_start(url, 4)
    assert start == b"0123"
    assert info == head(url)  # the facts a GET gives are those a HEAD gives: fingerprints agree
    assert read_start(ObjectURL(bucket, "media/missing.jpg"), 4) is None
    client().put_object(Bucket=bucket, Key="media/empty.jpg", Body=b"")
    assert read_start(ObjectURL(bucket, "media/empty.jpg"), 4)[1] == b""
    assert read_range(url, 2, 3, if_match=info.etag) == b"234"
    assert read_object(url, if_match=info.etag) == b"0123456789"
    client().put_object(Bucket=bucket, Key=url.key, Body=b"replaced")
    with pytest.raises(OSError, match=f"{url} changed after it was catalogued"):
        read_range(url, 0, 3, if_match=info.etag)
    with pytest.raises(OSError, match="cannot read bytes 0-3: HTTP 404 NoSuchBucket"):
        read_start(ObjectURL(f"{bucket}-gone", "a.jpg"), 4)
    with pytest.raises(OSError, match="cannot read it: HTTP 404 NoSuchKey"):
        read_object(ObjectURL(bucket, "media/missing.jpg"))


def test_a_source_in_a_missing_bucket_is_one_line_naming_the_bucket_and_the_endpoint(tmp_path, bucket, s3_endpoint):
    gone = f"{bucket}-gone"
    config = _config(tmp_path, "gone", f"s3://{gone}/vlm/captions.jsonl", f"s3://{gone}/vlm/media")
    result = subprocess.run([sys.executable, "-m", "vlm_assets.cli", "run", "--config", str(config), "--workers", "1",
                             "--dagster-home", str(tmp_path / "home")], capture_output=True, text=True, timeout=600)
    assert result.returncode == 1, result.stdout[-2000:] + result.stderr[-2000:]
    assert "Traceback" not in result.stderr and len(result.stderr.strip().splitlines()) == 1, result.stderr[-3000:]
    assert f"bucket '{gone}' does not exist on {s3_endpoint}; create it first" in result.stderr


def _stored_on(tmp_path: Path, root: str) -> Path:
    """The config of a local source whose storage root is `root` on object storage, its working copy in tmp_path."""
    record = {"messages": [{"role": "user", "content": "Hi?"}, {"role": "assistant", "content": "Hello."}]}
    (tmp_path / "talk.jsonl").write_text(json.dumps(record) + "\n")
    config = tmp_path / "vlm_assets.yaml"
    config.write_text(yaml.safe_dump({"storage": {"root": root, "work_dir": str(tmp_path / "work")},
                                      "sources": [{"name": "talk", "kind": "jsonl", "path": "talk.jsonl"}]}))
    return config


def test_a_failed_read_names_the_object_without_the_signature_it_was_read_with(monkeypatch, caplog):
    """A read that fails after its retries (here: a server that drops every connection at once) is one
    error naming the object and the endpoint; the signed address urllib3 quotes in its own error would
    hand a valid signature to every log the message reaches."""
    import socket
    import threading

    from vlm_assets.object_store import ObjectURL, read_range

    listener = socket.create_server(("127.0.0.1", 0))
    endpoint = f"http://127.0.0.1:{listener.getsockname()[1]}"

    def drop_every_connection() -> None:
        while True:
            try:
                connection, _ = listener.accept()
            except OSError:
                return  # closed: the test is over
            connection.close()

    threading.Thread(target=drop_every_connection, daemon=True).start()
    for name, value in {**CREDENTIALS, "AWS_ENDPOINT_URL": endpoint}.items():
        monkeypatch.setenv(name, value)
    failure: list[BaseException] = []

    def read() -> None:  # in a thread of its own: a thread's store client is made from the environment once
        try:
            read_range(ObjectURL("b", "media/a.jpg"), 0, 16)
        except OSError as error:
            failure.append(error)

    reader = threading.Thread(target=read)
    reader.start()
    reader.join(timeout=60)
    listener.close()
    [error] = failure
    assert str(error).startswith(f"s3://b/media/a.jpg: cannot read bytes 0-15 (endpoint {endpoint}): "), error
    assert "Signature" not in str(error) and "X-Amz" not in str(error), error
    retries = [record.getMessage() for record in caplog.records if record.name == "urllib3.connectionpool"]
    assert retries and not any("Signature" in message for message in retries), retries


@pytest.mark.processes
def test_a_store_down_when_a_run_starts_is_one_line_naming_its_endpoint(tmp_path, monkeypatch):
    endpoint = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    monkeypatch.setenv("AWS_ENDPOINT_URL", endpoint)
    for name, value in CREDENTIALS.items():
        monkeypatch.setenv(name, value)
    config = _stored_on(tmp_path, "s3://down/out")
    for plan in ([], ["--plan"]):
        result = subprocess.run([sys.executable, "-m", "vlm_assets.cli", "run", "--config", str(config), "--workers", "1",
                                 "--dagster-home", str(tmp_path / "home"), *plan], capture_output=True, text=True, timeout=600)
        assert result.returncode == 1, result.stdout[-2000:] + result.stderr[-3000:]
        assert result.stderr.strip().splitlines() == [
            f"error: store unreachable at {endpoint}: Connection refused (s3://down/out/{OWNER_NAME}: cannot read it)"
        ], result.stderr[-3000:]


@pytest.mark.processes
def test_a_store_lost_as_a_run_starts_is_named_in_the_runs_summary(tmp_path, monkeypatch):
    with seaweedfs(tmp_path / "s3", tmp_path / "weed.log") as server:
        monkeypatch.setenv("AWS_ENDPOINT_URL", server.endpoint)
        for name, value in CREDENTIALS.items():
            monkeypatch.setenv(name, value)
        import boto3

        boto3.client("s3", endpoint_url=server.endpoint).create_bucket(Bucket="lost")
        process = start_run(_stored_on(tmp_path, "s3://lost/out"), tmp_path / "home", "--workers", "1")
        output = ""
        for line in process.stdout:
            output += line
            if line.startswith("▶ sample_catalog"):
                # Gone once the run has claimed the root, before (or as) its first step opens it.
                os.kill(server.pid, signal.SIGKILL)
                break
        output += process.communicate(timeout=RUN_TIMEOUT_S)[0]
    assert process.returncode == 1, output[-3000:]
    failed = re.search(r"^  FAILED: sample_catalog \[talk\]: (.*)$", output, re.MULTILINE)
    assert failed and failed.group(1).startswith(f"store unreachable at {server.endpoint}: "), output[-3000:]


def _config(tmp_path: Path, name: str, path: str, media_root: str | None, kind: str = "jsonl", **extra) -> Path:
    source = {"name": "clips", "kind": kind, "path": path, **({"media_root": media_root} if media_root else {}), **extra}
    config = {"storage": {"root": str(tmp_path / name / "out")}, "inbox": str(tmp_path / name / "inbox"),
              "sources": [source],
              "sample": {"max_token_len": 8192}, "packing": {"min_fill_ratio": 0.2}, "wds": {"maxcount": 4}}
    target = tmp_path / name / "vlm_assets.yaml"
    target.parent.mkdir(parents=True)
    target.write_text(yaml.safe_dump(config))
    return target


def _build_packed_shards(config: Path) -> dg.ExecuteInProcessResult:
    vlm_config = VlmConfig(config_path=str(config))
    instance = dg.DagsterInstance.ephemeral()
    instance.add_dynamic_partitions(SOURCES_PARTITIONS.name, ["clips"])
    result = dg.materialize(
        [sample_catalog, sample_lengths, packing_bins, packed_json, packed_wds_shards], partition_key="clips",
        instance=instance, resources={"vlm_config": vlm_config, "hf_processor": HFProcessor(vlm_config=vlm_config)},
    )
    assert result.success
    return result


def _hostile_records() -> list[dict]:
    ask = [{"role": "user", "content": "<image>What is this?"}, {"role": "assistant", "content": "A still."}]
    return [{"id": f"hostile-{index}", "messages": ask, "images": [name]} for index, name in enumerate(
        ["../../secret/key.jpg", "/etc/passwd", "s3://another-bucket/x.jpg", "stills/../../../outside.jpg"])]


def test_a_jsonl_source_on_object_storage_packs_as_the_same_source_on_disk(demo_config_path, tmp_path, bucket):
    demo = demo_config_path.parent
    local = tmp_path / "local_source"
    shutil.copytree(demo / "media", local / "media")
    lines = (demo / "video_train.jsonl").read_text().splitlines()
    lines += [json.dumps(record) for record in _hostile_records()]
    (local / "train.jsonl").write_text("\n".join(lines) + "\n")
    _upload(local, bucket, "vlm/clips")
    client().put_object(Bucket=bucket, Key="vlm/secret/key.jpg", Body=(local / "media/stills/frame_still.jpg").read_bytes())

    on_disk = _config(tmp_path, "disk", str(local / "train.jsonl"), str(local / "media"))
    on_store = _config(tmp_path, "store", f"s3://{bucket}/vlm/clips/train.jsonl", f"s3://{bucket}/vlm/clips/media")
    _build_packed_shards(on_disk)
    requests_before = sum(REQUESTS.values())
    result = _build_packed_shards(on_store)
    assert sum(REQUESTS.values()) > requests_before  # read through the S3 API, not from a local copy

    disk, store = StorageLayout(tmp_path / "disk/out"), StorageLayout(tmp_path / "store/out")
    assert store.packed_json("clips").read_bytes() == disk.packed_json("clips").read_bytes()
    disk_shards = sorted(disk.packed_wds("clips").glob("*.tar"))
    assert disk_shards and [path.read_bytes() for path in disk_shards] == [
        (store.packed_wds("clips") / path.name).read_bytes() for path in disk_shards]
    # The same bins; each sample's content hash takes its media's stamps, which are the store's own.
    assert (pd.read_parquet(store.bins("clips")).drop(columns="content_hashes")
            .equals(pd.read_parquet(disk.bins("clips")).drop(columns="content_hashes")))

    catalog = pd.read_parquet(store.catalog("clips")).set_index("sample_id")
    reasons = catalog.reason.to_dict()
    for index in range(4):
        assert "escapes the source" in reasons[f"clips/hostile-{index}"] or "absolute path" in reasons[f"clips/hostile-{index}"]
    assert "outside" in reasons["clips/hostile-0"] and f"s3://{bucket}/vlm/clips/media" in reasons["clips/hostile-0"]
    assert f"missing media: 'clips/missing.mp4' not found (looked in s3://{bucket}/vlm/clips/media)" in reasons["clips/v5"]
    secrets = {os.environ["AWS_ACCESS_KEY_ID"], os.environ["AWS_SECRET_ACCESS_KEY"]}
    for event in result.all_events:
        assert not any(secret in str(event) for secret in secrets)


def test_a_wds_source_on_object_storage_is_read_in_place_and_packs_as_on_disk(demo_config_path, tmp_path, bucket):
    shards = demo_config_path.parent / "wds"
    _upload(shards, bucket, "shards")
    _build_packed_shards(_config(tmp_path, "disk", str(shards), None, kind="wds"))
    gets = REQUESTS["get"]
    _build_packed_shards(_config(tmp_path, "store", f"s3://{bucket}/shards", None, kind="wds"))
    assert REQUESTS["get"] > gets
    disk, store = StorageLayout(tmp_path / "disk/out"), StorageLayout(tmp_path / "store/out")
    assert store.packed_json("clips").read_bytes() == disk.packed_json("clips").read_bytes()
    disk_shards = sorted(disk.packed_wds("clips").glob("*.tar"))
    assert disk_shards and [path.read_bytes() for path in disk_shards] == [
        (store.packed_wds("clips") / path.name).read_bytes() for path in disk_shards]
    catalog = pd.read_parquet(store.catalog("clips"))
    refs = [ref for refs in catalog.media_refs for ref in refs]
    assert refs and all(ref.startswith("tar:") and f":s3://{bucket}/shards/" in ref for ref in refs)
    assert (catalog.status == "rejected").sum() == (pd.read_parquet(disk.catalog("clips")).status == "rejected").sum()


def test_a_flat_dir_source_on_object_storage_packs_as_on_disk_and_its_records_stay_below_its_prefix(
        demo_config_path, tmp_path, bucket):
    folder = tmp_path / "flat"
    shutil.copytree(demo_config_path.parent / "flat", folder)
    ask = [{"role": "user", "content": "<image>What is this?"}, {"role": "assistant", "content": "A still."}]
    (folder / "zz_escape.json").write_text(json.dumps({"messages": ask, "images": ["../secret/key.jpg"]}))
    _upload(folder, bucket, "data/flat")
    client().put_object(Bucket=bucket, Key="data/secret/key.jpg", Body=b"not to be read")
    _build_packed_shards(_config(tmp_path, "disk", str(folder), None, kind="flat_dir"))
    _build_packed_shards(_config(tmp_path, "store", f"s3://{bucket}/data/flat", None, kind="flat_dir"))
    disk, store = StorageLayout(tmp_path / "disk/out"), StorageLayout(tmp_path / "store/out")
    assert store.packed_json("clips").read_bytes() == disk.packed_json("clips").read_bytes()
    disk_shards = sorted(disk.packed_wds("clips").glob("*.tar"))
    assert disk_shards and [path.read_bytes() for path in disk_shards] == [
        (store.packed_wds("clips") / path.name).read_bytes() for path in disk_shards]
    on_disk = pd.read_parquet(disk.catalog("clips")).set_index("sample_id")
    on_store = pd.read_parquet(store.catalog("clips")).set_index("sample_id")
    assert list(on_store.index) == list(on_disk.index) and list(on_store.status) == list(on_disk.status)
    reason = on_store.reason["clips/zz_escape.json"]
    assert "escapes the source" in reason and f"s3://{bucket}/data/secret/key.jpg" in reason


def test_an_unchanged_source_on_object_storage_is_listed_not_read_and_an_edit_changes_its_digest(tmp_path, bucket):
    for index in range(3):
        client().put_object(Bucket=bucket, Key=f"src/media/{index}.jpg", Body=b"x" * index)
    client().put_object(Bucket=bucket, Key="src/train.jsonl", Body=b"{}\n")
    source = load_config(_config(tmp_path, "walk", f"s3://{bucket}/src/train.jsonl", f"s3://{bucket}/src/media")).sources[0]
    first = walk_source(source, [])
    gets = REQUESTS["get"]
    assert walk_source(source, []) == first and REQUESTS["get"] == gets
    assert first.snapshot[0] == 4  # the manifest and its own media root's three objects
    client().put_object(Bucket=bucket, Key="src/media/1.jpg", Body=b"y")  # same size, new bytes: a new ETag
    assert walk_source(source, []).digest != first.digest


def test_object_storage_settings_are_checked_on_load(tmp_path):
    with pytest.raises(ConfigError, match=r"sources\[0\]\.media_root: .*must all be on object storage"):
        load_config(_config(tmp_path, "mixed", "s3://data/train.jsonl", str(tmp_path)))
    with pytest.raises(ConfigError, match="credentials"):
        load_config(_config(tmp_path, "secret", "s3://key:secret@data/train.jsonl", "s3://key:secret@data/media"))


def test_lines_appended_to_a_manifest_on_object_storage_are_read_alone(demo_config_path, tmp_path, bucket):
    demo = demo_config_path.parent
    _upload(demo / "media", bucket, "clips/media")
    lines = (demo / "video_train.jsonl").read_bytes()
    client().put_object(Bucket=bucket, Key="clips/train.jsonl", Body=lines)
    config = _config(tmp_path, "append", f"s3://{bucket}/clips/train.jsonl", f"s3://{bucket}/clips/media")
    vlm_config = VlmConfig(config_path=str(config))
    instance = dg.DagsterInstance.ephemeral()
    instance.add_dynamic_partitions(SOURCES_PARTITIONS.name, ["clips"])

    def catalogue() -> dict:
        result = dg.materialize([sample_catalog], partition_key="clips", instance=instance,
                                resources={"vlm_config": vlm_config})
        return {key: value.value for key, value in result.asset_materializations_for_node("sample_catalog")[0].metadata.items()
                if key in ("rows_kept", "samples")}

    first = catalogue()
    record = {"id": "v7", "messages": [{"role": "user", "content": "<video>Again?"}, {"role": "assistant", "content": "Yes."}],
              "videos": ["clips/sweep.mkv"]}
    client().put_object(Bucket=bucket, Key="clips/train.jsonl", Body=lines + json.dumps(record).encode() + b"\n")
    second = catalogue()
    assert second["rows_kept"] == first["samples"]
    table = pd.read_parquet(StorageLayout(tmp_path / "append/out").catalog("clips"))
    assert list(table.sample_id)[-1] == "clips/v7" and table.status.iloc[-1] == "ok"


def _objects(bucket: str, prefix: str) -> dict[str, tuple[str, object]]:
    return {info.url.key[len(prefix) + 1:]: (info.etag, info.mtime_ns) for info in list_objects(ObjectURL(bucket, prefix))}


@pytest.mark.processes
def test_the_demo_graph_on_object_storage_publishes_the_reference_run_and_energon_loads_it_from_there(
        demo_config_path, reference_run, tmp_path, bucket):
    """Every source (jsonl, wds and flat_dir) on the S3 server and `storage.root` there too, through two concurrent
    `vlm-assets run`s (two Dagster instances, one working copy)."""
    from vlm_assets.orchestration.worker_output import log_folder
    from vlm_assets_tests.run_support import run, site_config, start_run

    sources = load_config(demo_config_path).sources
    video = next(source for source in sources if source.kind == "jsonl")
    shards = next(source for source in sources if source.kind == "wds")
    folder = next(source for source in sources if source.kind == "flat_dir")
    _upload(Path(folder.path), bucket, "demo/flat")
    _upload(Path(video.media_root), bucket, "demo/media")
    client().upload_file(str(video.path), bucket, "demo/video_train.jsonl")
    _upload(Path(shards.path), bucket, "demo/wds")
    config = site_config(demo_config_path, tmp_path / "site")
    raw = yaml.safe_load(config.read_text())
    raw["storage"] = {"root": f"s3://{bucket}/outputs", "work_dir": str(tmp_path / "site/work")}
    for source in raw["sources"]:
        if source["name"] == video.name:
            source.update(path=f"s3://{bucket}/demo/video_train.jsonl", media_root=f"s3://{bucket}/demo/media")
        if source["name"] == shards.name:
            source.update(path=f"s3://{bucket}/demo/wds", media_root=f"s3://{bucket}/demo/wds")
        if source["name"] == folder.name:
            source.update(path=f"s3://{bucket}/demo/flat", media_root=f"s3://{bucket}/demo/flat")
    config.write_text(yaml.safe_dump(raw, sort_keys=False))
    home = tmp_path / "site/home"

    processes = [start_run(config, each, "--workers", "1") for each in (home, tmp_path / "site/home2")]
    for process in processes:
        output = process.communicate(timeout=900)[0]
        assert process.returncode == 0, output[-4000:]
    published = {key: client().get_object(Bucket=bucket, Key=f"outputs/{key}")["Body"].read()
                 for key in _objects(bucket, "outputs") if key != OWNER_NAME}
    # Every output the reference run wrote under its local root is an object at the same relative key.
    expected = [path for path in reference_run.outputs if path.startswith(
        ("catalog/", "dedup/", "lengths/", "packing/", "packed_json/", "packed_wds/", "frame_cache/", "packages/"))
        and not path.endswith((".media_checks.sqlite", ".read.json"))]
    assert sorted(published) == sorted(expected)
    differing = sorted(key for key in expected if hashlib.sha256(published[key]).hexdigest() != reference_run.outputs[key])
    # What names where the bytes were differs (the sources' catalogues, the keys of their dedup
    # signatures, which take each medium's ref and stamp, and the reasons of their rejected rows,
    # the frame plan and its shards' done records, the package holding those), and the bins'
    # content hashes, which take each medium's stamp (here the store's ETag); everything a trainer
    # reads is the same.
    names = [source.name for source in sources]
    named = tuple(f"{output}/{name}." for name in names for output in ("catalog", "dedup", "lengths"))
    named += tuple(f"packing/{name}.{table}" for name in names for table in ("rejects", "bins"))
    assert all(key.startswith((*named, "packages/")) or key.endswith(("/plan.jsonl", ".done.json"))
               for key in differing), differing
    assert any(key.startswith(f"packed_wds/{video.name}/.nv-meta/") for key in expected)
    logs = "".join(path.read_text(errors="replace") for folder in ("home", "home2")
                   for path in log_folder(tmp_path / "site" / folder).glob("*.log"))
    for source in raw["sources"]:
        assert f"loaded from msc://_s3-{bucket}/outputs/packed_wds/{source['name']}" in logs

    before = _objects(bucket, "outputs")
    again = run(config, home, "--workers", "2")
    assert again.returncode == 0 and " 0 materialisation(s)" in again.stdout, again.stdout[-2000:]
    assert _objects(bucket, "outputs") == before  # an unchanged rerun writes no object


def test_a_storage_root_on_object_storage_is_built_in_a_working_copy_and_owned_by_one_config(tmp_path, bucket,
                                                                                            monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    first = _config(tmp_path, "first", f"s3://{bucket}/src/train.jsonl", f"s3://{bucket}/src/media")
    first.write_text(first.read_text().replace(f"root: {tmp_path}/first/out", f"root: s3://{bucket}/team/out"))
    app = load_config(first)
    assert str(app.storage_url) == f"s3://{bucket}/team/out"
    assert app.storage_root == tmp_path / "cache/vlm-assets/s3" / bucket / "team/out"
    claim_object_root(app.storage_url, app.path)
    claim_object_root(app.storage_url, app.path)  # the owner again: fine
    second = tmp_path / "second.yaml"
    second.write_text(first.read_text())
    with pytest.raises(StorageRootTaken, match=f"belongs to the configuration {first}"):
        claim_object_root(load_config(second).storage_url, second)
    local = _config(tmp_path, "local", f"s3://{bucket}/src/train.jsonl", f"s3://{bucket}/src/media")
    local.write_text(local.read_text().replace("storage:\n", "storage:\n  work_dir: ./work\n"))
    with pytest.raises(ConfigError, match="storage.work_dir: is for a storage.root on object storage"):
        load_config(local)


def test_a_package_on_object_storage_is_extracted_and_trained_from_its_url(tmp_path, bucket):
    from vlm_assets.cli import main
    from vlm_assets.package.writer import write_package
    from vlm_assets_tests.test_package import CREATED_AT, make_dataset, make_spec

    files = make_dataset(tmp_path / "data")
    package = write_package(make_spec(tmp_path / "data", "zstd", train_command="true"), tmp_path / "run",
                            created_at=CREATED_AT).path
    client().upload_file(str(package), bucket, f"out/packages/{package.name}")
    url = f"s3://{bucket}/out/packages/{package.name}"
    gets = REQUESTS["get"]
    assert main(["package", "extract", url, "-o", str(tmp_path / "from_store")]) == 0
    assert main(["package", "extract", str(package), "-o", str(tmp_path / "from_disk")]) == 0
    assert REQUESTS["get"] > gets
    extracted = {path.relative_to(tmp_path / "from_store"): path.read_bytes()
                 for path in (tmp_path / "from_store").rglob("*") if path.is_file()}
    assert extracted == {path.relative_to(tmp_path / "from_disk"): path.read_bytes()
                         for path in (tmp_path / "from_disk").rglob("*") if path.is_file()}
    assert len(extracted) > len(files) // 2
    assert main(["package", "train", url, "--workdir", str(tmp_path / "train")]) == 0
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(yaml.safe_dump({"name": "packed", "compress": "gzip", "data": {
        "packed_wds": str(tmp_path / "data/packed_wds"), "frame_cache": str(tmp_path / "data/frame_cache")}}))
    uploaded = f"s3://{bucket}/out/packages/packed.nnpkg"
    assert main(["package", "pack", str(recipe), "-o", uploaded]) == 0
    assert main(["package", "verify", uploaded]) == 0


def test_publishing_a_folder_mirrors_it_and_uploads_only_what_changed(tmp_path, bucket):
    from vlm_assets.publish import publish

    root = tmp_path / "work"
    folder = root / "packed_wds" / "src"
    (folder / ".nv-meta").mkdir(parents=True)
    for name, data in {"pretrain-000000.tar": b"a" * 100, "pretrain-000001.tar": b"b" * 50,
                       ".nv-meta/dataset.yaml": b"x", "pretrain-000002.tar.tmp": b"half"}.items():
        (folder / name).write_bytes(data)
    url = ObjectURL(bucket, "out")
    first = publish(root, url, [folder])
    assert (first.put, first.unchanged, first.deleted) == (3, 0, 0)  # never another writer's temp file
    assert sorted(_objects(bucket, "out")) == ["packed_wds/src/.nv-meta/dataset.yaml", "packed_wds/src/pretrain-000000.tar",
                                               "packed_wds/src/pretrain-000001.tar"]
    puts = REQUESTS["put"]
    again = publish(root, url, [folder])
    assert (again.put, again.unchanged, again.deleted) == (0, 3, 0) and REQUESTS["put"] == puts
    (folder / "pretrain-000001.tar").unlink()
    (folder / "pretrain-000000.tar").write_bytes(b"c" * 100)
    changed = publish(root, url, [folder])
    assert (changed.put, changed.unchanged, changed.deleted) == (1, 1, 1)
    assert client().get_object(Bucket=bucket, Key="out/packed_wds/src/pretrain-000000.tar")["Body"].read() == b"c" * 100
    client().put_object(Bucket=bucket, Key="out/packed_wds/src/.nv-meta/dataset.yaml", Body=b"edited elsewhere")
    assert publish(root, url, [folder]).put == 1  # the object is not what was uploaded: put again


def test_an_upload_killed_midway_leaves_no_object_visible(tmp_path, bucket):
    """What a step's publish does with a big shard, killed -9 once its multipart upload has begun
    (its parts go up side by side, and a fast store has the whole of them moments later)."""
    big = tmp_path / "pretrain-000000.tar"
    with open(big, "wb") as handle:
        for _ in range(3):
            handle.write(os.urandom(MULTIPART_BYTES))
    uploader = subprocess.Popen([sys.executable, "-c", (
        "import sys; from pathlib import Path; from vlm_assets.object_store import ObjectURL, upload_file; "
        "upload_file(Path(sys.argv[1]), ObjectURL.parse(sys.argv[2]))"), str(big), f"s3://{bucket}/out/{big.name}"])
    try:
        deadline = time.monotonic() + 120
        while not client().list_multipart_uploads(Bucket=bucket).get("Uploads"):
            assert uploader.poll() is None and time.monotonic() < deadline, "the upload ended before it could be killed"
            time.sleep(0.01)
    finally:
        uploader.kill()
        uploader.wait(timeout=30)
    assert head(ObjectURL(bucket, f"out/{big.name}")) is None
    assert _objects(bucket, "out") == {}


def _image_source(folder: Path) -> None:
    """Three images whose facts a name does not give: a portrait by EXIF orientation, a PNG, a JPEG named .png."""
    from PIL import Image

    media = folder / "media"
    media.mkdir(parents=True)
    exif = Image.Exif()
    exif[0x0112] = 6  # stored landscape, shown rotated a quarter turn
    Image.new("RGB", (96, 48), "red").save(media / "portrait.jpg", exif=exif)
    Image.new("RGB", (40, 30), "green").save(media / "plain.png")
    Image.new("RGB", (50, 20), "blue").save(media / "misnamed.png", format="JPEG")
    ask = [{"role": "user", "content": "<image>What colour is it?"}, {"role": "assistant", "content": "One colour."}]
    lines = [json.dumps({"id": name, "messages": ask, "images": [name]})
             for name in ("portrait.jpg", "plain.png", "misnamed.png")]
    (folder / "train.jsonl").write_text("\n".join(lines) + "\n")


def test_object_media_are_pinned_to_the_version_catalogued_and_read_once(tmp_path, bucket):
    _image_source(tmp_path / "source")
    _upload(tmp_path / "source", bucket, "vlm/images")
    config = _config(tmp_path, "store", f"s3://{bucket}/vlm/images/train.jsonl", f"s3://{bucket}/vlm/images/media")
    vlm_config = VlmConfig(config_path=str(config))
    instance = dg.DagsterInstance.ephemeral()
    instance.add_dynamic_partitions(SOURCES_PARTITIONS.name, ["clips"])
    assets = [sample_catalog, sample_lengths, packing_bins, packed_json, packed_wds_shards]

    def requests_of(*steps: dg.AssetsDefinition) -> dict[str, int]:
        before = dict(REQUESTS)
        assert dg.materialize(assets, selection=list(steps), partition_key="clips", instance=instance, resources={
            "vlm_config": vlm_config, "hf_processor": HFProcessor(vlm_config=vlm_config)}).success
        return {kind: REQUESTS[kind] - before.get(kind, 0) for kind in REQUESTS if REQUESTS[kind] != before.get(kind, 0)}

    # The catalogue reads each image once (its check); what it learns goes into the image's ref.
    assert requests_of(sample_catalog)["get"] >= 3
    catalog = pd.read_parquet(StorageLayout(tmp_path / "store/out").catalog("clips")).set_index("sample_id")
    refs = {sample_id.split("/", 1)[1]: refs[0] for sample_id, refs in catalog.media_refs.items()}
    for name, extension, height_width in (("portrait.jpg", "jpg", "96x48"), ("plain.png", "png", "30x40"),
                                          ("misnamed.png", "jpg", "20x50")):
        info = head(ObjectURL(bucket, f"vlm/images/media/{name}"))
        assert refs[name] == f"obj:{info.size}:{info.etag}:{extension}:{height_width}:{info.url}"

    # Lengths, bins and packed JSON learn sizes and extensions from the refs; the shards copy what the
    # catalogue kept of each image, then drop it.
    layout = StorageLayout(tmp_path / "store/out")
    copies = sorted(path for path in layout.media_copies("clips").rglob("*") if path.is_file())
    assert len(copies) == 3
    assert requests_of(sample_lengths, packing_bins, packed_json) == {}
    damaged = bytearray(copies[0].read_bytes())
    damaged[len(damaged) // 2] ^= 0xFF
    copies[0].write_bytes(bytes(damaged))  # as a crash could leave it: that copy is not taken
    assert requests_of(packed_wds_shards) == {"get": 1}
    assert not layout.media_copies("clips").exists()
    first = {path.name: path.read_bytes() for path in layout.packed_wds("clips").glob("*.tar")}
    # Without the copies, shards read the images (those this process does not hold) from the store,
    # and write the same bytes.
    shutil.rmtree(layout.packed_wds("clips"))
    assert set(requests_of(packed_wds_shards)) == {"get"}
    assert {path.name: path.read_bytes() for path in layout.packed_wds("clips").glob("*.tar")} == first

    # An object replaced after it was pinned: reading the pinned version is an error that says so, never the new bytes.
    late = ObjectURL(bucket, "vlm/images/media/late.png")
    client().put_object(Bucket=bucket, Key=late.key, Body=(tmp_path / "source/media/plain.png").read_bytes())
    info = head(late)
    pinned = pinned_object_ref(late, info.size, info.etag)
    client().put_object(Bucket=bucket, Key=late.key, Body=b"\x89PNG\r\n\x1a\n not the same")
    with pytest.raises(OSError, match=r"late\.png changed after it was catalogued"):
        read_media_bytes(pinned)


# STORE_ATTEMPTS × (connect + read timeout) and back-off, plus the CLI's start: with the default 20 s to
# answer, over a minute; with the 3 s set here, well under.
FROZEN_STORE_READ_TIMEOUT_S = "3"
FROZEN_STORE_BOUND_S = 60


@pytest.mark.processes
def test_a_frozen_store_fails_the_run_within_a_bound_naming_its_endpoint(tmp_path):
    import boto3

    with seaweedfs(tmp_path / "s3", tmp_path / "weed.log") as server:
        environment = {**os.environ, "AWS_ENDPOINT_URL": server.endpoint, **CREDENTIALS,
                       STORE_READ_TIMEOUT_ENV_VAR: FROZEN_STORE_READ_TIMEOUT_S}
        store = boto3.client("s3", endpoint_url=server.endpoint, aws_access_key_id=CREDENTIALS["AWS_ACCESS_KEY_ID"],
                             aws_secret_access_key=CREDENTIALS["AWS_SECRET_ACCESS_KEY"],
                             region_name=CREDENTIALS["AWS_DEFAULT_REGION"])
        store.create_bucket(Bucket="frozen")
        record = {"messages": [{"role": "user", "content": "Hi?"}, {"role": "assistant", "content": "Hello."}]}
        store.put_object(Bucket="frozen", Key="vlm/talk.jsonl", Body=json.dumps(record).encode() + b"\n")
        config = _config(tmp_path, "frozen", "s3://frozen/vlm/talk.jsonl", "s3://frozen/vlm")
        os.kill(server.pid, signal.SIGSTOP)  # the store stops answering, its connections left open
        try:
            started = time.monotonic()
            result = subprocess.run([sys.executable, "-m", "vlm_assets.cli", "run", "--config", str(config),
                                     "--workers", "1", "--dagster-home", str(tmp_path / "home")],
                                    capture_output=True, text=True, timeout=600, env=environment)
            took = time.monotonic() - started
        finally:
            os.kill(server.pid, signal.SIGCONT)
    output = result.stdout + result.stderr
    assert result.returncode != 0, output[-3000:]
    assert took < FROZEN_STORE_BOUND_S, (took, output[-3000:])
    assert server.endpoint in output and "Traceback" not in result.stderr, output[-3000:]


def test_the_time_a_store_has_to_answer_is_set_in_the_environment(monkeypatch):
    monkeypatch.delenv(STORE_READ_TIMEOUT_ENV_VAR, raising=False)
    assert store_read_timeout_s() == 20
    monkeypatch.setenv(STORE_READ_TIMEOUT_ENV_VAR, "90")
    assert store_read_timeout_s() == 90
    for wrong in ("0", "-1", "soon"):
        monkeypatch.setenv(STORE_READ_TIMEOUT_ENV_VAR, wrong)
        with pytest.raises(ValueError, match=rf"\$VLM_ASSETS_STORE_READ_TIMEOUT_S must be a positive number of seconds, not '{wrong}'"):
            store_read_timeout_s()


CAPTURED_LOGS_QUERY = """
query ($runId: ID!) { logsForRun(runId: $runId) { __typename ... on EventConnection {
  events { __typename ... on LogsCapturedEvent { fileKey stepKeys } } } } }"""


@pytest.mark.processes
def test_a_steps_captured_logs_are_kept_on_object_storage_and_the_ui_reads_them_from_there(demo_config_path, tmp_path,
                                                                                          bucket, monkeypatch):
    """With $VLM_ASSETS_LOGS_URL set, the instance keeps every step's stdout and stderr in the bucket: a webserver
    that shares nothing with the machine that ran the step but the instance's database shows them."""
    from vlm_assets.orchestration.home import LOGS_URL_ENV
    from vlm_assets_tests.run_support import run
    from vlm_assets_tests.ui_support import Ui, free_port as free_ui_port, start_dagster, stop_group, wait_for

    demo = demo_config_path.parent
    config = _config(tmp_path, "site", str(demo / "video_train.jsonl"), str(demo / "media"))
    home = tmp_path / "site/home"
    monkeypatch.setenv(LOGS_URL_ENV, f"s3://{bucket}/cluster/logs")
    monkeypatch.setenv("TMPDIR", str(tmp_path / "run-tmp"))  # where the run keeps its local copies of the logs
    (tmp_path / "run-tmp").mkdir()
    result = run(config, home, "--select", "sample_catalog", "--workers", "1")
    assert result.returncode == 0, result.stdout[-3000:]
    assert yaml.safe_load((home / "dagster.yaml").read_text())["compute_logs"]["class"] == "S3ComputeLogManager"
    stored = list(_objects(bucket, "cluster/logs"))
    assert stored and all(key.startswith("storage/") for key in stored), stored
    shutil.rmtree(tmp_path / "run-tmp")

    port, log = free_ui_port(), tmp_path / "webserver.log"
    with log.open("w") as out:
        server = start_dagster([str(Path(sys.executable).with_name("dagster-webserver")), "-h", "127.0.0.1",
                                "-p", str(port), "--empty-workspace"],
                               env={**os.environ, "DAGSTER_HOME": str(home), "TMPDIR": str(tmp_path)},
                               stdout=out, stderr=subprocess.STDOUT)
    try:
        ui = Ui(port)
        runs = wait_for("the webserver", 120, lambda: (ui.graphql(
            "{ runsOrError { ... on Runs { results { runId } } } }")["runsOrError"]["results"] or None, "no run"), log)
        captured = {}
        for each in runs:
            events = ui.graphql(CAPTURED_LOGS_QUERY, {"runId": each["runId"]})["logsForRun"]["events"]
            for event in events:
                if event["__typename"] == "LogsCapturedEvent" and "sample_catalog" in event["stepKeys"]:
                    logs = ui.graphql("query ($key: [String!]!) { capturedLogs(logKey: $key) { stdout stderr } }",
                                      {"key": [each["runId"], "compute_logs", event["fileKey"]]})["capturedLogs"]
                    captured[event["fileKey"]] = (logs["stdout"] or "") + (logs["stderr"] or "")
        assert any("cataloguing jsonl source 'clips'" in text and "clips: 5 ok, 1 rejected" in text
                   for text in captured.values()), captured
    finally:
        stop_group(server, 30)


def test_the_projects_own_compute_logs_section_wins_over_the_logs_url(tmp_path, monkeypatch):
    from vlm_assets.orchestration.home import LOGS_URL_ENV, instance_config_text

    monkeypatch.setenv(LOGS_URL_ENV, "s3://team-logs/dagster")
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")
    written = yaml.safe_load(instance_config_text(_settings(tmp_path, {})))["compute_logs"]
    assert written["config"] == {"bucket": "team-logs", "prefix": "dagster", "skip_empty_files": True,
                                 "endpoint_url": {"env": "AWS_ENDPOINT_URL"}}  # the variable's name, not its value
    own = {"module": "dagster.core.storage.local_compute_log_manager", "class": "LocalComputeLogManager",
           "config": {"base_dir": str(tmp_path / "logs")}}
    assert yaml.safe_load(instance_config_text(_settings(tmp_path, {"compute_logs": own})))["compute_logs"] == own


def _settings(tmp_path: Path, settings: dict) -> Path:
    path = tmp_path / f"dagster-{len(settings)}.yaml"
    path.write_text(yaml.safe_dump(settings))
    return path
