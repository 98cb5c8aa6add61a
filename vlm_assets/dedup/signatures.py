"""What a sample is compared by: its media's bytes and perceptual hashes, and its conversation's text.

A source's signatures are kept in `dedup/<source>.signatures.parquet`, one row per catalogued ok
sample, each under a key of what it was computed from (the sample's messages, its media and their
stamps, the signature settings): a rebuild computes only rows whose key is new (records appended,
media changed), and a changed threshold none at all, since thresholds only decide. While a build
computes them, every few thousand are kept in `dedup/<source>.signatures.parts/` as they come, so a
build interrupted part way resumes from there; the parts go once the table is written.

Video frames come from the mosaic the catalogue rendered into the frame-cache spool
(vlm_assets.frames.spool); a video without one is rendered once and spooled, so the frame cache's
shard takes the same mosaic instead of decoding the video again.
"""

from __future__ import annotations

import functools
import hashlib
import io
import json
import re
import shutil
import unicodedata
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import imagehash
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from datasketch import LeanMinHash, MinHash
from PIL import Image, ImageOps

from vlm_assets.atomic import atomic_path
from vlm_assets.catalog.schema import STATUS_OK
from vlm_assets.config import DedupConfig, FrameCacheConfig
from vlm_assets.frames.mosaic import split_mosaic
from vlm_assets.frames.render import mosaic_settings
from vlm_assets.frames.spool import MosaicSpool
from vlm_assets.media.refs import read_media_bytes
from vlm_assets.parallel import ordered_map
from vlm_assets.parquet_batches import parquet_batches

CATALOG_COLUMNS_READ = ["sample_id", "status", "messages", "media_kinds", "media_refs", "media_stamps"]
SIGNATURE_SCHEMA = pa.schema([
    ("sample_id", pa.string()),
    ("row_key", pa.string()),
    ("media_kinds", pa.list_(pa.string())),
    ("media_sha256", pa.list_(pa.string())),
    # Per medium: an image's pHash, or one pHash per sampled video frame; empty where near kinds are off.
    ("media_hashes", pa.list_(pa.list_(pa.uint64()))),
    ("text_sha256", pa.string()),
    ("text_minhash", pa.list_(pa.uint32())),  # empty where near text is off
])
# Samples whose signatures one task computes (a worker process's share of a source).
SIGNATURE_CHUNK_ROWS = 256
# Signatures computed before they are kept as a part, for an interrupted build to resume from: a part
# per minute or so of one core's work.
CHECKPOINT_ROWS = 16384
# An image is decoded at a reduced scale (JPEG's DCT scaling, both sides no smaller than this) and in
# grey, all a pHash of 32 × 32 grey pixels looks at. Twice the hash's side: decoded nearer to it, a
# resized copy's hash drifts by a few bits.
PHASH_DECODE_SIZE = (64, 64)
MINHASH_SEED = 1
# datasketch's 32-bit scheme: every stored value fits the table's uint32 column.
MINHASH_SCHEME = "affine32"
_NOT_WORD = re.compile(r"[\W_]+", re.UNICODE)
_SPACES = re.compile(r"\s+", re.UNICODE)


@dataclass(frozen=True)
class SampleSignature:
    sample_id: str
    row_key: str
    media_kinds: tuple[str, ...]
    media_sha256: tuple[str, ...]
    media_hashes: tuple[tuple[int, ...], ...]
    text_sha256: str
    # The MinHash's values, 4 little-endian bytes each (empty where near text is off): a tuple of
    # Python ints would take ten times the memory, and a decision holds every kept sample's.
    text_minhash: bytes

    @property
    def exact_key(self) -> str:
        """Equal for two samples whose media bytes and normalised conversations are equal."""
        return hashlib.sha256("\0".join((self.text_sha256, *self.media_kinds, *self.media_sha256)).encode()).hexdigest()


def conversation_text(messages_json: str) -> str:
    """The conversation as compared exactly: each turn as `role: content`, Unicode NFKC, case folded,
    runs of white space as one space (a re-wrapped or re-cased copy is the same text)."""
    turns = json.loads(messages_json)
    lines = [f"{turn.get('role', '')}: {turn.get('content', '')}" for turn in turns]
    return _SPACES.sub(" ", unicodedata.normalize("NFKC", "\n".join(lines)).casefold()).strip()


def text_shingles(text: str, size: int) -> set[bytes]:
    """Character `size`-grams of `text` with punctuation and symbols dropped (a copy with changed
    punctuation shares all of them); a text shorter than one shingle is its own."""
    words = _NOT_WORD.sub(" ", text).strip()
    if len(words) <= size:
        return {words.encode()}
    return {words[start:start + size].encode() for start in range(len(words) - size + 1)}


@functools.cache
def _empty_minhash(permutations: int) -> MinHash:
    # Drawing a MinHash's permutations costs more than hashing a caption: they are drawn once, then copied.
    return MinHash(num_perm=permutations, seed=MINHASH_SEED, scheme=MINHASH_SCHEME)


