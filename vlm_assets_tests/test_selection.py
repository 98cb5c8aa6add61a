"""What `vlm-assets run --select` builds: assets, single partitions, and everything they read."""

from __future__ import annotations

import pytest

from vlm_assets.definitions import build_definitions
from vlm_assets.orchestration.selection import graph_shape, selection_of


@pytest.fixture(scope="module")
def shape(demo_config_path):
    return graph_shape(build_definitions(demo_config_path))


def test_one_partition_brings_the_same_partition_of_its_upstream(shape):
    selection = selection_of(shape, ["sample_lengths[demo_images]"])
    assert selection.assets == ["sample_catalog", "sample_length_chunk", "sample_lengths"]
    assert selection.partitions == {name: {"demo_images"} for name in selection.assets}
    assert selection.keeps("sample_catalog", "demo_images") and not selection.keeps("sample_catalog", "demo_wds")
    # The source's chunks, whichever there are; and one chunk brings its source's catalogue only.
    assert selection.keeps("sample_length_chunk", "00007|demo_images")
    assert not selection.keeps("sample_length_chunk", "00000|demo_wds")
    one_chunk = selection_of(shape, ["sample_length_chunk[00001|demo_wds]"])
    assert one_chunk.partitions == {"sample_catalog": {"demo_wds"}, "sample_length_chunk": {"00001|demo_wds"}}
    assert not one_chunk.keeps("sample_length_chunk", "00000|demo_wds")


def test_an_upstream_partitioned_otherwise_is_built_whole(shape):
    selection = selection_of(shape, ["frame_cache_shard[part-00000]"])
    assert selection.assets == ["sample_catalog", "video_frame_plan", "frame_cache_shard"]
    assert selection.partitions == {"frame_cache_shard": {"part-00000"}}  # the plan reads every source's catalogue


def test_a_whole_asset_and_one_of_its_partitions_select_it_whole(shape):
    selection = selection_of(shape, ["packing_bins[demo_wds]", "sample_lengths", "packed_json[demo_video]"])
    assert selection.partitions == {"packing_bins": {"demo_wds", "demo_video"}, "packed_json": {"demo_video"}}
    assert "sample_catalog" not in selection.partitions and "sample_lengths" not in selection.partitions


def test_selection_errors_name_the_item(shape):
    with pytest.raises(ValueError, match=r"training_mix\[x\]: training_mix is not partitioned"):
        selection_of(shape, ["training_mix[x]"])
    with pytest.raises(ValueError, match="unknown asset key"):
        selection_of(shape, ["no_such_asset[demo_wds]"])
