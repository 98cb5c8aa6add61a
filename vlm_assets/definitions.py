"""The code location: every asset, check, sensor, schedule and job under `vlm_assets/defs/`, found by
Dagster's own loader (`load_definitions_from_package_module`: each module's objects, or the one
`Definitions` it holds), with the shared resources and the executor bound.

Not `load_from_defs_folder`: it also imports every installed package that registers Dagster components
(dagster-aws's take a second), on every load of the code location, by every run."""

from __future__ import annotations

import os

import dagster as dg

import vlm_assets.defs
from vlm_assets.config import ConfigError, default_config_path
from vlm_assets.defs.executor import code_location_executor
from vlm_assets.defs.resources import HFProcessor, VlmConfig
from vlm_assets.fingerprints import code_versions
from vlm_assets.tokens.processor import processor_fingerprint


def build_definitions(config_path: str | os.PathLike[str]) -> dg.Definitions:
    vlm_config = VlmConfig(config_path=str(config_path))
    defs = dg.Definitions.merge(
        dg.load_definitions_from_package_module(vlm_assets.defs),
        dg.Definitions(resources={"vlm_config": vlm_config, "hf_processor": HFProcessor(vlm_config=vlm_config)}),
        dg.Definitions(executor=code_location_executor()),
    )
    return _with_code_versions(defs, vlm_config)


def _with_code_versions(defs: dg.Definitions, vlm_config: VlmConfig) -> dg.Definitions:
    """Code versions from the settings each asset reads, so the UI marks exactly those stale after a config edit.

    A config that does not load leaves the definitions without versions; every run then reports the
    config error itself.
    """
    try:
        versions = code_versions(vlm_config.app, processor_fingerprint(vlm_config.app.model))
    except ConfigError:
        return defs
    return defs.map_asset_specs(
        func=lambda spec: spec.replace_attributes(code_version=versions.get(spec.key.to_user_string(), spec.code_version))
    )


@dg.definitions
def defs() -> dg.Definitions:
    """The code location `dagster dev`, `dg` and the daemon load: built when they load it, from the config
    `$VLM_ASSETS_CONFIG` names (else the demo's), not when this module is imported."""
    return build_definitions(default_config_path())
