"""A source with no sample to pack: every one of its samples a duplicate of a sample kept before it, or rejected.

Such a source is built, empty, rather than failed, when deduplication removed at least one of its
samples: a drop of data already kept adds nothing, and that is its expected outcome. One emptied
with no duplicate among its samples (every one too long, or not carried by its sample type) still
fails at the step that emptied it: nothing of it can be trained on, which is a fault to fix.

Energon's prepare refuses a folder without a tar, so an empty source gets no Energon dataset: its
folder under packed_wds/ holds no shard and no `.nv-meta`, but `empty.json`, which says why; the
training mix and the packages leave it out.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

from vlm_assets.atomic import atomic_write_text
from vlm_assets.wording import plural


@dataclass(frozen=True)
class EmptySource:
    source: str
    rejected: int  # every sample the source had after its catalogue
    duplicates: int  # of those, the ones deduplication removed

    @property
    def why(self) -> str:
        others = self.rejected - self.duplicates
        return (f"0 samples: every sample was a duplicate or rejected ({plural(self.duplicates, 'duplicate')} of "
                f"samples kept before, {others} rejected otherwise)")

    def save(self, path: Path) -> None:
        atomic_write_text(path, json.dumps({**asdict(self), "samples": 0, "why": self.why}, indent=1) + "\n")

    @classmethod
    def load(cls, path: Path) -> EmptySource | None:
        """The record at `path`; None where there is none (the source is not empty) or it cannot be read."""
        try:
            record = json.loads(path.read_text(encoding="utf-8"))
            return cls(record["source"], int(record["rejected"]), int(record["duplicates"]))
        except (OSError, ValueError, TypeError, KeyError):
            return None


def may_be_empty(duplicates: int) -> bool:
    """Whether a source left with no sample is built empty (see the module's docstring) rather than failed."""
    return duplicates > 0
