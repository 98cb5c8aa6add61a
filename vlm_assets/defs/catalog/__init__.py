"""Catalogue domain: the sources' files → `sample_catalog` → `sample_length_chunk` → `sample_lengths` (per source)."""

import dagster as dg

from vlm_assets.defs.catalog import assets, source_files

# Every asset and check the modules define: a new one is picked up where it is written.
defs = dg.Definitions(assets=dg.load_assets_from_modules([source_files, assets]),
                      asset_checks=dg.load_asset_checks_from_modules([assets]))
