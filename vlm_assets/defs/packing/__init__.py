"""Packing domain: `packing_bins` → `packed_json` → `packed_wds_shards` → `energon_dataset` (per source) → `training_mix`."""

import dagster as dg

from vlm_assets.defs.packing import assets, checks

# Every asset and check the modules define: a new one is picked up where it is written.
defs = dg.Definitions(assets=dg.load_assets_from_modules([assets]),
                      asset_checks=dg.load_asset_checks_from_modules([assets, checks]))
