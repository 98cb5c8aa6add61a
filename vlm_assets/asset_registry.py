"""The graph's assets by name, upstream first, with the revision of the code that writes each.

Bump an asset's revision when a code change alters what it writes: its fingerprint changes
(vlm_assets.fingerprints), so every output it wrote before is rebuilt.
"""

REVISIONS = {
    "sample_catalog": 4,
    "sample_length_chunk": 1,
    "sample_lengths": 2,
    "packing_bins": 1,
    "packed_json": 1,
    "packed_wds_shards": 1,
    "energon_dataset": 2,
    "training_mix": 1,
    "video_frame_plan": 2,
    "frame_cache_shard": 2,
    "frame_cache_index": 1,
    "training_package": 1,
}
ASSET_NAMES = tuple(REVISIONS)
