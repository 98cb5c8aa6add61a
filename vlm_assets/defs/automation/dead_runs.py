"""Runs whose process is gone (killed, out of memory, machine lost) are failed and their pool slots freed.

Dagster's default run launcher cannot tell a dead run worker from a slow one, and a run killed
in a step keeps its pool slot, so every later step of that pool would wait for ever. Each of our
runs is tagged with the liveness file of the process executing it (ALIVE_TAG); when no process
holds that file any more the run is dead. `vlm-assets run` sweeps before it launches anything,
and `dead_runs_sensor` does it in `dagster dev`.
"""

from __future__ import annotations

from pathlib import Path

import dagster as dg

from vlm_assets.defs.resources import FRAME_CACHE_POOL, HEAVY_POOL
from vlm_assets.defs.tags import ALIVE_TAG
from vlm_assets.locks import process_alive

IN_FLIGHT = [dg.DagsterRunStatus.STARTING, dg.DagsterRunStatus.STARTED, dg.DagsterRunStatus.CANCELING]
FINISHED = [dg.DagsterRunStatus.SUCCESS, dg.DagsterRunStatus.FAILURE, dg.DagsterRunStatus.CANCELED]
DEAD_RUN_MESSAGE = (
    "vlm-assets: the process executing this run is gone (killed, out of memory or machine lost); "
    "marked failed and its pool slots freed. Rerun to rebuild what it did not finish."
)


def fail_dead_runs(instance: dg.DagsterInstance) -> list[str]:
    """Mark in-flight runs whose process is gone as failed; free the slots that finished runs still hold."""
    failed = []
    for record in instance.get_run_records(filters=dg.RunsFilter(statuses=IN_FLIGHT)):
        run = record.dagster_run
        token = run.tags.get(ALIVE_TAG)
        if token and not process_alive(Path(token)):
            instance.report_run_failed(run, message=DEAD_RUN_MESSAGE)
            failed.append(run.run_id)
    storage = instance.event_log_storage
    if storage.supports_global_concurrency_limits:
        holders = storage.get_concurrency_run_ids()
        if holders:
            finished = instance.get_run_records(filters=dg.RunsFilter(run_ids=list(holders), statuses=FINISHED))
            for record in finished:
                storage.free_concurrency_slots_for_run(record.dagster_run.run_id)
    return failed


def assign_stranded_steps(instance: dg.DagsterInstance, pools: list[str]) -> int:
    """Hand free pool slots to the steps waiting for them that nobody will wake; how many were handed.

    A step that asks for a slot just as the last holder frees it can miss the hand-over: the holder
    found no step waiting, the asker saw no free slot, and the asker then waits for ever (seen with
    two `vlm-assets run` workers on one pool of one slot). Dagster's own rule decides when a slot is
    free to hand out.
    """
    storage = instance.event_log_storage
    if not storage.supports_global_concurrency_limits:
        return 0
    handed = 0
    for pool in pools:
        while storage.has_unassigned_slots(pool) and any(
            step.assigned_timestamp is None for step in storage.get_concurrency_info(pool).pending_steps
        ):
            storage.assign_pending_steps([pool])
            handed += 1
    return handed


@dg.sensor(
    name="dead_runs_sensor",
    minimum_interval_seconds=30,
    default_status=dg.DefaultSensorStatus.RUNNING,
    description="Fails runs whose process is gone and frees the pool slots they hold, so they never block live runs.",
)
def dead_runs_sensor(context: dg.SensorEvaluationContext) -> dg.SkipReason:
    failed = fail_dead_runs(context.instance)
    for run_id in failed:
        context.log.warning(f"run {run_id}: its process is gone; marked failed, pool slots freed")
    handed = assign_stranded_steps(context.instance, [FRAME_CACHE_POOL, HEAVY_POOL])
    if handed:
        context.log.warning(f"{handed} step(s) waiting for a pool slot that was free got it")
    return dg.SkipReason(f"{len(failed)} dead run(s) failed" if failed else "no dead runs")
