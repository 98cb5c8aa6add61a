"""Asset checks of the packing lineage. Each re-reads what was written to disk."""

import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import dagster as dg


from vlm_assets.config import AppConfig
from vlm_assets.defs.resources import SOURCES_PARTITIONS, VlmConfig
from vlm_assets.packing.empty import EmptySource
from vlm_assets.packing.energon import PreparedRecord, first_unloaded_sample, live_index_uuid, record_loaded
from vlm_assets.packing.mix import (
    DRAW_SEED,
    SHARE_SIGMAS,
    MixError,
    draws_needed,
    judge_draws,
    mix_entries,
)
from vlm_assets.packing.plan import BinsOnDisk
from vlm_assets.packing.records import record_id
from vlm_assets.packing.verify import (
    accounting_problems,
    CheckedShards,
    check_shard_members,
)
from vlm_assets.wording import plural

# Declared per partition, like the standalone checks, so the UI shows each result's source.
PACKING_BINS_CHECKS = [
    dg.AssetCheckSpec("every_sample_accounted_for", asset="packing_bins", blocking=True, partitions_def=SOURCES_PARTITIONS,
                      description="catalogue = packed ∪ rejects, disjoint, each id once"),
    dg.AssetCheckSpec("bins_within_max_token_len", asset="packing_bins", blocking=True, partitions_def=SOURCES_PARTITIONS,
                      description="every bin's total ≤ sample.max_token_len"),
    dg.AssetCheckSpec("fill_ratio", asset="packing_bins", partitions_def=SOURCES_PARTITIONS,
                      description="share of the token budget used; warns below packing.min_fill_ratio"),
]
SHARD_CHECKS = [
    dg.AssetCheckSpec("tar_members_match_records", asset="packed_wds_shards", blocking=True, partitions_def=SOURCES_PARTITIONS,
                      description="the shards hold exactly packed_json's records, each with exactly its members"),
]


def packing_bins_results(
    catalog: Path, bins_path: Path, rejects: Path, bins: BinsOnDisk, app: AppConfig
) -> Iterator[dg.AssetCheckResult]:
    problems = accounting_problems(catalog, bins_path, rejects)
    yield dg.AssetCheckResult(
        check_name="every_sample_accounted_for",
        passed=not problems,
        metadata={"problems": dg.MetadataValue.md("\n".join(f"- {p}" for p in problems) or "none")},
    )
    oversized = bins.oversized(app.sample.max_token_len)
    yield dg.AssetCheckResult(
        check_name="bins_within_max_token_len",
        passed=not oversized,
        metadata={"oversized_bins": len(oversized), "examples": dg.MetadataValue.json(oversized[:10])},
    )
    ratio = bins.fill_ratio(app.sample.max_token_len)
    passed = ratio >= app.packing.min_fill_ratio or not bins.bins
    yield dg.AssetCheckResult(
        check_name="fill_ratio",
        passed=passed,
        severity=dg.AssetCheckSeverity.WARN,
        description=_fill_ratio_finding(ratio, bins, app, passed),
        metadata={"fill_ratio": ratio, "min_fill_ratio": app.packing.min_fill_ratio, "bins": bins.bins},
    )


def _fill_ratio_finding(ratio: float, bins: BinsOnDisk, app: AppConfig, passed: bool) -> str:
    """The fill ratio against its minimum, and for one below it what would raise it."""
    if not bins.bins:
        return "no bins: nothing packed to fill"
    found = (f"fill ratio {ratio:.2f} ({bins.tokens:,} tokens in {plural(bins.bins, 'bin')} of sample.max_token_len "
             f"{app.sample.max_token_len:,})")
    if passed:
        return f"{found}, at least packing.min_fill_ratio {app.packing.min_fill_ratio:g}"
    if bins.tokens < app.sample.max_token_len:
        remedy = ("the whole source holds fewer tokens than one bin: give it more samples, lower sample.max_token_len, "
                  "or lower packing.min_fill_ratio to accept a small source's padding")
    else:
        remedy = ("the rest of the bins' capacity is padding: lower sample.max_token_len towards the samples' lengths "
                  "so that they pack tighter, or lower packing.min_fill_ratio to accept the padding")
    return f"{found}, below packing.min_fill_ratio {app.packing.min_fill_ratio:g}; {remedy}"


def shard_members_result(shards: list[Path], jsonl_path: Path, processes: int, checked: CheckedShards) -> dg.AssetCheckResult:
    result = check_shard_members(shards, jsonl_path, processes, checked)
    problems = result.problems
    return dg.AssetCheckResult(
        check_name="tar_members_match_records",
        passed=not problems,
        metadata={
            "shards": len(shards),
            "shards_read": result.shards_read,
            "problems": dg.MetadataValue.md("\n".join(f"- {p}" for p in problems) or "none"),
        },
    )


