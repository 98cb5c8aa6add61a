"""Dagster definitions, one package per domain (catalog, packing, frame_cache, package, automation), loaded
by Dagster's own loader (vlm_assets.definitions): whatever a module here defines is in the code location."""

import warnings

import dagster as dg

# Per-partition asset checks are a Dagster preview feature; we rely on it knowingly (the catalog and
# frame-cache checks, and the in-step checks of packing_bins and packed_wds_shards), so keep the UI
# and run logs free of the notice.
warnings.filterwarnings("ignore", category=dg.PreviewWarning, message=".*partitions_def on an AssetCheckSpec.*")
# Code versions come from the config (vlm_assets.definitions) through Definitions.map_asset_specs,
# a preview API we use knowingly.
warnings.filterwarnings("ignore", category=dg.PreviewWarning, message=".*map_(resolved_)?asset_specs.*")
# The code location loads this package with Definitions' package loader (vlm_assets.definitions), a
# preview API we use knowingly.
warnings.filterwarnings("ignore", category=dg.PreviewWarning, message=".*load_definitions_from_(package_module|modules).*")
