"""Independent re-reads of the packing outputs, each returning the problems it found."""

from __future__ import annotations

import contextlib
import hashlib
import json
from collections import Counter
from collections.abc import Iterable
from typing import BinaryIO
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from vlm_assets.atomic import atomic_write_text
from vlm_assets.packing.sample_ids import column_hashes, ids_with_hashes
from vlm_assets.packing.wds import ShardStamp, shard_sample_count
from vlm_assets.parallel import ordered_map
from vlm_assets.wording import plural

MAX_LISTED = 5
SHARDS_PER_PROCESS_FOR_A_POOL = 4


def _listed(values: Iterable[str]) -> str:
    values = list(values)
    more = f" (+{len(values) - MAX_LISTED} more)" if len(values) > MAX_LISTED else ""
    return ", ".join(repr(value) for value in values[:MAX_LISTED]) + more


def accounting_problems(catalog: Path, bins: Path, rejects: Path) -> list[str]:
    """catalogue = packed ∪ rejects, disjoint, every id exactly once (the three tables at these paths).

    Compared by id hashes, a few bytes per sample; the ids of any hash out of place are read again
    and judged by the ids themselves, so a problem is never a hash's.
    """
    tables = {"the catalogue": (catalog, "sample_id"), "packed": (bins, "sample_ids"), "rejects": (rejects, "sample_id")}
    in_catalog = column_hashes(catalog, "sample_id")
    in_catalog.sort()
    outcomes = np.concatenate([column_hashes(bins, "sample_ids"), column_hashes(rejects, "sample_id")])
    outcomes.sort()
    repeated = np.concatenate([_repeated(in_catalog), _repeated(outcomes)])
    if not repeated.size and np.array_equal(in_catalog, outcomes):
        return []
    suspects = np.unique(np.concatenate([repeated, in_catalog[~_found_in(in_catalog, outcomes)],
                                         outcomes[~_found_in(outcomes, in_catalog)]]))
    ids = {name: ids_with_hashes(path, column, suspects) for name, (path, column) in tables.items()}
    return _id_problems(ids["the catalogue"], ids["packed"], ids["rejects"])


def _repeated(sorted_values: np.ndarray) -> np.ndarray:
    return sorted_values[1:][sorted_values[1:] == sorted_values[:-1]]


def _found_in(values: np.ndarray, sorted_values: np.ndarray) -> np.ndarray:
    if not sorted_values.size:
        return np.zeros(values.size, dtype=bool)
    return sorted_values[np.minimum(np.searchsorted(sorted_values, values), sorted_values.size - 1)] == values


def _id_problems(catalog_ids: list[str], packed: list[str], rejected: list[str]) -> list[str]:
    problems = []
    for name, ids in (("the catalogue", catalog_ids), ("packed", packed), ("rejects", rejected)):
        repeated = [sample_id for sample_id, count in Counter(ids).items() if count > 1]
        if repeated:
            problems.append(f"{len(repeated)} ids appear more than once in {name}: {_listed(repeated)}")
    packed_set, rejected_set, catalog_set = set(packed), set(rejected), set(catalog_ids)
    both = packed_set & rejected_set
    if both:
        problems.append(f"{len(both)} ids both packed and rejected: {_listed(sorted(both))}")
    missing = catalog_set - packed_set - rejected_set
    if missing:
        problems.append(f"{len(missing)} catalogue ids neither packed nor rejected: {_listed(sorted(missing))}")
    unknown = (packed_set | rejected_set) - catalog_set
    if unknown:
        problems.append(f"{len(unknown)} ids not in the catalogue: {_listed(sorted(unknown))}")
    return problems


def _member_names(shard: Path) -> list[str]:
    """The shard's members as webdataset's own reader groups them into samples (`<key>.<suffix>`, in
    the order it reads them): a reader of the trainers' side, independent of the writer's code, so a
    name it would split into another key, or a member it would not read, shows here."""
    from webdataset.tariterators import group_by_keys, tar_file_expander

    with open(shard, "rb") as stream:
        samples = group_by_keys(tar_file_expander([{"stream": stream, "url": str(shard)}]))
        return [f"{sample['__key__']}.{suffix}" for sample in samples for suffix in sample if not suffix.startswith("__")]


