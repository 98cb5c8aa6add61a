"""The code location: every domain's assets, checks, sensors and schedules, with shared resources bound."""

from __future__ import annotations

import dagster as dg

from vlm_assets.config import default_config_path
from vlm_assets.defs.catalog import defs as catalog_defs
from vlm_assets.defs.frame_cache import defs as frame_cache_defs
from vlm_assets.defs.packing import defs as packing_defs
from vlm_assets.defs.resources import HFProcessor, VlmConfig


def build_definitions(config_path: str) -> dg.Definitions:
    vlm_config = VlmConfig(config_path=config_path)
    return dg.Definitions.merge(
        catalog_defs,
        packing_defs,
        frame_cache_defs,
        dg.Definitions(resources={"vlm_config": vlm_config, "hf_processor": HFProcessor(vlm_config=vlm_config)}),
    )


defs = build_definitions(default_config_path())
