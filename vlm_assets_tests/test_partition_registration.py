"""Registering dynamic partitions from several processes at once, on one real instance."""

from __future__ import annotations

import multiprocessing
from pathlib import Path

import dagster as dg
import pytest

from vlm_assets.defs.resources import SOURCES_PARTITIONS, register_partitions
from vlm_assets.orchestration.home import POSTGRES_HOST_ENV, ensure_dagster_home

pytestmark = pytest.mark.processes

PROCESSES = 6
ROUNDS = 4


def _register_at_once(home: str, rounds: list[list[str]], barrier, errors) -> None:
    """One process: each round, once every process is ready, register that round's keys."""
    try:
        with dg.DagsterInstance.from_config(home) as instance:
            instance.get_dynamic_partitions(SOURCES_PARTITIONS.name)  # storage opened before the first barrier
            for round_, keys in enumerate(rounds):
                barrier.wait(timeout=60)
                try:
                    register_partitions(instance, SOURCES_PARTITIONS, keys)
                except Exception as error:  # reported to the test, which names it
                    errors.put(f"round {round_}: {type(error).__name__}: {error}")
    except Exception as error:
        errors.put(f"{type(error).__name__}: {error}")


def test_processes_registering_the_same_partitions_at_once_never_fail(tmp_path: Path, monkeypatch):
    monkeypatch.delenv(POSTGRES_HOST_ENV, raising=False)
    home = ensure_dagster_home(tmp_path / "home")
    with dg.DagsterInstance.from_config(str(home)):
        pass  # its tables created once, as `vlm-assets run` does before its workers open it
    context = multiprocessing.get_context("spawn")
    errors = context.Queue()
    # Each round, each process adds an overlapping set: the shared keys are the race. The same
    # processes race in every round (a barrier per round), so the rounds cost one start each.
    rounds = [[[f"r{round_}-shared-{n}" for n in range(3)] + [f"r{round_}-own-{index}"] for round_ in range(ROUNDS)]
              for index in range(PROCESSES)]
    barrier = context.Barrier(PROCESSES)
    processes = [context.Process(target=_register_at_once, args=(str(home), own, barrier, errors)) for own in rounds]
    for process in processes:
        process.start()
    for process in processes:
        process.join(300)
    assert [process.exitcode for process in processes] == [0] * PROCESSES
    failures = [errors.get() for _ in range(errors.qsize())] if not errors.empty() else []
    assert failures == []
    expected = {key for own in rounds for keys in own for key in keys}
    with dg.DagsterInstance.from_config(str(home)) as instance:
        assert set(instance.get_dynamic_partitions(SOURCES_PARTITIONS.name)) == expected
