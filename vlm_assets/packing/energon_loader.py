"""Loading a prepared packed dataset through Energon's own loader: the proof that it is usable.

Kept apart from vlm_assets.packing.energon because importing Energon imports torch.
"""

from __future__ import annotations

import json
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from megatron.energon import (
    Cooker,
    DefaultTaskEncoder,
    Sample,
    WorkerConfig,
    basic_sample_keys,
    get_loader,
    get_val_dataset,
    reraise_exception,
    stateless,
)

from vlm_assets.packing.energon import SPLIT


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
