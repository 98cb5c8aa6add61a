"""Mosaics rendered while the catalogue validates each video, taken by the plan and the shards.

The catalogue has to decode every video to prove it readable. Rendering the frame-cache mosaic
in that same pass and keeping it in the spool (`StorageLayout.mosaic_spool`, beside the frame cache
rather than in it, so packages never carry it) lets `video_frame_plan` read the
frame count instead of demuxing the video again and `frame_cache_shard` copy the JPEG instead of
decoding it again. An entry counts only while the video file has the size and mtime it was
rendered from, the frame-cache settings are unchanged and its JPEG matches the recorded digest;
anything else is decoded afresh, so a stale or damaged entry costs time, never wrong frames.
A shard removes its videos' entries once its done record is written, and the plan those of videos
it does not hold (e.g. a video whose samples were rejected for another reason).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from pathlib import Path

from vlm_assets.atomic import atomic_write_bytes, atomic_write_text
from vlm_assets.media.checks import media_fingerprint
from vlm_assets.config import FrameCacheConfig
from vlm_assets.frames.plan import file_identity
from vlm_assets.media.video_probe import SampledFrames
from vlm_assets.frames.render import mosaic_settings, render_mosaic


@dataclass(frozen=True)
class SpoolEntry:
    """Contents of <spool>/<hh>/<key>.json, written after its .jpg."""

    video: str  # file identity (real path, or the tar member ref)
    fingerprint: str  # size, mtime and mosaic settings the JPEG was rendered from
    total_frames: int
    fps: float
    frame_indices: list[int]
    jpeg_sha256: str

    @property
    def sampled(self) -> SampledFrames:
        return SampledFrames(self.total_frames, self.fps, self.frame_indices)


class MosaicSpool:
    def __init__(self, root: Path, config: FrameCacheConfig) -> None:
        self.root = root
        self.config = config
        self._check = "mosaic:" + ",".join(str(value) for value in mosaic_settings(config))

    def render(self, ref: str) -> SampledFrames:
        """Decode and render `ref`'s mosaic, keep it, and return its frame count and indices.

        Raises what decoding raises. The file is fingerprinted before decoding, so a file
        changing meanwhile leaves an entry that no longer matches it.
        """
        try:
            fingerprint = media_fingerprint(ref, self._check)
        except OSError:
            fingerprint = None  # missing file: decoding names it
        jpeg, sampled = render_mosaic(ref, self.config)
        if fingerprint is not None:
            try:
                self._write(ref, fingerprint, jpeg, sampled)
            except OSError:
                pass  # a spool that cannot be written only means the shard decodes this video itself
        return sampled

    def sampled(self, ref: str) -> SampledFrames | None:
        """The frame count, fps and indices of `ref`'s current entry, if there is one."""
        entry = self._current_entry(ref)
        return entry.sampled if entry else None

    def mosaic(self, ref: str, frame_indices: list[int]) -> tuple[bytes, SampledFrames] | None:
        """The kept JPEG of `ref` when it is current, intact and shows exactly `frame_indices`."""
        entry = self._current_entry(ref)
        if entry is None or entry.frame_indices != frame_indices:
            return None
        try:
            jpeg = self._paths(ref)[1].read_bytes()
        except OSError:
            return None
        if hashlib.sha256(jpeg).hexdigest() != entry.jpeg_sha256:
            return None
        return jpeg, entry.sampled

    def discard(self, refs: Iterable[str]) -> None:
        for ref in refs:
            for path in self._paths(ref):
                path.unlink(missing_ok=True)

    def keep_only(self, refs: Iterable[str]) -> int:
        """Remove the entries of every video but `refs` (e.g. one whose samples were all rejected); returns how many.

        An entry a catalogue adds meanwhile for a video not yet planned may go too: that only
        costs its shard a decode.
        """
        keep = {_key(ref) for ref in refs}
        removed = 0
        for path in sorted(self.root.glob("*/*.json")) if self.root.is_dir() else []:
            if path.stem not in keep:
                path.unlink(missing_ok=True)
                path.with_suffix(".jpg").unlink(missing_ok=True)
                removed += 1
        return removed

    def _paths(self, ref: str) -> tuple[Path, Path]:
        key = _key(ref)
        folder = self.root / key[:2]
        return folder / f"{key}.json", folder / f"{key}.jpg"

    def _write(self, ref: str, fingerprint: str, jpeg: bytes, sampled: SampledFrames) -> None:
        entry_path, jpeg_path = self._paths(ref)
        jpeg_path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_bytes(jpeg_path, jpeg)
        entry = SpoolEntry(
            video=file_identity(ref),
            fingerprint=fingerprint,
            total_frames=sampled.total_frames,
            fps=sampled.fps,
            frame_indices=list(sampled.frame_indices),
            jpeg_sha256=hashlib.sha256(jpeg).hexdigest(),
        )
        atomic_write_text(entry_path, json.dumps(asdict(entry)) + "\n")

    def _current_entry(self, ref: str) -> SpoolEntry | None:
        try:
            entry = SpoolEntry(**json.loads(self._paths(ref)[0].read_text(encoding="utf-8")))
            current = media_fingerprint(ref, self._check)
        except (OSError, ValueError, TypeError):
            return None
        return entry if entry.fingerprint == current and entry.video == file_identity(ref) else None


def _key(ref: str) -> str:
    return hashlib.sha256(file_identity(ref).encode()).hexdigest()
