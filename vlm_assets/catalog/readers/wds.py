"""A `wds` source: WebDataset tar shards read in place, one record per sample (its .json or caption member)."""

from __future__ import annotations

import tarfile
from collections.abc import Iterator

from vlm_assets.media.refs import read_tar_member
from vlm_assets.catalog.media_resolution import (
    FileResolver,
    MediaResolver,
    SourceScope,
    TarSample,
    TarSampleResolver,
    member_extension,
    real_path,
    resolver_for,
)
from vlm_assets.catalog.readers.raw_record import RawRecord
from vlm_assets.catalog.readers.source_walk import SourceWalk, WalkEntry
from vlm_assets.catalog.records import RecordLimits, parse_bytes
from vlm_assets.config import SourceConfig
from vlm_assets.object_store import Location, ObjectURL, head, list_objects, location_size, open_location

TEXT_MEMBER_EXTENSIONS = ("txt", "caption")
# Reading a shard's member list seeks from header to header: a read buffer this size holds the
# headers of many small members per request, and costs a big member's header one request.
TAR_READ_BUFFER = 256 << 10


def read_wds(source: SourceConfig, scope: SourceScope, limits: RecordLimits) -> Iterator[RawRecord]:
    if isinstance(source.path, ObjectURL):
        yield from _read_object_wds(source, source.path, scope, limits)
        return
    root = real_path(source.path)
    if root.is_file():
        shards = [WalkEntry(root, root)]
    else:
        shards = SourceWalk(root, scope, _is_shard).entries()
    for shard in shards:
        shard_key = shard.path.relative_to(root).as_posix() if root.is_dir() else shard.path.name
        resolver = FileResolver(source.name, scope, [root])
        if shard.refused:
            yield RawRecord(f"{source.name}/{shard_key}", str(shard.path), None, resolver, shard.refused)
        elif not shard.path.name.endswith(".tar"):
            yield RawRecord(
                f"{source.name}/{shard_key}", str(shard.path), None, resolver,
                f"compressed shard {shard.path} cannot be read in place; store shards as plain .tar",
            )
        else:
            yield from _read_tar_samples(source, shard.real, shard_key, limits, resolver)


def _read_object_wds(source: SourceConfig, root: ObjectURL, scope: SourceScope, limits: RecordLimits) -> Iterator[RawRecord]:
    """A `wds` source on object storage: one shard object, or every shard below a prefix, listed a page at a time."""
    single = head(root)
    shards = [single] if single is not None else (info for info in list_objects(root) if _is_shard(info.url.name))
    resolver = resolver_for(source.name, scope)
    for shard in shards:
        shard_key = shard.url.name if single is not None else root.relative(shard.url)
        if any(part.startswith(".") for part in shard_key.split("/")):
            continue  # hidden, as on disk
        if not shard.url.name.endswith(".tar"):
            yield RawRecord(f"{source.name}/{shard_key}", str(shard.url), None, resolver,
                            f"compressed shard {shard.url} cannot be read in place; store shards as plain .tar")
        else:
            yield from _read_tar_samples(source, shard.url, shard_key, limits, resolver)


def _is_shard(name: str) -> bool:
    return name.endswith((".tar", ".tgz", ".tar.gz"))


def _tar_samples(shard: Location) -> tuple[list[TarSample], str]:
    """The shard's samples in member order, and why reading stopped early ("" when it did not).

    Members group by directory + basename up to the first "."; a member name seen again in a key's
    sample starts a new sample with that key (so a repeated key is seen, not merged away).
    """
    samples: list[TarSample] = []
    latest: dict[str, TarSample] = {}
    try:
        with open_location(shard, TAR_READ_BUFFER) as handle, tarfile.open(fileobj=handle, mode="r:") as archive:
            for member in archive:
                if member.isdir():
                    continue
                directory, _, base = member.name.rpartition("/")
                key = (f"{directory}/" if directory else "") + base.split(".", 1)[0]
                sample = latest.get(key)
                if sample is None or sample.holds(member.name):
                    sample = TarSample(key, 1 if sample is None else sample.occurrence + 1)
                    latest[key] = sample
                    samples.append(sample)
                if member.isfile():
                    sample.members[member.name] = (member.offset_data, member.size)
                else:
                    sample.others[member.name] = _member_kind(member)
            end = archive.offset
        return samples, _unread_tail(shard, end)
    except (tarfile.TarError, OSError) as error:
        return samples, f"unreadable tar shard {shard}: {error}"


def _unread_tail(shard: Location, end: int) -> str:
    """Why the shard holds more than tarfile read (it stops quietly at a cut header), or ""."""
    size = location_size(shard)
    if end > size:
        return f"unreadable tar shard {shard}: truncated (its members run to byte {end}, the file has {size})"
    with open_location(shard) as handle:
        handle.seek(end)
        while chunk := handle.read(1 << 20):
            if chunk.strip(b"\0"):
                return (f"unreadable tar shard {shard}: damaged or truncated after byte {end} "
                        "(what follows is not a tar member; the samples there cannot be read)")
    return ""


def _member_kind(member: tarfile.TarInfo) -> str:
    if member.issym():
        return f"a symbolic link to {member.linkname!r}"
    if member.islnk():
        return f"a hard link to {member.linkname!r}"
    return "not a regular file"


def _read_tar_samples(
    source: SourceConfig, shard: Location, shard_key: str, limits: RecordLimits, shard_resolver: MediaResolver
) -> Iterator[RawRecord]:
    samples, stopped = _tar_samples(shard)
    for sample in samples:
        key, members = sample.key, sample.members
        resolver = TarSampleResolver(source.name, shard, shard_key, sample)
        sample_id = f"{source.name}/{key}"
        origin = f"{shard}:{key}" + (f"#{sample.occurrence}" if sample.occurrence > 1 else "")
        json_members = [name for name in members if member_extension(name) == "json"]
        text_members = [name for name in members if member_extension(name) in TEXT_MEMBER_EXTENSIONS]
        chosen = (json_members or text_members or [None])[0]
        if chosen is None:
            yield RawRecord(sample_id, origin, None, resolver, f"no .json or caption member for sample {key!r} in {shard}")
            continue
        offset, size = members[chosen]
        where = f"{shard}:{chosen}"
        error = limits.too_large(size, where)
        if error:
            yield RawRecord(sample_id, origin, None, resolver, error)
            continue
        try:
            payload = read_tar_member(shard, offset, size)
        except OSError as read_error:
            yield RawRecord(sample_id, origin, None, resolver, f"unreadable member {where}: {read_error}")
            continue
        if json_members:
            record, error = parse_bytes(payload, where, limits)
        else:
            record, error = {"texts": payload.decode("utf-8", errors="replace").strip()}, ""
        yield RawRecord(sample_id, origin, record, resolver, error)
    if stopped:
        # Samples after the damage cannot be told apart: one row stands for the rest of the shard.
        yield RawRecord(f"{source.name}/{shard_key}", str(shard), None, shard_resolver, stopped)
