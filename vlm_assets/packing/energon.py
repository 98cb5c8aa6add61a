"""Energon metadata over the packed shards, and a check that Energon loads them.

The metadata (``.nv-meta/split.yaml``, ``.info.json``, ``index.sqlite``, the
``*.tar.idx`` beside every shard) is written by megatron-energon's own prepare
(``BaseWebdatasetFactory.prepare_dataset``, what ``energon prepare`` calls); we
add the ``dataset.yaml`` the CLI writes for a ``CrudeWebdataset``, with the
``sample_type`` as a subflavor so cookers can select on it. Every shard goes to
the ``train`` split; no shuffling at prepare time, so the metadata is
reproducible.
"""

from __future__ import annotations

import json
import os
import shutil
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from megatron.energon import (
    Cooker,
    CrudeWebdataset,
    DefaultTaskEncoder,
    Sample,
    WorkerConfig,
    basic_sample_keys,
    get_loader,
    get_val_dataset,
    reraise_exception,
    stateless,
)
from megatron.energon.flavors import BaseWebdatasetFactory
from megatron.energon.flavors.webdataset.config import MAIN_FOLDER_NAME

from vlm_assets.atomic import atomic_write_text

SPLIT = "train"


@dataclass(frozen=True)
class EnergonDataset:
    root: Path
    shards: tuple[str, ...]  # relative to root
    sample_count: int

    @property
    def meta_dir(self) -> Path:
        return self.root / MAIN_FOLDER_NAME


def prepare_energon_dataset(root: Path, shards: list[Path], sample_type: str, workers: int | None = None) -> EnergonDataset:
    """Index `shards` (all under `root`) with Energon and write `root/.nv-meta`.

    Metadata from an earlier prepare is replaced, so a source or shard that went
    away does not linger in the index.
    """
    if not shards:
        raise ValueError(f"{root}: no packed shards to prepare (did every source reject all of its samples?)")
    relative = [str(path.relative_to(root)) for path in sorted(shards)]
    meta_dir = root / MAIN_FOLDER_NAME
    if meta_dir.exists():
        shutil.rmtree(meta_dir)
    BaseWebdatasetFactory.prepare_dataset(
        root,
        relative,
        split_parts_ratio=[(SPLIT, 1.0), ("val", 0.0), ("test", 0.0)],
        shuffle_seed=None,
        workers=workers or max(1, min(len(relative), os.cpu_count() or 1)),
    )
    dataset_yaml = {
        "__module__": "megatron.energon",
        "__class__": CrudeWebdataset.__name__,
        "subflavors": {"sample_type": sample_type},
    }
    atomic_write_text(meta_dir / "dataset.yaml", yaml.safe_dump(dataset_yaml, sort_keys=False))
    info = json.loads((meta_dir / ".info.json").read_text())
    return EnergonDataset(root, tuple(relative), int(sum(info["shard_counts"].values())))


@dataclass
class LoadedPackedSample(Sample):
    """What the check's cooker makes of one crude sample: the record and its member names."""

    record: dict
    members: list[str]
    sample_type: str


@stateless
def cook_packed_sample(raw: dict) -> LoadedPackedSample:
    """Decode the record and insist every media member it names arrived with bytes."""
    payload = raw["json"]
    record: dict[str, Any] = payload if isinstance(payload, dict) else json.loads(payload)
    present = {name for name in raw if not name.startswith("__")}
    for names in record["media_files"]:
        for name in names:
            if name not in present:
                raise ValueError(f"{raw['__key__']}: media member {name!r} missing (has {sorted(present)})")
            value = raw[name]
            if isinstance(value, (bytes, bytearray)) and not value:
                raise ValueError(f"{raw['__key__']}: media member {name!r} is empty")
    if record["id"] != raw["__key__"].rsplit("/", 1)[-1]:
        raise ValueError(f"{raw['__key__']}: record id {record['id']!r} does not match the tar key")
    return LoadedPackedSample(
        **basic_sample_keys(raw),
        record=record,
        members=sorted(present),
        sample_type=raw["__subflavors__"].get("sample_type", ""),
    )


class _CheckEncoder(DefaultTaskEncoder):
    cookers = [Cooker(cook_packed_sample)]

    def batch(self, samples: list[LoadedPackedSample]) -> list[LoadedPackedSample]:
        return samples


def load_all_ids(root: Path) -> list[str]:
    """Load every sample of the prepared dataset through Energon; errors propagate.

    Returns the record ids in load order (one pass, no shuffling, no repeats).
    """
    worker_config = WorkerConfig(rank=0, world_size=1, num_workers=0, global_error_handler=reraise_exception)
    dataset = get_val_dataset(
        root,
        split_part=SPLIT,
        worker_config=worker_config,
        batch_size=1,
        task_encoder=_CheckEncoder(),
    )
    ids: list[str] = []
    with warnings.catch_warnings():
        # Energon always asks torch for pinned memory; on a CPU-only check that is a no-op, not news.
        warnings.filterwarnings("ignore", message="'pin_memory' argument is set as true but no accelerator")
        for batch in get_loader(dataset):
            ids.extend(sample.record["id"] for sample in batch)
    return ids