@dg.asset_check(
    asset="energon_dataset",
    partitions_def=SOURCES_PARTITIONS,
    blocking=True,
    description="Load every sample of the source's dataset through Energon's loader (stateless cooker, errors "
    "re-raised); ids must equal the bins'. Samples the dataset kept from an index that loaded in full are not "
    "loaded again (`loaded_from`).",
)
def energon_loads_every_sample(context: dg.AssetCheckExecutionContext, vlm_config: VlmConfig) -> dg.AssetCheckResult:
    from vlm_assets.packing.energon_loader import (
        load_all_ids,  # imports torch: only when the check runs
    )

    layout = vlm_config.layout
    source = context.partition_key
    root = layout.packed_wds(source)
    loaded_record = layout.energon_loaded(source)
    # Shared with other readers; excludes the shard writers and a re-prepare while Energon reads.
    with vlm_config.locked_to_read(context.log, "energon_dataset", source):
        bins_path = layout.bins(source)
        empty = EmptySource.load(layout.empty_dataset(source))
        if empty is not None and bins_path.exists() and not BinsOnDisk.read(bins_path).packed:
            return dg.AssetCheckResult(passed=True, description=f"nothing to load: {empty.why}",
                                       metadata={"loaded": 0, "expected": 0, "empty": empty.why})
        expected = [record_id(source, bin_id) for bin_id in BinsOnDisk.read(bins_path).bin_ids.tolist()] if bins_path.exists() else []
        live_uuid = live_index_uuid(root)
        start = first_unloaded_sample(PreparedRecord.load(layout.energon_prepared(source)), live_uuid, loaded_record)
        if start:
            context.log.info(f"{source}: the first {plural(start, 'sample')} were kept from an index whose every "
                             "sample loaded; loading the samples after them")
        loaded = load_all_ids(vlm_config.energon_location(root), start)
        if vlm_config.app.storage_url is not None:
            context.log.info(f"{source}: loaded from {vlm_config.energon_location(root)}")
        expected = expected[start:] if start <= len(expected) else []
        context.log.info(f"{source}: Energon loaded {plural(len(loaded), 'sample')}; the bins expect {len(expected)}")
        duplicates = sorted(key for key, count in Counter(loaded).items() if count > 1)
        missing = sorted(set(expected) - set(loaded))
        unexpected = sorted(set(loaded) - set(expected))
        passed = not (duplicates or missing or unexpected) and len(loaded) == len(expected)
        record_loaded(loaded_record, live_uuid if passed else None)
    return dg.AssetCheckResult(
        passed=passed,
        metadata={
            "loaded": len(loaded),
            "expected": len(expected),
            "loaded_from": start,
            "missing": dg.MetadataValue.json(missing[:20]),
            "unexpected": dg.MetadataValue.json(unexpected[:20]),
            "duplicates": dg.MetadataValue.json(duplicates[:20]),
        },
    )


@dg.asset_check(
    asset="training_mix",
    blocking=True,
    description="Draw from metadataset.yaml with Energon's get_train_dataset (fixed seed): every weighted source is "
    f"drawn, each source's drawn share within {SHARE_SIGMAS:g} binomial standard errors of its weight share, and "
    "every drawn sample's source and sample_type subflavors match its record.",
)
def training_mix_draws_match_weights(context: dg.AssetCheckExecutionContext, vlm_config: VlmConfig) -> dg.AssetCheckResult:
    from vlm_assets.packing.energon_loader import (
        draw_from_metadataset,  # imports torch: only when the check runs
    )

    layout = vlm_config.layout
    sources, _ = vlm_config.mix_sources(context.log)
    with vlm_config.locked_to_read(context.log, "training_mix"):
        try:
            entries = mix_entries(vlm_config.app, sources, layout)
        except MixError as error:
            return dg.AssetCheckResult(passed=False, metadata={"error": str(error)})
        draws = draws_needed(entries)
        started = time.perf_counter()
        drawn = draw_from_metadataset(vlm_config.energon_location(layout.metadataset), draws, DRAW_SEED)
    context.log.info(f"drew {plural(len(drawn), 'sample')} through Energon in {time.perf_counter() - started:.1f}s")
    report = judge_draws(entries, [sample.source for sample in drawn])
    sample_types = {entry.source: entry.sample_type for entry in entries}
    mislabelled = sorted({
        sample.record["id"] for sample in drawn
        if not sample.record["id"].startswith(f"{sample.source}_")
        or not sample.sample_type == sample.record["sample_type"] == sample_types.get(sample.source)
    })
    problems = list(report.problems)
    if mislabelled:
        problems.append(f"{len(mislabelled)} drawn sample(s) whose source or sample_type subflavor does not match "
                        f"the record, e.g. {mislabelled[:5]}")
    if len(drawn) < draws:
        problems.append(f"Energon yielded {len(drawn)} samples, {draws} were asked for")
    return dg.AssetCheckResult(
        passed=not problems,
        metadata={
            "draws": report.draws,
            "seed": DRAW_SEED,
            "sigmas": SHARE_SIGMAS,
            "shares": dg.MetadataValue.md(report.table_md()),
            "problems": dg.MetadataValue.md("\n".join(f"- {p}" for p in problems) or "none"),
        },
    )
