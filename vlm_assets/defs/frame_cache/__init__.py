"""Frame-cache domain: `video_frame_plan` → `frame_cache_shard` (per shard) → `frame_cache_index`."""

import dagster as dg

from vlm_assets.defs.frame_cache import assets, checks

# Every asset and check the modules define: a new one is picked up where it is written.
defs = dg.Definitions(assets=dg.load_assets_from_modules([assets]),
                      asset_checks=dg.load_asset_checks_from_modules([assets, checks]))
