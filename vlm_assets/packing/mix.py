"""The training mix: every source's Energon dataset blended by its weight (docs/formats.md).

`packed_wds/metadataset.yaml` is an Energon ``MetadatasetV2`` whose ``train`` split blends one
entry per source with a positive weight: the source's folder (relative to the file), its weight
and its subflavors (the configured ones plus ``sample_type`` and ``source``). Energon draws each
training sample from entry i with probability w_i / Σw, independently per draw; one sample here
is one packed bin, so the weights set the share of bins, and the share of tokens follows from the
bins' mean length per source.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Collection, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from vlm_assets.atomic import atomic_write_text
from vlm_assets.config import AppConfig, SourceConfig
from vlm_assets.layout import StorageLayout
from vlm_assets.packing.empty import EmptySource
from vlm_assets.packing.energon import DATASET_YAML, MAIN_FOLDER_NAME, SPLIT
from vlm_assets.packing.plan import BinsOnDisk

# Drawn shares must lie within this many binomial standard errors of the weights' shares:
# a two-sided normal tail of 5.7e-7 per source, so a correct mix practically never fails.
SHARE_SIGMAS = 5.0
# Expected draws of the rarest source: it is never drawn with probability at most e^-25.
MIN_EXPECTED_DRAWS = 25
MIN_DRAWS = 2000
MAX_DRAWS = 10000
DRAW_SEED = 1234


class MixError(ValueError):
    """The mix cannot be built or does not load as configured (names the source)."""


@dataclass(frozen=True)
class MixEntry:
    source: str
    sample_type: str
    weight: float
    subflavors: dict[str, Any]  # as Energon receives them: configured ones, sample_type, source
    samples: int  # original samples packed into the source's bins
    bins: int  # packed records: what Energon draws
    tokens: int

    @property
    def path(self) -> str:
        """The source's dataset folder, relative to the metadataset's folder."""
        return self.source


def source_subflavors(app: AppConfig, source: SourceConfig) -> dict[str, Any]:
    """What Energon hands a cooker with each of the source's samples: its configured subflavors, sample type and name."""
    return {**source.subflavors, "sample_type": app.sample_type_of(source), "source": source.name}


def mixable(sources: Iterable[SourceConfig], layout: StorageLayout, optional: Collection[str]) -> tuple[list[SourceConfig], dict[str, str]]:
    """The sources the mix takes, why each `optional` one without an Energon dataset is left out, and
    why each empty one is (packing.empty: it has no sample to draw).

    Inbox sources are optional: one whose lineage has not succeeded (yet) would otherwise hold back
    the mix of every other source. A configured source is left out only when empty (otherwise
    mix_entries names what it lacks).
    """
    taken, left_out = [], {}
    for source in sources:
        meta = layout.packed_wds(source.name) / MAIN_FOLDER_NAME / DATASET_YAML
        empty = EmptySource.load(layout.empty_dataset(source.name))
        if empty is not None and not meta.is_file():
            left_out[source.name] = f"empty, {empty.why}"
        elif source.name in optional and not meta.is_file():
            left_out[source.name] = f"no Energon dataset yet ({meta} missing); it joins once its packing lineage succeeds"
        else:
            taken.append(source)
    return taken, left_out


def mix_entries(app: AppConfig, sources: Iterable[SourceConfig], layout: StorageLayout) -> list[MixEntry]:
    """One entry per source, from its bins on disk; a weighted source without bins or metadata is an error."""
    entries = []
    for source in sources:
        bins_path = layout.bins(source.name)
        bins = BinsOnDisk.read(bins_path) if bins_path.exists() else None
        sample_type = app.sample_type_of(source)
        entry = MixEntry(
            source=source.name,
            sample_type=sample_type,
            weight=source.weight,
            subflavors=source_subflavors(app, source),
            samples=bins.packed if bins is not None else 0,
            bins=bins.bins if bins is not None else 0,
            tokens=bins.tokens if bins is not None else 0,
        )
        if entry.weight > 0:
            if not entry.bins:
                raise MixError(
                    f"source {source.name!r} has weight {entry.weight:g} but no packed bins "
                    f"({bins_path} {'is empty' if bins is not None else 'does not exist'}): it would never be drawn; "
                    "fix its data, materialise its packing lineage, or set its weight to 0"
                )
            meta = layout.packed_wds(source.name) / MAIN_FOLDER_NAME / DATASET_YAML
            if not meta.is_file():
                raise MixError(f"source {source.name!r}: no Energon dataset ({meta} missing); materialise energon_dataset for it")
        entries.append(entry)
    if not any(entry.weight > 0 for entry in entries):
        raise MixError("no source with a positive weight: nothing to train on")
    return entries


def blended(entries: Iterable[MixEntry]) -> list[MixEntry]:
    """The entries Energon blends: weight 0 leaves a source out (Energon requires weights > 0)."""
    return [entry for entry in entries if entry.weight > 0]


