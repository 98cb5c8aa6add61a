"""An output built from an upstream that has been rebuilt since is stale, whatever the config says now.

Real processes: `vlm-assets run`, and Dagster's own CLI materialising one asset as the UI's
"Materialize" button does, on one instance.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
import yaml

from vlm_assets_tests.run_support import run

pytestmark = pytest.mark.processes

SOURCE = "talk"


def write_site(site: Path, max_token_len: int) -> Path:
    """A text-only jsonl source whose samples are 20–400 tokens long, and a config over it."""
    site.mkdir(parents=True, exist_ok=True)
    lines = [
        json.dumps({"id": f"s{n}", "messages": [{"role": "user", "content": "word " * (10 + 40 * n)},
                                                 {"role": "assistant", "content": "ok"}]})
        for n in range(10)
    ]
    (site / "talk.jsonl").write_text("\n".join(lines) + "\n")
    return set_max_token_len(site, max_token_len)


def set_max_token_len(site: Path, max_token_len: int) -> Path:
    config = site / "vlm_assets.yaml"
    config.write_text(yaml.safe_dump({
        "storage": {"root": "vlm_data"},
        "sources": [{"name": SOURCE, "kind": "jsonl", "path": "talk.jsonl"}],
        "sample": {"max_token_len": max_token_len},
    }))
    return config


def dagster_materialize(config: Path, home: Path, asset: str, partition: str | None = None) -> subprocess.CompletedProcess:
    dagster = Path(sys.executable).parent / "dagster"
    return subprocess.run(
        [str(dagster), "asset", "materialize", "-m", "vlm_assets.definitions", "--select", asset,
         *(["--partition", partition] if partition else [])],
        env={**os.environ, "DAGSTER_HOME": str(home), "VLM_ASSETS_CONFIG": str(config)},
        capture_output=True, text=True, timeout=600,
    )


def test_a_config_edited_between_two_steps_leaves_no_output_that_a_later_run_calls_up_to_date(tmp_path):
    config, home = write_site(tmp_path / "site", 8192), tmp_path / "home"
    root = tmp_path / "site" / "vlm_data"
    first = run(config, home, "--select", "packing_bins")
    assert first.returncode == 0, first.stdout[-3000:]
    assert len(pd.read_parquet(root / "packing" / f"{SOURCE}.bins.parquet")) == 1  # every sample fits in 8192

    # The edit lands after packing_bins was built and before packed_json starts.
    set_max_token_len(tmp_path / "site", 512)
    step = dagster_materialize(config, home, "packed_json", SOURCE)
    assert step.returncode == 0, step.stdout[-3000:] + step.stderr[-3000:]
    assert len((root / "packed_json" / f"{SOURCE}.jsonl").read_text().splitlines()) == 1  # built from the 8192 bins

    repair = run(config, home, "--select", "packed_json")
    assert repair.returncode == 0, repair.stdout[-3000:]
    assert f"✓ materialised packing_bins [{SOURCE}]" in repair.stdout
    assert f"✓ materialised packed_json [{SOURCE}]" in repair.stdout, repair.stdout
    bins = pd.read_parquet(root / "packing" / f"{SOURCE}.bins.parquet")
    records = (root / "packed_json" / f"{SOURCE}.jsonl").read_text().splitlines()
    assert len(bins) > 1 and len(records) == len(bins)
    assert max(bins.total_len) <= 512

    settled = run(config, home, "--select", "packed_json")
    assert settled.returncode == 0 and "✓ materialised" not in settled.stdout, settled.stdout


def test_a_second_configuration_on_one_storage_root_is_refused_naming_both(tmp_path):
    mine = write_site(tmp_path / "mine", 8192)
    theirs = write_site(tmp_path / "theirs", 8192)
    shared_root = tmp_path / "shared_root"
    for config in (mine, theirs):
        raw = yaml.safe_load(config.read_text())
        config.write_text(yaml.safe_dump({**raw, "storage": {"root": str(shared_root)}}))
    first = run(mine, tmp_path / "home_mine", "--select", "training_mix")
    assert first.returncode == 0, first.stdout[-3000:]
    mix = (shared_root / "packed_wds" / "metadataset.yaml").read_bytes()

    refused = run(theirs, tmp_path / "home_theirs", "--select", "training_mix")
    assert refused.returncode == 2, refused.stdout[-3000:]
    assert f"storage.root {shared_root} belongs to the configuration {mine.resolve()}" in refused.stdout
    assert str(theirs) in refused.stdout and "Traceback" not in refused.stdout
    # The UI's path (a run launched outside `vlm-assets run`) is refused the same way.
    step = dagster_materialize(theirs, tmp_path / "home_theirs", "training_mix")
    assert step.returncode != 0 and f"belongs to the configuration {mine.resolve()}" in step.stdout + step.stderr
    assert (shared_root / "packed_wds" / "metadataset.yaml").read_bytes() == mix

    again = run(mine, tmp_path / "home_mine", "--select", "training_mix")
    assert again.returncode == 0 and "✓ materialised" not in again.stdout, again.stdout[-3000:]
