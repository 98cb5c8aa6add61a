"""Duplicate samples removed between the catalogue and the token lengths, per source."""

import dagster as dg
import numpy as np

from vlm_assets.dedup.decisions import COPIES, removed_kinds
from vlm_assets.defs.resources import HEAVY_POOL, SOURCES_PARTITIONS, LoggedProgress, VlmConfig
from vlm_assets.defs.spec_assets import Built, spec_asset
from vlm_assets.package.writer import sha256_file
from vlm_assets.packing.plan import packed_sample_ids
from vlm_assets.parallel import step_processes
from vlm_assets.parquet_batches import parquet_rows
from vlm_assets.wording import plural


@spec_asset(
    "sample_dedup",
    kinds={"parquet"},
    pool=HEAVY_POOL,
    description="Samples whose media and conversation duplicate a sample kept before them (this source or one "
    "of higher priority), exactly or nearly, each with the sample kept; the token lengths reject them with that reason.",
)
def sample_dedup(context: dg.AssetExecutionContext, vlm_config: VlmConfig) -> Built:
    # Imported here: datasketch imports SciPy, which every load of the definitions would pay for.
    from vlm_assets.dedup import build, report
    from vlm_assets.dedup.signatures import VideoFrames

    app, layout = vlm_config.app, vlm_config.layout
    source = vlm_config.source(context.partition_key)
    fingerprints = vlm_config.fingerprints(context.instance)
    ahead, behind = fingerprints.dedup_ahead(source.name), fingerprints.dedup_behind(source.name)
    progress = LoggedProgress(context, "samples", lambda done, _total: f"{source.name}: {plural(done, 'signature')} computed")
    # packing.mode append: bins once written stay, so the samples in them are kept before any other.
    # Not part of the fingerprint: what a packing adds to them was kept by these very decisions.
    packed = {name: packed_sample_ids(layout.bins(name)) for name in [*ahead, source.name, *behind]} \
        if app.packing.mode == "append" else None
    outcome = build.deduplicate_source(layout, source.name, ahead, app.dedup, app.frame_cache, step_processes(),
                                       progress.update, packed, behind)
    decisions = outcome.decisions
    removed = decisions.removed
    context.log.info(
        f"{source.name}: {plural(len(removed), 'duplicate')} removed of {plural(decisions.examined, 'sample')} "
        f"({plural(outcome.signatures_computed, 'signature')} computed, "
        f"{outcome.signatures_resumed} kept from an interrupted build, the others stored before; "
        f"compared with the samples kept in {', '.join(outcome.sources_ahead) or 'no other source'} first)")
    shown = removed[:report.EXAMPLE_PAIRS * 4]
    media = build.first_media(layout, [source.name, *outcome.sources_ahead, *outcome.sources_behind],
                              {sample_id for removal in shown for sample_id in (removal.sample_id, removal.kept_id)})
    video_frames = VideoFrames(layout.mosaic_spool(app.frame_cache), app.frame_cache)
    return Built({
        "path": dg.MetadataValue.path(str(layout.dedup(source.name))),
        "samples": decisions.examined,
        "removed": len(removed),
        "removed_share": round(len(removed) / decisions.examined, 4) if decisions.examined else 0.0,
        "removed_by_kind": dg.MetadataValue.json(report.counts_by_kind(removed)),
        "largest_clusters": dg.MetadataValue.md(report.largest_clusters_md(removed)),
        "images_reused": dg.MetadataValue.md(report.reused_media_md(decisions.reused_media)),
        "example_pairs": dg.MetadataValue.md(report.example_pairs_md(shown, media.get, lambda ref: _middle(video_frames.frames(ref)))),
        "distance_histogram": dg.MetadataValue.md(report.distance_histogram_md(removed)),
        "signatures_computed": outcome.signatures_computed,
        "signatures_written": outcome.signatures_written,
        "signatures_resumed": outcome.signatures_resumed,
        "signatures_computed_ahead": outcome.signatures_computed_ahead,
        "sources_ahead": dg.MetadataValue.json(outcome.sources_ahead),
        "sources_behind_with_packed_samples": dg.MetadataValue.json(outcome.sources_behind),
    }, data_version=sha256_file(layout.dedup(source.name))[:20])


def _middle(frames: np.ndarray) -> np.ndarray:
    return frames[len(frames) // 2]


@dg.asset_check(
    asset=sample_dedup,
    partitions_def=SOURCES_PARTITIONS,
    description="Fails when deduplication removed more of the source's catalogued samples as near duplicates than "
    "dedup.max_removed_share (exact copies are not counted: no distance or threshold decides them).",
)
def dedup_within_share(context: dg.AssetCheckExecutionContext, vlm_config: VlmConfig) -> dg.AssetCheckResult:
    layout = vlm_config.layout
    source = context.partition_key
    # Both files of one build: none is rewritten while they are read.
    with vlm_config.locked_to_read(context.log, "sample_dedup", source):
        kinds = removed_kinds(layout.dedup(source))
        samples = parquet_rows(layout.dedup_signatures(source))  # one row per catalogued ok sample
    # A share of near duplicates above the limit points at a distance or threshold set too loose; exact
    # copies are certain, so a drop of data already kept passes, however much of it is copied.
    copies = sum(count for kind, count in kinds.items() if kind in COPIES)
    near = sum(kinds.values()) - copies
    share = near / samples if samples else 0.0
    limit = vlm_config.app.dedup.max_removed_share
    passed = share <= limit
    description = (f"{plural(near, 'sample')} of {samples} removed as near duplicates ({share:.1%}), "
                   f"{'within' if passed else 'above'} dedup.max_removed_share ({limit:.0%})")
    if copies:
        description += f"; {plural(copies, 'exact copy', 'exact copies')} removed too, not counted"
    if not passed:
        description += ("; look at the asset's largest clusters and example pairs, then raise the share, "
                        "lower the distances, raise the text threshold or switch a near kind off")
    return dg.AssetCheckResult(passed=passed, description=description,
                               metadata={"removed": near + copies, "near_removed": near, "copies_removed": copies,
                                         "samples": samples, "removed_share": round(share, 4),
                                         "max_removed_share": limit})