def draw_shares(entries: list[MixEntry]) -> dict[str, float]:
    """Probability that a drawn sample (bin) comes from each source."""
    total = sum(entry.weight for entry in entries)
    return {entry.source: entry.weight / total for entry in entries}


def token_shares(entries: list[MixEntry]) -> dict[str, float]:
    """Share of training tokens each source gets: its draw share times its mean tokens per bin."""
    per_draw = {entry.source: entry.weight * entry.tokens / entry.bins if entry.bins else 0.0 for entry in entries}
    total = sum(per_draw.values())
    return {source: value / total if total else 0.0 for source, value in per_draw.items()}


def metadataset(entries: list[MixEntry]) -> dict[str, Any]:
    return {
        "__module__": "megatron.energon",
        "__class__": "MetadatasetV2",
        "splits": {
            SPLIT: {
                "blend": [
                    {"path": entry.path, "weight": entry.weight, "subflavors": entry.subflavors}
                    for entry in blended(entries)
                ],
            },
        },
    }


def mixed_paths(metadataset_path: Path) -> list[str]:
    """The dataset folders (relative to the metadataset's folder) a written metadataset blends."""
    data = yaml.safe_load(metadataset_path.read_text(encoding="utf-8")) or {}
    return sorted({str(entry["path"]) for split in (data.get("splits") or {}).values()
                   for entry in (split or {}).get("blend") or []})


def write_metadataset(path: Path, entries: list[MixEntry]) -> None:
    atomic_write_text(path, yaml.safe_dump(metadataset(entries), sort_keys=False))


def mix_table_md(entries: list[MixEntry]) -> str:
    """Each source's weight, counts and shares in six short columns (sample types and other subflavors,
    which can be long, are the asset's `subflavors` metadata); sources of weight 0 are named below it."""
    draws, tokens = draw_shares(entries), token_shares(entries)
    lines = ["| source | weight | samples | bins | % bins | % tokens |", "|---|---:|---:|---:|---:|---:|"]
    for entry in entries:
        shares = f"{draws[entry.source]:.1%} | {tokens[entry.source]:.1%}" if entry.weight else "– | –"
        lines.append(f"| {entry.source} | {entry.weight:g} | {entry.samples} | {entry.bins} | {shares} |")
    left_out = [entry.source for entry in entries if not entry.weight]
    if left_out:
        lines += ["", f"Weight 0, left out of the blend: {', '.join(left_out)}."]
    return "\n".join(lines)


def draws_needed(entries: list[MixEntry]) -> int:
    """Draws enough that the rarest blended source is expected MIN_EXPECTED_DRAWS times (within bounds)."""
    rarest = min(draw_shares(blended(entries)).values())
    return max(MIN_DRAWS, min(MAX_DRAWS, math.ceil(MIN_EXPECTED_DRAWS / rarest)))


def share_tolerance(share: float, draws: int) -> float:
    """SHARE_SIGMAS binomial standard errors of a share estimated from `draws` independent draws."""
    return SHARE_SIGMAS * math.sqrt(share * (1 - share) / draws)


@dataclass(frozen=True)
class DrawReport:
    draws: int
    rows: list[tuple[str, float, int, float, float]]  # source, expected share, drawn, drawn share, tolerance
    problems: list[str]

    def table_md(self) -> str:
        lines = ["| source | weight share | drawn | drawn share | ± tolerance |", "|---|---:|---:|---:|---:|"]
        lines += [
            f"| {source} | {expected:.4f} | {count} | {share:.4f} | {tolerance:.4f} |"
            for source, expected, count, share, tolerance in self.rows
        ]
        return "\n".join(lines)


def judge_draws(entries: list[MixEntry], drawn_sources: list[str]) -> DrawReport:
    """Compare the sources of `drawn_sources` (one per draw) with the shares the weights imply."""
    counts = Counter(drawn_sources)
    draws = len(drawn_sources)
    expected = draw_shares(blended(entries))
    problems = [f"drew {counts[name]} sample(s) of {name!r}, which is not in the blend" for name in counts if name not in expected]
    rows = []
    for source, share in expected.items():
        count = counts[source]
        drawn_share = count / draws if draws else 0.0
        tolerance = share_tolerance(share, draws) if draws else 0.0
        rows.append((source, share, count, drawn_share, tolerance))
        if not count:
            rarity = "" if share * draws >= MIN_EXPECTED_DRAWS else f" (only {share * draws:.1f} expected: weight too small to confirm)"
            problems.append(f"source {source!r} was never drawn in {draws} draws{rarity}")
        elif abs(drawn_share - share) > tolerance:
            problems.append(
                f"source {source!r}: drawn share {drawn_share:.4f} differs from its weight share {share:.4f} "
                f"by more than {SHARE_SIGMAS:g} standard errors (± {tolerance:.4f})"
            )
    return DrawReport(draws, rows, problems)
