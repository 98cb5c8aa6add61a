"""Packing lineage: bins → packed JSON → WebDataset shards → Energon dataset (per source) → training mix."""

import itertools
from collections import Counter
import shutil
import threading
import time

import dagster as dg

from vlm_assets.atomic import atomic_open
from vlm_assets.catalog.lookup import SampleLookup
from vlm_assets.layout import StorageLayout
from vlm_assets.media.copies import MediaCopies
from vlm_assets.defs.conditions import FOLLOWS_UPSTREAM
from vlm_assets.dedup.decisions import removal_kinds
from vlm_assets.defs.failures import emptied, reasons_in
from vlm_assets.defs.packing import checks
from vlm_assets.defs.resources import (
    HEAVY_POOL,
    VlmConfig,
    step_progress,
)
from vlm_assets.defs.spec_assets import Built, spec_asset
from vlm_assets.defs.tags import CHUNKED_TAG, FORCE_TAG
from vlm_assets.packing.empty import EmptySource
from vlm_assets.packing.energon import MAIN_FOLDER_NAME, PreparedRecord, prepare_energon_dataset
from vlm_assets.packing.mix import (
    MixError,
    blended,
    mix_entries,
    mix_table_md,
    source_subflavors,
    token_shares,
    write_metadataset,
)
from vlm_assets.packing.plan import BinsOnDisk, iter_bins, pack_source, reject_categories
from vlm_assets.packing.records import RECORD_COLUMNS, kept_records, write_packed_jsonl
from vlm_assets.packing.report import fill_summary_md, reject_counts_md
from vlm_assets.packing.verify import CheckedShards
from vlm_assets.packing.wds import kept_shards, list_shards, sample_ids_after, write_shards_from_jsonl
from vlm_assets.parallel import step_processes
from vlm_assets.tokens.histogram import length_histogram_md
from vlm_assets.wording import plural

GROUP = "packing"
PROGRESS_EVERY_S = 10.0


def _source(context: dg.AssetExecutionContext, vlm_config: VlmConfig) -> str:
    return vlm_config.source(context.partition_key).name


@spec_asset(
    "packing_bins",
    kinds={"parquet"},
    check_specs=checks.PACKING_BINS_CHECKS,
    description="Best-fit-decreasing bins of each source's samples (≤ sample.max_token_len), and a rejects table with reasons.",
)
def packing_bins(context: dg.AssetExecutionContext, vlm_config: VlmConfig) -> Built:
    app, layout = vlm_config.app, vlm_config.layout
    source = _source(context, vlm_config)
    catalog_path, lengths_path = layout.catalog(source), layout.lengths(source)
    bins_path, rejects_path = layout.bins(source), layout.rejects(source)
    started = time.perf_counter()
    append = app.packing.mode == "append"  # the bins written before stay; only samples not in them are packed
    outcome = pack_source(catalog_path, lengths_path, bins_path, rejects_path,
                          app.sample_type_of(vlm_config.source(source)), app.sample.max_token_len,
                          keep_written_bins=append, media_checks=layout.media_checks(source))
    context.log.info(
        f"{source}: {plural(outcome.packed, 'sample')} into {plural(outcome.bins, 'bin')}"
        + (f" ({outcome.bins_kept} kept, {outcome.bins - outcome.bins_kept} new)" if append else "")
        + f", {outcome.rejected} rejected ({time.perf_counter() - started:.2f}s)"
    )
    # Metadata and checks judge what landed on disk, not what we meant to write.
    bins, rejected = BinsOnDisk.read(bins_path), reject_categories(rejects_path)
    empty = {}
    if not bins.packed:
        reasons = reasons_in(rejects_path, status_column=None)
        left = emptied(source, "packing", reasons, removal_kinds(layout.dedup(source)), reject_counts_md(0, rejected))
        context.log.warning(f"{source}: built empty, {left.why}; it adds nothing to the shards")
        empty = {"empty": left.why}
    max_token_len = app.sample.max_token_len
    return Built({
        "bins_path": dg.MetadataValue.path(str(bins_path)),
        "rejects_path": dg.MetadataValue.path(str(rejects_path)),
        "bins": bins.bins,
        "bins_kept": outcome.bins_kept,
        "packed_samples": bins.packed,
        "rejected_samples": sum(rejected.values()),
        "fill_ratio": bins.fill_ratio(max_token_len),
        "outcomes": dg.MetadataValue.md(reject_counts_md(bins.packed, rejected)),
        "length_histogram": dg.MetadataValue.md(length_histogram_md(bins.lengths, max_token_len)),
        "fill_summary": dg.MetadataValue.md(fill_summary_md(bins, max_token_len)),
        **empty,
    }, checks=checks.packing_bins_results(catalog_path, bins_path, rejects_path, bins, app))


