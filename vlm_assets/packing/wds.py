"""Deterministic WebDataset shards from packed records.

Each record becomes one tar sample: ``<key>.json`` plus ``<key>.img<k>.<ext>`` /
``<key>.vid<k>.<ext>`` with the media's original bytes. Headers are fixed (mtime
0, uid/gid 0, no user names, mode 0644) and members are sorted, so the same
input gives the same bytes. Shards are cut before `maxcount` samples or
`maxsize` bytes would be exceeded (a single larger sample gets a shard of its
own) and never empty. Each shard is written under a temporary name and renamed
when complete; afterwards shards and Energon tar indexes left over from earlier
runs are removed.

For a big source the per-record work (parsing the record, looking its media up,
sizing them, building tar headers) runs in chunk processes; this process only
cuts shards and copies bytes, so the shards are the same bytes whatever the
number of processes.
"""

from __future__ import annotations

import itertools
import json
import multiprocessing
import os
import re
import tarfile
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import Executor, Future, ProcessPoolExecutor, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO

from vlm_assets.atomic import atomic_path, remove_stale_temp_files
from vlm_assets.catalog import lookup
from vlm_assets.media.refs import is_object_ref, is_tar_ref, media_size, read_media_bytes, tar_member_path
from vlm_assets.media.checks import verify_medium_stamp
from vlm_assets.media.copies import MediaCopies
from vlm_assets.packing.records import PackedRecord, encode_record, record_of_line
from vlm_assets.parallel import ordered_map, store_reading_processes

BLOCK = tarfile.BLOCKSIZE
RECORD = tarfile.RECORDSIZE
SHARD_PATTERN = re.compile(r"^pretrain-(\d{6})\.tar$")
ENERGON_INDEX_SUFFIX = ".idx"
SHARD_MODE = 0o644
# packed_json bytes per chunk a process prepares: a fraction of a second of work each.
JSONL_CHUNK_BYTES = 512 * 1024


@dataclass(frozen=True)
class _Member:
    name: str
    size: int
    header: bytes
    data: bytes | None = None  # the JSON member; media are read when written
    ref: str | None = None
    stamp: str = ""  # the medium's stamp in the catalogue, compared once its bytes are written

    @property
    def stored_size(self) -> int:
        return len(self.header) + _padded(self.size)


@dataclass
class ShardInfo:
    path: Path
    keys: list[str] = field(default_factory=list)
    size: int = 0


@dataclass(frozen=True)
class ShardStamp:
    """A shard as it was when something was recorded about it: a changed size or modification time
    means the record no longer holds."""

    name: str  # relative to the folder the record is about
    size: int
    mtime_ns: int

    @classmethod
    def of(cls, root: Path, name: str) -> ShardStamp:
        status = (root / name).stat()
        return cls(name, status.st_size, status.st_mtime_ns)


def shard_name(index: int) -> str:
    return f"pretrain-{index:06d}.tar"


def list_shards(directory: Path) -> list[Path]:
    if not directory.is_dir():
        return []
    return sorted(path for path in directory.iterdir() if SHARD_PATTERN.match(path.name))


@dataclass(frozen=True)
class KeptShards:
    """packing.mode append: the shards already written, kept byte for byte, and how many of
    packed_json's first records they hold."""

    paths: list[Path]
    records: int


def write_shards_from_jsonl(
    jsonl_path: Path,
    samples: lookup.SampleLookup,
    directory: Path,
    maxcount: int,
    maxsize: int,
    on_sample: Callable[[str], None] | None = None,
    processes: int = 1,
    kept: KeptShards | None = None,
    media_copies: MediaCopies | None = None,
) -> list[ShardInfo]:
    """Write `packed_json`'s records to `directory/pretrain-NNNNNN.tar`, each record's members prepared by one
    of `processes` processes; returns the shards written.

    `samples` (with a `media_refs` column) stays open meanwhile: the chunk processes read its index file.
    `kept` (packing.mode append, see `kept_shards`): only the records after the kept shards' are
    written, into new shards numbered after them. Media on object storage are taken from
    `media_copies` where the catalogue kept a copy.

    Shards are cut as the records stream by and written as soon as each is complete: memory holds the
    shards in flight, never the whole source, and the bytes do not depend on `processes`.
    `on_sample(key)` is called once each sample's bytes are written (progress; it may raise to abort,
    which leaves no partial shard under a final name).
    """
    kept = kept or KeptShards([], 0)
    try:
        # The lookup's index is a file of this machine's.
        prepared = ordered_map(_prepare_lines, _line_chunks(jsonl_path, kept.records), processes, lookup.attach,
                               (str(samples.path), samples.columns), reads_local_files=True)
        members = (sample for chunk in prepared for sample in chunk)
        return _write_samples(members, directory, maxcount, maxsize, on_sample, threads=processes, kept=kept.paths,
                              media_copies=media_copies)
    finally:
        lookup.detach()


