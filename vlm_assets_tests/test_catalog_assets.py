import dagster as dg
import pandas as pd

from vlm_assets.defs.catalog.assets import lengths_match_processor, sample_catalog, sample_lengths
from vlm_assets.defs.resources import SOURCES_PARTITIONS, HFProcessor, VlmConfig
from vlm_assets.layout import StorageLayout


def test_catalog_and_lengths_materialise_per_source_with_passing_check(demo_config_path, tmp_path):
    config_path = tmp_path / "cfg.yaml"
    config_path.write_text(demo_config_path.read_text().replace("./", f"{demo_config_path.parent}/").replace(
        f"{demo_config_path.parent}/vlm_data", str(tmp_path / "out")))
    vlm_config = VlmConfig(config_path=str(config_path))
    instance = dg.DagsterInstance.ephemeral()
    instance.add_dynamic_partitions(SOURCES_PARTITIONS.name, ["demo_images", "demo_wds"])
    for partition in ("demo_images", "demo_wds"):
        result = dg.materialize(
            [sample_catalog, sample_lengths, lengths_match_processor],
            partition_key=partition,
            instance=instance,
            resources={"vlm_config": vlm_config, "hf_processor": HFProcessor(vlm_config=vlm_config)},
        )
        assert result.success
        checks = result.get_asset_check_evaluations()
        assert [c.passed for c in checks] == [True]
        metadata = result.asset_materializations_for_node("sample_catalog")[0].metadata
        assert "rejects_by_reason" in metadata and metadata["media_decoded"].value > 0
    layout = StorageLayout(tmp_path / "out")
    catalog = pd.read_parquet(layout.catalog("demo_images"))
    lengths = pd.read_parquet(layout.lengths("demo_images"))
    assert list(catalog.sample_id) == list(lengths.sample_id)
    assert (lengths.status == catalog.status).all()
    rejected = lengths[lengths.status == "rejected"]
    assert (rejected.reason != "").all() and (rejected.token_len == 0).all()
    ok = lengths[lengths.status == "ok"]
    assert (ok.token_len == ok.text_tokens + ok.image_tokens + ok.video_tokens).all()
