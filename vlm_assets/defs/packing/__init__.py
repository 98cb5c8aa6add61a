import dagster as dg

from vlm_assets.defs.packing.assets import (
    energon_dataset,
    packed_json,
    packed_wds_shards,
    packing_bins,
    training_mix,
)
from vlm_assets.defs.packing.checks import (
    energon_loads_every_sample,
    training_mix_draws_match_weights,
)

defs = dg.Definitions(
    assets=[packing_bins, packed_json, packed_wds_shards, energon_dataset, training_mix],
    asset_checks=[energon_loads_every_sample, training_mix_draws_match_weights],
)