def kept_shards(directory: Path, sample_count: Callable[[Path], int] | None = None) -> KeptShards:
    """The shards in `directory` to append after, with the records they hold (`sample_count` of each
    shard, by default read from its tar headers): those numbered 0, 1, … up to the first gap.

    Shards are renamed into place only once whole, so each one there is complete; but they are written
    side by side, and an append cut short (a full disk, a kill) may leave one finished after another
    that is not. The shards before the gap are kept (the append resumes after them; the member check
    reads those it has not passed), and those after it are written again (`write_shards_from_jsonl`
    replaces or removes them).
    """
    shards = list_shards(directory)
    gap = next((index for index, path in enumerate(shards) if path.name != shard_name(index)), len(shards))
    shards = shards[:gap]
    count = sample_count or shard_sample_count
    return KeptShards(shards, sum(count(path) for path in shards))


def sample_ids_after(jsonl_path: Path, skip: int) -> set[str]:
    """The sample ids of packed_json's records after its first `skip` lines: what their shards need
    from the catalogue."""
    found: set[str] = set()
    for _, _, lines in _line_chunks(jsonl_path, skip):
        for line in lines:
            found.update(json.loads(line)["sample_ids"])
    return found


def shard_sample_count(path: Path) -> int:
    """How many samples (distinct keys) a shard holds, from its tar headers."""
    with tarfile.open(path, "r:") as shard:
        return len({member.name.split(".", 1)[0] for member in shard})


def _write_samples(
    prepared: Iterable[list[_Member]],
    directory: Path,
    maxcount: int,
    maxsize: int,
    on_sample: Callable[[str], None] | None,
    threads: int,
    kept: Sequence[Path] = (),
    media_copies: MediaCopies | None = None,
) -> list[ShardInfo]:
    directory.mkdir(parents=True, exist_ok=True)
    remove_stale_temp_files(directory)
    planned = _planned_shards(prepared, directory, maxcount, maxsize, first_index=len(kept))
    first = next(planned, None)
    planned = itertools.chain([first] if first is not None else [], planned)
    if threads <= 1:
        shards = [_write_planned(directory, shard, samples, on_sample, media_copies) for shard, samples in planned]
    else:
        shards = []
        remote = first is not None and _reads_remote(first[1])

        def finished(future: Future[ShardInfo]) -> None:
            shards.append(future.result())
            if remote and on_sample is not None:  # a writer process cannot report each sample: its shard's, at its end
                for key in shards[-1].keys:
                    on_sample(key)

        with _shard_writers(threads, remote) as pool:
            in_flight: deque[Future[ShardInfo]] = deque()
            try:
                for shard, samples in planned:
                    in_flight.append(pool.submit(_write_planned, directory, shard, samples, None if remote else on_sample,
                                                 media_copies))
                    # One shard waiting beside those being written keeps the writers busy; each planned
                    # shard holds its records' text (tens of MB), so no more wait.
                    if len(in_flight) > (store_reading_processes(threads) if remote else threads):
                        finished(in_flight.popleft())
                while in_flight:
                    finished(in_flight.popleft())
            finally:
                pool.shutdown(cancel_futures=True)
    written = {shard.path.name for shard in shards} | {path.name for path in kept}
    for path in list_shards(directory):
        if path.name not in written:
            path.unlink()
    for orphan_index in directory.glob("*.tar" + ENERGON_INDEX_SUFFIX):
        if orphan_index.name[: -len(ENERGON_INDEX_SUFFIX)] not in written:
            orphan_index.unlink()
    return shards


def _reads_remote(samples: list[list[_Member]]) -> bool:
    return any(member.ref is not None and _is_remote(member.ref) for members in samples for member in members)


def _shard_writers(threads: int, remote: bool) -> Executor:
    """Threads, or, when the media lie on object storage, processes: a read from the store is mostly
    boto3's Python, which threads of one process cannot run side by side."""
    if remote:
        return ProcessPoolExecutor(max_workers=store_reading_processes(threads),
                                   mp_context=multiprocessing.get_context("spawn"))
    return ThreadPoolExecutor(max_workers=threads, thread_name_prefix="shard-writer")


