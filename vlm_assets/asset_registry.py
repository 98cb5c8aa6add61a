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
# Assets that neither load the model's processor nor read anything that does: a run of these alone
# does not warm the processor in its workers (vlm_assets.orchestration.workers).
WITHOUT_PROCESSOR = ("sample_catalog", "video_frame_plan", "frame_cache_shard", "frame_cache_index")


def may_load_processor(selected: list[str] | None) -> bool:
    """Whether building `selected` (asset names or `asset[partition]`; None: the whole graph) with
    its upstream may measure token lengths."""
    return selected is None or any(name.split("[", 1)[0].strip() not in WITHOUT_PROCESSOR for name in selected)
