"""The graph's assets by name, upstream first, with the revision of the code that writes each.

Bump an asset's revision when a code change alters what it writes: its fingerprint changes
(vlm_assets.fingerprints), so every output it wrote before is rebuilt.
"""

import re

REVISIONS = {
    "sample_catalog": 5,
    "sample_length_chunk": 2,
    "sample_lengths": 3,
    "packing_bins": 3,
    "packed_json": 2,
    "packed_wds_shards": 2,
    "energon_dataset": 3,
    "training_mix": 2,
    "video_frame_plan": 2,
    "frame_cache_shard": 2,
    "frame_cache_index": 1,
    "training_package": 2,
}
ASSET_NAMES = tuple(REVISIONS)

# `run --select` names an asset, or one partition of it as `asset[partition]`.
SELECTED_PARTITION = re.compile(r"^(?P<asset>[^\[\]]+)\[(?P<partition>[^\[\]]+)\]$")


def selected_asset(item: str) -> tuple[str, str | None]:
    """One `run --select` item as (asset, partition or None); ValueError naming the known assets when
    the asset is none of them."""
    match = SELECTED_PARTITION.match(item)
    asset, partition = (match["asset"], match["partition"]) if match else (item, None)
    if asset not in REVISIONS:
        raise ValueError(f"unknown asset key(s): {asset} (known: {', '.join(sorted(ASSET_NAMES))})")
    return asset, partition
