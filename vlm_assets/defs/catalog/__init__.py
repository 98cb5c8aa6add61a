"""Catalogue domain: the sources' files → `sample_catalog` → `sample_length_chunk` → `sample_lengths` (per source)."""

import dagster as dg

from vlm_assets.defs.catalog import assets
from vlm_assets.defs.catalog.source_files import source_files

# Every asset and check the module defines: a new one is picked up where it is written. The sources'
# files are an external asset spec, which the loader does not collect.
defs = dg.Definitions(assets=[source_files, *dg.load_assets_from_modules([assets])],
                      asset_checks=dg.load_asset_checks_from_modules([assets]))