def _line_chunks(jsonl_path: Path, skip: int = 0) -> Iterator[tuple[Path, int, list[bytes]]]:
    """(the file, number of the first line, lines) of about JSONL_CHUNK_BYTES each, after the first `skip` lines."""
    with open(jsonl_path, "rb") as handle:
        _skip_lines(handle, skip)
        first, lines, size = skip + 1, [], 0
        for number, line in enumerate(handle, start=skip + 1):
            lines.append(line)
            size += len(line)
            if size >= JSONL_CHUNK_BYTES:
                yield jsonl_path, first, lines
                first, lines, size = number + 1, [], 0
        if lines:
            yield jsonl_path, first, lines


_SKIP_BLOCK = 8 << 20


def _skip_lines(handle: BinaryIO, count: int) -> None:
    """Move `handle` past its first `count` lines (or to its end), counting them a block at a time:
    the records kept by an append are most of a big packed_json."""
    while count:
        start = handle.tell()
        block = handle.read(_SKIP_BLOCK)
        if not block:
            return
        newlines = block.count(b"\n")
        if newlines < count:
            count -= newlines
            continue
        end = -1
        for _ in range(count):
            end = block.index(b"\n", end + 1)
        handle.seek(start + end + 1)
        return


def _prepare_lines(chunk: tuple[Path, int, list[bytes]]) -> list[list[_Member]]:
    jsonl_path, first, lines = chunk
    samples = lookup.attached()
    return [_sample_members(record_of_line(line, samples, jsonl_path, first + offset))
            for offset, line in enumerate(lines)]


def _write_planned(
    directory: Path, shard: ShardInfo, samples: list[list[_Member]], on_sample: Callable[[str], None] | None,
    media_copies: MediaCopies | None = None,
) -> ShardInfo:
    before = _identity(shard.path)
    _write_shard(shard.path, samples, on_sample, media_copies)
    if _identity(shard.path) != before:
        # Energon's index of the old bytes is wrong for the new ones; an unchanged shard keeps it.
        (directory / (shard.path.name + ENERGON_INDEX_SUFFIX)).unlink(missing_ok=True)
    return shard


def _identity(path: Path) -> tuple[int, int] | None:
    try:
        stat = path.stat()
    except FileNotFoundError:
        return None
    return stat.st_ino, stat.st_mtime_ns


def _planned_shards(
    prepared: Iterable[list[_Member]], directory: Path, maxcount: int, maxsize: int, first_index: int = 0
) -> Iterator[tuple[ShardInfo, list[list[_Member]]]]:
    """Each shard with its samples' members, as soon as the next sample would not fit in it."""
    shard: ShardInfo | None = None
    samples: list[list[_Member]] = []
    count = first_index
    for members in prepared:
        size = sum(member.stored_size for member in members)
        if shard is None or len(samples) >= maxcount or shard.size + size > maxsize:
            if shard is not None:
                yield shard, samples
            shard, samples = ShardInfo(directory / shard_name(count)), []
            count += 1
        shard.keys.append(_key(members))
        shard.size += size
        samples.append(members)
    if shard is not None:
        yield shard, samples


def _write_shard(path: Path, samples: list[list[_Member]], on_sample: Callable[[str], None] | None,
                 media_copies: MediaCopies | None) -> None:
    with (atomic_path(path) as tmp, open(tmp, "wb", buffering=0) as handle,
          _RemoteReads(samples, media_copies) as remote):
        fd = handle.fileno()
        written = 0
        for members in samples:
            for member in members:
                _write_all(fd, member.header)
                if member.data is not None:
                    _write_all(fd, member.data)
                elif member in remote:
                    _write_all(fd, remote.bytes_of(member, path))
                else:
                    _copy_file(member, fd, path)
                    # Once its bytes are in: a medium replaced meanwhile would ship beside the length
                    # measured from the one the catalogue checked.
                    verify_medium_stamp(member.ref, member.stamp)
                _write_all(fd, bytes(_padded(member.size) - member.size))
                written += member.stored_size
            if on_sample is not None:
                on_sample(_key(members))
        end = written + 2 * BLOCK
        _write_all(fd, bytes(2 * BLOCK + (-end % RECORD)))


def _is_remote(ref: str) -> bool:
    return is_object_ref(ref) or (is_tar_ref(ref) and is_object_ref(tar_member_path(ref)))


