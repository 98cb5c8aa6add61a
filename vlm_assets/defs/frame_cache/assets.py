"""Frame-cache assets: plan the unique videos, build each shard, merge the index."""


import time
from pathlib import Path

import dagster as dg

from vlm_assets.defs.conditions import FOLLOWS_UPSTREAM
from vlm_assets.defs.resources import (
    FRAME_CACHE_POOL,
    FRAME_CACHE_SHARD_PARTITIONS,
    VlmConfig,
    register_partitions,
    step_progress,
)
from vlm_assets.defs.spec_assets import Built, spec_asset
from vlm_assets.frames.index import write_index
from vlm_assets.frames.plan import (
    PlannedVideo,
    accepted_videos,
    extend_plan,
    frames_source_files,
    load_frames_source,
    plan_file_digest,
    read_plan,
    shard_members,
    write_plan,
)
from vlm_assets.media.video_probe import SampledFrames
from vlm_assets.frames.shard import ensure_shard, tar_path
from vlm_assets.frames.spool import MosaicSpool
from vlm_assets.wording import md_cell, plural, shortened

LOG_EVERY = 25
# Characters of a video's error in the latest_videos table (cut at a word; the log has it whole).
PLAN_ERROR_CHARS = 100


def frame_cache_dir(vlm_config: VlmConfig) -> Path:
    return vlm_config.layout.frame_cache_dir(vlm_config.app.frame_cache)


def _known_frames(vlm_config: VlmConfig, log: dg.DagsterLogManager) -> dict[str, SampledFrames]:
    known: dict[str, SampledFrames] = {}
    for source in vlm_config.sources():
        for path in frames_source_files(source):
            imported = load_frames_source(path, source.name, source.media_root)
            log.info(f"{source.name}: imported frame counts and indices of {plural(len(imported), 'video')} from {path}")
            known.update(imported)
    return known


def plan_table_md(plan: list[PlannedVideo], limit: int = 10) -> str:
    lines = ["| video | shard | frames | fps | error |", "|---|---|---|---|---|"]
    for video in plan[-limit:]:
        error = md_cell(shortened(video.error, PLAN_ERROR_CHARS))
        lines.append(f"| {md_cell(video.keys[0])} | {video.shard} | {video.total_frames} | {video.fps:g} | {error} |")
    return "\n".join(lines)


@spec_asset(
    "video_frame_plan",
    automation_condition=FOLLOWS_UPSTREAM,
    description="Every unique video of the samples the token lengths accept with its decodable frame "
    "count, fps, sampled frame indices and (append-only) shard; registers the frame_cache_shards partitions. Videos the "
    "catalogue decoded are taken from its spool, the others probed.",
)
def video_frame_plan(context: dg.AssetExecutionContext, vlm_config: VlmConfig) -> Built:
    app = vlm_config.app
    cache_dir = frame_cache_dir(vlm_config)
    videos: list[tuple[str, str]] = []
    missing: list[str] = []
    for source in vlm_config.sources():
        catalog, lengths = vlm_config.layout.catalog(source.name), vlm_config.layout.lengths(source.name)
        if not (catalog.is_file() and lengths.is_file()):
            missing.append(source.name)
            context.log.warning(f"{source.name}: no catalogue and token lengths at {catalog}, {lengths} yet; "
                                "its videos are not planned")
            continue
        videos.extend(accepted_videos(catalog, lengths))

    def report(added: int, video: PlannedVideo) -> None:
        if added % LOG_EVERY == 0:
            context.log.info(f"probed {added} new videos (latest {video.keys[0]})")
        if video.error:
            context.log.warning(f"{video.keys[0]}: {video.error}")

    # The plan is append-only: read, extend and write it as one writer (the spec's lock), or two runs
    # could each append to the same old plan and one's videos would be lost.
    existing = read_plan(cache_dir)
    spool = MosaicSpool(vlm_config.layout.mosaic_spool(app.frame_cache), app.frame_cache)
    known = _known_frames(vlm_config, context.log)
    plan, added = extend_plan(existing, videos, app.frame_cache, known, report, decoded=spool.sampled)
    write_plan(cache_dir, plan)
    orphans = spool.keep_only(video.ref for video in plan)
    if orphans:
        context.log.info(f"removed {plural(orphans, 'spooled mosaic')} of videos that are not in the plan")
    shards = list(shard_members(plan))
    new_keys = register_partitions(context.instance, FRAME_CACHE_SHARD_PARTITIONS, shards)
    failed = sum(1 for video in plan if video.error)
    context.log.info(f"plan: {plural(len(plan), 'video')} ({added} new, {failed} unreadable) in {plural(len(shards), 'shard')}")
    return Built({
        "videos": len(plan),
        "media_keys": sum(len(video.keys) for video in plan),
        "new_videos": added,
        "probe_failures": failed,
        "shards": len(shards),
        "new_shards": dg.MetadataValue.json(new_keys),
        "sources_without_lengths": dg.MetadataValue.json(missing),
        "path": dg.MetadataValue.path(str(cache_dir)),
        "latest_videos": dg.MetadataValue.md(plan_table_md(plan)),
    }, data_version=plan_file_digest(cache_dir))


