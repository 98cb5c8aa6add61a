"""The nightly integrity jobs: every standalone asset check, over everything materialised.

A Dagster job has one partitioning, so there is one job (and one 03:00 UTC schedule) per
partitioning: unpartitioned, `sources`, `frame_cache_shards`; the schedules request one run per
materialised partition. The standalone checks are the `@dg.asset_check` definitions of the domains
(their `Definitions(asset_checks=...)`); a per-partition check declares its `partitions_def`. Checks
computed inside their asset's step (`check_specs`) run on every materialisation and cannot run
alone, so they are not among them.
"""

from __future__ import annotations

import dagster as dg

import vlm_assets.defs
from vlm_assets.defs.resources import FRAME_CACHE_SHARD_PARTITIONS, SOURCES_PARTITIONS
from vlm_assets.defs.tags import LAUNCHED_BY_TAG, PARTITION_TAG

INTEGRITY_CRON = "0 3 * * *"
PARTITIONINGS: tuple[dg.PartitionsDefinition | None, ...] = (None, SOURCES_PARTITIONS, FRAME_CACHE_SHARD_PARTITIONS)
STANDALONE_CHECKS: tuple[dg.AssetChecksDefinition, ...] = tuple(
    dg.load_asset_checks_from_package_module(vlm_assets.defs))


def _partitioning_name(partitions_def: dg.PartitionsDefinition | None) -> str | None:
    return None if partitions_def is None else getattr(partitions_def, "name", None) or type(partitions_def).__name__


def standalone_checks(partitioning: str | None) -> dict[dg.AssetCheckKey, dg.PartitionsDefinition | None]:
    """The standalone checks of one partitioning (by name; None: unpartitioned), with their partitions."""
    return {
        spec.key: check.partitions_def
        for check in STANDALONE_CHECKS
        if _partitioning_name(check.partitions_def) == partitioning
        for spec in check.check_specs
    }


def _materialised(instance: dg.DagsterInstance, asset_key: dg.AssetKey, partition: str) -> bool:
    records = instance.fetch_materializations(dg.AssetRecordsFilter(asset_key=asset_key, asset_partitions=[partition]), limit=1)
    return bool(records.records)


def _materialised_partitions(
    instance: dg.DagsterInstance, checks: dict[dg.AssetCheckKey, dg.PartitionsDefinition | None]
) -> dict[str | None, list[dg.AssetCheckKey]]:
    """Partition (None when unpartitioned) -> the checks whose asset has been materialised there."""
    by_partition: dict[str | None, list[dg.AssetCheckKey]] = {}
    for check_key in sorted(checks, key=lambda key: key.to_user_string()):
        partitions_def = checks[check_key]
        if partitions_def is None:
            if instance.get_latest_materialization_event(check_key.asset_key) is not None:
                by_partition.setdefault(None, []).append(check_key)
            continue
        for partition in sorted(partitions_def.get_partition_keys(dynamic_partitions_store=instance)):
            if _materialised(instance, check_key.asset_key, partition):
                by_partition.setdefault(partition, []).append(check_key)
    return by_partition


def integrity_job_and_schedule(partitions_def: dg.PartitionsDefinition | None):
    partitioning = _partitioning_name(partitions_def)
    suffix = f"_{partitioning}" if partitioning else ""
    checks = standalone_checks(partitioning)
    job = dg.define_asset_job(
        f"integrity_checks{suffix}",
        selection=dg.AssetSelection.checks(*sorted(checks, key=lambda key: key.to_user_string())),
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
        groups = _materialised_partitions(context.instance, checks)
        if not groups:
            return dg.SkipReason("nothing materialised to check yet")
        night = context.scheduled_execution_time.strftime("%Y-%m-%d")
        return [
            dg.RunRequest(
                run_key=f"{job.name}-{night}-{partition or 'all'}",
                asset_selection=[],
                asset_check_keys=due,
                # A checks-only job selects no asset to infer a partitioning from, so the partition
                # travels as the run's partition tag, which the checks' contexts read.
                tags={LAUNCHED_BY_TAG: f"nightly_integrity{suffix}", **({PARTITION_TAG: partition} if partition else {})},
            )
            for partition, due in groups.items()
        ]

    return job, nightly


INTEGRITY = [integrity_job_and_schedule(partitions_def) for partitions_def in PARTITIONINGS]
integrity_jobs = [job for job, _ in INTEGRITY]
integrity_schedules = [schedule for _, schedule in INTEGRITY]
# Lists are not collected from a module: the definitions loader takes this object instead.
defs = dg.Definitions(jobs=integrity_jobs, schedules=integrity_schedules)