def text_minhash(text: str, settings: DedupConfig) -> MinHash:
    minhash = _empty_minhash(settings.text_permutations).copy()
    minhash.update_batch(list(text_shingles(text, settings.text_shingle_chars)))
    return minhash


def minhash_of(values: bytes) -> LeanMinHash:
    """The MinHash a signature stores, for comparison and the index (without permutations: it is not updated)."""
    return LeanMinHash(seed=MINHASH_SEED, hashvalues=np.frombuffer(values, dtype="<u4").astype(np.uint64),
                       scheme=MINHASH_SCHEME)


def image_phash(data: bytes) -> int:
    """The 64-bit pHash (imagehash) of an image as displayed (EXIF orientation applied)."""
    with Image.open(io.BytesIO(data)) as image:
        image.draft("L", PHASH_DECODE_SIZE)  # a JPEG decodes at 1/2 … 1/8 scale
        oriented = ImageOps.exif_transpose(image)
        return _hash_bits(imagehash.phash(oriented))


def frame_phashes(frames: np.ndarray, count: int) -> tuple[int, ...]:
    """pHashes of `count` frames spread evenly over `frames` (all of them when fewer)."""
    picked = np.unique(np.round(np.linspace(0, len(frames) - 1, min(count, len(frames)))).astype(int))
    return tuple(_hash_bits(imagehash.phash(Image.fromarray(frames[index]))) for index in picked)


def _hash_bits(hashed: imagehash.ImageHash) -> int:
    return int("".join("1" if bit else "0" for bit in hashed.hash.flatten()), 2)


class VideoFrames:
    """A video's sampled frames, taken from the frame-cache spool's mosaic, rendered (and spooled) when it has none."""

    def __init__(self, spool: Path, frame_cache: FrameCacheConfig) -> None:
        self.spool = MosaicSpool(spool, frame_cache)
        self.frame_cache = frame_cache

    def frames(self, ref: str) -> np.ndarray:
        sampled = self.spool.sampled(ref)
        kept = self.spool.mosaic(ref, list(sampled.frame_indices)) if sampled is not None else None
        if kept is None:
            self.spool.render(ref)
            sampled = self.spool.sampled(ref)
            kept = self.spool.mosaic(ref, list(sampled.frame_indices)) if sampled is not None else None
            if kept is None:
                raise OSError(f"{ref}: its frames could not be spooled")
        jpeg, sampled = kept
        with Image.open(io.BytesIO(jpeg)) as mosaic:
            pixels = np.asarray(mosaic.convert("RGB"))
        return split_mosaic(pixels, self.frame_cache.rows, self.frame_cache.cols, len(sampled.frame_indices))


def row_key(row: dict[str, Any], settings: DedupConfig, frame_cache: FrameCacheConfig) -> str:
    """What a sample's signatures are computed from: its conversation, its media (each with its stamp)
    and the settings (a video's frames are the frame cache's mosaic tiles)."""
    parts = [row["messages"], *row["media_kinds"], *row["media_refs"], *row["media_stamps"],
             json.dumps([settings.signature_settings(), mosaic_settings(frame_cache)], sort_keys=True)]
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:32]


def compute_signature(row: dict[str, Any], key: str, settings: DedupConfig, video_frames: VideoFrames) -> SampleSignature:
    text = conversation_text(row["messages"])
    near = settings.signature_settings()
    shas, hashes = [], []
    for kind, ref in zip(row["media_kinds"], row["media_refs"]):
        data = read_media_bytes(ref)
        shas.append(hashlib.sha256(data).hexdigest())
        if kind == "image" and near["near_images"]:
            hashes.append((image_phash(data),))
        elif kind == "video" and near["near_videos"]:
            hashes.append(frame_phashes(video_frames.frames(ref), settings.video_frames))
        else:
            hashes.append(())
    minhash = text_minhash(text, settings).hashvalues.astype("<u4").tobytes() if settings.near_text else b""
    return SampleSignature(row["sample_id"], key, tuple(row["media_kinds"]), tuple(shas), tuple(hashes),
                           hashlib.sha256(text.encode()).hexdigest(), minhash)


# Set up in each process that computes signatures (start_signing).
_signing: tuple[DedupConfig, VideoFrames] | None = None


def start_signing(settings: DedupConfig, spool: Path, frame_cache: FrameCacheConfig) -> None:
    global _signing
    _signing = (settings, VideoFrames(spool, frame_cache))


def _sign_rows(rows: list[tuple[dict[str, Any], str]]) -> list[SampleSignature]:
    assert _signing is not None, "start_signing runs first in every process"
    settings, video_frames = _signing
    return [compute_signature(row, key, settings, video_frames) for row, key in rows]


@dataclass(frozen=True)
class SignatureTable:
    signatures: list[SampleSignature]  # the catalogue's ok samples, in catalogue order
    computed: int  # rows computed now (the others were kept from the stored table or its parts)
    written: bool  # whether the stored table was (re)written
    resumed: int = 0  # rows taken from the parts an interrupted build left


