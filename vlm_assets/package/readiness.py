"""Whether the outputs a package bundles are complete enough to package.

A package is handed to a training run elsewhere, where a source left out or a
frame cache that misses videos is costly to discover; so the training_package
asset tests these conditions (the frame cache's one is its coverage check's)
before it writes anything.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from vlm_assets.config import AppConfig
from vlm_assets.frames.index import verify_coverage
from vlm_assets.frames.plan import read_plan
from vlm_assets.layout import StorageLayout
from vlm_assets.package.recipe import FRAME_CACHE, PACKED_WDS
from vlm_assets.packing.empty import EmptySource
from vlm_assets.packing.wds import list_shards

SHOWN_KEYS = 5


def input_problems(app: AppConfig, layout: StorageLayout) -> list[str]:
    """Why the parts `app.package.include` names are not ready to package; empty when they are.

    packed_wds: every source configured in `app.sources` has at least one
    pretrain-*.tar shard or is recorded empty (packing.empty), and the training mix
    (metadataset.yaml) exists. frame_cache: index.jsonl and failures.jsonl account for
    every key of the cache's plan exactly once (a cache without a plan is not
    checked; nothing was planned into it).
    """
    problems: list[str] = []
    if PACKED_WDS in app.package.include:
        problems += missing_shards(layout, [source.name for source in app.sources])
        if not layout.metadataset.is_file():
            problems.append(f"no training mix: {layout.metadataset} does not exist (materialise training_mix)")
    if FRAME_CACHE in app.package.include:
        problems += frame_cache_gaps(layout.frame_cache_dir(app.frame_cache))
    return problems


def missing_shards(layout: StorageLayout, sources: Iterable[str]) -> list[str]:
    return [
        f"source {source!r} has no packed shards: no pretrain-*.tar in {layout.packed_wds(source)} "
        "(materialise packed_wds_shards for it, or remove it from the config)"
        for source in sources
        # An empty source has none by design (packing.empty): the training mix leaves it out.
        if not list_shards(layout.packed_wds(source)) and EmptySource.load(layout.empty_dataset(source)) is None
    ]


def frame_cache_gaps(cache_dir: Path) -> list[str]:
    gaps = verify_coverage(cache_dir, read_plan(cache_dir))
    if not gaps:
        return []
    shown = "; ".join(gaps[:SHOWN_KEYS]) + ("; …" if len(gaps) > SHOWN_KEYS else "")
    return [
        f"frame cache {cache_dir}: {len(gaps)} key(s) not covered by its index (every key of plan.jsonl must be in "
        f"index.jsonl or failures.jsonl exactly once; materialise frame_cache_shard and frame_cache_index): {shown}"
    ]
