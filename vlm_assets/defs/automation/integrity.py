"""The nightly integrity jobs: every standalone asset check, over everything materialised.

A Dagster job has one partitioning, so there is one job (and one 03:00 UTC schedule) per
partitioning: unpartitioned, `sources`, `frame_cache_shards`; the schedules request one run per
materialised partition. Checks computed inside their asset's step (`check_specs`) run on every
materialisation and cannot run alone, so the jobs leave them out.
"""

from __future__ import annotations

import dagster as dg

from vlm_assets.defs.automation.sensors import LAUNCHED_BY_TAG
from vlm_assets.defs.resources import FRAME_CACHE_SHARD_PARTITIONS, SOURCES_PARTITIONS

INTEGRITY_CRON = "0 3 * * *"
PARTITION_TAG = "dagster/partition"
PARTITIONINGS: tuple[dg.PartitionsDefinition | None, ...] = (None, SOURCES_PARTITIONS, FRAME_CACHE_SHARD_PARTITIONS)


def _partitioning_name(partitions_def: dg.PartitionsDefinition | None) -> str | None:
    return None if partitions_def is None else getattr(partitions_def, "name", None) or type(partitions_def).__name__


class StandaloneChecks(dg.AssetSelection):
    """Asset checks that run without materialising their asset, on assets of one partitioning."""

    def __init__(self, partitioning: str | None) -> None:
        self.partitioning = partitioning

    def resolve_inner(self, asset_graph, allow_missing: bool) -> set[dg.AssetKey]:
        return set()

    def resolve_checks_inner(self, asset_graph, allow_missing: bool) -> set[dg.AssetCheckKey]:
        return {
            key for key in asset_graph.asset_check_keys
            if asset_graph.get_execution_set_asset_and_check_keys(key) == {key}
            and _partitioning_name(asset_graph.get(key.asset_key).partitions_def) == self.partitioning
        }

    def to_serializable_asset_selection(self, asset_graph) -> dg.AssetSelection:
        return dg.AssetSelection.checks(*sorted(self.resolve_checks(asset_graph), key=lambda key: key.to_user_string()))


def _materialised_partitions(instance: dg.DagsterInstance, graph, checks: set[dg.AssetCheckKey]) -> dict[str | None, list[dg.AssetCheckKey]]:
    """Partition (None when unpartitioned) -> the checks whose asset has been materialised there."""
    by_partition: dict[str | None, list[dg.AssetCheckKey]] = {}
    for check_key in sorted(checks, key=lambda key: key.to_user_string()):
        partitions_def = graph.get(check_key.asset_key).partitions_def
        if partitions_def is None:
            if instance.get_latest_materialization_event(check_key.asset_key) is not None:
                by_partition.setdefault(None, []).append(check_key)
            continue
        current = set(partitions_def.get_partition_keys(dynamic_partitions_store=instance))
        for partition in sorted(instance.get_materialized_partitions(check_key.asset_key) & current):
            by_partition.setdefault(partition, []).append(check_key)
    return by_partition


def integrity_job_and_schedule(partitions_def: dg.PartitionsDefinition | None):
    partitioning = _partitioning_name(partitions_def)
    suffix = f"_{partitioning}" if partitioning else ""
    selection = StandaloneChecks(partitioning)
    job = dg.define_asset_job(
        f"integrity_checks{suffix}",
        selection=selection,
        description=f"The standalone asset checks of the {partitioning or 'unpartitioned'} assets.",
    )

    @dg.schedule(
        name=f"nightly_integrity{suffix}",
        cron_schedule=INTEGRITY_CRON,
        execution_timezone="UTC",
        job=job,
        default_status=dg.DefaultScheduleStatus.RUNNING,
        description=f"Every night, {job.name} over every materialised "
        + (f"`{partitioning}` partition." if partitioning else "asset."),
    )
    def nightly(context: dg.ScheduleEvaluationContext):
        graph = context.repository_def.asset_graph
        groups = _materialised_partitions(context.instance, graph, selection.resolve_checks(graph))
        if not groups:
            return dg.SkipReason("nothing materialised to check yet")
        night = context.scheduled_execution_time.strftime("%Y-%m-%d")
        return [
            dg.RunRequest(
                run_key=f"{job.name}-{night}-{partition or 'all'}",
                asset_selection=[],
                asset_check_keys=checks,
                # A checks-only job selects no asset to infer a partitioning from, so the partition
                # travels as the run's partition tag, which the checks' contexts read.
                tags={LAUNCHED_BY_TAG: f"nightly_integrity{suffix}", **({PARTITION_TAG: partition} if partition else {})},
            )
            for partition, checks in groups.items()
        ]

    return job, nightly


INTEGRITY = [integrity_job_and_schedule(partitions_def) for partitions_def in PARTITIONINGS]
integrity_jobs = [job for job, _ in INTEGRITY]
integrity_schedules = [schedule for _, schedule in INTEGRITY]