@spec_asset(
    "frame_cache_shard",
    pool=FRAME_CACHE_POOL,
    description="One frame-cache shard: part-NNNNN.tar of JPEG mosaics, then part-NNNNN.done.json. "
    "Mosaics the catalogue rendered are copied from its spool; the others are decoded here.",
)
def frame_cache_shard(context: dg.AssetExecutionContext, vlm_config: VlmConfig) -> Built:
    settings = vlm_config.app.frame_cache
    cache_dir = frame_cache_dir(vlm_config)
    shard = context.partition_key
    # The fingerprint was taken before the plan is read (spec_asset): a plan extended in between then
    # makes the next run rebuild this shard, never call a shard built from fewer members up to date.
    members = shard_members(read_plan(cache_dir)).get(shard)
    if not members:
        raise dg.Failure(f"{shard}: not in the plan at {cache_dir}; materialise video_frame_plan first")

    progress = step_progress(context, "videos")

    def report(done: int, video: PlannedVideo, error: str) -> None:
        progress.update(done, len(members))
        if error:
            context.log.warning(f"{shard}: {video.keys[0]} failed: {error}")
        if done % LOG_EVERY == 0 or done == len(members):
            context.log.info(f"{shard}: {done}/{len(members)} videos")

    started = time.perf_counter()
    spool = MosaicSpool(vlm_config.layout.mosaic_spool(settings), settings)
    record, reused = ensure_shard(cache_dir, shard, members, settings, on_video=report, spool=spool)
    seconds = time.perf_counter() - started
    context.log.info(f"{shard}: {'reused' if reused else 'built'} — {len(record.entries)} cached, {len(record.failures)} failed")
    return Built({
        "videos": len(members),
        "cached": len(record.entries),
        "failed": len(record.failures),
        "reused": reused,
        "tar_bytes": record.tar_bytes,
        "seconds": round(seconds, 3),
        "videos_per_second": round(len(members) / seconds, 2) if not reused and seconds > 0 else 0.0,
        "path": dg.MetadataValue.path(str(tar_path(cache_dir, shard))),
        "failures": dg.MetadataValue.md(
            "\n".join(f"- `{failure.video_id}`: {failure.error}" for failure in record.failures) or "none"
        ),
    })


@spec_asset(
    "frame_cache_index",
    automation_condition=FOLLOWS_UPSTREAM,
    description="index.jsonl (one row per media key with shard, byte offset and size), metadata.json, failures.jsonl.",
)
def frame_cache_index(context: dg.AssetExecutionContext, vlm_config: VlmConfig) -> Built:
    cache_dir = frame_cache_dir(vlm_config)
    plan = read_plan(cache_dir)
    summary = write_index(cache_dir, plan, vlm_config.app.frame_cache)
    context.log.info(summary.line())
    if summary.shards_pending:
        context.log.warning(f"shards not built yet: {', '.join(summary.shards_pending)}")
    return Built({
        "records": summary.records,
        "skipped": summary.skipped,
        "failed": summary.failed,
        "unique_videos": summary.videos,
        "shards_done": summary.shards_done,
        "shards_pending": dg.MetadataValue.json(summary.shards_pending),
        "summary": summary.line(),
        "path": dg.MetadataValue.path(str(cache_dir)),
    })
