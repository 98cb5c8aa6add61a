"""The instance's PostgreSQL unreachable, at start and mid-run: one line naming it and the cause, exit code 3.

Each test uses a throwaway PostgreSQL cluster of its own (initdb + pg_ctl on a free loopback port,
trust auth), so stopping it touches no other test's server. The binaries come from Debian's
`postgresql` (/usr/lib/postgresql/*/bin); without them the tests are skipped, except under CI=true
where that is a failure.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import dagster as dg
import pytest
import yaml

from vlm_assets.cli import EXIT_INSTANCE_UNREACHABLE, TRACEBACK_ENV_VAR
from vlm_assets.orchestration.home import POSTGRES_HOST_ENV
from vlm_assets.orchestration.outage import as_outage
from vlm_assets_tests.run_support import run, site_config

pytestmark = [pytest.mark.services, pytest.mark.processes]

psycopg2 = pytest.importorskip("psycopg2")

PASSWORD = "never-print-me"  # trust auth ignores it; it must still appear nowhere in the output
DATABASE = "dagster"
SELECTION = "sample_lengths"  # with its upstream sample_catalog: two runs, the second in flight when the server goes
OUTAGE_EXIT_BOUND_S = 90  # Dagster retries a connection for about 12 s; the CLI looks at the instance every 5 s


class ThrowawayPostgres:
    """A cluster in its own directory; as root its programs run as the `postgres` user, as initdb demands."""

    def __init__(self, bin_dir: Path, directory: Path) -> None:
        self.bin_dir, self.directory = bin_dir, directory
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            self.port = probe.getsockname()[1]
        self._as_owner("initdb", "-D", str(directory / "data"), "-U", "postgres", "--auth=trust")

    def _as_owner(self, program: str, *args: str) -> None:
        prefix = ["runuser", "-u", "postgres", "--"] if os.geteuid() == 0 else []
        subprocess.run([*prefix, str(self.bin_dir / program), *args], check=True, capture_output=True, timeout=120)

    def start(self) -> None:
        self._as_owner("pg_ctl", "-D", str(self.directory / "data"), "-l", str(self.directory / "log"), "-w",
                       "-t", "60", "-o", f"-c listen_addresses=127.0.0.1 -p {self.port} -k {self.directory}", "start")

    def stop(self) -> None:
        self._as_owner("pg_ctl", "-D", str(self.directory / "data"), "-m", "fast", "-w", "stop")


def _unavailable(reason: str) -> None:
    if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
        pytest.fail(f"CI is set but {reason}")
    pytest.skip(reason)


@pytest.fixture
def postgres(monkeypatch):
    """A running throwaway cluster with an empty DATABASE; the product's VLM_ASSETS_PG_* point at it."""
    initdbs = sorted(Path("/usr/lib/postgresql").glob("*/bin/initdb"),
                     key=lambda path: [int(part) for part in path.parts[-3].split(".") if part.isdigit()])
    if not initdbs:
        _unavailable("no PostgreSQL binaries in /usr/lib/postgresql/*/bin (Debian's `postgresql` package)")
    if os.geteuid() == 0 and shutil.which("runuser") is None:
        _unavailable("running as root, initdb needs `runuser` to run as the postgres user")
    # Not under pytest's tmp_path: as root that lies in a directory only root may enter, and the
    # cluster's files belong to the postgres user.
    directory = Path(tempfile.mkdtemp(prefix="vlm-assets-outage-pg-"))
    if os.geteuid() == 0:
        shutil.chown(directory, "postgres")
    server = ThrowawayPostgres(initdbs[-1].parent, directory)
    server.start()
    try:
        admin = psycopg2.connect(host="127.0.0.1", port=server.port, user="postgres", dbname="postgres")
        admin.autocommit = True
        admin.cursor().execute(f'CREATE DATABASE "{DATABASE}"')
        admin.close()
        for name, value in ((POSTGRES_HOST_ENV, "127.0.0.1"), ("VLM_ASSETS_PG_PORT", str(server.port)),
                            ("VLM_ASSETS_PG_USER", "postgres"), ("VLM_ASSETS_PG_PASSWORD", PASSWORD),
                            ("VLM_ASSETS_PG_DB", DATABASE)):
            monkeypatch.setenv(name, value)
        monkeypatch.delenv(TRACEBACK_ENV_VAR, raising=False)
        yield server
    finally:
        try:
            server.stop()
        except subprocess.CalledProcessError:
            pass  # already stopped by the test
        shutil.rmtree(directory, ignore_errors=True)


@pytest.fixture
def tiny_config(demo_config_path, tmp_path) -> Path:
    """The demo's image source alone: the smallest graph that still has two runs in a row."""
    config = site_config(demo_config_path, tmp_path / "site")
    raw = yaml.safe_load(config.read_text())
    raw["sources"] = [source for source in raw["sources"] if source["kind"] == "flat_dir"][:1]
    config.write_text(yaml.safe_dump(raw, sort_keys=False))
    return config