def read_signatures(path: Path) -> dict[str, SampleSignature]:
    """The stored signatures by sample id (none where the file is missing or unreadable)."""
    try:
        table = pq.ParquetFile(path).read()
    except (FileNotFoundError, pa.ArrowInvalid, OSError):
        return {}
    return {row["sample_id"]: _from_row(row) for row in table.to_pylist()}


def source_signatures(catalog: Path, store: Path, settings: DedupConfig, spool: Path, frame_cache: FrameCacheConfig,
                      processes: int = 1, persist: bool = True, progress: Callable[[int], None] | None = None,
                      checkpoint_rows: int = CHECKPOINT_ROWS) -> SignatureTable:
    """Signatures of every ok sample of the catalogue at `catalog`, those stored in `store` with the
    same key taken from there; with `persist`, `store` is rewritten (atomically) when anything in it
    changed, and every `checkpoint_rows` computed are kept as a part beside it until then (a build
    interrupted before resumes from them). `processes` compute the others side by side."""
    stored = read_signatures(store)
    parts = signature_parts(store)
    resumable = _read_parts(parts) if persist else {}
    rows = [(row, key) for row in _ok_rows(catalog) for key in [row_key(row, settings, frame_cache)]]
    computed: dict[str, SampleSignature] = {}
    resumed: dict[str, SampleSignature] = {}
    to_compute = []
    for row, key in rows:
        if (part := resumable.get(row["sample_id"])) is not None and part.row_key == key:
            resumed[row["sample_id"]] = part
        elif (kept := stored.get(row["sample_id"])) is None or kept.row_key != key:
            to_compute.append((row, key))
    chunks = [to_compute[start:start + SIGNATURE_CHUNK_ROWS] for start in range(0, len(to_compute), SIGNATURE_CHUNK_ROWS)]
    processes = min(processes, len(chunks))
    unsaved: list[SampleSignature] = []
    for signed in ordered_map(_sign_rows, chunks, processes, start_signing, (settings, spool, frame_cache)):
        computed.update((signature.sample_id, signature) for signature in signed)
        unsaved.extend(signed)
        if persist and len(unsaved) >= checkpoint_rows:
            _write_part(parts, unsaved)
            unsaved = []
        if progress:
            progress(len(computed))
    signatures = [computed.get(row["sample_id"]) or resumed.get(row["sample_id"]) or stored[row["sample_id"]]
                  for row, _ in rows]
    # Rows of samples gone from the catalogue are dropped too; an unchanged table is left as it is.
    write = persist and (bool(computed) or bool(resumed) or len(stored) != len(signatures) or not store.exists())
    if write:
        store.parent.mkdir(parents=True, exist_ok=True)
        with atomic_path(store) as tmp:
            pq.write_table(_to_table(signatures), tmp)
    if persist:
        shutil.rmtree(parts, ignore_errors=True)  # all they held is in the table now
    return SignatureTable(signatures, len(computed), write, len(resumed))


def signature_parts(store: Path) -> Path:
    """The folder of the signatures a build of `store` has computed and not yet written into it."""
    return store.with_name(store.name.removesuffix(".parquet") + ".parts")


def _write_part(parts: Path, signatures: list[SampleSignature]) -> None:
    # Named by its samples: a resumed build that computes the same ones again writes the same part.
    name = hashlib.sha256("\0".join(signature.sample_id for signature in signatures).encode()).hexdigest()[:24]
    parts.mkdir(parents=True, exist_ok=True)
    with atomic_path(parts / f"{name}.parquet") as tmp:
        pq.write_table(_to_table(signatures), tmp)


def _read_parts(parts: Path) -> dict[str, SampleSignature]:
    found: dict[str, SampleSignature] = {}
    for part in sorted(parts.glob("*.parquet")):
        found.update(read_signatures(part))
    return found


def _ok_rows(catalog: Path) -> Iterator[dict[str, Any]]:
    for batch in parquet_batches(catalog, CATALOG_COLUMNS_READ, 8192):
        yield from (row for row in batch.to_pylist() if row["status"] == STATUS_OK)


def _to_table(signatures: list[SampleSignature]) -> pa.Table:
    columns = {name: [getattr(signature, name) for signature in signatures] for name in SIGNATURE_SCHEMA.names}
    columns["text_minhash"] = [np.frombuffer(value, dtype="<u4").tolist() for value in columns["text_minhash"]]
    return pa.table({name: [list(map(list, value)) if name == "media_hashes" else
                            (list(value) if isinstance(value, tuple) else value) for value in values]
                     for name, values in columns.items()}, schema=SIGNATURE_SCHEMA)


def _from_row(row: dict[str, Any]) -> SampleSignature:
    return SampleSignature(row["sample_id"], row["row_key"], tuple(row["media_kinds"]), tuple(row["media_sha256"]),
                           tuple(tuple(hashes) for hashes in row["media_hashes"]), row["text_sha256"],
                           np.asarray(row["text_minhash"], dtype="<u4").tobytes())
