"""Packing domain: `packing_bins` → `packed_json` → `packed_wds_shards` → `energon_dataset` (per source) → `training_mix`."""