class _RemoteReads:
    """The media of a shard on object storage, read ahead in threads: a read is a round trip to the
    store, and one after another the shard would wait on each. In order, at most READ_AHEAD reads or
    READ_AHEAD_BYTES at a time (at least one)."""

    READ_AHEAD = 4
    READ_AHEAD_BYTES = 64 << 20

    def __init__(self, samples: list[list[_Member]], copies: MediaCopies | None) -> None:
        self.copies = copies
        self.waiting = deque(member for members in samples for member in members
                             if member.data is None and member.ref is not None and _is_remote(member.ref))
        self.members = set(map(id, self.waiting))
        self.reading: deque[tuple[_Member, Future[bytes]]] = deque()
        self.reading_bytes = 0
        self.pool: ThreadPoolExecutor | None = None  # started by the first read

    def __enter__(self) -> _RemoteReads:
        return self

    def __exit__(self, *exc_info: object) -> None:
        if self.pool is not None:
            self.pool.shutdown(cancel_futures=True)

    def __contains__(self, member: _Member) -> bool:
        return id(member) in self.members

    def _read(self, ref: str) -> bytes:
        kept = self.copies.read(ref) if self.copies is not None and is_object_ref(ref) else None
        return kept if kept is not None else read_media_bytes(ref)

    def bytes_of(self, member: _Member, shard: Path) -> bytes:
        """`member`'s bytes: the next to be read, in the order the shard holds them."""
        if self.pool is None:
            self.pool = ThreadPoolExecutor(max_workers=self.READ_AHEAD, thread_name_prefix="media-reader")
        while self.waiting and (not self.reading or (len(self.reading) < self.READ_AHEAD and
                                                     self.reading_bytes + self.waiting[0].size <= self.READ_AHEAD_BYTES)):
            upcoming = self.waiting.popleft()
            self.reading.append((upcoming, self.pool.submit(self._read, upcoming.ref)))
            self.reading_bytes += upcoming.size
        expected, future = self.reading.popleft()
        self.reading_bytes -= expected.size
        if expected is not member:
            raise RuntimeError(f"{shard.name}: media read out of order ({member.name} before {expected.name})")
        data = future.result()
        if len(data) != member.size:
            raise OSError(f"{member.ref}: size changed while writing {shard.name} ({member.size} -> {len(data)} bytes)")
        return data


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def _copy_file(member: _Member, out_fd: int, shard: Path) -> None:
    """Append the media's bytes; a plain file goes kernel-to-kernel (sendfile), a tar member via a read."""
    if is_tar_ref(member.ref):
        data = read_media_bytes(member.ref)
        if len(data) != member.size:
            raise OSError(f"{member.ref}: size changed while writing {shard.name} ({member.size} -> {len(data)} bytes)")
        _write_all(out_fd, data)
        return
    with open(member.ref, "rb") as source:
        size = os.fstat(source.fileno()).st_size
        if size != member.size:
            raise OSError(f"{member.ref}: size changed while writing {shard.name} ({member.size} -> {size} bytes)")
        offset = 0
        while offset < size:
            sent = os.sendfile(out_fd, source.fileno(), offset, size - offset)
            if sent == 0:
                raise OSError(f"{member.ref}: file shrank while writing {shard.name}")
            offset += sent


def _key(members: list[_Member]) -> str:
    return members[0].name.split(".", 1)[0]


def _sample_members(packed: PackedRecord) -> list[_Member]:
    key = packed.key
    if "." in key or "/" in key:
        raise ValueError(f"sample key {key!r} must not contain '.' or '/'")
    payload = encode_record(packed.record)
    members = [_member(f"{key}.json", len(payload), data=payload)]
    for item in packed.media:
        verify_medium_stamp(item.ref, item.stamp)
        members.append(_member(f"{key}.{item.member}", media_size(item.ref), ref=item.ref, stamp=item.stamp))
    return sorted(members, key=lambda member: member.name)


def _member(name: str, size: int, data: bytes | None = None, ref: str | None = None, stamp: str = "") -> _Member:
    info = tarfile.TarInfo(name)
    info.size = size
    info.mtime = 0
    info.mode = SHARD_MODE
    info.uid = info.gid = 0
    info.uname = info.gname = ""
    header = info.tobuf(tarfile.PAX_FORMAT, "utf-8", "surrogateescape")
    return _Member(name, size, header, data, ref, stamp)


def _padded(size: int) -> int:
    return -(-size // BLOCK) * BLOCK
