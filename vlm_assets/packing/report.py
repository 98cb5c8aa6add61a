"""Markdown summaries of a source's packing, for the asset's UI metadata (the length histogram is
vlm_assets.tokens.histogram, shared with sample_lengths)."""

from __future__ import annotations

import numpy as np
import pandas as pd

from vlm_assets.packing.plan import fill_ratio
from vlm_assets.wording import plural

FILL_EDGES = (0.0, 0.5, 0.8, 0.9, 0.95, 0.99, 1.0)


def fill_summary_md(bins: pd.DataFrame, max_token_len: int) -> str:
    """How full the bins are: overall ratio plus a distribution of per-bin fill."""
    if not len(bins):
        return "No bins."
    fills = bins["total_len"].to_numpy() / max_token_len
    counts, _ = np.histogram(fills, bins=FILL_EDGES)
    per_bin = bins["lengths"].map(len)
    lines = [
        f"**fill ratio** {fill_ratio(bins, max_token_len):.4f} over {plural(len(bins), 'bin')} "
        f"(min {fills.min():.3f}, median {np.median(fills):.3f}); "
        f"samples per bin: mean {per_bin.mean():.2f}, max {per_bin.max()}",
        "",
        "| bin fill | bins |",
        "|---|---:|",
    ]
    for low, high, count in zip(FILL_EDGES[:-1], FILL_EDGES[1:], counts):
        lines.append(f"| {low:.0%}–{high:.0%} | {int(count)} |")
    return "\n".join(lines)


def reject_counts_md(packed: int, rejects: pd.DataFrame) -> str:
    lines = ["| outcome | samples |", "|---|---:|", f"| packed | {packed} |"]
    for category, count in rejects["category"].value_counts().sort_index().items():
        lines.append(f"| rejected: {category} | {int(count)} |")
    return "\n".join(lines)
