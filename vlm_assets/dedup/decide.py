"""Which samples are duplicates of a sample kept before them, and of which.

Samples are taken in one stated order: sources by priority (`dedup.priority` first, then the config's
order, then inbox sources), within a source by sample id. With `packing.mode: append`, the samples
already packed (in the bins on disk) are all taken first, in that order, then the others in that
order: a sample packed stays where it is, whatever the id of a copy arriving later. Each is compared
with the samples kept before it; the first it matches (in that order) is the one it duplicates, and
it is removed; else it is kept. So a rerun keeps the same ones, and a sample another source already
holds is not kept twice.

A duplicate is a sample, not a medium: its media and its conversation must both match a kept
sample's. Media match when each medium's bytes are equal (sha256), or, with the near kinds on, its
pHash is within `image_distance` bits (a video's frames within `video_distance` bits on average);
conversations match when their normalised texts are equal or, with `near_text`, their MinHash
Jaccard estimate reaches `text_threshold`. A text-only sample matches on its text alone;
`media_only` drops the text condition for samples with media.
"""

from __future__ import annotations

import math
from collections import Counter, defaultdict
from collections.abc import Collection
from dataclasses import dataclass, field

from datasketch import MinHashLSH

from vlm_assets.config import DedupConfig
from vlm_assets.dedup.decisions import EXACT, NEAR_IMAGE, NEAR_TEXT, NEAR_VIDEO, SAME_MEDIA, Removal
from vlm_assets.dedup.index import BandedHashIndex, hamming
from vlm_assets.dedup.signatures import SampleSignature, minhash_of


@dataclass
class SourceDecisions:
    removed: list[Removal] = field(default_factory=list)
    examined: int = 0  # ok samples compared
    # Media (sha256) kept in more than one sample of this source with other text: medium -> samples.
    reused_media: Counter[str] = field(default_factory=Counter)


@dataclass(frozen=True)
class _Match:
    kept: int
    kind: str
    distance: float
    jaccard: float  # estimated, of the texts; 1 where they are equal
    near_text: bool  # the texts differ (the estimate may still round to 1)


class _Kept:
    """The samples kept so far, indexed so that each new one is compared with few of them."""

    def __init__(self, settings: DedupConfig) -> None:
        self.settings = settings
        self.samples: list[SampleSignature] = []
        self.by_exact: dict[str, int] = {}
        self.by_media: dict[tuple[str, ...], list[int]] = defaultdict(list)
        self.by_text: dict[str, list[int]] = defaultdict(list)
        self.images = BandedHashIndex(settings.image_distance)
        self.videos = BandedHashIndex(math.floor(settings.video_distance))
        self.texts = MinHashLSH(threshold=settings.text_threshold, num_perm=settings.text_permutations)

    def add(self, sample: SampleSignature) -> None:
        item = len(self.samples)
        self.samples.append(sample)
        self.by_exact.setdefault(sample.exact_key, item)
        if sample.media_sha256:
            self.by_media[sample.media_sha256].append(item)
            first = sample.media_hashes[0]
            if first:
                (self.images if sample.media_kinds[0] == "image" else self.videos).add(item, first)
        self.by_text[sample.text_sha256].append(item)
        if sample.text_minhash:
            # Not kept as a MinHash object (about a kilobyte each): a comparison makes one from the bytes.
            self.texts.insert(item, minhash_of(sample.text_minhash))

    def match(self, sample: SampleSignature) -> _Match | None:
        """The first kept sample this one duplicates, by the kinds switched on."""
        if self.settings.exact and sample.exact_key in self.by_exact:
            return _Match(self.by_exact[sample.exact_key], EXACT, 0.0, 1.0, False)
        media_only = self.settings.media_only and bool(sample.media_sha256)
        candidates = self._media_candidates(sample) if sample.media_sha256 else None
        if not media_only:
            texts = self._text_candidates(sample)
            candidates = texts if candidates is None else candidates & texts
        for item in sorted(candidates or ()):
            found = self._compare(sample, item, media_only)
            if found is not None:
                return found
        return None

    def _media_candidates(self, sample: SampleSignature) -> set[int]:
        found = set(self.by_media.get(sample.media_sha256, ()))
        first = sample.media_hashes[0]
        if first:
            found |= (self.images if sample.media_kinds[0] == "image" else self.videos).candidates(first)
        return found

    def _text_candidates(self, sample: SampleSignature) -> set[int]:
        found = set(self.by_text.get(sample.text_sha256, ()))
        if sample.text_minhash:
            found.update(self.texts.query(minhash_of(sample.text_minhash)))
        return found

    def _compare(self, sample: SampleSignature, item: int, media_only: bool) -> _Match | None:
        kept = self.samples[item]
        if kept.media_kinds != sample.media_kinds:
            return None
        distances = []  # (kind, bits) of each medium that is near, not equal
        for kind, sha, kept_sha, hashes, kept_hashes in zip(sample.media_kinds, sample.media_sha256, kept.media_sha256,
                                                           sample.media_hashes, kept.media_hashes):
            if sha == kept_sha:
                continue
            bits = _media_distance(hashes, kept_hashes)
            limit = self.settings.image_distance if kind == "image" else self.settings.video_distance
            if bits is None or bits > limit:
                return None
            distances.append((kind, bits))
        jaccard = 1.0
        near_text = not media_only and sample.text_sha256 != kept.text_sha256
        if near_text:
            if not sample.text_minhash or not kept.text_minhash:
                return None
            jaccard = minhash_of(sample.text_minhash).jaccard(minhash_of(kept.text_minhash))
            if jaccard < self.settings.text_threshold:
                return None
        distance = max((bits for _, bits in distances), default=0.0)
        if media_only:
            kind = SAME_MEDIA if not distances else (NEAR_IMAGE if distances[0][0] == "image" else NEAR_VIDEO)
        elif distances:
            kind = NEAR_IMAGE if any(kind == "image" for kind, _ in distances) else NEAR_VIDEO
        elif near_text:
            kind = NEAR_TEXT
        else:
            # Equal media and equal text with `exact` off: not removed.
            return None
        return _Match(item, kind, distance, jaccard, near_text)


