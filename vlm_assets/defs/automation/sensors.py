"""Sensors: new sources from the inbox, configured sources' partitions, changed source files, new frame-cache shards."""

from __future__ import annotations

import os
from pathlib import Path

import dagster as dg

from vlm_assets.asset_specs import source_lineage
from vlm_assets.defs.automation.inbox_watch import (
    InboxCursor,
    RunOutcome,
    RunState,
    decide,
    fingerprint_key,
    vanished_sources,
)
from vlm_assets.defs.catalog.source_files import changed_source_files
from vlm_assets.defs.resources import FRAME_CACHE_SHARD_PARTITIONS, SOURCES_PARTITIONS, VlmConfig, register_partitions
from vlm_assets.defs.tags import INBOX_ATTEMPT_TAG, INBOX_ENTRY_TAG, INBOX_FINGERPRINT_TAG, LAUNCHED_BY_TAG
from vlm_assets.frames.index import done_shards
from vlm_assets.frames.plan import read_plan, shard_members
from vlm_assets.frames.shard import plan_digest
from vlm_assets.inbox import InboxEntry, discover_inbox
from vlm_assets.defs.failures import FAILURE_EVENT_TYPES, failure_of
from vlm_assets.wording import plural

INTERVAL_ENV_VAR = "VLM_ASSETS_SENSOR_INTERVAL_S"
SENSOR_INTERVAL_S = int(os.environ.get(INTERVAL_ENV_VAR, "30"))
# Walking a source of millions of files takes a while: its files are looked at less often.
SOURCE_SCAN_INTERVAL_S = 300

VIDEO_FRAME_PLAN = dg.AssetKey("video_frame_plan")
FRAME_CACHE_SHARD = dg.AssetKey("frame_cache_shard")
# What a new source needs built: every `sources`-partitioned asset up to its own Energon dataset, in order.
PACKING_LINEAGE = [dg.AssetKey(name) for name in source_lineage()]


def latest_inbox_run(instance: dg.DagsterInstance, name: str) -> RunOutcome | None:
    """The newest run the inbox sensor launched for an entry, with its outcome (and, if it failed, why)."""
    runs = instance.get_runs(filters=dg.RunsFilter(tags={INBOX_ENTRY_TAG: name}), limit=1)
    if not runs:
        return None
    run = runs[0]
    if not run.is_finished:
        state, why = RunState.IN_PROGRESS, ""
    elif run.is_success:
        state, why = RunState.SUCCEEDED, ""
    else:
        state, why = RunState.FAILED, _failure_cause(instance, run)
    return RunOutcome(run.run_id, run.tags.get(INBOX_FINGERPRINT_TAG, ""), int(run.tags.get(INBOX_ATTEMPT_TAG, "1")), state, why)


def _failure_cause(instance: dg.DagsterInstance, run: dg.DagsterRun) -> str:
    if run.status == dg.DagsterRunStatus.CANCELED:
        return "canceled"
    for record in instance.all_logs(run.run_id, of_type=set(FAILURE_EVENT_TYPES)):
        return f"{record.dagster_event.step_key}: {failure_of(record.dagster_event)}"
    for record in instance.all_logs(run.run_id, of_type=dg.DagsterEventType.RUN_FAILURE):
        return record.message
    return ""


@dg.sensor(
    name="inbox_sensor",
    target=dg.AssetSelection.assets(*PACKING_LINEAGE),
    minimum_interval_seconds=SENSOR_INTERVAL_S,
    default_status=dg.DefaultSensorStatus.STOPPED,
    description="Turns each finished inbox entry (directory of JSON or pretrain-*.tar, or *.jsonl) into a "
    "`sources` partition and runs its packing lineage; entries still being copied wait, a failed run is "
    "retried with back-off, and a source whose entry is gone is unregistered.",
)
def inbox_sensor(context: dg.SensorEvaluationContext, vlm_config: VlmConfig) -> dg.SensorResult:
    app, instance = vlm_config.app, context.instance
    registered = set(instance.get_dynamic_partitions(SOURCES_PARTITIONS.name))
    entries = discover_inbox(app.inbox)
    decision = decide(entries, InboxCursor.from_json(context.cursor), registered, app.inbox_require_ready_marker,
                      lambda name: latest_inbox_run(instance, name), SENSOR_INTERVAL_S)
    for name in decision.built:
        context.log.info(f"{name}: packing lineage built; launched again only when its files change")
    for name, reason in decision.waiting.items():
        if name in decision.failed:
            context.log.warning(f"{name}: {reason}; training_mix and the other followers do not wait for it")
        else:
            context.log.info(f"{name}: waiting ({reason})")
    gone = _unregistrable(context, app.inbox, entries, registered, {source.name for source in app.sources})

    # Registered here, not by a partitions request: the request's add races a `vlm-assets run` adding the same key.
    register_partitions(instance, SOURCES_PARTITIONS, (launch.entry.source.name for launch in decision.launches))
    partition_requests = [SOURCES_PARTITIONS.build_delete_request(gone)] if gone else []
    runs = []
    for launch in decision.launches:
        source = launch.entry.source
        again = f" (attempt {launch.attempt})" if launch.attempt > 1 else ""
        context.log.info(f"{source.name}: {source.kind} source at {source.path}, launching its packing lineage{again}")
        runs.append(dg.RunRequest(
            run_key=launch.run_key,
            partition_key=source.name,
            asset_selection=PACKING_LINEAGE,
            tags={LAUNCHED_BY_TAG: "inbox_sensor", INBOX_ENTRY_TAG: source.name,
                  INBOX_FINGERPRINT_TAG: fingerprint_key(launch.entry), INBOX_ATTEMPT_TAG: str(launch.attempt)},
        ))
    news = [f"{name}: {why}" for name, why in decision.failed.items()] + [f"{name}: entry gone, unregistered" for name in gone]
    skip_reason = None if runs else "; ".join(news) or f"no new finished sources in {app.inbox}"
    return dg.SensorResult(run_requests=runs, dynamic_partitions_requests=partition_requests,
                           skip_reason=skip_reason, cursor=decision.cursor.to_json())