@spec_asset(
    "packed_json",
    kinds={"json"},
    tags={CHUNKED_TAG: "true"},
    description="One packed record per bin: full messages, per-sample lengths, texts, media members and keys.",
)
def packed_json(context: dg.AssetExecutionContext, vlm_config: VlmConfig) -> Built:
    app, layout = vlm_config.app, vlm_config.layout
    source = _source(context, vlm_config)
    path = layout.packed_json(source)
    sample_type = app.sample_type_of(vlm_config.source(source))
    processes = step_processes()
    bins_path = layout.bins(source)
    with atomic_open(path, "wb") as handle:
        # packing.mode append: the records of the bins kept first are kept as they are (their
        # shards are too), copied as they are checked.
        kept = kept_records(path, iter_bins(bins_path), source, sample_type, copy_to=handle) \
            if app.packing.mode == "append" and path.is_file() else 0
        new_bins = itertools.islice(iter_bins(bins_path), kept, None)
        needed = {sample_id for _, sample_ids, _ in new_bins for sample_id in sample_ids} if kept else None
        with SampleLookup(layout.catalog(source), RECORD_COLUMNS, near=path, only=needed) as samples:
            count = kept + write_packed_jsonl(source, itertools.islice(iter_bins(bins_path), kept, None), samples,
                                              sample_type, handle, processes)
    context.log.info(f"{source}: {count} packed records -> {path}" + (f" ({kept} kept)" if kept else "")
                     + (f" ({processes} processes)" if processes > 1 else ""))
    return Built({
        "path": dg.MetadataValue.path(str(path)),
        "records": count,
        "records_kept": kept,
        "sample_type": sample_type,
        "processes": processes,
    })


@spec_asset(
    "packed_wds_shards",
    kinds={"webdataset"},
    pool=HEAVY_POOL,
    tags={CHUNKED_TAG: "true"},
    check_specs=checks.SHARD_CHECKS,
    description="Deterministic pretrain-*.tar shards of the packed records with their original media bytes.",
)
def packed_wds_shards(context: dg.AssetExecutionContext, vlm_config: VlmConfig) -> Built:
    app, layout = vlm_config.app, vlm_config.layout
    source = _source(context, vlm_config)
    jsonl_path = layout.packed_json(source)
    directory = layout.packed_wds(source)
    written = 0
    last_log = time.monotonic()
    progress_lock = threading.Lock()  # several shard writer threads report

    bar = step_progress(context, "samples")

    def progress(key: str) -> None:
        nonlocal written, last_log
        with progress_lock:
            written += 1
            bar.update(written)
            if time.monotonic() - last_log > PROGRESS_EVERY_S:
                context.log.info(f"{source}: {plural(written, 'sample')} written (at {key})")
                last_log = time.monotonic()

    processes = step_processes()
    if context.run.tags.get(FORCE_TAG) == "true":
        layout.checked_shards(source).unlink(missing_ok=True)  # `run --force` reads every shard again
    checked = CheckedShards(layout.checked_shards(source))
    # packing.mode append: the shards written before stay; only the records after theirs need the catalogue.
    kept = kept_shards(directory, checked.sample_count) if app.packing.mode == "append" else None
    needed = sample_ids_after(jsonl_path, kept.records) if kept and kept.records else None
    # Images on object storage that the catalogue read are copied from what it kept, then dropped.
    copies = MediaCopies(layout.media_copies(source))
    with SampleLookup(layout.catalog(source), ["media_refs", "media_stamps"], near=jsonl_path,
                      only=needed) as samples:
        shards = write_shards_from_jsonl(jsonl_path, samples, directory, app.wds.maxcount, app.wds.maxsize,
                                         progress, processes, kept=kept, media_copies=copies)
    copies.clear()
    context.log.info(f"{source}: {plural(written, 'sample')} in {plural(len(shards), 'shard')} -> {directory}"
                     + (f" ({processes} processes)" if processes > 1 else ""))
    members_result = checks.shard_members_result(list_shards(directory), jsonl_path, processes, checked)
    table = ["| shard | samples | bytes |", "|---|---:|---:|"] + [
        f"| {shard.path.name} | {len(shard.keys)} | {shard.size} |" for shard in shards
    ]
    return Built({
        "directory": dg.MetadataValue.path(str(directory)),
        "shards": len(shards),
        "shards_kept": len(list_shards(directory)) - len(shards),
        "samples": written,
        "processes": processes,
        "bytes": sum(shard.size for shard in shards),
        "shard_paths": dg.MetadataValue.json([str(shard.path) for shard in shards]),
        "shard_table": dg.MetadataValue.md("\n".join(table)),
    }, checks=[members_result])


