"""Frame-cache domain: `video_frame_plan` → `frame_cache_shard` (per shard) → `frame_cache_index`."""

import dagster as dg

from vlm_assets.defs.frame_cache.assets import frame_cache_index, frame_cache_shard, video_frame_plan
from vlm_assets.defs.frame_cache.checks import frame_cache_covers_plan, frame_cache_shard_matches_record

defs = dg.Definitions(
    assets=[video_frame_plan, frame_cache_shard, frame_cache_index],
    asset_checks=[frame_cache_shard_matches_record, frame_cache_covers_plan],
)
