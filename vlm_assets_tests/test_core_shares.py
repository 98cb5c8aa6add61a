"""Celery workers on one machine share its cores among the tasks they execute at the same moment."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time

import pytest

from vlm_assets.orchestration.workers import default_workers
from vlm_assets.parallel import STEP_PROCESSES_ENV_VAR, step_processes
from vlm_assets.scale_out import core_shares

# A pool process of another worker on this machine, in the middle of a task.
OTHER_TASK = """
import sys, time
from vlm_assets.scale_out import core_shares
core_shares.start_task()
print("busy", flush=True)
time.sleep(600)
"""


@pytest.fixture
def machine_temp(tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    # Set before it is deleted, so that monkeypatch restores its absence too: the tasks below set it,
    # and later tests in this process would otherwise split their steps over that many processes.
    monkeypatch.setenv(STEP_PROCESSES_ENV_VAR, "1")
    monkeypatch.delenv(STEP_PROCESSES_ENV_VAR)
    return tmp_path


def test_a_task_alone_takes_every_core_and_two_at_once_split_them(machine_temp):
    cores = default_workers()
    core_shares.start_task()
    try:
        assert step_processes() == cores
        assert core_shares.busy_tasks(core_shares.busy_folder()) == 1
    finally:
        core_shares.end_task()
    assert core_shares.busy_tasks(core_shares.busy_folder()) == 0

    other = subprocess.Popen([sys.executable, "-c", OTHER_TASK], env={**os.environ, "TMPDIR": str(machine_temp)},
                             stdout=subprocess.PIPE, text=True)
    try:
        assert other.stdout.readline().strip() == "busy"
        core_shares.start_task()
        try:
            assert core_shares.busy_tasks(core_shares.busy_folder()) == 2
            assert step_processes() == max(1, cores // 2)
        finally:
            core_shares.end_task()
    finally:
        other.send_signal(signal.SIGKILL)
        other.wait()
    # A process killed in its task holds nothing: the next task has the machine again.
    deadline = time.monotonic() + 10
    while core_shares.busy_tasks(core_shares.busy_folder()) and time.monotonic() < deadline:
        time.sleep(0.1)
    core_shares.start_task()
    try:
        assert step_processes() == cores
    finally:
        core_shares.end_task()


def test_a_share_is_at_least_one_process():
    assert core_shares.share_of_cores(2, 5) == 1
    assert core_shares.share_of_cores(16, 3) == 5
    assert core_shares.share_of_cores(8, 0) == 8
