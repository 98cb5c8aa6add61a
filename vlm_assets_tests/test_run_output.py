"""`vlm-assets run` prints its own lines only: what its workers print goes to a log file under
$DAGSTER_HOME/vlm_assets_logs, and a failed run still says why in one line, naming its log."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import yaml

from vlm_assets.orchestration.worker_output import log_folder
from vlm_assets_tests.run_support import run
from vlm_assets_tests.test_provenance import write_site

pytestmark = pytest.mark.processes

WORKERS_LOG = re.compile(r"^what the worker processes printed \(libraries' own output too\): (\S+)$", re.MULTILINE)
FAILED_LINE = re.compile(r"^  ✗ sample_catalog \[empty\] failed: (.+); full log: (\S+)$", re.MULTILINE)


def test_workers_print_to_the_log_file_and_the_terminal_keeps_the_cli_lines(tmp_path):
    site = tmp_path / "site"
    config = write_site(site, 8192)
    # A second source whose only record is rejected: its catalogue, which left it with no sample, fails.
    (site / "empty.jsonl").write_text(json.dumps({"id": "e1", "no_conversation": True}) + "\n")
    raw = yaml.safe_load(config.read_text())
    raw["sources"].append({"name": "empty", "kind": "jsonl", "path": "empty.jsonl"})
    config.write_text(yaml.safe_dump(raw))
    home = tmp_path / "home"

    result = run(config, home, "--select", "energon_dataset", "--workers", "2")

    terminal = result.stdout  # stdout and stderr together, as a terminal shows them
    assert result.returncode == 1, terminal[-3000:]
    assert "  ✓ materialised energon_dataset [talk]" in terminal
    assert "Saving info" not in terminal and "Collapsing split parts" not in terminal, terminal
    assert " - dagster - " not in terminal and "Stack Trace" not in terminal, terminal
    failed = FAILED_LINE.search(terminal)
    assert failed, terminal[-3000:]
    cause, run_log = failed.group(1), Path(failed.group(2))
    assert cause.startswith("empty: no sample left after its catalogue (1 rejected): 1 × ") and run_log.parent == log_folder(home)

    [workers_log] = log_folder(home).glob("workers-*.log")
    printed = workers_log.read_text()
    assert re.search(r"^Saving info to .*/packed_wds/talk/", printed, re.MULTILINE), printed[-3000:]
    assert " - dagster - INFO - " in printed and "talk: Energon indexed 1 sample" in printed
    assert "no sample left after its catalogue" in printed
    assert WORKERS_LOG.search(run_log.read_text()).group(1) == str(workers_log)


def test_a_rerun_after_its_log_folder_was_removed_succeeds(tmp_path):
    config = write_site(tmp_path / "site", 8192)
    home = tmp_path / "home"
    first = run(config, home, "--select", "sample_catalog", "--workers", "1")
    assert first.returncode == 0, first.stdout[-3000:]
    # Never Dagster's `logs` folder, which its webserver and daemon move away to upload (telemetry).
    assert not (home / "logs").exists()
    shutil.rmtree(log_folder(home))

    rerun = run(config, home, "--select", "sample_catalog", "--workers", "1", "--force")

    assert rerun.returncode == 0, rerun.stdout[-3000:]
    assert "  ✓ materialised sample_catalog [talk]" in rerun.stdout
    [workers_log] = log_folder(home).glob("workers-*.log")
    assert " - dagster - INFO - " in workers_log.read_text()
