"""Sample catalogue and token-length assets, partitioned by source."""


from collections import Counter
from pathlib import Path


import dagster as dg
import numpy as np
import pandas as pd

from vlm_assets.catalog.appending import reading_settings
from vlm_assets.catalog.build import MediaValidator
from vlm_assets.media.checks import MediaCheckLog
from vlm_assets.media.copies import MediaCopies
from vlm_assets.catalog.schema import STATUS_OK
from vlm_assets.catalog.table import CatalogSummary, SourceChangedError, write_catalog
from vlm_assets.dedup.decisions import removal_kinds, removed_reasons
from vlm_assets.defs.catalog.source_files import (
    observed_digest,
    observed_source_files,
    source_files_observation,
)
from vlm_assets.defs.failures import emptied, nothing_left, reasons_in
from vlm_assets.defs.resources import (
    CHUNK_INDEX_PARTITIONS,
    HEAVY_POOL,
    SOURCES_PARTITIONS,
    HFProcessor,
    LoggedProgress,
    register_partitions,
    VlmConfig,
)
from vlm_assets.defs.spec_assets import Built, spec_asset
from vlm_assets.defs.tags import CHUNKED_TAG, FORCE_TAG
from vlm_assets.frames.spool import MosaicSpool
from vlm_assets.package.writer import sha256_file
from vlm_assets.tokens.consumer import counting_rule
from vlm_assets.tokens.histogram import length_histogram_md
from vlm_assets.parallel import step_processes
from vlm_assets.parquet_batches import rows_with_ids
from vlm_assets.tokens.lengths import SampleForLength
from vlm_assets.tokens.profile import ProcessorProfile, check_model_type, processor_profile
from vlm_assets.tokens.processor import transformers_version
from vlm_assets.config import SourceConfig
from vlm_assets.catalog.source_walk import Snapshot
from vlm_assets.fingerprints import Fingerprints
from vlm_assets.tokens.chunk_plan import ChunkPlan, chunk_index_key, plan_chunks, split_chunk_partition
from vlm_assets.tokens.table import ChunkStore, LengthTableSummary, rows_to_recheck, write_length_table
from vlm_assets.wording import md_cell, plural

# Rows of each kind (text only, one image, several, video, mixed) the check recomputes.
CHECK_ROWS_PER_KIND = 8
# Rows of the rejects_by_reason table: the commonest reasons, the others counted below it.
SHOWN_REASONS = 20


def reason_table_md(reasons: Counter[str], rows: int = SHOWN_REASONS) -> str:
    """The commonest reasons, whole, one row each; the rest summed up in one line below the table."""
    if not reasons:
        return "_none_"
    ranked = reasons.most_common()
    lines = ["| reason | samples |", "|---|---:|"] + [f"| {md_cell(reason)} | {count} |" for reason, count in ranked[:rows]]
    rest = ranked[rows:]
    if rest:
        lines += ["", f"… {plural(len(rest), 'more reason')} ({plural(sum(count for _, count in rest), 'sample')})"]
    return "\n".join(lines)


