"""A source's deduplication: its signatures, those of the sources kept before it, and the decisions."""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Mapping
from dataclasses import dataclass

from vlm_assets.config import DedupConfig, FrameCacheConfig
from vlm_assets.dedup.decide import SourceDecisions, decide
from vlm_assets.dedup.decisions import write_decisions
from vlm_assets.dedup.signatures import SampleSignature, source_signatures
from vlm_assets.layout import StorageLayout
from vlm_assets.parquet_batches import rows_with_ids


@dataclass(frozen=True)
class DedupOutcome:
    decisions: SourceDecisions
    signatures_computed: int  # of this source's samples, computed now (the rest were stored)
    signatures_written: bool  # whether the stored table changed (never on a rerun or a changed threshold)
    signatures_resumed: int  # of this source's samples, taken from the parts an interrupted build left
    sources_ahead: list[str]  # the sources kept before this one that have a catalogue
    signatures_computed_ahead: int  # of theirs (and of the sources behind with packed samples), not stored yet
                                    # and computed here (not stored by this step)
    sources_behind: list[str]  # the sources kept after this one whose samples already packed were compared


def deduplicate_source(layout: StorageLayout, source: str, ahead: list[str], settings: DedupConfig,
                       frame_cache: FrameCacheConfig, processes: int = 1,
                       progress: Callable[[int], None] | None = None,
                       packed: Mapping[str, Collection[str]] | None = None, behind: Iterable[str] = ()) -> DedupOutcome:
    """Decide which of `source`'s samples duplicate one kept before them (in the sources `ahead`, in
    keep order, or earlier in `source`), write the decisions and `source`'s signatures.

    `packed` (packing.mode append): per source, the ids of its samples already packed, which are kept
    before every other (vlm_assets.dedup.decide); those of the sources `behind` (after `source` in keep
    order) are compared too."""
    spool = layout.mosaic_spool(frame_cache)
    signed: list[tuple[str, list[SampleSignature]]] = []
    computed_ahead = 0
    for name in ahead:
        if not layout.catalog(name).exists():
            continue  # not catalogued yet: the decisions are rebuilt once it is (their fingerprint names it)
        # Their own step stores their signatures; those it has not stored yet are computed here, in memory.
        table = source_signatures(layout.catalog(name), layout.dedup_signatures(name), settings, spool, frame_cache,
                                  processes, persist=False)
        computed_ahead += table.computed
        signed.append((name, table.signatures))
    own = source_signatures(layout.catalog(source), layout.dedup_signatures(source), settings, spool, frame_cache,
                            processes, progress=progress)
    after: list[tuple[str, list[SampleSignature]]] = []
    packed = packed or {}
    for name in behind:
        if layout.catalog(name).exists() and packed.get(name):
            table = source_signatures(layout.catalog(name), layout.dedup_signatures(name), settings, spool, frame_cache,
                                      processes, persist=False)
            computed_ahead += table.computed
            # Only their packed samples: the others come after this source's in keep order.
            after.append((name, [signature for signature in table.signatures if signature.sample_id in packed[name]]))
    decisions = decide([*signed, (source, own.signatures), *after], settings,
                       {sample_id for ids in packed.values() for sample_id in ids})[source]
    write_decisions(layout.dedup(source), decisions.removed)
    return DedupOutcome(decisions, own.computed, own.written, own.resumed, [name for name, _ in signed], computed_ahead,
                        [name for name, _ in after])


def first_media(layout: StorageLayout, sources: list[str], sample_ids: set[str]) -> dict[str, tuple[str, str]]:
    """The first medium (kind, ref) of each of `sample_ids` that has one, read from its source's catalogue."""
    media: dict[str, tuple[str, str]] = {}
    for name in sources:
        ids = [sample_id for sample_id in sample_ids if sample_id.startswith(f"{name}/")]
        if ids and layout.catalog(name).exists():
            for row in rows_with_ids(layout.catalog(name), ids, ["media_kinds", "media_refs"]):
                if row["media_refs"]:
                    media[row["sample_id"]] = (row["media_kinds"][0], row["media_refs"][0])
    return media
