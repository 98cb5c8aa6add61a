"""What `vlm-assets run --select` builds: assets, single partitions, and everything they read, by the
partition mappings the Dagster definitions declare."""

from __future__ import annotations

import dagster as dg
import pytest

from vlm_assets.asset_specs import may_measure_lengths, runs_energon
from vlm_assets.config import load_config
from vlm_assets.definitions import build_definitions
from vlm_assets.demo import write_demo
from vlm_assets.layout import StorageLayout
from vlm_assets.orchestration.selection import graph_shape, selection_of, upstream_partitions


@pytest.fixture(scope="module")
def defs(demo_config_path):
    return build_definitions(demo_config_path)


@pytest.fixture(scope="module")
def shape(defs):
    return graph_shape(defs)


@pytest.fixture(scope="module")
def instance():
    """An instance that knows the demo's sources and three chunk indices."""
    with dg.DagsterInstance.ephemeral() as instance:
        instance.add_dynamic_partitions("sources", ["demo_images", "demo_video", "demo_wds"])
        instance.add_dynamic_partitions("chunk_index", ["00000", "00001", "00007"])
        yield instance


def test_the_definitions_declare_which_partitions_each_partition_reads(defs):
    assets = {asset.key.to_user_string(): asset for asset in defs.assets}
    by_source = assets["sample_lengths"].get_partition_mapping(dg.AssetKey("sample_length_chunk"))
    assert isinstance(by_source, dg.MultiToSingleDimensionPartitionMapping) and by_source.partition_dimension_name == "source"
    assert isinstance(assets["packing_bins"].get_partition_mapping(dg.AssetKey("sample_lengths")), dg.IdentityPartitionMapping)
    assert isinstance(assets["frame_cache_index"].get_partition_mapping(dg.AssetKey("frame_cache_shard")), dg.AllPartitionMapping)
    # A source's dedup reads the catalogues of the sources kept before it: every catalogue is built first.
    assert isinstance(assets["sample_dedup"].get_partition_mapping(dg.AssetKey("sample_catalog")), dg.AllPartitionMapping)
    assert isinstance(assets["sample_lengths"].get_partition_mapping(dg.AssetKey("sample_dedup")), dg.IdentityPartitionMapping)


def test_a_source_reads_its_own_chunks_and_a_chunk_its_own_source(shape, instance):
    assert upstream_partitions(shape, "sample_lengths", "demo_wds", "sample_length_chunk", instance) == {
        "00000|demo_wds", "00001|demo_wds", "00007|demo_wds"}
    assert upstream_partitions(shape, "sample_length_chunk", "00001|demo_wds", "sample_catalog", instance) == {"demo_wds"}
    assert upstream_partitions(shape, "packing_bins", "demo_video", "sample_lengths", instance) == {"demo_video"}
    assert upstream_partitions(shape, "frame_cache_index", None, "frame_cache_shard", instance) is None


def test_one_partition_brings_the_same_partition_of_its_upstream(shape, instance):
    selection = selection_of(shape, ["sample_lengths[demo_images]"], instance)
    assert selection.assets == ["sample_catalog", "sample_dedup", "sample_length_chunk", "sample_lengths"]
    assert selection.keeps("sample_dedup", "demo_images") and not selection.keeps("sample_dedup", "demo_wds")
    assert not selection.keeps("sample_lengths", "demo_video")
    # Its dedup compares it with the samples kept in the other sources: their catalogues come first.
    assert selection.keeps("sample_catalog", "demo_images") and selection.keeps("sample_catalog", "demo_wds")
    # The source's chunks, whichever there are; and one chunk brings its source's catalogue only.
    assert selection.keeps("sample_length_chunk", "00007|demo_images")
    assert not selection.keeps("sample_length_chunk", "00000|demo_wds")
    one_chunk = selection_of(shape, ["sample_length_chunk[00001|demo_wds]"], instance)
    assert one_chunk.keeps("sample_catalog", "demo_wds") and not one_chunk.keeps("sample_catalog", "demo_images")
    assert not one_chunk.keeps("sample_length_chunk", "00000|demo_wds")
    # A chunked asset selected by a source's name: every chunk of that source.
    by_source = selection_of(shape, ["sample_length_chunk[demo_video]"], instance)
    assert by_source.keeps("sample_length_chunk", "00001|demo_video") and by_source.keeps("sample_catalog", "demo_video")
    assert not by_source.keeps("sample_length_chunk", "00001|demo_wds")


def test_an_upstream_partitioned_otherwise_is_built_whole(shape, instance):
    selection = selection_of(shape, ["frame_cache_shard[part-00000]"], instance)
    assert selection.assets == ["sample_catalog", "sample_dedup", "sample_length_chunk", "sample_lengths",
                                "video_frame_plan", "frame_cache_shard"]
    assert selection.keeps("frame_cache_shard", "part-00000") and not selection.keeps("frame_cache_shard", "part-00001")
    # The plan reads every source's catalogue and token lengths.
    assert all(selection.keeps(asset, source) for source in ("demo_images", "demo_video", "demo_wds")
               for asset in ("sample_catalog", "sample_lengths"))


def test_a_whole_asset_and_one_of_its_partitions_select_it_whole(shape, instance):
    selection = selection_of(shape, ["packing_bins[demo_wds]", "sample_lengths", "packed_json[demo_video]"], instance)
    assert selection.keeps("packing_bins", "demo_wds") and selection.keeps("packing_bins", "demo_video")
    assert not selection.keeps("packing_bins", "demo_images") and not selection.keeps("packed_json", "demo_wds")
    assert all(selection.keeps(asset, "demo_images") for asset in ("sample_lengths", "sample_catalog"))


def test_selection_errors_name_the_item(shape):
    with pytest.raises(ValueError, match=r"training_mix\[x\]: training_mix is not partitioned"):
        selection_of(shape, ["training_mix[x]"])
    with pytest.raises(ValueError, match="unknown asset key"):
        selection_of(shape, ["no_such_asset[demo_wds]"])


def test_the_processor_is_loaded_ahead_only_for_a_selection_that_may_measure_lengths(tmp_path):
    app = load_config(write_demo(tmp_path / "demo"))
    layout = StorageLayout(app.storage_root)
    assert may_measure_lengths(None, app, force=False)  # no table yet
    assert not may_measure_lengths(["sample_catalog"], app, force=False)  # reads no processor
    layout.lengths("demo_images").parent.mkdir(parents=True)
    layout.lengths("demo_images").write_bytes(b"a table")
    assert not may_measure_lengths(["packed_json[demo_images]", "sample_length_chunk[00000|demo_images]"], app, force=False)
    assert may_measure_lengths(["packed_json[demo_images]"], app, force=True)
    assert may_measure_lengths(["packed_json[demo_video]"], app, force=False)
    assert may_measure_lengths(["packed_json[demo_images]", "training_mix"], app, force=False)  # every source
    for source in ("demo_video", "demo_wds"):
        layout.lengths(source).write_bytes(b"a table")
    assert not may_measure_lengths(None, app, force=False)


def test_energon_is_imported_ahead_only_for_a_selection_that_runs_it():
    assert runs_energon(None) and runs_energon(["training_package"]) and runs_energon(["energon_dataset[demo_wds]"])
    assert not runs_energon(["packed_wds_shards", "frame_cache_index"])
