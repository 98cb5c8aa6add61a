"""The Dagster webserver as the tests reach it: its GraphQL API, a free port, waiting, stopping its processes."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

LOCATION_QUERY = """
query { workspaceOrError { ... on Workspace { locationEntries { name
  locationOrLoadError { __typename ... on RepositoryLocation { repositories { name } } ... on PythonError { message } }
} } } }"""


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


class Ui:
    def __init__(self, port: int) -> None:
        self.url = f"http://127.0.0.1:{port}"

    def graphql(self, query: str, variables: dict | None = None) -> dict:
        body = json.dumps({"query": query, "variables": variables or {}}).encode()
        request = urllib.request.Request(f"{self.url}/graphql", body, {"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=30) as response:
            payload = json.load(response)
        assert not payload.get("errors"), payload["errors"]
        return payload["data"]


def wait_for(what: str, timeout_s: float, probe, log: Path, interval_s: float = 3.0):
    deadline = time.monotonic() + timeout_s
    last = None
    while time.monotonic() < deadline:
        try:
            result, last = probe()
        except (urllib.error.URLError, ConnectionError, TimeoutError) as error:
            result, last = None, f"not answering: {error}"
        if result is not None:
            return result
        time.sleep(interval_s)
    tail = log.read_text(errors="replace")[-4000:] if log.exists() else ""
    pytest.fail(f"timed out after {timeout_s:.0f} s waiting for {what}; last state: {last}\n--- server log tail ---\n{tail}")


def start_dagster(args: list[str], **popen_kwargs) -> subprocess.Popen:
    """A Dagster command (`dagster dev`, `dagster-webserver`) in a session of its own, taking SIGINT
    as a terminal gives it even where this process ignores SIGINT (a pytest-xdist worker of a
    session started as a shell's background job does): Dagster answers SIGTERM as it answers
    SIGINT, so an inherited "ignore" would leave stop_group's SIGTERM unanswered until its wait
    runs out. A handler set here is reset to the default in the child by exec."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        return subprocess.Popen(args, start_new_session=True, **popen_kwargs)
    finally:
        signal.signal(signal.SIGINT, previous)


def stop_group(process: subprocess.Popen, timeout_s: float) -> None:
    if process.poll() is None:
        os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            pass
    try:
        os.killpg(process.pid, signal.SIGKILL)  # anything of the group still there
    except ProcessLookupError:
        pass
    process.wait(10)


def wait_for_location(ui: Ui, timeout_s: float, log: Path) -> dict:
    """The code location's workspace entry once the webserver has loaded it; a load error fails the test."""
    def location_loaded():
        entries = ui.graphql(LOCATION_QUERY)["workspaceOrError"]["locationEntries"]
        loaded = [e for e in entries if (e["locationOrLoadError"] or {}).get("__typename") == "RepositoryLocation"]
        errors = [e["locationOrLoadError"] for e in entries
                  if (e["locationOrLoadError"] or {}).get("__typename") == "PythonError"]
        assert not errors, errors
        return (loaded[0] if loaded else None), entries

    return wait_for("the webserver and code location", timeout_s, location_loaded, log)