@spec_asset(
    "sample_catalog",
    fingerprints_itself=True,
    kinds={"parquet"},
    tags={CHUNKED_TAG: "true"},
    description="Every input sample of a source: normalised messages, exactly resolved media, ok or rejected with a reason.",
)
def sample_catalog(context: dg.AssetExecutionContext, vlm_config: VlmConfig) -> Built:
    source = vlm_config.source(context.partition_key)
    fingerprints = vlm_config.fingerprints(context.instance)
    progress = LoggedProgress(context, "records", lambda done, _total: f"{plural(done, 'record')} catalogued")
    context.log.info(f"cataloguing {source.kind} source {source.name!r} at {source.path}")
    path = vlm_config.layout.catalog(source.name)
    built = None
    observed = observed_source_files(context.instance, source.name)
    if observed is not None:
        # The files as `vlm-assets run` (or the sensor) last walked them, not walked once more before
        # reading (seconds for a million media files): the walk after reading proves they still are.
        fingerprints.assume_walked(source.name, observed)
        try:
            built = _catalogue(context, vlm_config, fingerprints, source, observed.snapshot, progress)
        except SourceChangedError as changed:
            context.log.info(f"{source.name}: walking its files again, they differ from their last observation ({changed})")
            fingerprints = vlm_config.fingerprints(context.instance)
    if built is None:
        walked = fingerprints.source_walk(source.name)
        if observed_digest(context.instance, source.name) != walked.digest:
            # Recorded before the materialisation, so the UI compares later observations with what this read.
            context.log_event(source_files_observation(source, walked))
        built = _catalogue(context, vlm_config, fingerprints, source, walked.snapshot, progress)
    summary, validator, chunks = built
    fingerprint = fingerprints.of("sample_catalog", source.name)
    register_partitions(context.instance, CHUNK_INDEX_PARTITIONS, list(map(chunk_index_key, range(len(chunks)))))
    if summary.kept:
        context.log.info(f"{source.name}: kept the {plural(summary.kept, 'row')} read before; read only the appended records")
    elif summary.read_in_full:
        context.log.info(f"{source.name}: read in full: {summary.read_in_full}")
    context.log.info(
        f"{source.name}: {summary.ok} ok, {summary.rejected} rejected -> {path} "
        f"({validator.decoded} media decoded, {validator.remembered} unchanged since their last check)"
    )
    if not summary.ok:
        raise nothing_left(source.name, "its catalogue", summary.reject_reasons, reason_table_md(summary.reject_reasons))
    return Built({
        "path": dg.MetadataValue.path(str(path)),
        "samples": summary.samples,
        "ok": summary.ok,
        "rejected": summary.rejected,
        "media_type_counts": dg.MetadataValue.json(dict(summary.media_types.most_common())),
        "rejects_by_reason": dg.MetadataValue.md(reason_table_md(summary.reject_reasons)),
        "multi_turn_samples": summary.multi_turn,
        "rows_kept": summary.kept,
        "media_decoded": validator.decoded,
        "media_unchanged_since_last_check": validator.remembered,
        "length_chunks": len(chunks),
        "rows_per_length_chunk": chunks.rows,
    }, fingerprint=fingerprint,
        # Its bytes: a catalogue rebuilt unchanged (a file touched) leaves its chunks fresh in the UI too.
        data_version=sha256_file(path)[:20])


def _catalogue(context: dg.AssetExecutionContext, vlm_config: VlmConfig, fingerprints: Fingerprints,
               source: SourceConfig, before: Snapshot, progress: LoggedProgress,
               ) -> tuple[CatalogSummary, MediaValidator, ChunkPlan]:
    """Write the source's catalogue and its chunk plan, from files that were as `before` says when
    the reading began (SourceChangedError when they no longer are once it ends)."""
    app, layout = vlm_config.app, vlm_config.layout
    path = layout.catalog(source.name)
    check_log = MediaCheckLog(layout.media_checks(source.name))
    # The validating decode also renders each video's frame-cache mosaic, for the plan and shards to take.
    spool = MosaicSpool(layout.mosaic_spool(app.frame_cache), app.frame_cache)
    # Of a source on object storage, the images the catalogue reads are kept for the shards to copy.
    copies = MediaCopies(layout.media_copies(source.name)) if source.on_object_store else None
    validator = MediaValidator(app.frame_cache.num_frames, check_log, spool, source.max_image_pixels, copies)
    read_mark = layout.catalog_read_mark(source.name)
    if context.run.tags.get(FORCE_TAG) == "true":
        read_mark.unlink(missing_ok=True)  # `run --force` reads every record again
    summary = write_catalog(
        source, path, app.sample.text_key, validator, step_processes(),
        progress=progress.update,
        excluded=fingerprints.excluded,
        read_mark=read_mark,
        settings=reading_settings(source, fingerprints.versions["sample_catalog"]),
        before=before,
    )
    chunks = plan_chunks(path, source.chunk_rows)
    chunks.save(layout.chunk_plan(source.name))
    return summary, validator, chunks


def _samples_for_length(frame: pd.DataFrame) -> list[SampleForLength]:
    return [
        SampleForLength(row.sample_id, row.messages, list(row.media_kinds), list(row.media_refs))
        for row in frame.itertuples(index=False)
    ]


