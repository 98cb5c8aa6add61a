"""A real materialisation on a Dagster instance stored in PostgreSQL, selected by VLM_ASSETS_PG_* only.

The server comes from VLM_ASSETS_TEST_PG_HOST/PORT/USER/PASSWORD (default 127.0.0.1:5432, user
postgres; `.ci/run` starts one); the test creates its own database there and points the product's
VLM_ASSETS_PG_* at it. Without a reachable server the test is skipped, except under CI=true where
that is a failure.
"""

from __future__ import annotations

import os
import uuid

import dagster as dg
import pytest
import yaml

from vlm_assets.config import load_config
from vlm_assets.orchestration.home import POSTGRES_DEFAULTS, POSTGRES_HOST_ENV, ensure_dagster_home
from vlm_assets.orchestration.scheduler import run_graph
from vlm_assets.definitions import build_definitions
from vlm_assets_tests.pg_support import pg_server

pytestmark = pytest.mark.services

psycopg2 = pytest.importorskip("psycopg2")


def _server() -> dict[str, object]:
    settings = pg_server()
    try:
        psycopg2.connect(dbname="postgres", connect_timeout=5, **settings).close()
    except psycopg2.OperationalError as error:
        where = f"{settings['user']}@{settings['host']}:{settings['port']}"
        if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
            pytest.fail(f"CI is set but no PostgreSQL server is reachable at {where}: {error}")
        pytest.skip(f"no PostgreSQL server reachable at {where} (set VLM_ASSETS_TEST_PG_*; .ci/run starts one): {error}")
    return settings


@pytest.fixture
def database(monkeypatch):
    """A fresh database on the server, dropped afterwards; VLM_ASSETS_PG_* point at it."""
    settings = _server()
    name = f"vlm_assets_test_{uuid.uuid4().hex[:10]}"
    admin = psycopg2.connect(dbname="postgres", **settings)
    admin.autocommit = True
    admin.cursor().execute(f'CREATE DATABASE "{name}"')
    monkeypatch.setenv(POSTGRES_HOST_ENV, str(settings["host"]))
    monkeypatch.setenv("VLM_ASSETS_PG_PORT", str(settings["port"]))
    monkeypatch.setenv("VLM_ASSETS_PG_USER", str(settings["user"]))
    monkeypatch.setenv("VLM_ASSETS_PG_PASSWORD", str(settings["password"]))
    monkeypatch.setenv("VLM_ASSETS_PG_DB", name)
    try:
        yield {**settings, "dbname": name}
    finally:
        admin.cursor().execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        admin.close()


def test_materialisation_is_stored_in_postgres(database, demo_config_path, tmp_path, monkeypatch):
    monkeypatch.setenv("DAGSTER_HOME", str(tmp_path / "home"))
    home = ensure_dagster_home(tmp_path / "unused")
    instance_yaml = (home / "dagster.yaml").read_text()
    assert "postgres_db" in instance_yaml and "concurrency" in instance_yaml
    assert "VLM_ASSETS_PG_DB" in instance_yaml  # a reference, resolved when the instance starts

    app = load_config(demo_config_path)
    defs = build_definitions(demo_config_path)
    with dg.DagsterInstance.get() as instance:
        assert type(instance.run_storage).__name__ == "PostgresRunStorage"
        summary = run_graph(defs, app, instance, select=["sample_catalog"], echo=lambda line: None)
        assert summary.ok and summary.runs == len(app.sources)
        assert set(instance.get_dynamic_partitions("sources")) == {source.name for source in app.sources}
        assert instance.get_materialized_partitions(dg.AssetKey("sample_catalog")) == {s.name for s in app.sources}

    with psycopg2.connect(**database) as connection, connection.cursor() as cursor:
        cursor.execute("SELECT count(*) FROM runs WHERE status = 'SUCCESS'")
        assert cursor.fetchone()[0] == len(app.sources)
        cursor.execute("SELECT count(*) FROM event_logs WHERE dagster_event_type = 'ASSET_MATERIALIZATION'")
        assert cursor.fetchone()[0] == len(app.sources)


def test_sqlite_unless_postgres_is_asked_for(tmp_path, monkeypatch):
    for variable in (POSTGRES_HOST_ENV, *POSTGRES_DEFAULTS):
        monkeypatch.delenv(variable, raising=False)
    monkeypatch.setenv("DAGSTER_HOME", str(tmp_path / "home"))
    home = ensure_dagster_home(tmp_path / "unused")
    assert "storage" not in yaml.safe_load((home / "dagster.yaml").read_text())  # sqlite under DAGSTER_HOME
    monkeypatch.setenv(POSTGRES_HOST_ENV, "db.example")
    monkeypatch.setenv("VLM_ASSETS_PG_PASSWORD", "secret")
    ensure_dagster_home(tmp_path / "unused")  # the managed file follows the environment
    text = (home / "dagster.yaml").read_text()
    database = yaml.safe_load(text)["storage"]["postgres"]["postgres_db"]
    assert database["hostname"] == {"env": "VLM_ASSETS_PG_HOST"} and database["password"] == {"env": "VLM_ASSETS_PG_PASSWORD"}
    assert database["port"] == 5432 and "secret" not in text
    own = "# my own instance config\n"
    (home / "dagster.yaml").write_text(own)
    ensure_dagster_home(tmp_path / "unused")
    assert (home / "dagster.yaml").read_text() == own
