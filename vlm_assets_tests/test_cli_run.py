import json
import os
import re
import subprocess
import sys
import tarfile
from collections import Counter
from pathlib import Path

import dagster as dg
import pandas as pd
import pytest

from vlm_assets.catalog.table import reason_kind
from vlm_assets_tests.run_support import site_config

pytestmark = pytest.mark.processes


def vlm_assets(*args: str, env: dict | None = None, cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "vlm_assets.cli", *args], capture_output=True, text=True,
                          env={**os.environ, **(env or {})}, cwd=cwd, timeout=600)


def test_run_materialises_the_whole_demo_graph_through_the_instance(reference_run):
    config, home, root = reference_run.config, reference_run.home, reference_run.root
    assert "0 failed run(s), 0 failed check(s)" in reference_run.result.stdout
    warned = reference_run.result.stdout.count("FAILED (WARN)")
    assert f"{warned} check warning(s)" in reference_run.result.stdout
    for source in ("demo_images", "demo_video", "demo_wds"):
        catalog = pd.read_parquet(root / "catalog" / f"{source}.parquet")
        bins = pd.read_parquet(root / "packing" / f"{source}.bins.parquet")
        rejects = pd.read_parquet(root / "packing" / f"{source}.rejects.parquet")
        packed = {sample for ids in bins.sample_ids for sample in ids}
        assert packed | set(rejects.sample_id) == set(catalog.sample_id)
        assert not packed & set(rejects.sample_id)
        assert list((root / "packed_wds" / source).glob("pretrain-*.tar"))
        assert (root / "packed_wds" / source / ".nv-meta" / "dataset.yaml").exists()
    assert (root / "packed_wds" / "metadataset.yaml").exists()
    index = [json.loads(line) for line in (root / "frame_cache" / "384" / "64" / "index.jsonl").read_text().splitlines()]
    assert {row["video"] for row in index} == {
        "demo_video/clips/bouncing.mp4", "demo_video/clips/sweep.mkv", "demo_video/clips/no_extension"}
    package = root / "packages" / "demo_run.nnpkg.zst"
    assert package.read_bytes()[:4] == b"\x28\xb5\x2f\xfd"
    # The runs are on the real instance in $DAGSTER_HOME, where `dagster dev` shows them.
    with dg.DagsterInstance.from_config(str(home)) as instance:
        assert instance.get_latest_materialization_event(dg.AssetKey("training_package")) is not None
        assert set(instance.get_dynamic_partitions("sources")) == {"demo_images", "demo_video", "demo_wds"}
    rerun = vlm_assets("run", "--config", str(config), "--select", "packed_wds_shards", env={"DAGSTER_HOME": str(home)})
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    assert "frame_cache_shard" not in rerun.stdout
    with tarfile.open(next((root / "packed_wds" / "demo_wds").glob("pretrain-*.tar"))) as shard:
        assert all(member.mtime == 0 and member.uid == 0 for member in shard.getmembers())


# The demo's small sources cannot fill their 8,192-token bins: packing_bins' fill_ratio check warns.
FILL_RATIO_WARNING = re.compile(
    r"^  ✗ check packing_bins:fill_ratio FAILED \(WARN\)(?P<when>.*?): (?P<finding>fill ratio \d\.\d\d \([\d,]+ tokens "
    r"in \d+ bins? of sample\.max_token_len [\d,]+\), below packing\.min_fill_ratio [\d.]+; .+)$", re.MULTILINE)


def test_a_warning_says_what_it_found_and_what_to_do_and_an_unchanged_rerun_says_it_again(reference_run):
    first = reference_run.result.stdout
    found = [match["finding"] for match in FILL_RATIO_WARNING.finditer(first)]
    assert found and first.count("FAILED (WARN)") == len(found), first
    assert all("lower packing.min_fill_ratio" in finding for finding in found)
    assert sorted(line.split("): ", 1)[1] for line in first.splitlines() if line.startswith("  WARNING:")) == sorted(found)
    rerun = vlm_assets("run", "--config", str(reference_run.config), "--select", "packing_bins",
                       env={"DAGSTER_HOME": str(reference_run.home)})
    assert rerun.returncode == 0, rerun.stdout[-3000:] + rerun.stderr[-3000:]
    assert "▶" not in rerun.stdout, "everything is up to date"
    again = list(FILL_RATIO_WARNING.finditer(rerun.stdout))
    assert sorted(match["finding"] for match in again) == sorted(found)
    assert {match["when"] for match in again} == {" in its last build"}
    assert f"{len(found)} check warning(s)" in rerun.stdout
    assert sorted(line.split("): ", 1)[1] for line in rerun.stderr.splitlines() if "WARNING:" in line) == sorted(found)