@spec_asset(
    "energon_dataset",
    automation_condition=FOLLOWS_UPSTREAM,
    kinds={"energon"},
    description="The source's own Energon dataset: .nv-meta and tar indexes beside its shards, from energon's own prepare.",
)
def energon_dataset(context: dg.AssetExecutionContext, vlm_config: VlmConfig) -> Built:
    layout = vlm_config.layout
    source = vlm_config.source(context.partition_key)
    root = layout.packed_wds(source.name)
    subflavors = source_subflavors(vlm_config.app, source)
    # Everything it writes is under the source's folder: other sources' metadata is never touched.
    record_path = layout.energon_prepared(source.name)
    forced = context.run.tags.get(FORCE_TAG) == "true"  # `run --force` indexes every shard again
    previous = None if forced else PreparedRecord.load(record_path)
    empty = None
    shards = list_shards(root)
    bins_path = layout.bins(source.name)
    if not shards and bins_path.exists() and not BinsOnDisk.read(bins_path).packed:
        # Energon's prepare refuses a folder without a tar: the source's folder says why it has no dataset.
        empty = _write_empty(layout, source.name)
        record_path.unlink(missing_ok=True)
    else:
        context.log.info(f"{source.name}: preparing Energon metadata over {plural(len(shards), 'shard')} in {root}")
        dataset = prepare_energon_dataset(root, shards, subflavors, previous=previous)
        dataset.record.save(record_path)
        # A source with samples again is no longer empty.
        layout.empty_dataset(source.name).unlink(missing_ok=True)
    if empty is not None:
        context.log.warning(f"{source.name}: no Energon dataset, {empty.why} ({layout.empty_dataset(source.name)}); "
                            "the training mix and the packages leave it out")
        return Built({
            "path": dg.MetadataValue.path(str(root)),
            "shards": 0,
            "samples": 0,
            "empty": empty.why,
            "empty_record": dg.MetadataValue.path(str(layout.empty_dataset(source.name))),
            "subflavors": dg.MetadataValue.json(subflavors),
        })
    if dataset.kept_shards:
        context.log.info(f"{source.name}: kept the index entries of the {plural(dataset.kept_shards, 'shard')} "
                         f"indexed before; Energon read only the {plural(len(shards) - dataset.kept_shards, 'new shard')}")
    else:
        context.log.info(f"{source.name}: Energon read every shard: {'forced' if forced else dataset.read_in_full}")
    context.log.info(f"{source.name}: Energon indexed {plural(dataset.sample_count, 'sample')} -> {dataset.meta_dir}")
    return Built({
        "path": dg.MetadataValue.path(str(root)),
        "meta_dir": dg.MetadataValue.path(str(dataset.meta_dir)),
        "shards": len(dataset.shards),
        "shards_kept": dataset.kept_shards,
        "samples": dataset.sample_count,
        "index_uuid": dataset.record.index_uuid,
        "subflavors": dg.MetadataValue.json(subflavors),
    })


def _write_empty(layout: StorageLayout, source: str) -> EmptySource:
    """Record the source as empty in its folder (its rejects say why), its Energon metadata of an earlier build gone."""
    rejects = layout.rejects(source)
    reasons = reasons_in(rejects, status_column=None) if rejects.exists() else Counter()
    duplicate_reasons = removal_kinds(layout.dedup(source))
    empty = EmptySource(source, sum(reasons.values()),
                        sum(count for reason, count in reasons.items() if reason in duplicate_reasons))
    empty.save(layout.empty_dataset(source))
    meta = layout.packed_wds(source) / MAIN_FOLDER_NAME
    if meta.is_dir():
        shutil.rmtree(meta)
    return empty


@spec_asset(
    "training_mix",
    automation_condition=FOLLOWS_UPSTREAM,
    kinds={"energon", "yaml"},
    description="packed_wds/metadataset.yaml: an Energon MetadatasetV2 blending every source's dataset by its "
    "`weight`, with subflavors sample_type and source; the metadata shows each source's share of training tokens.",
)
def training_mix(context: dg.AssetExecutionContext, vlm_config: VlmConfig) -> Built:
    layout = vlm_config.layout
    sources, left_out = vlm_config.mix_sources(context.log)
    path = layout.metadataset
    try:
        entries = mix_entries(vlm_config.app, sources, layout)
    except MixError as error:
        raise dg.Failure(description=f"training_mix: {error}") from error
    write_metadataset(path, entries)
    # Energon metadata directly under packed_wds/ makes it one dataset over every source, which
    # packaging would copy beside the mix (that names each source's own dataset), stale.
    legacy = layout.packed_wds_root / MAIN_FOLDER_NAME
    if legacy.is_dir():
        shutil.rmtree(legacy)
        context.log.info(f"removed {legacy}: each source now has its own Energon dataset")
    tokens = token_shares(entries)
    context.log.info("training mix: " + ", ".join(f"{e.source} {tokens[e.source]:.1%} of tokens" for e in entries))
    return Built({
        "path": dg.MetadataValue.path(str(path)),
        "sources": len(entries),
        "blended_sources": len(blended(entries)),
        "bins": sum(entry.bins for entry in entries),
        "tokens": sum(entry.tokens for entry in entries),
        "mix": dg.MetadataValue.md(mix_table_md(entries)),
        "token_shares": dg.MetadataValue.json({source: round(share, 6) for source, share in tokens.items()}),
        "tokens_by_source": dg.MetadataValue.json({entry.source: entry.tokens for entry in entries}),
        "subflavors": dg.MetadataValue.json({entry.source: entry.subflavors for entry in entries}),
        "left_out": dg.MetadataValue.json(left_out),
    })
