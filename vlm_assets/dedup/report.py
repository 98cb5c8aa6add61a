"""What a source's deduplication removed, for a person to look at: Markdown for the asset's metadata."""

from __future__ import annotations

import base64
import io
from collections import Counter
from collections.abc import Callable

import numpy as np
from PIL import Image, ImageOps

from vlm_assets.dedup.decisions import KINDS, NEAR_TEXT, Removal
from vlm_assets.media.refs import open_media
from vlm_assets.wording import md_cell

THUMBNAIL_PIXELS = 96
THUMBNAIL_QUALITY = 70
EXAMPLE_PAIRS = 4
LARGEST_CLUSTERS = 10


def counts_by_kind(removed: list[Removal]) -> dict[str, int]:
    counted = Counter(removal.kind for removal in removed)
    return {kind: counted[kind] for kind in KINDS}


def largest_clusters_md(removed: list[Removal], rows: int = LARGEST_CLUSTERS) -> str:
    """The kept samples this source's removals duplicate most often, with how many each."""
    clusters = Counter(removal.kept_id for removal in removed)
    if not clusters:
        return "_no duplicates removed_"
    lines = ["| kept sample | removed duplicates |", "|---|---:|"]
    lines += [f"| {md_cell(kept)} | {count} |" for kept, count in sorted(clusters.items(), key=lambda item: (-item[1], item[0]))[:rows]]
    return "\n".join(lines)


def distance_histogram_md(removed: list[Removal]) -> str:
    """How near the near-duplicates were: bits for media, the Jaccard estimate (in steps of 0.05) for text."""
    rows = Counter()
    for removal in removed:
        if removal.kind == NEAR_TEXT:
            rows[("text jaccard", f"{np.floor(removal.jaccard * 20) / 20:.2f}")] += 1
        elif removal.kind in ("near_image", "near_video"):
            rows[(removal.kind.replace("near_", "") + " bits", f"{removal.distance:g}")] += 1
    if not rows:
        return "_no near-duplicates removed_"
    lines = ["| measure | value | samples |", "|---|---:|---:|"]
    lines += [f"| {measure} | {value} | {count} |" for (measure, value), count in sorted(rows.items())]
    return "\n".join(lines)


def reused_media_md(reused: Counter[str], rows: int = LARGEST_CLUSTERS) -> str:
    """Media kept in several samples of this source with different conversations (not duplicates)."""
    if not reused:
        return "_no medium is reused with other text_"
    lines = [f"{len(reused)} media reused by 2 or more samples with other text", "",
             "| medium (sha256) | samples |", "|---|---:|"]
    lines += [f"| {sha[:16]} | {count} |" for sha, count in sorted(reused.items(), key=lambda item: (-item[1], item[0]))[:rows]]
    return "\n".join(lines)


def example_pairs_md(removed: list[Removal], first_medium: Callable[[str], tuple[str, str] | None],
                     video_frame: Callable[[str], np.ndarray], pairs: int = EXAMPLE_PAIRS) -> str:
    """A few removed samples beside the one each duplicates, as small inline JPEGs; `first_medium`
    gives a sample's first (kind, ref), `video_frame` a video's middle frame."""
    lines = ["| removed | kept | reason |", "|---|---|---|"]
    shown = 0
    for removal in removed:
        if shown == pairs:
            break
        removed_medium, kept_medium = first_medium(removal.sample_id), first_medium(removal.kept_id)
        if removed_medium is None or kept_medium is None:
            continue
        try:
            images = [_thumbnail(kind, ref, video_frame) for kind, ref in (removed_medium, kept_medium)]
        except (OSError, ValueError):
            continue  # a medium changed since: the pair is left out of the examples, not the decision
        lines.append(f"| {images[0]}<br>{md_cell(removal.sample_id)} | {images[1]}<br>{md_cell(removal.kept_id)} "
                     f"| {md_cell(removal.reason)} |")
        shown += 1
    return "\n".join(lines) if shown else "_no duplicate with media removed_"


def _thumbnail(kind: str, ref: str, video_frame: Callable[[str], np.ndarray]) -> str:
    if kind == "video":
        image = Image.fromarray(video_frame(ref))
    else:
        with open_media(ref) as handle, Image.open(handle) as opened:
            image = ImageOps.exif_transpose(opened).convert("RGB")
    image.thumbnail((THUMBNAIL_PIXELS, THUMBNAIL_PIXELS))
    buffer = io.BytesIO()
    image.save(buffer, "JPEG", quality=THUMBNAIL_QUALITY)
    return f"![](data:image/jpeg;base64,{base64.b64encode(buffer.getvalue()).decode()})"
