"""The token-length histogram shown by `sample_lengths` (every ok sample) and `packing_bins` (the
packed samples), with one bucket scheme so the two tables line up."""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

FIRST_EDGE = 256


def histogram_edges(max_token_len: int) -> list[int]:
    """0, 256, 512, … doubling while below max_token_len, then max_token_len itself."""
    edges, edge = [0], FIRST_EDGE
    while edge < max_token_len:
        edges.append(edge)
        edge *= 2
    return edges + [max_token_len]


def length_histogram_md(lengths: npt.ArrayLike, max_token_len: int) -> str:
    """Markdown table of samples per length bucket `low+1–high`, plus `> max_token_len` when any are longer."""
    values = np.asarray(lengths, dtype=np.int64)
    if not values.size:
        return "_no samples_"
    edges = np.asarray(histogram_edges(max_token_len))
    # Bucket i holds edges[i] < length <= edges[i + 1]; index len(edges) - 1 is the overflow bucket.
    buckets = np.clip(np.searchsorted(edges, values, side="left") - 1, 0, len(edges) - 1)
    counts = np.bincount(buckets, minlength=len(edges))
    labels = [f"{low + 1}–{high}" for low, high in zip(edges[:-1], edges[1:])] + [f"> {max_token_len}"]
    rows = ["| token_len | samples | share |", "|---|---:|---:|"]
    for index, (label, count) in enumerate(zip(labels, counts)):
        if index < len(labels) - 1 or count:
            rows.append(f"| {label} | {int(count)} | {count / values.size:.1%} |")
    return "\n".join(rows)
