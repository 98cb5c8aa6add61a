"""Runs and steps on Celery workers: Redis as broker, the instance in PostgreSQL, two `vlm-assets worker` processes.

Redis is Debian's `redis-server`, started by the test on a free loopback port; PostgreSQL comes from
VLM_ASSETS_TEST_PG_* (`.ci/run` starts one; the test creates and drops its own database). Without
either the test is skipped, except under CI=true where that is a failure.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import dagster as dg
import pytest
import redis

from vlm_assets.orchestration.home import POSTGRES_HOST_ENV
from vlm_assets.defs.tags import LAUNCHED_BY_CLI, LAUNCHED_BY_TAG
from vlm_assets.defs.executor import CELERY_BROKER_ENV
from vlm_assets.orchestration.celery_runs import LOST_AFTER_ENV_VAR, answering_workers
from vlm_assets_tests.pg_support import pg_server
from vlm_assets_tests.run_support import (
    differences, initialised_home, run, site_config, snapshot, start_run, wait_for_started_run,
)

pytestmark = [pytest.mark.services, pytest.mark.processes]

psycopg2 = pytest.importorskip("psycopg2")

REPO = Path(__file__).resolve().parents[1]
STARTUP_TIMEOUT_S = 120
STOP_TIMEOUT_S = 60
# Events a step emits while it executes (engine events about a step come from the run's process too).
STEP_EVENTS = {dg.DagsterEventType.STEP_START, dg.DagsterEventType.ASSET_MATERIALIZATION,
               dg.DagsterEventType.ASSET_CHECK_EVALUATION, dg.DagsterEventType.STEP_SUCCESS}


def _unavailable(reason: str) -> None:
    if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
        pytest.fail(f"CI is set but {reason}")
    pytest.skip(reason)


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _stop(process: subprocess.Popen) -> None:
    """SIGTERM (a Celery worker's warm shutdown), then SIGKILL to its whole session if it lingers."""
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[str]:
    """redis://127.0.0.1:PORT of a fresh redis-server, stopped afterwards (append /DB to use it)."""
    server = shutil.which("redis-server")
    if server is None:
        _unavailable("redis-server is not installed (Debian package redis-server; .ci/run installs it)")
    port = _free_port()
    process = subprocess.Popen(
        [server, "--bind", "127.0.0.1", "--port", str(port), "--save", "", "--appendonly", "no", "--dir", str(tmp_path)],
        stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT, start_new_session=True,
    )
    try:
        client = redis.Redis(host="127.0.0.1", port=port)
        deadline = time.monotonic() + 30
        while True:
            try:
                client.ping()
                break
            except redis.ConnectionError:
                if process.poll() is not None or time.monotonic() > deadline:
                    raise AssertionError(f"redis-server on port {port} did not start (exit code {process.poll()})")
                time.sleep(0.1)
        yield f"redis://127.0.0.1:{port}"
    finally:
        _stop(process)


@pytest.fixture
def postgres_env() -> Iterator[dict[str, str]]:
    """VLM_ASSETS_PG_* naming a fresh database on the test server, dropped afterwards."""
    server = pg_server()
    try:
        admin = psycopg2.connect(dbname="postgres", connect_timeout=5, **server)
    except psycopg2.OperationalError as error:
        _unavailable(f"no PostgreSQL server reachable at {server['user']}@{server['host']}:{server['port']} "
                     f"(set VLM_ASSETS_TEST_PG_*; .ci/run starts one): {error}")
    name = f"vlm_assets_celery_{uuid.uuid4().hex[:10]}"
    admin.autocommit = True
    admin.cursor().execute(f'CREATE DATABASE "{name}"')
    try:
        yield {POSTGRES_HOST_ENV: str(server["host"]), "VLM_ASSETS_PG_PORT": str(server["port"]),
               "VLM_ASSETS_PG_USER": str(server["user"]), "VLM_ASSETS_PG_PASSWORD": str(server["password"]),
               "VLM_ASSETS_PG_DB": name}
    finally:
        admin.cursor().execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        admin.close()


def start_worker(config: Path, workdir: Path) -> subprocess.Popen:
    """`vlm-assets worker` in its own directory and Dagster home, as on another machine.

    PYTHONPATH: outside the checkout, `-m vlm_assets.cli` would import the package the virtualenv's
    editable install points at, which in a second git worktree is another checkout's code.
    """
    workdir.mkdir(parents=True, exist_ok=True)
    return subprocess.Popen(
        [sys.executable, "-m", "vlm_assets.cli", "worker", "--config", str(config), "--concurrency", "1"],
        cwd=workdir, env={**os.environ, "DAGSTER_HOME": str(workdir / "home"), "PYTHONUNBUFFERED": "1",
                          "PYTHONPATH": os.pathsep.join(filter(None, (str(REPO), os.environ.get("PYTHONPATH"))))},
        stdout=(workdir / "worker.log").open("w"), stderr=subprocess.STDOUT, start_new_session=True,
    )


def wait_for_workers(broker: str, workers: list[subprocess.Popen], logs: list[Path]) -> list[str]:
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while time.monotonic() < deadline:
        for worker, log in zip(workers, logs):
            if worker.poll() is not None:
                raise AssertionError(f"worker exited with {worker.returncode}:\n{log.read_text()[-3000:]}")
        names = answering_workers(broker)
        if len(names) == len(workers):
            return names
    raise AssertionError(f"{len(workers)} workers did not answer within {STARTUP_TIMEOUT_S} s")


def pool_processes(worker_pid: int) -> set[int]:
    """The Celery pool processes (children) of a running worker."""
    children = Path(f"/proc/{worker_pid}/task/{worker_pid}/children").read_text().split()
    return {int(pid) for pid in children}


def step_executions(instance: dg.DagsterInstance) -> list[tuple[str, str, bool, int, set[int]]]:
    """Per step of every run: (run id, step, launched by the CLI?, run pid, pids of the step's events)."""
    executions = []
    for record in instance.get_run_records():
        run = record.dagster_run
        run_pid, pids = None, {}
        for entry in instance.all_logs(run.run_id):
            event = entry.dagster_event
            if event is None:
                continue
            if event.event_type == dg.DagsterEventType.RUN_START:
                run_pid = event.pid
            elif event.event_type in STEP_EVENTS:
                pids.setdefault(entry.step_key, set()).add(event.pid)
        assert run_pid is not None and pids, f"run {run.run_id} did not start or executed no step"
        by_cli = run.tags.get(LAUNCHED_BY_TAG) == LAUNCHED_BY_CLI
        executions.extend((run.run_id, step, by_cli, run_pid, step_pids) for step, step_pids in pids.items())
    return executions


def test_the_celery_executor_without_a_broker_is_a_clear_error(demo_config_path, tmp_path, monkeypatch):
    monkeypatch.delenv(CELERY_BROKER_ENV, raising=False)
    monkeypatch.delenv(POSTGRES_HOST_ENV, raising=False)
    config = site_config(demo_config_path, tmp_path)
    refused = run(config, tmp_path / "home", "--executor", "celery")
    assert refused.returncode == 2, refused.stdout[-3000:]
    assert f"set {CELERY_BROKER_ENV}" in refused.stdout and "vlm-assets worker" in refused.stdout
    worker = subprocess.run([sys.executable, "-m", "vlm_assets.cli", "worker", "--config", str(config)],
                            capture_output=True, text=True, timeout=120)
    assert worker.returncode == 2 and f"set {CELERY_BROKER_ENV}" in worker.stderr


def test_two_celery_workers_run_every_step_and_write_the_bytes_of_an_in_process_run(
    reference_run, tmp_path, monkeypatch, redis_server, postgres_env
):
    broker = f"{redis_server}/0"
    # The in-process run to compare with: the session's reference run (conftest.reference_run).
    assert "0 failed run(s), 0 failed check(s)" in reference_run.result.stdout
    for name, value in {**postgres_env, CELERY_BROKER_ENV: broker}.items():
        monkeypatch.setenv(name, value)
    site = tmp_path / "celery"
    # The reference run's inputs: catalogues record where each sample's media is, and another pytest-xdist
    # worker may have built the reference from a demo dataset of its own.
    config = site_config(reference_run.config, site)
    home = site / "home"
    workers: list[subprocess.Popen] = []
    try:
        workdirs = [tmp_path / "worker-1", tmp_path / "worker-2"]
        workers = [start_worker(config, workdir) for workdir in workdirs]
        # Meanwhile: a broker no worker listens on (Redis database 1; the workers use 0) is refused up front.
        monkeypatch.setenv(CELERY_BROKER_ENV, f"{redis_server}/1")
        no_workers = run(config, home, "--executor", "celery")
        assert no_workers.returncode == 2 and "no Celery worker answers" in no_workers.stdout, no_workers.stdout[-3000:]
        monkeypatch.setenv(CELERY_BROKER_ENV, broker)
        names = wait_for_workers(broker, workers, [workdir / "worker.log" for workdir in workdirs])

        result = run(config, home, "--executor", "celery", "--workers", "2")
        assert result.returncode == 0, result.stdout[-4000:]
        assert f"steps go to 2 Celery worker(s): {', '.join(names)}" in result.stdout
        # The graph's partitions, a sample_dedup per source among them (test_run_safety counts them up to date).
        assert "30 materialisation(s), 0 up to date, 0 failed run(s), 0 failed check(s)" in result.stdout

        # A run of the code location (as the daemon launches them) goes to the workers as well.
        launched = subprocess.run(
            [str(Path(sys.executable).with_name("dagster")), "asset", "materialize", "-m", "vlm_assets.definitions",
             "--select", "sample_catalog", "--partition", "demo_images"],
            env={**os.environ, "DAGSTER_HOME": str(home), "VLM_ASSETS_CONFIG": str(config)},
            capture_output=True, text=True, timeout=300,
        )
        assert launched.returncode == 0, launched.stdout[-3000:] + launched.stderr[-3000:]

        assert differences(reference_run.outputs, snapshot(site / "vlm_data")) == []

        pools = {f"vlm-assets-{worker.pid}@{socket.gethostname()}": pool_processes(worker.pid) for worker in workers}
        with dg.DagsterInstance.from_config(str(home)) as instance:
            executions = step_executions(instance)
            assert len(instance.get_run_records()) == 31  # the graph's 30 and the one launched like the daemon does
        assert len(executions) >= 25
        used = set()
        for run_id, step, by_cli, run_pid, step_pids in executions:
            worker = next((name for name, pids in pools.items() if step_pids <= pids), None)
            assert worker is not None, f"run {run_id}: step {step} was not executed by a worker ({step_pids}, {pools})"
            used.add(worker)
            # A CLI run is one task: a worker's pool process executes it whole. The daemon-style run
            # is orchestrated where it was launched and only its steps go to the workers.
            assert (run_pid in pools[worker]) == by_cli, (run_id, step, by_cli, run_pid, step_pids, pools)
        assert used == set(pools)  # both workers took runs
    finally:
        for worker in workers:
            _stop(worker)


def test_two_workers_measure_chunks_of_one_source_and_a_killed_ones_chunk_goes_to_the_other(
    tmp_path, monkeypatch, redis_server, postgres_env
):
    broker = f"{redis_server}/0"
    for name, value in {**postgres_env, CELERY_BROKER_ENV: broker, LOST_AFTER_ENV_VAR: "10"}.items():
        monkeypatch.setenv(name, value)
    site = tmp_path / "site"
    site.mkdir()
    # Text only, enough of it that counting a chunk's token lengths lasts a while: 5 chunks of 8,192 rows.
    with (site / "chat.jsonl").open("w") as manifest:
        for index in range(40_000):
            manifest.write(json.dumps({"messages": [
                {"role": "user", "content": f"question {index}: " + "how many words " * (index % 40 + 5)},
                {"role": "assistant", "content": "this many " * (index % 30 + 5)}]}) + "\n")
    config = site / "vlm_assets.yaml"
    config.write_text(f"storage: {{root: {site / 'vlm_data'}}}\n"
                      "sources:\n  - {name: chat, kind: jsonl, path: ./chat.jsonl, chunk_rows: 8192}\n"
                      "model: {processor: embedded}\nsample: {sample_type: packed_multi_mix_qa, max_token_len: 4096}\n")
    home = initialised_home(site / "home")
    workdirs = [tmp_path / "worker-1", tmp_path / "worker-2"]
    workers = [start_worker(config, workdir) for workdir in workdirs]
    cli = None
    try:
        wait_for_workers(broker, workers, [workdir / "worker.log" for workdir in workdirs])
        cli = start_run(config, home, "--executor", "celery", "--workers", "2", "--select", "sample_lengths")
        # The first two chunks start side by side, one on each worker.
        started = [wait_for_started_run(home, "sample_length_chunk", f"0000{index}|chat") for index in (0, 1)]
        with dg.DagsterInstance.from_config(str(home)) as instance:
            run_pids = [next(entry.dagster_event.pid for entry in instance.all_logs(run.run_id)
                             if entry.dagster_event and entry.dagster_event.event_type == dg.DagsterEventType.RUN_START)
                        for run in started]
        executing = [next(worker for worker in workers if pid in pool_processes(worker.pid)) for pid in run_pids]
        assert executing[0] is not executing[1], "both chunks went to one worker"
        victim = executing[0]
        time.sleep(2)  # mid-chunk: its run is counting
        os.killpg(victim.pid, signal.SIGKILL)
        victim.wait()

        output, _ = cli.communicate(timeout=600)
        assert cli.returncode == 0, output[-4000:]
        assert (f"↻ sample_length_chunk [00000|chat]: worker vlm-assets-{victim.pid}@{socket.gethostname()} stopped answering"
                in output), output[-4000:]
        with dg.DagsterInstance.from_config(str(home)) as instance:
            assert instance.get_run_by_id(started[0].run_id).status == dg.DagsterRunStatus.FAILURE  # failed as dead
            chunks = instance.fetch_materializations(dg.AssetKey("sample_length_chunk"), limit=20).records
            assert sorted(record.partition_key for record in chunks) == [f"0000{index}|chat" for index in range(5)]
            assert started[0].run_id not in {record.run_id for record in chunks}
            finished = instance.fetch_materializations(
                dg.AssetRecordsFilter(asset_key=dg.AssetKey("sample_lengths"), asset_partitions=["chat"]), limit=5).records
            assert len(finished) == 1
            assert finished[0].asset_materialization.metadata["samples"].value == 40_000
            assert finished[0].asset_materialization.metadata["rows_reused"].value == 40_000
    finally:
        if cli is not None and cli.poll() is None:
            os.killpg(cli.pid, signal.SIGKILL)
            cli.wait()
        for worker in workers:
            _stop(worker)
