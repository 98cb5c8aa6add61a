"""Loading packed datasets and the training mix through Energon's own loaders: the proof that they are usable.

Kept apart from vlm_assets.packing.energon because importing Energon imports torch.
"""

from __future__ import annotations

import json
import tempfile
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import yaml

from megatron.energon import (
    Cooker,
    DefaultTaskEncoder,
    Sample,
    WorkerConfig,
    basic_sample_keys,
    get_train_dataset,
    get_val_dataset,
    reraise_exception,
    stateless,
)
from megatron.energon.savable_loader import BasicDataLoader

from vlm_assets.packing.contract import contract_problems
from vlm_assets.packing.energon import SPLIT


@dataclass
class LoadedPackedSample(Sample):
    """What the check's cooker makes of one crude sample: the record and its member names."""

    record: dict
    members: list[str]
    sample_type: str
    source: str  # subflavor set by the training mix; empty when a source's dataset is loaded alone


@stateless
def cook_packed_sample(raw: dict) -> LoadedPackedSample:
    """Read the record as its sample type's consumer does (vlm_assets.packing.contract); any problem
    is an error naming the sample and the child."""
    payload = raw["json"]
    record: dict[str, Any] = payload if isinstance(payload, dict) else json.loads(payload)
    present = {name for name in raw if not name.startswith("__")}
    with_bytes = {name for name in present if not (isinstance(raw[name], (bytes, bytearray)) and not raw[name])}
    if record.get("id") != raw["__key__"].rsplit("/", 1)[-1]:
        raise ValueError(f"{raw['__key__']}: record id {record.get('id')!r} does not match the tar key")
    subflavor_type = raw["__subflavors__"].get("sample_type", record.get("sample_type"))
    if subflavor_type != record.get("sample_type"):
        raise ValueError(f"{raw['__key__']}: the dataset's sample_type {subflavor_type!r} is not the record's "
                         f"{record.get('sample_type')!r}")
    problems = contract_problems(record, with_bytes)
    if problems:
        raise ValueError(f"{raw['__key__']} ({record.get('sample_type')}): " + "; ".join(problems[:5])
                         + (f"; and {len(problems) - 5} more" if len(problems) > 5 else ""))
    return LoadedPackedSample(
        **basic_sample_keys(raw),
        record=record,
        members=sorted(present),
        sample_type=raw["__subflavors__"].get("sample_type", ""),
        source=raw["__subflavors__"].get("source", ""),
    )


class _CheckEncoder(DefaultTaskEncoder):
    cookers: ClassVar = [Cooker(cook_packed_sample)]

    def batch(self, samples: list[LoadedPackedSample]) -> list[LoadedPackedSample]:
        return samples


def load_all_ids(root: Path | str, start: int = 0) -> list[str]:
    """Load every sample of the prepared dataset through Energon; errors propagate.

    Media arrive as their bytes, undecoded: the catalogue already decoded each one, and decoding
    them again here would make the check cost more than the whole packing.

    `root`: a local folder, or a dataset on object storage as Energon names it (`msc://…`).
    `start`: load only the samples from that index on, in the dataset's order (shard by shard),
    through a metadataset that takes that subset of it.

    Returns the record ids in load order (one pass, no shuffling, no repeats).
    """
    if not start:
        return _load_ids(root)
    with tempfile.TemporaryDirectory(prefix="vlm-assets-load-") as scratch:
        view = Path(scratch) / "subset.yaml"
        view.write_text(yaml.safe_dump({
            "__module__": "megatron.energon",
            "__class__": "MetadatasetV2",
            "splits": {SPLIT: {"path": root if isinstance(root, str) else str(root.absolute()),
                               "subset": {"range": [start, "end"]}}},
        }, sort_keys=False), encoding="utf-8")
        return _load_ids(view)


def _load_ids(path: Path | str) -> list[str]:
    worker_config = WorkerConfig(rank=0, world_size=1, num_workers=0, global_error_handler=reraise_exception)
    dataset = get_val_dataset(
        path,
        split_part=SPLIT,
        worker_config=worker_config,
        batch_size=1,
        task_encoder=_CheckEncoder(),
        auto_decode=False,
    )
    return [sample.record["id"] for sample in _samples(dataset)]


def draw_from_metadataset(metadataset: Path | str, draws: int, seed: int) -> list[LoadedPackedSample]:
    """The first `draws` training samples Energon's train loader yields from `metadataset`.

    One rank, no worker processes, no shuffle buffer: each draw picks a blended dataset at random
    by weight (seeded by `seed`, so the result is reproducible) and takes its next sample.
    """
    worker_config = WorkerConfig(rank=0, world_size=1, num_workers=0, seed_offset=seed, global_error_handler=reraise_exception)
    dataset = get_train_dataset(
        metadataset,
        split_part=SPLIT,
        worker_config=worker_config,
        batch_size=1,
        shuffle_buffer_size=None,
        max_samples_per_sequence=None,
        task_encoder=_CheckEncoder(),
        auto_decode=False,
    )
    drawn: list[LoadedPackedSample] = []
    for sample in _samples(dataset):
        drawn.append(sample)
        if len(drawn) == draws:
            break
    return drawn


def _samples(dataset) -> Iterator[LoadedPackedSample]:
    with warnings.catch_warnings():
        # Energon always asks torch for pinned memory; on a CPU-only check that is a no-op, not news.
        warnings.filterwarnings("ignore", message="'pin_memory' argument is set as true but no accelerator")
        # The loader get_loader returns, without its garbage collection every few samples (and the
        # gc.freeze before it): that keeps a training run's loader workers small, and in a check's one
        # pass in this process it costs more than the reading.
        for batch in BasicDataLoader(dataset, gc_collect_every_n_steps=0):
            yield from batch