def _media_distance(hashes: tuple[int, ...], kept: tuple[int, ...]) -> float | None:
    """Bits between two media's hashes (a video's averaged over its frames); None where they cannot be compared."""
    if not hashes or len(hashes) != len(kept):
        return None
    return sum(hamming(a, b) for a, b in zip(hashes, kept)) / len(hashes)


def _reason(match: _Match, kept_id: str, media_only: bool) -> str:
    text = f"text jaccard {match.jaccard:.2f}" if match.near_text else ""
    suffix = ", media_only" if media_only else ""
    if match.kind == EXACT:
        return f"exact duplicate of {kept_id}"
    if match.kind == SAME_MEDIA:
        return f"same media as {kept_id} (media_only)"
    if match.kind == NEAR_TEXT:
        return f"near-duplicate text of {kept_id} (jaccard {match.jaccard:.2f})"
    medium = "image" if match.kind == NEAR_IMAGE else "video"
    details = "; ".join(part for part in (f"distance {match.distance:g}", text) if part)
    return f"near-duplicate {medium} of {kept_id} ({details}{suffix})"


def decide(sources: list[tuple[str, list[SampleSignature]]], settings: DedupConfig,
           packed: Collection[str] = ()) -> dict[str, SourceDecisions]:
    """Decisions for every source of `sources` (in keep order), each source's samples taken by sample id;
    the samples already `packed` (packing.mode append) first, those of every source before any other."""
    kept = _Kept(settings)
    decisions = {name: SourceDecisions() for name, _ in sources}
    media_texts: dict[str, dict[str, set[str]]] = {name: defaultdict(set) for name, _ in sources}
    # A sample packed by an earlier build stays where it is packed: nothing arriving later removes it.
    for first in (True, False) if packed else (False,):
        for name, signatures in sources:
            source = decisions[name]
            taken = [signature for signature in signatures if not packed or (signature.sample_id in packed) == first]
            for sample in sorted(taken, key=lambda signature: signature.sample_id):
                source.examined += 1
                match = kept.match(sample)
                if match is None:
                    kept.add(sample)
                    for sha in set(sample.media_sha256):
                        media_texts[name][sha].add(sample.text_sha256)
                    continue
                kept_id = kept.samples[match.kept].sample_id
                media_only = match.kind != EXACT and settings.media_only and bool(sample.media_sha256)
                source.removed.append(Removal(sample.sample_id, match.kind, kept_id, match.distance, match.jaccard,
                                              _reason(match, kept_id, media_only)))
    for name, source in decisions.items():
        source.reused_media = Counter({sha: len(texts) for sha, texts in media_texts[name].items() if len(texts) > 1})
    return decisions
