"""The outer compression of a package: gzip or (multi-threaded) zstd, told apart by magic number.

The file name is only a hint; a `.nnpkg` that is really zstd opens fine, and a
file that is neither gets a clear error instead of a tar parser's complaint.
A package is a concatenation of gzip members or zstd frames (compressed ones and
uncompressed "stored" ones), which every gzip/zstd reader treats as one stream.
"""

from __future__ import annotations

import contextlib
import gzip
import io
import os
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO

import zstandard

from vlm_assets.config import COMPRESSIONS
from vlm_assets.layout import PACKAGE_EXTENSIONS
from vlm_assets.object_store import Location, open_location
from vlm_assets.package.manifest import PackageError

GZIP, ZSTD = COMPRESSIONS  # "gzip", "zstd": the values `package.compress` and a recipe's `compress` take
EXTENSIONS = PACKAGE_EXTENSIONS
DEFAULT_LEVELS = {GZIP: 6, ZSTD: 3}  # what `tar czf` / `tar --zstd` use, so sizes compare like for like

_GZIP_MAGIC = b"\x1f\x8b"
_ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"
READ_CHUNK = 1 << 20


def package_file_name(name: str, compress: str) -> str:
    return name + EXTENSIONS[_checked(compress)]


def default_threads() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def detect_compression(path: Location) -> str:
    """Return 'gzip' or 'zstd' from the file's (or object's) first bytes."""
    try:
        with open_location(path) as handle:
            head = handle.read(4)
    except OSError as error:
        raise PackageError(f"{path}: cannot open package: {error.strerror or error}") from error
    if head.startswith(_ZSTD_MAGIC):
        return ZSTD
    if head.startswith(_GZIP_MAGIC):
        return GZIP
    if not head:
        raise PackageError(f"{path}: empty file, not a training package")
    raise PackageError(f"{path}: not a training package (neither gzip nor zstd magic number; starts with {head.hex()})")


_ZSTD_RAW_BLOCK_MAX = 128 * 1024
_ZSTD_WINDOW_128K = bytes([(17 - 10) << 3])  # Window_Descriptor: exponent 7 -> 2**17 bytes
_DEFLATE_STORED_BLOCK_MAX = 0xFFFF


class StoredSegment:
    """Exactly `length` bytes written as one uncompressed zstd frame (raw blocks) or gzip member (stored blocks).

    Costs a copy instead of a compression attempt, for data that would not
    shrink anyway (JPEG, video); its size depends only on `length`.
    """

    def __init__(self, out: BinaryIO, compress: str, length: int) -> None:
        self._out = out
        self._zstd = _checked(compress) == ZSTD
        self._remaining = length
        self._length = length
        self._crc = 0
        if self._zstd:
            # Frame header: 8-byte content size, no checksum, no dictionary, and a 128 KiB window
            # (one raw block), so a decoder needs no more memory however long the segment is.
            out.write(_ZSTD_MAGIC + b"\xc0" + _ZSTD_WINDOW_128K + length.to_bytes(8, "little"))
        else:
            # gzip header with mtime 0 and OS 255 (unknown): nothing that varies between runs.
            out.write(_GZIP_MAGIC + b"\x08\x00\x00\x00\x00\x00\x00\xff")
        if length == 0:
            self._block(b"", last=True)

    def _block(self, block: bytes | memoryview, last: bool) -> None:
        size = len(block)
        if self._zstd:
            self._out.write(((size << 3) | int(last)).to_bytes(3, "little"))
        else:
            self._out.write(bytes([int(last)]) + size.to_bytes(2, "little") + (size ^ 0xFFFF).to_bytes(2, "little"))
        self._out.write(block)
        if last and not self._zstd:
            self._out.write(self._crc.to_bytes(4, "little") + (self._length & 0xFFFFFFFF).to_bytes(4, "little"))

    def write(self, data: bytes | memoryview) -> None:
        view = memoryview(data)
        if len(view) > self._remaining:
            raise ValueError(f"stored segment overflow: {len(view)} bytes offered, {self._remaining} left")
        if not self._zstd:
            self._crc = zlib.crc32(view, self._crc)
        step = _ZSTD_RAW_BLOCK_MAX if self._zstd else _DEFLATE_STORED_BLOCK_MAX
        for start in range(0, len(view), step):
            block = view[start : start + step]
            self._remaining -= len(block)
            self._block(block, last=self._remaining == 0)

    @property
    def complete(self) -> bool:
        return self._remaining == 0


