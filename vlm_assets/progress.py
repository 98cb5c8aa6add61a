"""How far a long step is, for `vlm-assets run` to show as a progress bar.

A step (in a worker process of `vlm-assets run`) rewrites a small JSON file, at most twice a
second: how many of its units it has done and, where known, out of how many. `vlm-assets run`
names the folder in $VLM_ASSETS_PROGRESS_DIR and reads the files of its runs in flight; a step
run any other way (the daemon, the UI) writes nothing.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from pathlib import Path

from vlm_assets.atomic import atomic_write_text

PROGRESS_DIR_ENV_VAR = "VLM_ASSETS_PROGRESS_DIR"
WRITE_EVERY_S = 0.5


@dataclass(frozen=True)
class Progress:
    done: int
    total: int | None
    unit: str


def progress_path(directory: Path, asset: str, partition: str | None) -> Path:
    return directory / (f"{asset}[{partition}].json" if partition else f"{asset}.json")


def read_progress(path: Path) -> Progress | None:
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return Progress(int(raw["done"]), raw.get("total"), str(raw.get("unit", "it")))


class ProgressFile:
    """`update(done, total)` from anywhere in a step; written at most every WRITE_EVERY_S seconds."""

    def __init__(self, asset: str, partition: str | None, unit: str) -> None:
        directory = os.environ.get(PROGRESS_DIR_ENV_VAR)
        self.path = progress_path(Path(directory), asset, partition) if directory else None
        self.unit = unit
        self.written_at = 0.0

    def update(self, done: int, total: int | None = None) -> None:
        if self.path is None or time.monotonic() - self.written_at < WRITE_EVERY_S:
            return
        self.written_at = time.monotonic()
        try:
            atomic_write_text(self.path, json.dumps({"done": done, "total": total, "unit": self.unit}))
        except OSError:
            self.path = None  # the folder went with its `vlm-assets run`; the step goes on
