import dagster as dg

from vlm_assets.defs.catalog.assets import lengths_match_processor, sample_catalog, sample_lengths

defs = dg.Definitions(assets=[sample_catalog, sample_lengths], asset_checks=[lengths_match_processor])
