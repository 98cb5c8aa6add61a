"""Markdown summaries of a source's packing, for the asset's UI metadata (the length histogram is
vlm_assets.tokens.histogram, shared with sample_lengths)."""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from vlm_assets.packing.plan import BinsOnDisk
from vlm_assets.wording import plural

FILL_EDGES = (0.0, 0.5, 0.8, 0.9, 0.95, 0.99, 1.0)


def fill_summary_md(bins: BinsOnDisk, max_token_len: int) -> str:
    """How full the bins are: overall ratio plus a distribution of per-bin fill."""
    if not bins.bins:
        return "No bins."
    fills = bins.total_len / max_token_len
    counts, _ = np.histogram(fills, bins=FILL_EDGES)
    per_bin = bins.sample_counts
    lines = [
        f"**fill ratio** {bins.fill_ratio(max_token_len):.4f} over {plural(bins.bins, 'bin')} "
        f"(min {fills.min():.3f}, median {np.median(fills):.3f}); "
        f"samples per bin: mean {per_bin.mean():.2f}, max {per_bin.max()}",
        "",
        "| bin fill | bins |",
        "|---|---:|",
    ]
    for low, high, count in zip(FILL_EDGES[:-1], FILL_EDGES[1:], counts):
        lines.append(f"| {low:.0%}–{high:.0%} | {int(count)} |")
    return "\n".join(lines)


def reject_counts_md(packed: int, rejected: Mapping[str, int]) -> str:
    """`rejected`: samples per reject category."""
    lines = ["| outcome | samples |", "|---|---:|", f"| packed | {packed} |"]
    for category, count in sorted(rejected.items()):
        lines.append(f"| rejected: {category} | {int(count)} |")
    return "\n".join(lines)
