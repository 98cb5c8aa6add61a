"""The CLI's answers to what goes wrong around it: a mistyped option, a reader that stops early, a damaged
package, a misspelt selection, a full disk. Each is one clear line (or none) and the exit code its help names."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from vlm_assets.package import write_package
from vlm_assets_tests.run_support import site_config, skip_without_mount_namespace
from vlm_assets_tests.test_package import CREATED_AT, make_dataset, make_spec

pytestmark = pytest.mark.processes

CLI = [sys.executable, "-m", "vlm_assets.cli"]


def vlm_assets(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=600)


@pytest.fixture
def package(tmp_path: Path) -> Path:
    make_dataset(tmp_path / "storage")
    return write_package(make_spec(tmp_path / "storage", "zstd"), tmp_path / "run", created_at=CREATED_AT).path


@pytest.mark.parametrize(("args", "expected"), [
    (["run", "--workers", "abc"], "--workers: expected a whole number ≥ 1, got 'abc'"),
    (["run", "--workers", "0"], "--workers: expected a whole number ≥ 1, got '0'"),
    (["package", "pack", "--threads", "-1"], "--threads: expected a whole number ≥ 0, got '-1'"),
    (["package", "pack", "--level", "high"], "--level: expected a whole number, got 'high'"),
    (["worker", "--concurrency", "many"], "--concurrency: expected a whole number ≥ 1, got 'many'"),
])
def test_a_count_option_given_something_else_says_what_it_expects(args, expected):
    result = vlm_assets(*args)
    assert result.returncode == 2
    assert expected in result.stderr and "invalid" not in result.stderr


@pytest.mark.parametrize("command", ["list", "info", "verify"])
def test_a_reader_that_stops_early_ends_the_command_quietly(package, command):
    process = subprocess.Popen([*CLI, "package", command, str(package)], stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True)
    process.stdout.close()  # as `| head -1` does once it has its line
    _, errors = process.communicate(timeout=600)
    assert errors.strip() == "" or errors.startswith("verified"), errors  # verify's progress line is its own
    assert "Broken pipe" not in errors and "Traceback" not in errors
    assert process.returncode == 128 + signal.SIGPIPE


def test_verify_of_a_damaged_package_exits_with_the_code_its_help_names(package):
    data = bytearray(package.read_bytes())
    data[len(data) // 2:] = bytes(len(data) - len(data) // 2)  # the zstd stream cannot be decoded past here
    package.write_bytes(bytes(data))
    result = vlm_assets("package", "verify", str(package))
    assert result.returncode == 1, result.stderr
    assert result.stderr.strip().splitlines()[-1].startswith(f"error: {package}")
    usage = vlm_assets("package", "verify", "--help").stdout.replace("\n", " ")
    assert "1 a file mismatches, is missing or unexpected, or the package cannot be read" in " ".join(usage.split())
    assert vlm_assets("package", "verify").returncode == 2


def test_a_misspelt_selection_is_refused_before_any_worker_starts(demo_config_path, tmp_path):
    config = site_config(demo_config_path, tmp_path / "site")
    home = tmp_path / "home"
    result = vlm_assets("run", "--config", str(config), "--dagster-home", str(home), "--select", "sample_lenghts")
    assert result.returncode == 2
    assert result.stderr.strip().startswith("error: unknown asset key(s): sample_lenghts (known: ")
    assert "worker output" not in result.stdout
    assert not home.exists(), "no instance, no worker log for a usage error"


FULL_DISK_WRITES = """
import io, json, os, sys, tarfile
from pathlib import Path
from vlm_assets.media.checks import MediaCheckLog
from vlm_assets.packing.energon import prepare_energon_dataset

full = Path(sys.argv[1])
if sys.argv[2] == "catalogue":
    log = MediaCheckLog(full / "demo.media_checks.sqlite")
    for number in range(100_000):
        log.record_pass(f"/media/{number:08d}.jpg" + "x" * 200, "1:2:3")
    log.close()
else:
    root = full / "packed"
    root.mkdir()
    with tarfile.open(root / "pretrain-000000.tar", "w") as tar:
        for number in range(60):
            data = json.dumps({"id": number}).encode()
            member = tarfile.TarInfo(f"{number:06d}.json")
            member.size = len(data)
            tar.addfile(member, io.BytesIO(data))
    filler = full / "filler"
    try:
        with open(filler, "wb") as handle:
            while True:
                handle.write(bytes(4096))
                handle.flush()
    except OSError:
        pass
    # Room for the prepare's folders and links, none for its index.
    os.truncate(filler, filler.stat().st_size - 8192)
    prepare_energon_dataset(root, [root / "pretrain-000000.tar"], {}, workers=1)
"""


@pytest.mark.parametrize("writer", ["catalogue", "energon"])
def test_a_full_disk_under_sqlite_names_the_file_being_written(tmp_path, writer):
    skip_without_mount_namespace()
    full = tmp_path / "full"
    full.mkdir()
    script = tmp_path / "writes.py"
    script.write_text(FULL_DISK_WRITES)
    command = (f"mount -t tmpfs -o size=256k tmpfs {full} && "
               f"exec {subprocess.list2cmdline([sys.executable, str(script), str(full), writer])}")
    result = subprocess.run(["unshare", "--user", "--map-root-user", "--mount", "sh", "-c", command],
                            capture_output=True, text=True, timeout=600, env=os.environ)
    assert result.returncode != 0
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith(f"OSError: [Errno 28] No space left on device: '{full}/"), result.stderr[-3000:]
    assert "disk is full" not in last
