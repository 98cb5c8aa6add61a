"""Frame-cache checks: each shard's tar matches its record; every planned video is accounted for."""


import dagster as dg

from vlm_assets.defs.frame_cache.assets import frame_cache_dir
from vlm_assets.defs.resources import FRAME_CACHE_SHARD_PARTITIONS, VlmConfig
from vlm_assets.frames.index import verify_coverage, verify_shard
from vlm_assets.frames.plan import read_plan, shard_members
from vlm_assets.frames.shard import load_done_shard


def _result(problems: list[str], **metadata) -> dg.AssetCheckResult:
    return dg.AssetCheckResult(
        passed=not problems,
        metadata={"problems": len(problems), "first_problems": dg.MetadataValue.json(problems[:20]), **metadata},
    )


@dg.asset_check(
    asset="frame_cache_shard",
    partitions_def=FRAME_CACHE_SHARD_PARTITIONS,
    blocking=True,
    description="The tar holds exactly the recorded JPEGs at the recorded offsets and sizes, each cols*size × rows*size.",
)
def frame_cache_shard_matches_record(context: dg.AssetCheckExecutionContext, vlm_config: VlmConfig) -> dg.AssetCheckResult:
    settings = vlm_config.app.frame_cache
    cache_dir = frame_cache_dir(vlm_config)
    shard = context.partition_key
    members = shard_members(read_plan(cache_dir)).get(shard, [])
    with vlm_config.locked_to_read(context.log, "frame_cache_shard", shard):
        record = load_done_shard(cache_dir, shard, members, settings)
        if record is None:
            return _result([f"{shard}: not built, or stale against the plan"])
        return _result(verify_shard(cache_dir, record, settings), entries=len(record.entries))


@dg.asset_check(
    asset="frame_cache_index",
    blocking=True,
    description="Every planned video key is in index.jsonl or failures.jsonl, exactly once.",
)
def frame_cache_covers_plan(context: dg.AssetCheckExecutionContext, vlm_config: VlmConfig) -> dg.AssetCheckResult:
    cache_dir = frame_cache_dir(vlm_config)
    with vlm_config.locked_to_read(context.log, "frame_cache_index"):
        plan = read_plan(cache_dir)
        return _result(verify_coverage(cache_dir, plan), planned_keys=sum(len(video.keys) for video in plan))