@dataclass(frozen=True)
class CheckedShard:
    """A shard the member check found holding exactly `records` packed_json lines, as it was then."""

    stamp: ShardStamp
    records: int
    lines_sha256: str  # of those lines, in order


class CheckedShards:
    """The shards that passed the member check, kept in a file (at `path`) so that a shard whose
    bytes (its stamp) and whose packed_json lines are both unchanged is not read again: in
    `packing.mode: append`, every shard but the new ones.
    """

    def __init__(self, path: Path):
        self.path = path
        try:
            entries = json.loads(path.read_text(encoding="utf-8"))
            self.entries = {e["name"]: CheckedShard(ShardStamp(e["name"], e["size"], e["mtime_ns"]), e["records"],
                                                    e["lines_sha256"]) for e in entries}
        except (OSError, ValueError, KeyError, TypeError):
            self.entries = {}

    def unchanged(self, shard: Path) -> CheckedShard | None:
        entry = self.entries.get(shard.name)
        try:
            return entry if entry and entry.stamp == ShardStamp.of(shard.parent, shard.name) else None
        except OSError:
            return None

    def sample_count(self, shard: Path) -> int:
        entry = self.unchanged(shard)
        return entry.records if entry else shard_sample_count(shard)

    def replace(self, entries: list[CheckedShard]) -> None:
        self.entries = {entry.stamp.name: entry for entry in entries}
        atomic_write_text(self.path, json.dumps([{**asdict(entry.stamp), "records": entry.records,
                                                  "lines_sha256": entry.lines_sha256} for entry in entries], indent=0))


@dataclass(frozen=True)
class _RecordLine:
    key: str
    sha256: bytes
    # Where the line is in packed_json: its media files are parsed only where a shard is read (most
    # of an appended source's shards are taken as checked, and its lines are a million media names).
    offset: int
    size: int


def _record_lines(packed: BinaryIO) -> list[_RecordLine]:
    """For each record in `packed_json` (open), in order: its id, its line's digest and place."""
    lines = []
    offset = 0
    for line in packed:
        lines.append(_RecordLine(_record_id(line), hashlib.sha256(line).digest(), offset, len(line)))
        offset += len(line)
    return lines


_ID_START = b'{"id":'
_AFTER_ID = b',"sample_type":'
_MEDIA_FILES = b',"media_files":'
_DECODER = json.JSONDecoder()


def _record_id(line: bytes) -> str:
    """A packed record's id, read where encode_record writes it (first, then `sample_type`); a line
    written otherwise is parsed whole."""
    id_end = line.find(_AFTER_ID)
    if line.startswith(_ID_START) and id_end > 0:
        with contextlib.suppress(ValueError):
            key = json.loads(line[len(_ID_START):id_end])
            if isinstance(key, str):
                return key
    return json.loads(line)["id"]


def _members(packed: BinaryIO, line: _RecordLine) -> set[str]:
    """The tar member names the sample of `line` must have."""
    packed.seek(line.offset)
    key, media_files = _id_and_media_files(packed.read(line.size))
    return {f"{key}.json"} | {f"{key}.{name}" for names in media_files for name in names}


def _id_and_media_files(line: bytes) -> tuple[str, list[list[str]]]:
    """A packed record's id and media_files, read where encode_record writes them (the id first,
    then `sample_type`; `media_files` after the conversations, the last key of that name: inside a
    string a quote is escaped), without parsing the conversations. A line written otherwise is parsed whole."""
    id_end, media_at = line.find(_AFTER_ID), line.rfind(_MEDIA_FILES)
    if line.startswith(_ID_START) and 0 < id_end < media_at:
        key = json.loads(line[len(_ID_START):id_end])
        media_files = _DECODER.raw_decode(line[media_at + len(_MEDIA_FILES):].decode("utf-8"))[0]
        if isinstance(key, str) and isinstance(media_files, list):
            return key, media_files
    record = json.loads(line)
    return record["id"], record["media_files"]