def stored_frame(data: bytes, compress: str) -> bytes:
    """`data` as one complete uncompressed frame/member (its length depends only on len(data))."""
    out = io.BytesIO()
    StoredSegment(out, compress, len(data)).write(data)
    return out.getvalue()


class PackageStreamWriter:
    """Tar bytes in; out a standard concatenation of gzip members / zstd frames (gunzip, zstd -d, tar read it).

    `write` compresses (gzip, or zstd with `threads` workers); `stored(length)`
    ends the current compressed frame and returns a StoredSegment for data that
    does not compress.
    """

    def __init__(self, out: BinaryIO, compress: str, *, level: int | None = None, threads: int | None = None) -> None:
        self._out = out
        self.compress = _checked(compress)
        self._level = DEFAULT_LEVELS[compress] if level is None else level
        self._zstd = (
            zstandard.ZstdCompressor(level=self._level, threads=default_threads() if threads is None else threads, write_checksum=True)
            if compress == ZSTD
            else None
        )
        self._frame: BinaryIO | None = None

    def write(self, data: bytes | memoryview) -> None:
        if self._frame is None:
            if self._zstd is not None:
                self._frame = self._zstd.stream_writer(self._out, closefd=False)
            else:
                # filename="" and mtime=0 keep the gzip header free of anything that varies between runs.
                self._frame = gzip.GzipFile(filename="", mode="wb", fileobj=self._out, compresslevel=self._level, mtime=0)
        self._frame.write(data)

    def _end_frame(self) -> None:
        if self._frame is not None:
            self._frame.close()
            self._frame = None

    def stored(self, length: int) -> StoredSegment:
        self._end_frame()
        return StoredSegment(self._out, self.compress, length)

    def close(self) -> None:
        self._end_frame()


class DecompressedStream:
    """Readable decompressed bytes of a package; a cut or damaged compressed stream raises PackageError.

    Built on decompress objects rather than library stream readers because those
    end quietly at a truncated zstd frame; here every frame must reach its end.
    """

    def __init__(self, path: Path, raw: BinaryIO, compress: str) -> None:
        self.path = path
        self.compress = compress
        self._raw = raw
        self._zstd = zstandard.ZstdDecompressor()
        self._decoder = self._new_decoder()
        self._buffer = bytearray()
        self._raw_exhausted = False

    def _new_decoder(self):
        if self.compress == ZSTD:
            return self._zstd.decompressobj()
        return zlib.decompressobj(wbits=16 + zlib.MAX_WBITS)

    def read(self, size: int = -1) -> bytes:
        while (size < 0 or len(self._buffer) < size) and self._fill():
            pass
        if size < 0 or size >= len(self._buffer):
            data = bytes(self._buffer)
            self._buffer.clear()
        else:
            data = bytes(self._buffer[:size])
            del self._buffer[:size]
        return data

    def _fill(self) -> bool:
        """Decode more input into the buffer; False once the input is used up."""
        if self._raw_exhausted:
            return False
        chunk = self._raw.read(READ_CHUNK)
        if not chunk:
            self._raw_exhausted = True
            if not self._decoder.eof:
                raise self.corrupt("compressed stream ends early")
            return False
        try:
            if self._decoder.eof:  # the previous frame/member ended exactly at the chunk boundary
                self._decoder = self._new_decoder()
            self._buffer += self._decoder.decompress(chunk)
            # Concatenated frames/members (pigz, zstd multi-frame) are valid: start the next one.
            while self._decoder.eof and self._decoder.unused_data:
                rest = self._decoder.unused_data
                self._decoder = self._new_decoder()
                self._buffer += self._decoder.decompress(rest)
        except (zlib.error, zstandard.ZstdError) as error:
            raise self.corrupt(error) from error
        return True

    def drain(self) -> None:
        """Read to the end so a cut or damaged tail (gzip CRC, zstd frame end and checksum) is noticed."""
        while self._fill():
            self._buffer.clear()
        self._buffer.clear()

    def corrupt(self, reason: object) -> PackageError:
        return PackageError(f"{self.path}: package is truncated or corrupt ({self.compress}: {reason})")


@contextlib.contextmanager
def open_decompressed(path: Location) -> Iterator[DecompressedStream]:
    compress = detect_compression(path)
    with open_location(path) as raw:
        yield DecompressedStream(path, raw, compress)


def _checked(compress: str) -> str:
    if compress not in COMPRESSIONS:
        raise ValueError(f"unknown compression {compress!r} (use one of {', '.join(COMPRESSIONS)})")
    return compress
