"""The graph's assets by name, upstream first, with the revision of the code that writes each.

Bump an asset's revision when a code change alters what it writes: its fingerprint changes
(vlm_assets.fingerprints), so every output it wrote before is rebuilt.
"""

REVISIONS = {
    "sample_catalog": 4,
    "sample_length_chunk": 2,
    "sample_lengths": 3,
    "packing_bins": 2,
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