def _measure_lengths(context: dg.AssetExecutionContext, vlm_config: VlmConfig, source: SourceConfig,
                     target: Path | None, rows: range | None = None, reuse: bool = True) -> LengthTableSummary:
    """Token lengths of the source's catalogue (`rows` of it only, into the chunk store, without a `target`).

    `reuse`: take the chunks already in the store (a run of `vlm-assets run --force` measures them again).
    """
    app, layout = vlm_config.app, vlm_config.layout
    # Chunks measured by an earlier build under the same settings (the transformers release among
    # them, through the processor's fingerprint) are reused: a killed run, appended records, a chunk
    # measured by its own run.
    store = ChunkStore(layout.length_chunks(source.name), settings="|".join(
        [vlm_config.fingerprints(context.instance).versions["sample_lengths"], str(source.rejects_control_tokens)]),
        reuse=reuse)

    def loaded(profile: ProcessorProfile) -> None:
        context.log.info(f"processor {profile.describe()}")
        check_model_type(app.model, profile)

    progress = LoggedProgress(context, "samples",
                              lambda done, total: f"{context.partition_key}: token lengths {done}/{total}")

    summary = write_length_table(
        layout.catalog(source.name), target, app.model, app.frame_cache, step_processes(), progress.update,
        reject_control_tokens=source.rejects_control_tokens, on_processor_loaded=loaded, store=store, rows=rows,
        rule=counting_rule(app, source),
        # The frame count, fps and frame indices the catalogue's decoding pass found for each video:
        # a family whose video text follows them (Qwen3-VL's timestamps) counts them without a decode.
        clip_spool=layout.mosaic_spool(app.frame_cache),
        # The whole table rejects the samples deduplication removed; a chunk's measurements are kept as they are.
        removed=removed_reasons(layout.dedup(source.name)) if target is not None else None,
    )
    if summary.reused_rows:
        context.log.info(f"{context.partition_key}: {plural(summary.reused_rows, 'row')} reused from chunks measured before")
    return summary


@spec_asset(
    "sample_length_chunk",
    kinds={"parquet"},
    pool=HEAVY_POOL,
    tags={CHUNKED_TAG: "true"},
    description="Token lengths of one chunk of a source's catalogue (rows [k × chunk_rows, (k + 1) × chunk_rows)), "
    "kept for sample_lengths to assemble: a big source's chunks are measured side by side, on any worker, "
    "and a killed or appended build measures only the chunks it lacks.",
)
def sample_length_chunk(context: dg.AssetExecutionContext, vlm_config: VlmConfig) -> Built:
    source_name, index = split_chunk_partition(context.partition_key)
    source = vlm_config.source(source_name)
    plan = ChunkPlan.load(vlm_config.layout.chunk_plan(source.name))
    if plan is None:
        raise dg.Failure(f"{source.name}: its catalogue has no chunk plan yet; build sample_catalog[{source.name}] first")
    if index >= len(plan):
        # A cell of the source × chunk grid past this source's last chunk (a bigger source made the index).
        context.log.info(f"{source.name} has {plural(len(plan), 'chunk')}; chunk {index} holds no rows")
        return Built({"rows": 0, "source_chunks": len(plan)})
    rows = plan.row_range(index)
    summary = _measure_lengths(context, vlm_config, source, None, rows,
                               reuse=context.run.tags.get(FORCE_TAG) != "true")
    lengths = summary.ok_token_lens
    return Built({
        "first_row": rows.start,
        "last_row": rows.stop - 1,
        "samples": summary.samples,
        "ok": len(lengths),
        "total_tokens": int(lengths.sum()),
        "rows_reused": summary.reused_rows,
        "source_chunks": len(plan),
        "processes": summary.processes,
    })


@spec_asset(
    "sample_lengths",
    kinds={"parquet"},
    pool=HEAVY_POOL,
    tags={CHUNKED_TAG: "true"},
    description="Exact token length of every catalogued sample under the configured HF processor (fast path, checked against the exact path).",
)
def sample_lengths(
    context: dg.AssetExecutionContext, vlm_config: VlmConfig, hf_processor: HFProcessor
) -> Built:
    app = vlm_config.app
    source = vlm_config.source(context.partition_key)
    path = vlm_config.layout.lengths(source.name)
    # Chunks measured by their own runs (sample_length_chunk, forced ones too) are taken from the
    # store; any chunk not measured yet (a run of this asset alone) is measured here.
    summary = _measure_lengths(context, vlm_config, source, path)
    profile = summary.profile
    assert profile is not None, "a source's whole table loads its processor"
    lengths = summary.ok_token_lens
    empty = {}
    if not len(lengths):
        reasons = reasons_in(path)
        left = emptied(source.name, "token lengths", reasons, removal_kinds(vlm_config.layout.dedup(source.name)),
                       reason_table_md(reasons))
        context.log.warning(f"{source.name}: built empty, {left.why}; it adds nothing to the shards")
        empty = {"empty": left.why, "rejects_by_reason": dg.MetadataValue.md(reason_table_md(reasons))}
    return Built({
        "path": dg.MetadataValue.path(str(path)),
        "samples": summary.samples,
        "ok": len(lengths),
        "rejected": summary.samples - len(lengths),
        "total_tokens": int(lengths.sum()),
        "median_tokens": float(np.median(lengths)) if len(lengths) else 0.0,
        "max_tokens": int(lengths.max()) if len(lengths) else 0,
        # Up to the longest sample, not sample.max_token_len: the lengths do not depend on that setting,
        # so neither does their table (packing_bins shows the split at max_token_len).
        "length_histogram": dg.MetadataValue.md(length_histogram_md(lengths, int(lengths.max()) if len(lengths) else 1)),
        "processes": summary.processes,
        "rows_reused": summary.reused_rows,
        "processor": app.model.processor,
        "processor_family": profile.modalities.processor_class,
        "length_path": profile.describe(),
        "special_tokens_in_text": source.special_tokens_in_text,
        "processor_fingerprint": hf_processor.fingerprint(),
        "transformers": transformers_version(),
        **empty,
    })