def _outage_line(server: ThrowawayPostgres, home: Path) -> str:
    return f"PostgreSQL 127.0.0.1:{server.port}/{DATABASE} (DAGSTER_HOME={home}) is unreachable: "


def _assert_one_outage_line(stderr: str, server: ThrowawayPostgres, home: Path) -> None:
    last = stderr.rstrip().splitlines()[-1]
    assert last.startswith("error: ") and _outage_line(server, home) in last, stderr[-3000:]
    # libpq's own words for a server that is down, that stops, or that went while a query was in flight.
    reasons = ("connection refused", "terminating connection", "server closed the connection unexpectedly")
    assert any(reason in last.lower() for reason in reasons), last


def _vlm_assets_run(config: Path, home: Path, *args: str, env: dict[str, str] | None = None) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "vlm_assets.cli", "run", "--config", str(config), "--select", SELECTION, *args],
        env={**os.environ, "DAGSTER_HOME": str(home), "PYTHONUNBUFFERED": "1", **(env or {})},
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
    )


def test_server_down_at_start_is_one_line_and_its_own_exit_code(postgres, tiny_config, tmp_path):
    home = tmp_path / "home"
    postgres.stop()

    started = time.monotonic()
    stdout, stderr = _vlm_assets_run(tiny_config, home).communicate(timeout=120)
    assert time.monotonic() - started < 30  # no waiting out Dagster's retries in every process
    assert stderr.count("\n") == 1, stderr
    _assert_one_outage_line(stderr, postgres, home)
    assert "Traceback" not in stdout + stderr and PASSWORD not in stdout + stderr

    process = _vlm_assets_run(tiny_config, home, env={TRACEBACK_ENV_VAR: "1"})
    stdout, stderr = process.communicate(timeout=120)
    assert process.returncode == EXIT_INSTANCE_UNREACHABLE
    assert "Traceback" in stderr and "psycopg2.OperationalError" in stderr
    _assert_one_outage_line(stderr, postgres, home)


def test_server_lost_mid_run_exits_in_bounded_time_and_the_rerun_completes(postgres, tiny_config, tmp_path):
    home = tmp_path / "home"
    process = _vlm_assets_run(tiny_config, home)
    stderr_lines: list[str] = []
    drain = threading.Thread(target=lambda: stderr_lines.extend(process.stderr), daemon=True)
    drain.start()
    stdout_lines = []
    for line in process.stdout:
        stdout_lines.append(line)
        if "✓" in line:
            break
    assert any("✓ materialised sample_catalog" in line for line in stdout_lines), "".join(stdout_lines + stderr_lines)

    postgres.stop()  # and it stays down until the CLI has given up
    stopped = time.monotonic()
    try:
        process.wait(timeout=OUTAGE_EXIT_BOUND_S)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, 9)
        raise AssertionError(f"vlm-assets run still running {OUTAGE_EXIT_BOUND_S} s into the outage") from None
    outage_s = time.monotonic() - stopped
    stdout_lines += process.stdout.readlines()
    drain.join(timeout=10)
    stdout, stderr = "".join(stdout_lines), "".join(stderr_lines)
    assert process.returncode == EXIT_INSTANCE_UNREACHABLE, stdout + stderr
    _assert_one_outage_line(stderr, postgres, home)
    assert "Traceback" not in stdout + stderr and PASSWORD not in stdout + stderr
    print(f"vlm-assets run exited {outage_s:.1f} s after PostgreSQL stopped")

    postgres.start()
    rerun = run(tiny_config, home, "--select", SELECTION, timeout=300)
    assert rerun.returncode == 0, rerun.stdout[-4000:]
    with dg.DagsterInstance.from_config(str(home)) as instance:
        for asset in ("sample_catalog", SELECTION):
            assert instance.get_materialized_partitions(dg.AssetKey(asset)) == {"demo_images"}, asset
        assert not instance.get_runs(filters=dg.RunsFilter(statuses=[dg.DagsterRunStatus.STARTED]))
    assert (tmp_path / "site" / "vlm_data" / "lengths" / "demo_images.parquet").is_file()


def test_an_error_from_a_worker_without_its_chain_is_named_by_asking_the_server(postgres, tmp_path):
    from dagster_postgres.utils import DagsterPostgresException

    home = tmp_path / "home"
    home.mkdir()
    # A user-owned dagster.yaml with the URL form: the line names host, port and database, not the password.
    url = f"postgresql+psycopg2://postgres:{PASSWORD}@127.0.0.1:{postgres.port}/{DATABASE}"
    (home / "dagster.yaml").write_text(yaml.safe_dump({"storage": {"postgres": {"postgres_url": url}}}))
    postgres.stop()

    # What a worker process's error looks like here: pickled, its driver error left behind.
    outage = as_outage(DagsterPostgresException("too many retries for DB connection"), home)
    assert outage is not None and _outage_line(postgres, home) in str(outage)
    assert "connection refused" in str(outage).lower() and PASSWORD not in str(outage)
    assert as_outage(ValueError("not a database problem"), home) is None
