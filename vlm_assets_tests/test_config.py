from pathlib import Path

import dagster as dg
import pytest

from vlm_assets.config import ConfigError, ModelConfig, PackingConfig, SourceConfig, load_config
from vlm_assets.definitions import build_definitions


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "cfg.yaml"
    path.write_text(text)
    return path


def test_demo_config_loads_with_defaults_and_relative_paths(demo_app, demo_config_path):
    assert [source.kind for source in demo_app.sources] == ["flat_dir", "jsonl", "wds"]
    assert demo_app.storage_root == demo_config_path.parent / "vlm_data"
    assert demo_app.sources[1].media_root == demo_config_path.parent / "media"
    assert demo_app.frame_cache.num_frames == demo_app.frame_cache.rows * demo_app.frame_cache.cols


@pytest.mark.parametrize(
    ("text", "key"),
    [
        ("sample: {max_token_len: lots}\n", "sample.max_token_len"),
        ("sample: {sample_type: packed_everything}\n", "sample.sample_type"),
        ("wds: {maxcount: 10, colour: red}\n", "wds.colour"),
        ("frobnicate: 1\n", "frobnicate"),
        ("sources: [{name: a, kind: ftp, path: x}]\n", "sources[0].kind"),
        ("sources: [{name: a, kind: jsonl}]\n", "sources[0].path"),
        ("sources: [{name: a, kind: jsonl, path: x}, {name: a, kind: jsonl, path: y}]\n", "sources[1].name"),
        ("frame_cache: {num_frames: 64, rows: 4, cols: 8}\n", "frame_cache.rows"),
        ("package: {compress: lz4}\n", "package.compress"),
        ("package: {name: ../escape}\n", "package.name"),
        ("model: {processor: ./no/such/dir}\n", "model.processor"),
    ],
)
def test_errors_name_the_file_and_the_key(tmp_path, text, key):
    for name in ("x", "y"):
        (tmp_path / name).write_text("")
    path = write(tmp_path, text)
    with pytest.raises(ConfigError) as error:
        load_config(path)
    assert str(path) in str(error.value)
    assert key in str(error.value)


def test_model_type_and_single_value_keys_are_accepted(tmp_path):
    """model.model_type is kept (checked against the processor when it loads); best_fit_decreasing the only algorithm."""
    (tmp_path / "train.jsonl").write_text("")
    sources = "sources: [{name: a, kind: jsonl, path: train.jsonl}]\n"
    app = load_config(write(tmp_path, sources + "model: {model_type: qwen2_vl}\npacking: {algorithm: best_fit_decreasing}\n"))
    assert app.model == ModelConfig(model_type="qwen2_vl") and app.packing == PackingConfig()
    with pytest.raises(ConfigError, match="packing.algorithm"):
        load_config(write(tmp_path, sources + "packing: {algorithm: first_fit}\n"))
    with pytest.raises(ConfigError, match="model.model_type"):
        load_config(write(tmp_path, sources + "model: {model_type: [qwen2_vl]}\n"))
    keep = "sources: [{name: a, kind: jsonl, path: train.jsonl, special_tokens_in_text: keep}]\n"
    assert not load_config(write(tmp_path, keep)).sources[0].rejects_control_tokens
    assert app.sources[0].rejects_control_tokens
    with pytest.raises(ConfigError, match=r"sources\[0\].special_tokens_in_text: must be one of reject, keep"):
        load_config(write(tmp_path, keep.replace("keep", "escape")))


def test_trainer_chat_template_takes_loongforges_qwen_vl_template_names(tmp_path):
    (tmp_path / "train.jsonl").write_text("")
    sources = "sources: [{name: a, kind: jsonl, path: train.jsonl}]\n"
    assert load_config(write(tmp_path, sources)).trainer.chat_template == "qwen2-vl"
    for name in ("qwen2-vl", "qwen3-vl", "qwen2.5-vl-hf", "qwen3-vl-hf", "processor"):
        assert load_config(write(tmp_path, sources + f"trainer: {{chat_template: {name}}}\n")).trainer.chat_template == name
    with pytest.raises(ConfigError, match=r"trainer.chat_template: must be one of qwen2-vl, qwen3-vl, qwen2.5-vl-hf, "
                                          r"qwen3-vl-hf, processor; got 'qwen2.5-vl'"):
        load_config(write(tmp_path, sources + "trainer: {chat_template: qwen2.5-vl}\n"))


def test_integer_bounds_are_refused_at_load_naming_the_key(tmp_path):
    """A bin capacity beyond what a trainer takes is refused here, not by the packing step it would fail."""
    (tmp_path / "train.jsonl").write_text("")
    sources = "sources: [{name: a, kind: jsonl, path: train.jsonl}]\n"
    assert load_config(write(tmp_path, sources + f"sample: {{max_token_len: {2**20}}}\n")).sample.max_token_len == 2**20
    path = write(tmp_path, sources + "sample: {max_token_len: 99999999999999999999}\n")
    with pytest.raises(ConfigError, match=r"sample.max_token_len: must be <= 1048576, got 99999999999999999999") as error:
        load_config(path)
    assert str(path) in str(error.value)
    with pytest.raises(ConfigError, match=r"frame_cache.jpeg_quality: must be <= 100, got 101"):
        load_config(write(tmp_path, sources + "frame_cache: {jpeg_quality: 101}\n"))


def test_invalid_yaml_and_missing_file_are_clear(tmp_path):
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(write(tmp_path, "sources: [\n"))
    with pytest.raises(ConfigError, match="config file not found"):
        load_config(tmp_path / "absent.yaml")


def test_a_missing_config_still_loads_the_code_location_and_each_run_names_it(tmp_path):
    config = tmp_path / "absent.yaml"
    defs = build_definitions(config)  # what `dagster dev` loads: no config error at load time
    defs.resolve_asset_graph()
    training_mix = next(a for a in defs.assets if isinstance(a, dg.AssetsDefinition) and dg.AssetKey("training_mix") in a.keys)
    with pytest.raises(dg.DagsterResourceFunctionError) as error:
        dg.materialize([training_mix], resources=defs.resources, instance=dg.DagsterInstance.ephemeral())
    cause = error.value.__cause__
    assert isinstance(cause, ConfigError)
    assert str(cause) == f"{config}: config file not found (set $VLM_ASSETS_CONFIG or pass --config FILE)"


def test_config_from_environment(tmp_path, monkeypatch):
    (tmp_path / "train.jsonl").write_text("")
    path = write(tmp_path, "storage: {root: out}\nsources: [{name: a, kind: jsonl, path: train.jsonl}]\n")
    monkeypatch.setenv("VLM_ASSETS_CONFIG", str(path))
    assert load_config().storage_root == tmp_path / "out"


def test_a_sources_kind_is_part_of_what_its_catalogue_is_built_from(tmp_path):
    from dataclasses import replace

    from vlm_assets.catalog.source_walk import walk_source

    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "0.json").write_text("{}")
    flat = SourceConfig("s", "flat_dir", tmp_path / "src", tmp_path / "src")
    assert walk_source(flat, []).digest != walk_source(replace(flat, kind="wds"), []).digest