def _lines_digest(lines: list[_RecordLine]) -> str:
    return hashlib.sha256(b"".join(line.sha256 for line in lines)).hexdigest()


@dataclass(frozen=True)
class MemberCheck:
    problems: list[str]
    shards_read: int


def check_shard_members(shards: list[Path], jsonl_path: Path, processes: int = 1, checked: CheckedShards | None = None) -> MemberCheck:
    """The shards hold exactly the records of `packed_json`, each with exactly its members.

    webdataset's reader reads the shards whole, `processes` shards at a time. With `checked`,
    a shard it holds unchanged whose lines in packed_json are unchanged too is taken as checked
    without being read, and `checked` then holds the shards of this check (none if it failed).
    """
    with open(jsonl_path, "rb") as packed:
        return _check_shard_members(shards, packed, processes, checked)


def _check_shard_members(shards: list[Path], packed: BinaryIO, processes: int, checked: CheckedShards | None) -> MemberCheck:
    lines = _record_lines(packed)
    reusable = {shard: entry for shard in shards if checked and (entry := checked.unchanged(shard))}
    to_read = [shard for shard in shards if shard not in reusable]
    if len(to_read) < SHARDS_PER_PROCESS_FOR_A_POOL * processes:
        processes = 1  # a pool's start-up (a second) would cost more than it saves
    names_of = dict(zip(to_read, ordered_map(_member_names, to_read, processes, reads_local_files=True)))
    found: dict[str, set[str]] = {}  # the members of each sample read from a shard
    home: dict[str, str] = {}
    problems = []
    passed: list[CheckedShard] = []
    read = 0
    position: int | None = 0  # the packed_json line the next shard starts at, while shards follow the file
    for shard in shards:
        entry = reusable.get(shard)
        if entry and position is not None and _lines_digest(lines[position:position + entry.records]) == entry.lines_sha256:
            # Unchanged since it was read and found to hold exactly these lines' members: they are its samples.
            for line in lines[position:position + entry.records]:
                if home.setdefault(line.key, shard.name) != shard.name:
                    problems.append(f"sample {line.key!r} appears in both {home[line.key]} and {shard.name}")
            passed.append(entry)
            position += entry.records
            continue
        names = names_of.get(shard) or _member_names(shard)
        read += 1
        if not names:
            problems.append(f"{shard.name} is empty")
        if names != sorted(names):
            problems.append(f"{shard.name}: members are not sorted")
        keys = []
        for name in names:
            key = name.split(".", 1)[0]
            if home.setdefault(key, shard.name) != shard.name:
                problems.append(f"sample {key!r} appears in both {home[key]} and {shard.name}")
            if key not in found:
                keys.append(key)
            found.setdefault(key, set()).add(name)
        held = lines[position:position + len(keys)] if position is not None else []
        if position is not None and sorted(keys) == sorted(line.key for line in held):
            passed.append(CheckedShard(ShardStamp.of(shard.parent, shard.name), len(keys), _lines_digest(held)))
            position += len(keys)
        else:
            position = None  # the shards no longer follow packed_json line by line: record no more of them
    expected = {line.key: line for line in lines}
    missing = sorted(set(expected) - set(home))
    if missing:
        problems.append(f"{plural(len(missing), 'record')} missing from the shards: {_listed(missing)}")
    extra = sorted(set(home) - set(expected))
    if extra:
        problems.append(f"{plural(len(extra), 'tar sample')} not in packed_json: {_listed(extra)}")
    mismatched = sorted(key for key in set(found) & set(expected) if found[key] != _members(packed, expected[key]))
    if mismatched:
        key = mismatched[0]
        problems.append(
            f"{plural(len(mismatched), 'sample')} whose members differ from their record, e.g. {key!r}: "
            f"tar has {sorted(found[key])}, record names {sorted(_members(packed, expected[key]))}"
        )
    if checked is not None:
        checked.replace([] if problems else passed)
    return MemberCheck(problems, read)
