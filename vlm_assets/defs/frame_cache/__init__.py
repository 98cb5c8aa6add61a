"""Frame-cache domain: `video_frame_plan` → `frame_cache_shard` (per shard) → `frame_cache_index`."""
