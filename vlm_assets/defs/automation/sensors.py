"""Sensors: new sources from the inbox, configured sources' partitions, new frame-cache shards."""

from __future__ import annotations

import os

import dagster as dg

from vlm_assets.defs.automation.inbox_watch import InboxCursor, decide, fingerprint_key
from vlm_assets.defs.resources import FRAME_CACHE_SHARD_PARTITIONS, SOURCES_PARTITIONS, VlmConfig
from vlm_assets.frames.index import done_shards
from vlm_assets.frames.plan import read_plan, shard_members
from vlm_assets.frames.shard import plan_digest
from vlm_assets.inbox import discover_inbox
from vlm_assets.wording import plural

INTERVAL_ENV_VAR = "VLM_ASSETS_SENSOR_INTERVAL_S"
SENSOR_INTERVAL_S = int(os.environ.get(INTERVAL_ENV_VAR, "30"))
LAUNCHED_BY_TAG = "vlm_assets/launched_by"

VIDEO_FRAME_PLAN = dg.AssetKey("video_frame_plan")
FRAME_CACHE_SHARD = dg.AssetKey("frame_cache_shard")
# What a new source needs built: every `sources`-partitioned asset up to its own Energon dataset, in order.
PACKING_LINEAGE = [dg.AssetKey(name) for name in
                   ("sample_catalog", "sample_lengths", "packing_bins", "packed_json", "packed_wds_shards",
                    "energon_dataset")]


@dg.sensor(
    name="inbox_sensor",
    target=dg.AssetSelection.assets(*PACKING_LINEAGE),
    minimum_interval_seconds=SENSOR_INTERVAL_S,
    default_status=dg.DefaultSensorStatus.STOPPED,
    description="Turns each finished inbox entry (directory of JSON or pretrain-*.tar, or *.jsonl) into a "
    "`sources` partition and runs its packing lineage; entries still being copied wait.",
)
def inbox_sensor(context: dg.SensorEvaluationContext, vlm_config: VlmConfig) -> dg.SensorResult:
    app = vlm_config.app
    registered = set(context.instance.get_dynamic_partitions(SOURCES_PARTITIONS.name))
    decision = decide(discover_inbox(app.inbox), InboxCursor.from_json(context.cursor), registered,
                      app.inbox_require_ready_marker)
    for name, reason in decision.not_ready.items():
        context.log.info(f"{name}: waiting ({reason})")
    if not decision.ready:
        return dg.SensorResult(skip_reason=f"no new finished sources in {app.inbox}", cursor=decision.cursor.to_json())
    new_keys = [entry.source.name for entry in decision.ready if entry.source.name not in registered]
    runs = []
    for entry in decision.ready:
        context.log.info(f"{entry.source.name}: {entry.source.kind} source at {entry.source.path}, launching its packing lineage")
        runs.append(dg.RunRequest(
            run_key=f"{entry.source.name}@{fingerprint_key(entry)}",
            partition_key=entry.source.name,
            asset_selection=PACKING_LINEAGE,
            tags={LAUNCHED_BY_TAG: "inbox_sensor"},
        ))
    return dg.SensorResult(
        run_requests=runs,
        dynamic_partitions_requests=[SOURCES_PARTITIONS.build_add_request(new_keys)] if new_keys else [],
        cursor=decision.cursor.to_json(),
    )


@dg.sensor(
    name="configured_sources_sensor",
    minimum_interval_seconds=SENSOR_INTERVAL_S,
    default_status=dg.DefaultSensorStatus.RUNNING,
    description="Registers every source named in the config as a `sources` partition (launches nothing).",
)
def configured_sources_sensor(context: dg.SensorEvaluationContext, vlm_config: VlmConfig) -> dg.SensorResult:
    registered = set(context.instance.get_dynamic_partitions(SOURCES_PARTITIONS.name))
    new_keys = [source.name for source in vlm_config.app.sources if source.name not in registered]
    if not new_keys:
        return dg.SensorResult(skip_reason="every configured source is registered")
    context.log.info(f"registering sources: {', '.join(new_keys)}")
    return dg.SensorResult(dynamic_partitions_requests=[SOURCES_PARTITIONS.build_add_request(new_keys)])


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
    registered = set(context.instance.get_dynamic_partitions(FRAME_CACHE_SHARD_PARTITIONS.name))
    unregistered = [shard for shard in stale if shard not in registered]
    context.log.info(f"plan has {plural(len(members), 'shard')}; {len(stale)} to build: {', '.join(stale) or 'none'}")
    if not stale:
        return dg.SensorResult(skip_reason="every planned shard is built for the current plan", cursor=str(records[0].storage_id))
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
        dynamic_partitions_requests=[FRAME_CACHE_SHARD_PARTITIONS.build_add_request(unregistered)] if unregistered else [],
        cursor=str(records[0].storage_id),
    )
