import dagster as dg

from vlm_assets.defs.packing.assets import energon_dataset, packed_json, packed_wds_shards, packing_bins
from vlm_assets.defs.packing.checks import energon_loads_every_sample

defs = dg.Definitions(
    assets=[packing_bins, packed_json, packed_wds_shards, energon_dataset],
    asset_checks=[energon_loads_every_sample],
)
