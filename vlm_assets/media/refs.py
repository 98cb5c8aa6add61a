"""Media references: a string that says where one media file's bytes are.

A plain file is its absolute path. A member of a WebDataset tar (read in place,
never unpacked) is ``tar:<offset>:<size>:<absolute tar path>`` so its bytes can
be read with a single seek. An object on S3-compatible storage is its
``s3://bucket/key`` URL, or, once the catalogue has resolved it, that URL pinned to the version it
read, with what it learnt of it: ``obj:<size>:<etag>:<extension>:<height>x<width>:<url>`` (the
extension and the image size empty until its content was checked). Later steps then read that
version only (a changed object is an error, never a silent mix) and need no request to learn its
size, its extension or an image's size.
"""

from __future__ import annotations

import io
import os
import threading
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO
from urllib.parse import quote, unquote

from vlm_assets.object_store import (
    URL_SCHEME,
    ObjectInfo,
    ObjectURL,
    location_size,
    read_object,
    read_range,
    read_start,
)

TAR_PREFIX = "tar:"
OBJECT_PREFIX = "obj:"

IMAGE_EXTENSIONS = frozenset({"jpg", "jpeg", "png", "webp", "gif", "bmp", "tif", "tiff"})
VIDEO_EXTENSIONS = frozenset({"mp4", "avi", "mkv", "mov", "webm", "m4v", "mpg", "mpeg", "flv", "ts", "3gp"})


def tar_member_ref(tar_path: Path | ObjectURL, offset: int, size: int) -> str:
    where = tar_path if isinstance(tar_path, ObjectURL) else tar_path.resolve()
    return f"{TAR_PREFIX}{offset}:{size}:{where}"


def is_tar_ref(ref: str) -> bool:
    return ref.startswith(TAR_PREFIX)


def _parse_tar_ref(ref: str) -> tuple[int, int, str]:
    offset, size, path = ref[len(TAR_PREFIX):].split(":", 2)
    return int(offset), int(size), path


def tar_member_path(ref: str) -> str:
    """The tar file that holds a tar member ref."""
    return _parse_tar_ref(ref)[2]


def read_tar_member(tar_path: str | os.PathLike[str] | ObjectURL, offset: int, size: int) -> bytes:
    """One tar member's data, read in place: `size` bytes at `offset` (OSError when the tar is cut short);
    of a tar on object storage, by one ranged GET."""
    if isinstance(tar_path, ObjectURL) or is_object_ref(str(tar_path)):
        data = read_range(tar_path if isinstance(tar_path, ObjectURL) else ObjectURL.parse(str(tar_path)), offset, size)
    else:
        with open(tar_path, "rb") as handle:
            handle.seek(offset)
            data = handle.read(size)
    if len(data) != size:
        raise OSError(f"{tar_path}: tar member at offset {offset} is truncated ({len(data)} of {size} bytes)")
    return data


def is_object_ref(ref: str) -> bool:
    return ref.startswith((URL_SCHEME, OBJECT_PREFIX))


@dataclass(frozen=True)
class ObjectFacts:
    """An object medium's URL and what a pinned ref records of it (size None: not pinned)."""

    url: ObjectURL
    size: int | None = None
    etag: str = ""
    extension: str = ""
    image_size: tuple[int, int] | None = None  # (height, width) after EXIF orientation

    def ref(self) -> str:
        dims = f"{self.image_size[0]}x{self.image_size[1]}" if self.image_size else ""
        return f"{OBJECT_PREFIX}{self.size}:{quote(self.etag, safe='')}:{self.extension}:{dims}:{self.url}"


def object_facts(ref: str) -> ObjectFacts:
    if not ref.startswith(OBJECT_PREFIX):
        return ObjectFacts(ObjectURL.parse(ref))
    size, etag, extension, dims, url = ref[len(OBJECT_PREFIX):].split(":", 4)
    height, _, width = dims.partition("x")
    return ObjectFacts(ObjectURL.parse(url), int(size), unquote(etag), extension,
                       (int(height), int(width)) if dims else None)


def pinned_object_ref(url: ObjectURL, size: int, etag: str) -> str:
    return ObjectFacts(url, size, etag).ref()


class _RecentObjects:
    """Objects this process read last: checking a medium opens it more than once (decode, sniff,
    orientation), and one request is enough; a record's media are resolved before they are checked.
    At most MAX_BYTES are held, the oldest dropped first; a bigger object is read again instead."""

    MAX_BYTES = 64 << 20

    def __init__(self) -> None:
        self.by_ref: OrderedDict[str, bytes] = OrderedDict()  # pinned ref -> bytes
        self.total = 0
        self.lock = threading.Lock()  # a shard's media are read by several threads

    def get(self, ref: str) -> bytes | None:
        return self.by_ref.get(ref)

    def keep(self, ref: str, data: bytes) -> None:
        with self.lock:
            if len(data) > self.MAX_BYTES or ref in self.by_ref:
                return
            self.by_ref[ref] = data
            self.total += len(data)
            while self.total > self.MAX_BYTES:
                self.total -= len(self.by_ref.popitem(last=False)[1])


