"""The Dagster instance's PostgreSQL being unreachable, told apart from every other failure.

An outage is recognised by the exception chain: a psycopg2 error from the connection itself (no
SQLSTATE, or a connection-exception / operator-intervention one), or dagster-postgres giving up
after its retries. A worker process's error arrives pickled without its chain; the server is then
asked once more, so the line names the driver's own cause. Nothing here imports Dagster.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

import yaml

PROBE_TIMEOUT_S = 5
# SQLSTATE classes of a lost or refused connection: 08 connection exception, 57P operator
# intervention (server shutting down, restarting). Deadlocks or statement timeouts are not outages.
CONNECTION_SQLSTATE_PREFIXES = ("08", "57P")


@dataclass(frozen=True)
class PostgresInstance:
    """Where an instance keeps its storage; `connect` holds psycopg2 arguments (password included)."""

    where: str  # host:port/database, never the password
    connect: dict[str, object] = field(repr=False)

    def connection_error(self) -> Exception | None:
        """The driver's error if the server cannot be reached now, else None."""
        import psycopg2

        try:
            psycopg2.connect(**{"connect_timeout": PROBE_TIMEOUT_S, **self.connect}).close()
        except psycopg2.OperationalError as error:
            return error
        return None


class InstanceUnreachable(Exception):
    """The instance's PostgreSQL cannot be reached; str() is the one line for the operator."""

    def __init__(self, instance: PostgresInstance | None, home: Path, cause: str) -> None:
        where = f"PostgreSQL {instance.where}" if instance else "PostgreSQL"
        super().__init__(f"the Dagster instance's {where} (DAGSTER_HOME={home}) is unreachable: {cause}; "
                         "rerun once it answers")


def postgres_instance(home: Path) -> PostgresInstance | None:
    """The PostgreSQL storage named by `home`/dagster.yaml (`storage.postgres`), None for sqlite."""
    path = home / "dagster.yaml"
    settings = yaml.safe_load(path.read_text(encoding="utf-8")) if path.exists() else None
    postgres = ((settings or {}).get("storage") or {}).get("postgres")
    if not isinstance(postgres, dict):
        return None
    if "postgres_url" in postgres:
        url = urlsplit(str(_resolved(postgres["postgres_url"])))
        # libpq takes the URL itself, without SQLAlchemy's "+driver" in the scheme.
        dsn = urlunsplit(url._replace(scheme=url.scheme.split("+")[0]))
        where = f"{url.hostname}:{url.port or 5432}/{url.path.lstrip('/')}"
        return PostgresInstance(where, {"dsn": dsn})
    database = {name: _resolved(value) for name, value in (postgres.get("postgres_db") or {}).items()}
    connect = {"host": database.get("hostname"), "port": database.get("port") or 5432,
               "user": database.get("username"), "password": database.get("password") or None,
               "dbname": database.get("db_name"), **(database.get("params") or {})}
    return PostgresInstance(f"{connect['host']}:{connect['port']}/{connect['dbname']}", connect)


def require_reachable(home: Path) -> None:
    """Raise InstanceUnreachable now, before any process opens the instance, if its server does not answer."""
    instance = postgres_instance(home)
    error = instance.connection_error() if instance else None
    if error is not None:
        raise InstanceUnreachable(instance, home, _first_line(error)) from error


def is_outage(error: BaseException) -> bool:
    return _driver_error(error) is not None or _gave_up(error)


def as_outage(error: BaseException, home: Path) -> InstanceUnreachable | None:
    """`error` as an InstanceUnreachable naming the instance in `home` and the cause, None if it is no outage."""
    if not is_outage(error):
        return None
    instance = postgres_instance(home)
    driver_error = _driver_error(error) or (instance.connection_error() if instance else None)
    return InstanceUnreachable(instance, home, _first_line(driver_error or error))


def _chain(error: BaseException):
    seen: set[int] = set()
    pending: list[BaseException | None] = [error]
    while pending:
        current = pending.pop()
        if current is None or id(current) in seen:
            continue
        seen.add(id(current))
        yield current
        pending += [current.__cause__, current.__context__]


def _driver_error(error: BaseException) -> BaseException | None:
    # Only an error already raised can be in the chain: its module is imported if it is there.
    psycopg2 = sys.modules.get("psycopg2")
    if psycopg2 is None:
        return None
    for link in _chain(error):
        # SQLAlchemy's wrapper keeps the driver's error as `orig` too, which survives pickling.
        for candidate in (link, getattr(link, "orig", None)):
            if isinstance(candidate, psycopg2.InterfaceError):
                return candidate
            if isinstance(candidate, psycopg2.OperationalError):
                code = candidate.pgcode or ""
                if not code or code.startswith(CONNECTION_SQLSTATE_PREFIXES):
                    return candidate
    return None


def _gave_up(error: BaseException) -> bool:
    utils = sys.modules.get("dagster_postgres.utils")
    return utils is not None and any(isinstance(link, utils.DagsterPostgresException) for link in _chain(error))


def _resolved(value: object) -> object:
    """A dagster.yaml value, `{env: NAME}` read from the environment as Dagster does."""
    if isinstance(value, dict) and set(value) == {"env"}:
        return os.environ.get(value["env"])
    return value


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__
