"""Asset checks of the packing lineage. Each re-reads what was written to disk."""

from collections import Counter
from collections.abc import Iterable, Iterator
from pathlib import Path

import dagster as dg
import pandas as pd

from vlm_assets.config import AppConfig
from vlm_assets.defs.resources import SOURCES_PARTITIONS, VlmConfig
from vlm_assets.packing.plan import fill_ratio, read_bins
from vlm_assets.packing.records import record_id
from vlm_assets.packing.verify import (
    accounting_problems,
    oversized_bins,
    shard_problems,
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
    catalog_ids: Iterable[str], bins: pd.DataFrame, rejects: pd.DataFrame, app: AppConfig
) -> Iterator[dg.AssetCheckResult]:
    problems = accounting_problems(catalog_ids, bins, rejects)
    yield dg.AssetCheckResult(
        check_name="every_sample_accounted_for",
        passed=not problems,
        metadata={"problems": dg.MetadataValue.md("\n".join(f"- {p}" for p in problems) or "none")},
    )
    oversized = oversized_bins(bins, app.sample.max_token_len)
    yield dg.AssetCheckResult(
        check_name="bins_within_max_token_len",
        passed=not oversized,
        metadata={"oversized_bins": len(oversized), "examples": dg.MetadataValue.json(oversized[:10])},
    )
    ratio = fill_ratio(bins, app.sample.max_token_len)
    yield dg.AssetCheckResult(
        check_name="fill_ratio",
        passed=ratio >= app.packing.min_fill_ratio or not len(bins),
        severity=dg.AssetCheckSeverity.WARN,
        metadata={"fill_ratio": ratio, "min_fill_ratio": app.packing.min_fill_ratio, "bins": len(bins)},
    )


def shard_members_result(shards: list[Path], jsonl_path: Path) -> dg.AssetCheckResult:
    problems = shard_problems(shards, jsonl_path)
    return dg.AssetCheckResult(
        check_name="tar_members_match_records",
        passed=not problems,
        metadata={
            "shards": len(shards),
            "problems": dg.MetadataValue.md("\n".join(f"- {p}" for p in problems) or "none"),
        },
    )


@dg.asset_check(
    asset="energon_dataset",
    blocking=True,
    description="Load every sample through Energon's loader (stateless cooker, errors re-raised); ids must equal the bins'.",
)
def energon_loads_every_sample(context: dg.AssetCheckExecutionContext, vlm_config: VlmConfig) -> dg.AssetCheckResult:
    from vlm_assets.packing.energon_loader import (
        load_all_ids,  # imports torch: only when the check runs
    )

    layout = vlm_config.layout
    sources = [source.name for source in vlm_config.sources()]
    # Shared with other readers; excludes shard writers and a re-prepare while Energon reads.
    with vlm_config.locked(context.log, shared=[layout.ENERGON_LOCK, *map(layout.source_lock, sources)]):
        expected = [
            record_id(source, int(bin_id))
            for source in sources
            if layout.bins(source).exists()
            for bin_id in read_bins(layout.bins(source))["bin_id"]
        ]
        loaded = load_all_ids(layout.packed_wds_root)
    context.log.info(f"Energon loaded {plural(len(loaded), 'sample')}; the bins expect {len(expected)}")
    duplicates = sorted(key for key, count in Counter(loaded).items() if count > 1)
    missing = sorted(set(expected) - set(loaded))
    unexpected = sorted(set(loaded) - set(expected))
    return dg.AssetCheckResult(
        passed=not (duplicates or missing or unexpected) and len(loaded) == len(expected),
        metadata={
            "loaded": len(loaded),
            "expected": len(expected),
            "missing": dg.MetadataValue.json(missing[:20]),
            "unexpected": dg.MetadataValue.json(unexpected[:20]),
            "duplicates": dg.MetadataValue.json(duplicates[:20]),
        },
    )