_recent_objects = _RecentObjects()


def _object_bytes(ref: str) -> bytes:
    recent = _recent_objects.get(ref)
    if recent is not None:
        return recent
    facts = object_facts(ref)
    data = read_object(facts.url, if_match=facts.etag)
    if facts.size is not None and len(data) != facts.size:
        raise OSError(f"{facts.url}: {len(data)} bytes, not the {facts.size} it had when catalogued")
    _recent_objects.keep(ref, data)
    return data


def recently_read(ref: str) -> bytes | None:
    """The bytes of the pinned object `ref` if this process read them lately (no request)."""
    return _recent_objects.get(ref)


# An object fetched as it is resolved (see fetch_object) is read in one request when it is no bigger.
FETCHED_BYTES = 8 << 20


def fetch_object(url: ObjectURL) -> ObjectInfo | None:
    """Whether the object exists, and its version, learnt by reading it (its first FETCHED_BYTES):
    when it is about to be checked anyway, that read is the check's too. None: no such object."""
    found = read_start(url, FETCHED_BYTES)
    if found is None:
        return None
    info, data = found
    if len(data) == info.size:
        _recent_objects.keep(pinned_object_ref(url, info.size, info.etag), data)
    return info


def read_media_bytes(ref: str) -> bytes:
    if is_tar_ref(ref):
        offset, size, path = _parse_tar_ref(ref)
        return read_tar_member(path, offset, size)
    if is_object_ref(ref):
        return _object_bytes(ref)
    return Path(ref).read_bytes()


def open_media(ref: str) -> BinaryIO:
    """A readable, seekable binary file for the media (for PIL / PyAV); an object is read whole, in one request."""
    if is_tar_ref(ref) or is_object_ref(ref):
        return io.BytesIO(read_media_bytes(ref))
    return open(ref, "rb")


def read_media_head(ref: str, size: int) -> bytes:
    """The media's first `size` bytes (of an object: one ranged GET, not the whole object)."""
    if is_object_ref(ref):
        recent = _recent_objects.get(ref)
        if recent is not None:
            return recent[:size]
        facts = object_facts(ref)
        return read_range(facts.url, 0, size, if_match=facts.etag)
    if is_tar_ref(ref):
        offset, member_size, path = _parse_tar_ref(ref)
        return read_tar_member(path, offset, min(size, member_size))
    with open(ref, "rb") as handle:
        return handle.read(size)


def media_size(ref: str) -> int:
    if is_tar_ref(ref):
        return _parse_tar_ref(ref)[1]
    if is_object_ref(ref):
        facts = object_facts(ref)
        return facts.size if facts.size is not None else location_size(facts.url)
    return Path(ref).stat().st_size


def describe_ref(ref: str) -> str:
    """Human-readable location for error messages."""
    if is_tar_ref(ref):
        offset, _size, path = _parse_tar_ref(ref)
        return f"{path}@{offset}"
    return str(object_facts(ref).url) if is_object_ref(ref) else ref


def sniff_extension(head: bytes) -> str | None:
    """File extension implied by the content's magic bytes (None when unknown)."""
    if head.startswith(b"\xff\xd8\xff"):
        return "jpg"
    if head.startswith(b"\x89PNG\r\n\x1a\n"):
        return "png"
    if head[:4] == b"RIFF" and head[8:12] == b"WEBP":
        return "webp"
    if head[:4] == b"RIFF" and head[8:12] == b"AVI ":
        return "avi"
    if head[:6] in (b"GIF87a", b"GIF89a"):
        return "gif"
    if head[:2] == b"BM":
        return "bmp"
    if head[:4] in (b"II*\x00", b"MM\x00*"):
        return "tif"
    if head[4:8] == b"ftyp":
        brand = head[8:12]
        return "mov" if brand == b"qt  " else "mp4"
    if head[:4] == b"\x1a\x45\xdf\xa3":
        return "webm" if b"webm" in head[:64] else "mkv"
    if head[:4] == b"\x00\x00\x01\xba":
        return "mpg"
    if head[:3] == b"FLV":
        return "flv"
    return None


def media_extension(ref: str, name: str) -> str:
    """Extension for a media file: from its content, else from its name, else 'bin'."""
    recorded = object_facts(ref).extension if is_object_ref(ref) else ""
    sniffed = recorded or sniff_extension(read_media_head(ref, 64))
    if sniffed:
        return sniffed
    # os.path, not pathlib: a source's reader asks this for every string of every record.
    suffix = os.path.splitext(os.path.basename(name.rstrip("/")))[1][1:].lower()
    return suffix if suffix.isalnum() and suffix else "bin"


def kind_from_name(name: str) -> str | None:
    # os.path, not pathlib: a source's reader asks this for every string of every record.
    suffix = os.path.splitext(os.path.basename(name.rstrip("/")))[1][1:].lower()
    if suffix in IMAGE_EXTENSIONS:
        return "image"
    if suffix in VIDEO_EXTENSIONS:
        return "video"
    return None
