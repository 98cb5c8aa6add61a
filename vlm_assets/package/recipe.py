"""Package recipes: the small YAML a user writes (or `package new` starts) to say what goes in a package.

A recipe names the package, its compression, the training hyperparameters, the
command that trains on it, and one data path per role. The same PackageSpec is
built from the app config (`package:` section) by the Dagster asset and by
`package pack --config`.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import yaml

from vlm_assets.config import (
    COMPRESSIONS,
    DEFAULT_STORAGE_ROOT,
    AppConfig,
    FrameCacheConfig,
    PackageConfig,
    SampleConfig,
    package_name_problem,
)
from vlm_assets.layout import StorageLayout
from vlm_assets.packing.mix import mixed_paths
from vlm_assets.package.manifest import PackageError
from vlm_assets.package.writer import PackagePart, PackageSpec

PACKED_WDS = "packed_wds"
FRAME_CACHE = "frame_cache"
_RECIPE_KEYS = {"name", "compress", "hyperparameters", "train_command", "data"}

STARTER_RECIPE = """\
# Training package recipe (vlm-assets package pack {file_name}).
# Relative paths are resolved against this file's folder.
name: {name}
# zstd -> <name>.nnpkg.zst (multi-threaded, fast); gzip -> <name>.nnpkg (readable by any tar).
compress: zstd
# Stored in manifest.json and available to train_command as {{hp[KEY]}}.
hyperparameters:
  learning_rate: 1.0e-5
  global_batch_size: 64
  micro_batch_size: 1
  epochs: 1
  max_token_len: {max_token_len}
# Run by `vlm-assets package train PACKAGE` after it verifies and extracts the package.
# Placeholders: {{<role>}} = extracted folder of that data role, {{metadataset}} = the training mix
# (packed_wds/metadataset.yaml, an Energon metadataset), {{workdir}}, {{manifest}},
# {{hyperparameters}} (JSON), {{hp[KEY]}}. The same values are in the environment as
# VLM_PACKAGE_DATA_<ROLE>, VLM_PACKAGE_METADATASET, VLM_PACKAGE_WORKDIR, VLM_PACKAGE_MANIFEST,
# VLM_PACKAGE_HYPERPARAMETERS.
train_command: "python train.py --data {{packed_wds}} --frames {{frame_cache}} --lr {{hp[learning_rate]}}"
# role: path (a folder is packed whole, including hidden folders such as .nv-meta).
data:
  packed_wds: {packed_wds}
  frame_cache: {frame_cache}
"""


def starter_recipe(recipe_path: Path, name: str, app: AppConfig | None = None) -> str:
    """Text of a starter recipe whose data paths point at the outputs of `app`, or, without one, at
    those of a config with default settings beside the recipe."""
    base = recipe_path.parent.resolve()
    if app is None:
        layout, frame_cache, sample = StorageLayout(base / DEFAULT_STORAGE_ROOT), FrameCacheConfig(), SampleConfig()
    else:
        layout, frame_cache, sample = StorageLayout(app.storage_root), app.frame_cache, app.sample
    return STARTER_RECIPE.format(
        file_name=recipe_path.name,
        name=name,
        packed_wds=_relative(layout.packed_wds_root, base),
        frame_cache=_relative(layout.frame_cache_dir(frame_cache), base),
        max_token_len=sample.max_token_len,
    )


def _relative(path: Path, base: Path) -> str:
    relative = os.path.relpath(path, base)
    return relative if relative.startswith("..") else f"./{relative}"


def load_recipe(path: Path) -> PackageSpec:
    """Parse a recipe file; every error names the file and key."""
    try:
        raw = yaml.safe_load(path.read_text(encoding="utf-8"))
    except OSError as error:
        raise PackageError(f"{path}: cannot read recipe: {error.strerror or error}") from error
    except yaml.YAMLError as error:
        raise PackageError(f"{path}: not valid YAML: {error}") from error
    if not isinstance(raw, dict):
        raise PackageError(f"{path}: a recipe is a YAML mapping with keys {', '.join(sorted(_RECIPE_KEYS))}")
    unknown = sorted(set(raw) - _RECIPE_KEYS)
    if unknown:
        raise PackageError(f"{path}: {unknown[0]}: unknown key (allowed: {', '.join(sorted(_RECIPE_KEYS))})")
    name = raw.get("name")
    problem = package_name_problem(name)
    if problem:
        raise PackageError(f"{path}: name: {problem}")
    compress = raw.get("compress", PackageConfig.compress)
    if compress not in COMPRESSIONS:
        raise PackageError(f"{path}: compress: must be one of {', '.join(COMPRESSIONS)}, got {compress!r}")
    hyperparameters = raw.get("hyperparameters") or {}
    if not isinstance(hyperparameters, dict):
        raise PackageError(f"{path}: hyperparameters: expected a mapping")
    train_command = raw.get("train_command") or ""
    if not isinstance(train_command, str):
        raise PackageError(f"{path}: train_command: expected a string")
    data = raw.get("data")
    if not isinstance(data, dict) or not data:
        raise PackageError(f"{path}: data: expected a mapping of role -> path with at least one entry")
    parts = []
    for role, value in data.items():
        if not isinstance(value, str) or not value:
            raise PackageError(f"{path}: data.{role}: expected a path")
        source = Path(os.path.expanduser(value))
        source = source if source.is_absolute() else (path.parent / source).resolve()
        if not source.exists():
            raise PackageError(f"{path}: data.{role}: {source} does not exist")
        parts.append(PackagePart(str(role), source))
    return PackageSpec(name, compress, tuple(parts), _plain(hyperparameters), train_command)


def spec_from_config(app: AppConfig, warn: Any = None) -> PackageSpec:
    """The package the `package:` section of the app config describes; parts that do not exist yet are skipped."""
    layout = StorageLayout(app.storage_root)
    locations = {
        PACKED_WDS: layout.packed_wds_root,
        FRAME_CACHE: layout.frame_cache_dir(app.frame_cache),
    }
    parts = []
    for role in app.package.include:
        source = locations[role]
        if source.is_dir():
            parts.append(PackagePart(role, source, _mixed_only(layout) if role == PACKED_WDS else ()))
        elif warn is not None:
            warn(f"package part {role!r} skipped: {source} does not exist")
    if not parts:
        raise PackageError(f"{app.path}: package.include {list(app.package.include)}: none of these exist yet, nothing to package")
    return PackageSpec(
        app.package.name, app.package.compress, tuple(parts), _plain(app.package.hyperparameters), app.package.train_command
    )


def _mixed_only(layout: StorageLayout) -> tuple[str, ...]:
    """What of packed_wds a package ships: the training mix and the datasets it blends, not the
    folders of sources since renamed or unregistered (all of it while no mix is written)."""
    if not layout.metadataset.is_file():
        return ()
    return (layout.metadataset.name, *mixed_paths(layout.metadataset))


def _plain(value: Any) -> Any:
    """YAML values as JSON-safe ones (dates become ISO strings) so the manifest always serialises."""
    if isinstance(value, dict):
        return {str(key): _plain(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(item) for item in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return str(value)
