"""Chunked steps on a Ray cluster of several nodes on this machine (vlm_assets_tests.ray_support): the
chunks become Ray tasks on the worker nodes, the outputs are the one-machine build's bytes, and a node
lost mid-step costs its tasks only, which run again on another node."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import time
from pathlib import Path

import dagster as dg
import pytest
import yaml

from vlm_assets.parallel import RAY_ADDRESS_ENV_VAR, STEP_PROCESSES_ENV_VAR, ordered_map
from vlm_assets_tests.ray_support import (
    LOOPBACK,
    LoopbackRayCluster,
    TaskWatch,
    chunk_on_node,
    fail_on_three,
    set_up,
    write_mixed_source,
)
from vlm_assets_tests.run_support import RUN_TIMEOUT_S, run, start_run

pytestmark = pytest.mark.processes

# Over two length chunks of 4,096 rows (each two store entries of 2,048: two Ray tasks) and two dozen
# catalogue chunks.
SOURCE_ROWS = 6000
CATALOGUE_TASK = "ray::vlm_assets.catalog.build._checked_chunk"
LENGTHS_TASK = "ray::vlm_assets.tokens.table._measure_rows"
SIGNATURES_TASK = "ray::vlm_assets.dedup.signatures._sign_rows"


@pytest.fixture(scope="module")
def cluster():
    import ray

    with LoopbackRayCluster(workers=2) as cluster:
        yield cluster
        ray.shutdown()  # this process joined it in the ordered_map tests


@pytest.fixture(scope="module")
def manifest(tmp_path_factory) -> Path:
    return write_mixed_source(tmp_path_factory.mktemp("inputs"), SOURCE_ROWS)


def _site(folder: Path, manifest: Path) -> Path:
    folder.mkdir()
    config = folder / "vlm_assets.yaml"
    config.write_text(yaml.safe_dump({
        "storage": {"root": str(folder / "vlm_data")},
        "sources": [{"name": "mixed", "kind": "jsonl", "path": str(manifest), "media_root": str(manifest.parent),
                     "chunk_rows": 4096}],
    }))
    return config


def _outputs(config: Path) -> dict[str, str]:
    """sha256 of every output the packed shards are built from and of the shards, by path under the root."""
    root = config.parent / "vlm_data"
    paths = [root / "catalog/mixed.parquet", root / "dedup/mixed.signatures.parquet", root / "dedup/mixed.parquet",
             root / "lengths/mixed.parquet", root / "packing/mixed.bins.parquet",
             root / "packing/mixed.rejects.parquet", root / "packed_json/mixed.jsonl",
             *sorted((root / "packed_wds/mixed").glob("*.tar"))]
    return {str(path.relative_to(root)): hashlib.sha256(path.read_bytes()).hexdigest() for path in paths if path.exists()}


SHARDS = ("--select", "packed_wds_shards", "--workers", "2")


@pytest.fixture(scope="module")
def one_machine(manifest, tmp_path_factory) -> dict[str, str]:
    config = _site(tmp_path_factory.mktemp("one_machine") / "site", manifest)
    result = run(config, config.parent / "home", *SHARDS)
    assert result.returncode == 0, result.stdout[-3000:]
    return _outputs(config)


def test_chunks_become_ray_tasks_on_every_worker_node_results_in_input_order(cluster, monkeypatch):
    monkeypatch.setenv(RAY_ADDRESS_ENV_VAR, cluster.address)
    chunks = [(number, 0.3 if number % 3 == 0 else 0.05) for number in range(24)]
    results = list(ordered_map(chunk_on_node, chunks, 2, set_up, ("model",)))
    assert [number for number, _node, _setup in results] == list(range(24))
    assert len({node for _number, node, _setup in results}) == 2  # both worker nodes took chunks
    # Each task's process was set up once for this call before its first chunk, not once per chunk.
    assert all(setup == ["model"] for _number, _node, setup in results)


def test_a_chunks_error_fails_the_map_as_itself_naming_the_node(cluster, monkeypatch):
    monkeypatch.setenv(RAY_ADDRESS_ENV_VAR, cluster.address)
    with pytest.raises(FileNotFoundError, match="chunk 3: no such file") as raised:
        list(ordered_map(fail_on_three, range(8), 2))
    assert any(f"in a Ray task on node {LOOPBACK}" in note for note in raised.value.__notes__)


def test_a_source_built_on_the_cluster_gives_the_one_machine_bytes(cluster, manifest, one_machine, tmp_path):
    config = _site(tmp_path / "site", manifest)
    with TaskWatch(cluster) as watch:
        result = run(config, config.parent / "home", *SHARDS, "--executor", "ray", "--address", cluster.address)
    assert result.returncode == 0, result.stdout[-3000:]
    assert "Ray cluster: 2 CPU(s)" in result.stdout
    assert _outputs(config) == one_machine
    # The catalogue's, the signatures' and the lengths' chunks ran on both worker nodes, none on the head (no CPUs).
    for node in (1, 2):
        assert {CATALOGUE_TASK, SIGNATURES_TASK, LENGTHS_TASK} <= watch.seen[node], watch.seen
    assert not any(title in watch.seen[0] for title in (CATALOGUE_TASK, SIGNATURES_TASK, LENGTHS_TASK))
    # Dagster stays the control plane: the runs and their materialisations are on the instance.
    with dg.DagsterInstance.from_config(str(config.parent / "home")) as instance:
        for asset in ("sample_catalog", "sample_dedup", "sample_lengths", "packed_wds_shards"):
            assert instance.get_latest_materialization_event(dg.AssetKey(asset)) is not None


def test_a_run_dagster_launches_itself_sends_its_chunks_to_the_cluster_its_environment_names(
        cluster, manifest, one_machine, tmp_path):
    """Not only `vlm-assets run`: a run Dagster executes from its own command (as the daemon's runs and the UI's
    Materialize do, in a process that inherits the environment) takes $VLM_ASSETS_RAY_ADDRESS too."""
    config = _site(tmp_path / "site", manifest)
    home = config.parent / "home"
    home.mkdir()
    with dg.DagsterInstance.from_config(str(home)) as instance:
        instance.add_dynamic_partitions("sources", ["mixed"])
    env = {**os.environ, "DAGSTER_HOME": str(home), "VLM_ASSETS_CONFIG": str(config),
           RAY_ADDRESS_ENV_VAR: cluster.address, STEP_PROCESSES_ENV_VAR: "2"}
    with TaskWatch(cluster) as watch:
        result = subprocess.run(
            [str(Path(sys.executable).with_name("dagster")), "asset", "materialize", "-m", "vlm_assets.definitions",
             "--select", "sample_catalog", "--partition", "mixed"],
            cwd=tmp_path, env=env, capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
    assert result.returncode == 0, (result.stdout + result.stderr)[-3000:]
    for node in (1, 2):
        assert CATALOGUE_TASK in watch.seen[node], watch.seen
    assert _outputs(config) == {"catalog/mixed.parquet": one_machine["catalog/mixed.parquet"]}


def test_a_node_lost_mid_step_costs_only_its_tasks_which_run_again_elsewhere(manifest, one_machine, tmp_path):
    config = _site(tmp_path / "site", manifest)
    with LoopbackRayCluster(workers=2) as cluster:
        process = start_run(config, config.parent / "home", "--select", "sample_lengths", "--workers", "2",
                            "--executor", "ray", "--address", cluster.address)
        try:
            watch = TaskWatch(cluster)
            deadline = time.monotonic() + RUN_TIMEOUT_S
            while not watch.running(1, LENGTHS_TASK):
                assert process.poll() is None and time.monotonic() < deadline, "no length chunk ran on worker node 1"
                time.sleep(0.02)
            cluster.kill(cluster.nodes[1])
            with TaskWatch(cluster) as after:
                output, _ = process.communicate(timeout=RUN_TIMEOUT_S)
        except BaseException:
            process.kill()
            raise
    assert process.returncode == 0, output[-3000:]
    assert "0 failed run(s)" in output
    assert LENGTHS_TASK in after.seen[2]  # the lost node's chunk ran again on the other one
    # Nothing lost, nothing twice: the catalogue and the length table are the one-machine build's, byte for byte.
    built = _outputs(config)
    assert set(built) == {"catalog/mixed.parquet", "dedup/mixed.signatures.parquet", "dedup/mixed.parquet",
                          "lengths/mixed.parquet"}
    assert all(built[path] == one_machine[path] for path in built)


def test_an_address_without_the_ray_executor_is_refused_before_anything_starts(tmp_path, manifest):
    config = _site(tmp_path / "site", manifest)
    result = run(config, config.parent / "home", "--address", "127.0.0.2:6379")
    assert result.returncode == 2
    assert "error: --address names a Ray cluster: it goes with --executor ray" in result.stdout
    assert not (config.parent / "home").exists()
