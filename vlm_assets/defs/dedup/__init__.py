"""Dedup domain: `sample_catalog` → `sample_dedup` → `sample_lengths` (per source)."""

import dagster as dg

from vlm_assets.defs.dedup import assets

# Every asset and check the module defines: a new one is picked up where it is written.
defs = dg.Definitions(assets=dg.load_assets_from_modules([assets]),
                      asset_checks=dg.load_asset_checks_from_modules([assets]))
