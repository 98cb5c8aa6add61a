"""A new asset needs one spec, one build function and its test: the rest of vlm-assets reads the spec.

The asset here, a per-source count of catalogued samples, is what a newcomer would add: its spec goes
into the registry (as a line in vlm_assets/asset_specs.py would put it there), its function uses
`spec_asset` and returns `Built`, and fingerprints, code versions, publishing's file list, the
outputs freshness checks, `--select` and the locks all know it without another edit. The function only
builds and returns its metadata: the factory takes its fingerprint first, holds its locks while it runs
and publishes its outputs after.
"""

import json

import dagster as dg
import pandas as pd
import pytest

from vlm_assets import asset_specs
from vlm_assets.asset_specs import AssetSpec, Locks, Partitioning, damaged_outputs, selected_asset
from vlm_assets.atomic import atomic_write_text
from vlm_assets.defs.catalog.assets import sample_catalog
from vlm_assets.defs.resources import FINGERPRINT_KEY, SOURCES_PARTITIONS, VlmConfig
from vlm_assets.defs.spec_assets import Built, spec_asset
from vlm_assets.fingerprints import code_versions
from vlm_assets.tokens.processor import processor_fingerprint

SAMPLE_COUNT = AssetSpec(
    "source_sample_count", 1, "catalog", Partitioning.SOURCES, ("sample_catalog",),
    settings=lambda app: [app.sample.text_key],
    outputs=lambda layout, source, _app: [layout.root / "counts" / f"{source}.json"],
    locks=lambda layout, source, _app, _sources: Locks(exclusive=(layout.source_lock(source),)),
)


def _sample_count_asset() -> dg.AssetsDefinition:
    @spec_asset("source_sample_count", description="How many samples of the source were catalogued ok.")
    def source_sample_count(context: dg.AssetExecutionContext, vlm_config: VlmConfig) -> Built:
        layout = vlm_config.layout
        catalog = pd.read_parquet(layout.catalog(context.partition_key), columns=["status"])
        count = int((catalog.status == "ok").sum())
        (target,) = asset_specs.spec_of("source_sample_count").outputs_of(layout, context.partition_key, vlm_config.app)
        target.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(target, json.dumps({"samples": count}))
        return Built({"samples": count})

    return source_sample_count


@pytest.fixture
def with_sample_count(monkeypatch):
    monkeypatch.setitem(asset_specs.SPECS, SAMPLE_COUNT.name, SAMPLE_COUNT)


def test_a_new_asset_is_one_spec_and_one_function(with_sample_count, demo_config_path, tmp_path):
    config_path = tmp_path / "cfg.yaml"
    config_path.write_text(demo_config_path.read_text().replace("./", f"{demo_config_path.parent}/").replace(
        f"{demo_config_path.parent}/vlm_data", str(tmp_path / "out")))
    vlm_config = VlmConfig(config_path=str(config_path))
    instance = dg.DagsterInstance.ephemeral()
    instance.add_dynamic_partitions(SOURCES_PARTITIONS.name, ["demo_images"])
    count_asset = _sample_count_asset()
    result = dg.materialize([sample_catalog, count_asset], partition_key="demo_images", instance=instance,
                            resources={"vlm_config": vlm_config})
    assert result.success

    # Its place in the graph comes from the spec.
    assert count_asset.group_names_by_key[dg.AssetKey("source_sample_count")] == "catalog"
    assert count_asset.partitions_def == SOURCES_PARTITIONS
    assert set(count_asset.asset_deps[dg.AssetKey("source_sample_count")]) == {dg.AssetKey("sample_catalog")}

    # Its output, and what it recorded: the fingerprint its upstream's record and its settings give.
    app, layout = vlm_config.app, vlm_config.layout
    catalog = pd.read_parquet(layout.catalog("demo_images"))
    written = json.loads((tmp_path / "out" / "counts" / "demo_images.json").read_text())
    assert written == {"samples": int((catalog.status == "ok").sum())} and written["samples"] > 0
    metadata = result.asset_materializations_for_node("source_sample_count")[0].metadata
    assert metadata[FINGERPRINT_KEY].value == vlm_config.fingerprints(instance).of("source_sample_count", "demo_images")
    assert "source_sample_count" in code_versions(app, processor_fingerprint(app.model))

    # Freshness, publishing and `--select` know it.
    recorded = {key: value.value for key, value in metadata.items()}
    assert damaged_outputs(layout, "source_sample_count", "demo_images", app, recorded) == []
    (tmp_path / "out" / "counts" / "demo_images.json").unlink()
    assert damaged_outputs(layout, "source_sample_count", "demo_images", app, recorded) == [
        f"{tmp_path / 'out' / 'counts' / 'demo_images.json'} is missing"]
    assert SAMPLE_COUNT.publishes(layout, "demo_images", app) == [tmp_path / "out" / "counts" / "demo_images.json"]
    assert selected_asset("source_sample_count[demo_images]") == ("source_sample_count", "demo_images")
    assert "source_sample_count" in asset_specs.source_lineage()