@dg.asset_check(
    asset=sample_lengths,
    partitions_def=SOURCES_PARTITIONS,
    blocking=True,
    description=(
        "Recomputes random rows of each kind (text only, one image, several images, video, mixed) of at most "
        "262,144 tokens with the exact processor path; fails on any difference, on rows the processor call itself refused, and on a "
        "source whose accepted samples have no length. A failed check moves the table aside."
    ),
)
def lengths_match_processor(
    context: dg.AssetCheckExecutionContext, vlm_config: VlmConfig, hf_processor: HFProcessor
) -> dg.AssetCheckResult:
    source = vlm_config.source(context.partition_key)
    layout = vlm_config.layout
    counter = hf_processor.length_counter(source)
    selection = rows_to_recheck(layout.catalog(source.name), layout.lengths(source.name), CHECK_ROWS_PER_KIND)
    chosen = list(selection.chosen)
    mismatches = []
    if chosen:
        # Only the chosen rows of the catalogue are read: a big source's conversations stay on disk.
        rows = pd.DataFrame(rows_with_ids(layout.catalog(source.name), chosen, ["messages", "media_kinds", "media_refs"]))
        for sample in _samples_for_length(rows.set_index("sample_id", drop=False).loc[chosen]):
            exact = counter.exact(sample)
            expected = selection.chosen[sample.sample_id]
            if exact.status != STATUS_OK or exact.token_len != expected:
                mismatches.append({"sample_id": sample.sample_id, "kind": selection.kind_of[sample.sample_id],
                                   "stored": expected, "exact": exact.token_len, "reason": exact.reason})
    problems = []
    if mismatches:
        problems.append(f"{plural(len(mismatches), 'row')} differ from the exact path")
    if selection.processor_failure_count:
        problems.append(f"the processor call refused {plural(selection.processor_failure_count, 'row')}")
    # Rows the sample type cannot carry and the duplicates removed are rejects with their reason,
    # not a processor's failure.
    accepted = selection.catalog_ok - selection.not_carried - len(removed_reasons(layout.dedup(source.name)))
    if accepted > 0 and not selection.ok_by_kind:
        problems.append(f"none of the {plural(accepted, 'accepted sample')} has a length")
    recomputed = Counter(selection.kind_of.values())
    description = (f"{plural(len(chosen), 'row')} recomputed with the exact path "
                   f"({', '.join(f'{kind} {n}' for kind, n in recomputed.items()) or 'none'}), {len(mismatches)} differ")
    if problems:
        aside = layout.lengths_failed_check(source.name)
        layout.lengths(source.name).replace(aside)
        description = f"{'; '.join(problems)}. Table moved to {aside}. {description}"
    return dg.AssetCheckResult(
        passed=not problems,
        metadata={
            "rows_checked": len(chosen),
            "rows_checked_by_kind": dg.MetadataValue.json(dict(recomputed)),
            "ok_rows_by_kind": dg.MetadataValue.json(dict(selection.ok_by_kind)),
            "ok_rows_too_long_to_recheck": selection.too_long,
            "mismatches": dg.MetadataValue.json(mismatches[:20]),
            "processor_call_failures": selection.processor_failure_count,
            "processor_call_failure_examples": dg.MetadataValue.json(selection.processor_failures),
            "length_path": processor_profile(counter).describe(),
        },
        description=description,
    )