SOURCE_LINE = re.compile(r"^  (?P<source>\w+): (?P<packed>\d+) packed, (?P<rejected>\d+) rejected(?:: (?P<reasons>.+))?$")


def samples_by_source(stdout: str) -> dict[str, re.Match]:
    lines = stdout.splitlines()
    start = next(number for number, line in enumerate(lines) if line.startswith("samples by source, "))
    matches = [SOURCE_LINE.match(line) for line in lines[start + 1:]]
    return {match["source"]: match for match in matches[:matches.index(None)] if match}


def test_the_summary_counts_each_source_packed_and_rejected_with_its_commonest_reasons(reference_run):
    counted = samples_by_source(reference_run.result.stdout)
    assert set(counted) == {"demo_images", "demo_video", "demo_wds"}
    for source, line in counted.items():
        bins = pd.read_parquet(reference_run.root / "packing" / f"{source}.bins.parquet")
        rejects = pd.read_parquet(reference_run.root / "packing" / f"{source}.rejects.parquet")
        assert int(line["packed"]) == sum(len(ids) for ids in bins.sample_ids)
        assert int(line["rejected"]) == len(rejects) > 0
        # The commonest first; what is not named is counted, so every rejected sample is in the line.
        reasons = line["reasons"]
        commonest = Counter(map(reason_kind, rejects.reason)).most_common(1)[0][1]
        assert reasons.startswith(f"{commonest} × "), reasons
        named = sum(int(count) for count in re.findall(r"(?:^|; )(\d+) × ", reasons))
        more = re.search(r"; \d+ more reasons? \((\d+) samples?\)$", reasons)
        assert named + (int(more[1]) if more else 0) == len(rejects), reasons
    # A summary that packs nothing counts them still, as they were last packed.
    rerun = vlm_assets("run", "--config", str(reference_run.config), "--select", "sample_catalog",
                       env={"DAGSTER_HOME": str(reference_run.home)})
    assert rerun.returncode == 0, rerun.stdout[-3000:] + rerun.stderr[-3000:]
    assert {source: line[0] for source, line in samples_by_source(rerun.stdout).items()} == {
        source: line[0] for source, line in counted.items()}


def test_run_with_a_bad_config_names_the_key_and_exits_non_zero(tmp_path):
    config = tmp_path / "bad.yaml"
    config.write_text("sample: {max_token_len: -3}\n")
    result = vlm_assets("run", "--config", str(config), env={"DAGSTER_HOME": str(tmp_path / "home")})
    assert result.returncode == 2
    assert "sample.max_token_len" in result.stderr and str(config) in result.stderr


def test_run_with_an_unknown_selection_is_a_clear_error(demo_config_path, tmp_path):
    config = site_config(demo_config_path, tmp_path)
    result = vlm_assets("run", "--config", str(config), "--select", "no_such_asset",
                        env={"DAGSTER_HOME": str(tmp_path / "home")})
    assert result.returncode == 2
    assert "unknown asset key(s): no_such_asset" in result.stderr


def test_run_refuses_fewer_than_one_worker_and_its_help_lists_assets_and_exit_codes(tmp_path):
    for workers in ("0", "-1"):
        result = vlm_assets("run", "--config", str(tmp_path / "absent.yaml"), "--workers", workers)
        assert result.returncode == 2 and f"--workers: expected a whole number ≥ 1, got '{workers}'" in result.stderr
    usage = vlm_assets("run", "--help").stdout.replace("\n", " ")
    assert "sample_catalog, sample_dedup, sample_length_chunk, sample_lengths" in usage and "training_package" in usage
    assert "3 the Dagster instance's database is unreachable" in usage.replace("  ", " ")


def test_run_selects_one_partition_and_refuses_an_unknown_one(demo_config_path, tmp_path):
    config = site_config(demo_config_path, tmp_path)
    home = {"DAGSTER_HOME": str(tmp_path / "home")}
    result = vlm_assets("run", "--config", str(config), "--select", "sample_lengths[demo_wds]", env=home)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    launched = sorted(line.split(" ", 1)[1].split(" on ")[0] for line in result.stdout.splitlines() if line.startswith("▶ "))
    # Its dedup compares it with the other sources' samples: their catalogues are built too.
    assert launched == ["sample_catalog [demo_images]", "sample_catalog [demo_video]", "sample_catalog [demo_wds]",
                        "sample_dedup [demo_wds]", "sample_length_chunk [00000|demo_wds]", "sample_lengths [demo_wds]"]
    unknown = vlm_assets("run", "--config", str(config), "--select", "sample_lengths[nope]", env=home)
    assert unknown.returncode == 2
    assert "no such partition: sample_lengths [nope] (known: demo_images, demo_video, demo_wds)" in unknown.stderr
