"""The PostgreSQL server tests may use: announced by .ci/run as VLM_ASSETS_TEST_PG_*."""

from __future__ import annotations

import os

from vlm_assets.orchestration.home import POSTGRES_DEFAULTS


def pg_server() -> dict[str, object]:
    """psycopg2.connect keyword arguments (without dbname) for the announced test server."""
    return {
        "host": os.environ.get("VLM_ASSETS_TEST_PG_HOST") or "127.0.0.1",
        "port": int(os.environ.get("VLM_ASSETS_TEST_PG_PORT") or POSTGRES_DEFAULTS["VLM_ASSETS_PG_PORT"]),
        "user": os.environ.get("VLM_ASSETS_TEST_PG_USER") or POSTGRES_DEFAULTS["VLM_ASSETS_PG_USER"],
        "password": os.environ.get("VLM_ASSETS_TEST_PG_PASSWORD", ""),
    }
