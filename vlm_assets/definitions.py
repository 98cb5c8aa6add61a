"""The code location: every domain's assets, checks, sensors and schedules, with shared resources bound."""

from __future__ import annotations

import os

import dagster as dg

from vlm_assets.config import default_config_path
from vlm_assets.defs import automation, catalog, frame_cache, package, packing
from vlm_assets.defs.resources import HFProcessor, VlmConfig

DOMAINS = (catalog, packing, frame_cache, package, automation)


def build_definitions(config_path: str | os.PathLike[str]) -> dg.Definitions:
    vlm_config = VlmConfig(config_path=str(config_path))
    return dg.Definitions.merge(
        *(domain.defs for domain in DOMAINS),
        dg.Definitions(resources={"vlm_config": vlm_config, "hf_processor": HFProcessor(vlm_config=vlm_config)}),
    )


defs = build_definitions(default_config_path())
