import dagster as dg

from vlm_assets.defs.catalog.assets import lengths_match_processor, sample_catalog, sample_length_chunk, sample_lengths
from vlm_assets.defs.catalog.source_files import source_files

defs = dg.Definitions(assets=[source_files, sample_catalog, sample_length_chunk, sample_lengths], asset_checks=[lengths_match_processor])
