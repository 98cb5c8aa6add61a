"""Dagster layer for training packages (the domain code is vlm_assets.package)."""

import dagster as dg

from vlm_assets.defs.package import assets, checks

# Every asset and check the modules define: a new one is picked up where it is written.
defs = dg.Definitions(assets=dg.load_assets_from_modules([assets]),
                      asset_checks=dg.load_asset_checks_from_modules([assets, checks]))
