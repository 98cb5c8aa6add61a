"""Resources shared by every domain: the user's config and the storage layout under it."""

from __future__ import annotations

import os
from functools import cached_property

import dagster as dg

from vlm_assets.config import CONFIG_ENV_VAR, AppConfig, load_config
from vlm_assets.layout import StorageLayout


def default_config_path() -> str:
    """$VLM_ASSETS_CONFIG, else ./vlm_assets.yaml (what `vlm-assets demo` writes)."""
    return os.environ.get(CONFIG_ENV_VAR, "vlm_assets.yaml")


class VlmConfig(dg.ConfigurableResource):
    """The validated YAML config (SPEC §2) every asset reads its settings from."""

    config_path: str

    @cached_property
    def app(self) -> AppConfig:
        return load_config(self.config_path)

    @property
    def layout(self) -> StorageLayout:
        return StorageLayout(self.app.storage_root)


SOURCES_PARTITIONS = dg.DynamicPartitionsDefinition(name="sources")
FRAME_CACHE_SHARD_PARTITIONS = dg.DynamicPartitionsDefinition(name="frame_cache_shards")