def _unregistrable(
    context: dg.SensorEvaluationContext, inbox: Path, entries: list[InboxEntry], registered: set[str],
    configured: set[str],
) -> list[str]:
    """Inbox sources whose entry is gone and whose last run has ended: their partitions are deleted, so
    training_mix and the other followers stop waiting for them. Built data stays under the storage root."""
    vanished = vanished_sources(entries, registered, configured)
    if vanished and not inbox.is_dir():
        # An inbox that is itself missing (an unmounted share) says nothing about its entries.
        context.log.warning(f"inbox {inbox} is not a directory: {', '.join(vanished)} stay registered")
        return []
    gone = []
    for name in vanished:
        run = latest_inbox_run(context.instance, name)
        if run is not None and run.state is RunState.IN_PROGRESS:
            context.log.info(f"{name}: its inbox entry is gone; unregistered once run {run.run_id} ends")
            continue
        context.log.warning(f"{name}: its inbox entry is gone; unregistered (its `sources` partition deleted), so "
                            "training_mix and the other followers no longer wait for it")
        gone.append(name)
    return gone


@dg.sensor(
    name="configured_sources_sensor",
    minimum_interval_seconds=SENSOR_INTERVAL_S,
    default_status=dg.DefaultSensorStatus.RUNNING,
    description="Registers every source named in the config as a `sources` partition (launches nothing).",
)
def configured_sources_sensor(context: dg.SensorEvaluationContext, vlm_config: VlmConfig) -> dg.SensorResult:
    new_keys = register_partitions(context.instance, SOURCES_PARTITIONS, (source.name for source in vlm_config.app.sources))
    if not new_keys:
        return dg.SensorResult(skip_reason="every configured source is registered")
    context.log.info(f"registered sources: {', '.join(new_keys)}")
    return dg.SensorResult(skip_reason=f"registered sources: {', '.join(new_keys)}")


@dg.sensor(
    name="source_files_sensor",
    minimum_interval_seconds=SOURCE_SCAN_INTERVAL_S,
    default_status=dg.DefaultSensorStatus.RUNNING,
    description="Walks every registered source's files (names, sizes, modification times) and records an "
    "observation of `source_files` for each source whose files changed, so its catalogue shows as stale "
    "(launches nothing).",
)
def source_files_sensor(context: dg.SensorEvaluationContext, vlm_config: VlmConfig) -> dg.SensorResult:
    fingerprints = vlm_config.fingerprints(context.instance)
    observations = changed_source_files(context.instance, vlm_config.sources(), fingerprints.source_walk)
    if not observations:
        return dg.SensorResult(skip_reason="no source's files changed since last observed")
    context.log.info(f"files changed: {', '.join(str(observation.partition) for observation in observations)}")
    return dg.SensorResult(asset_events=observations)


@dg.sensor(
    name="frame_cache_shards_sensor",
    target=dg.AssetSelection.assets(FRAME_CACHE_SHARD),
    minimum_interval_seconds=SENSOR_INTERVAL_S,
    default_status=dg.DefaultSensorStatus.RUNNING,
    description="After each video_frame_plan materialisation, runs every frame_cache_shard partition that "
    "is new or whose membership grew (not built for the current plan).",
)
def frame_cache_shards_sensor(context: dg.SensorEvaluationContext, vlm_config: VlmConfig) -> dg.SensorResult:
    records = context.instance.fetch_materializations(VIDEO_FRAME_PLAN, limit=1).records
    handled = int(context.cursor or 0)
    if not records or records[0].storage_id <= handled:
        return dg.SensorResult(skip_reason="no new video_frame_plan materialisation")
    settings = vlm_config.app.frame_cache
    cache_dir = vlm_config.layout.frame_cache_dir(settings)
    plan = read_plan(cache_dir)
    members = shard_members(plan)
    stale = [shard for shard, record in done_shards(cache_dir, plan, settings).items() if record is None]
    context.log.info(f"plan has {plural(len(members), 'shard')}; {len(stale)} to build: {', '.join(stale) or 'none'}")
    if not stale:
        return dg.SensorResult(skip_reason="every planned shard is built for the current plan", cursor=str(records[0].storage_id))
    register_partitions(context.instance, FRAME_CACHE_SHARD_PARTITIONS, stale)
    return dg.SensorResult(
        run_requests=[
            dg.RunRequest(
                run_key=f"{shard}@{plan_digest(members[shard], settings)[:16]}",
                partition_key=shard,
                asset_selection=[FRAME_CACHE_SHARD],
                tags={LAUNCHED_BY_TAG: "frame_cache_shards_sensor"},
            )
            for shard in stale
        ],
        cursor=str(records[0].storage_id),
    )
