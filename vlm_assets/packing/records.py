"""Packed records (docs/formats.md): one JSON object per bin, lossless about its samples.

Field choices:
- ``messages``: each sample's full conversation, exactly as the catalogue holds it
  (``<image>`` / ``<video>`` placeholders mark media positions).
- ``texts.prompts`` / ``texts.captions``: the first user / first assistant turn of
  each sample with the placeholders removed and surrounding whitespace stripped
  ("" when the sample has no such turn): a flat view for cookers that do not parse ``messages``.
- ``media_files``: per sample, the tar member suffixes ``img<k>.<ext>`` /
  ``vid<k>.<ext>`` (k = flat media index within the record, ext sniffed from the
  bytes), so two samples that both say ``0001.jpg`` never collide.
- ``images`` (packed_vqa / packed_captioning only): the flat list of those suffixes,
  which are also the keys of an Energon CrudeWebdataset sample dict.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO

from vlm_assets.catalog import lookup
from vlm_assets.catalog.media import media_extension
from vlm_assets.catalog.schema import media_type_of
from vlm_assets.parallel import ordered_map

if TYPE_CHECKING:  # shard chunk processes start faster without pandas
    import pandas as pd

IMAGE_ONLY_SAMPLE_TYPES = frozenset({"packed_vqa", "packed_captioning"})
MEMBER_PREFIX = {"image": "img", "video": "vid"}
_PLACEHOLDER = re.compile(r"<image>|<video>")
PackedBin = tuple[int, Sequence[str], Sequence[int]]  # (bin_id, sample_ids, lengths)
# Samples per chunk of bins a process turns into records: a fraction of a second of work each.
RECORD_CHUNK_SAMPLES = 4096


@dataclass(frozen=True)
class RecordMedia:
    member: str  # "img0.jpg": the tar member name after "<key>."
    ref: str  # where the bytes are (vlm_assets.catalog.media)


@dataclass(frozen=True)
class PackedRecord:
    record: dict[str, Any]
    media: tuple[RecordMedia, ...]

    @property
    def key(self) -> str:
        return self.record["id"]


def record_id(source: str, bin_id: int) -> str:
    return f"{source}_ps_{bin_id:08d}"


def encode_record(record: dict[str, Any]) -> bytes:
    """The one serialisation used for both the JSONL line and the tar's .json member."""
    return json.dumps(record, ensure_ascii=False, separators=(",", ":")).encode("utf-8")


def first_text(messages: list[dict[str, Any]], role: str) -> str:
    for message in messages:
        if message.get("role") == role:
            return _PLACEHOLDER.sub("", str(message.get("content", ""))).strip()
    return ""


# The catalogue columns a packed record is made of.
RECORD_COLUMNS = ("messages", "media_files", "media_kinds", "media_refs", "media_keys")
SampleRows = Mapping[str, Mapping[str, Any]]  # sample id -> {catalogue column: value}


def samples_by_id(catalog: pd.DataFrame) -> dict[str, dict[str, Any]]:
    """An in-memory SampleRows of a whole catalogue (vlm_assets.catalog.lookup keeps a big one on disk)."""
    columns = [column for column in RECORD_COLUMNS if column in catalog]
    return catalog.set_index("sample_id")[columns].to_dict("index")


def build_records(
    source: str, bins: Iterable[PackedBin], samples: SampleRows, sample_type: str
) -> Iterator[PackedRecord]:
    """One packed record per bin `(bin_id, sample_ids, lengths)`, in bin order."""
    for bin_id, sample_ids, lengths in bins:
        yield _build_record(record_id(source, int(bin_id)), list(sample_ids), list(lengths), samples, sample_type)


def _build_record(
    key: str, sample_ids: list[str], lengths: list[int], samples: SampleRows, sample_type: str
) -> PackedRecord:
    messages, prompts, captions, media_files, media_keys, kinds = [], [], [], [], [], []
    media: list[RecordMedia] = []
    for sample_id in sample_ids:
        sample = samples[sample_id]
        raw_messages, names_written, media_kinds, media_refs, keys = (sample[column] for column in RECORD_COLUMNS)
        conversation = json.loads(raw_messages)
        messages.append(conversation)
        prompts.append(first_text(conversation, "user"))
        captions.append(first_text(conversation, "assistant"))
        names = []
        for name, kind, ref in zip(names_written, media_kinds, media_refs):
            member = f"{MEMBER_PREFIX[kind]}{len(media)}.{media_extension(ref, name)}"
            media.append(RecordMedia(member, ref))
            names.append(member)
            kinds.append(kind)
        media_files.append(names)
        media_keys.append(list(keys))
    record: dict[str, Any] = {
        "id": key,
        "sample_type": sample_type,
        "sample_ids": sample_ids,
        "lengths": [int(length) for length in lengths],
        "messages": messages,
        "texts": {"prompts": prompts, "captions": captions},
        "media_files": media_files,
        "media_keys": media_keys,
        "media_type": media_type_of(kinds),
    }
    if sample_type in IMAGE_ONLY_SAMPLE_TYPES:
        record["images"] = [item.member for item in media]
    return PackedRecord(record, tuple(media))


def write_jsonl(records: Iterable[PackedRecord], handle) -> int:
    count = 0
    for packed in records:
        handle.write(encode_record(packed.record) + b"\n")
        count += 1
    return count


def write_packed_jsonl(
    source: str,
    bins: Iterable[PackedBin],
    samples: lookup.SampleLookup,
    sample_type: str,
    handle,
    processes: int = 1,
) -> int:
    """`write_jsonl(build_records(...))`, the records built by `processes` processes: the same bytes.

    `samples` (with the RECORD_COLUMNS) stays open meanwhile: the chunk processes read its index file.
    """
    chunks = ((source, sample_type, chunk) for chunk in _bin_chunks(bins))
    count = 0
    try:
        for records, data in ordered_map(_encode_chunk, chunks, processes, lookup.attach,
                                         (str(samples.path), samples.columns)):
            handle.write(data)
            count += records
    finally:
        lookup.detach()
    return count


def kept_records(path: Path, bins: Iterable[PackedBin], source: str, sample_type: str,
                 copy_to: BinaryIO | None = None) -> int:
    """packing.mode append: how many records `path` (packed JSON an earlier build wrote) holds when
    they are the records of the first bins (each line's id, sample type and sample ids those of its
    bin), so it is kept and only the later bins' records are built; 0 when it is not (it is then rebuilt).
    `copy_to` (a new file, empty): the kept records are written to it as they are read, and nothing when none are."""
    count = 0
    with open(path, "rb") as handle:
        bins = iter(bins)
        for line in handle:
            packed_bin = next(bins, None)
            # Compared as the bytes encode_record writes them (its keys in this order, first):
            # parsing a million samples' conversations to read three fields took seconds.
            if packed_bin is None or not line.endswith(b"}\n") or not line.startswith(
                    _record_head(record_id(source, int(packed_bin[0])), sample_type, list(packed_bin[1]))):
                if copy_to is not None:
                    copy_to.seek(0)
                    copy_to.truncate()
                return 0
            if copy_to is not None:
                copy_to.write(line)
            count += 1
    return count


def _record_head(key: str, sample_type: str, sample_ids: list[str]) -> bytes:
    """The start of the packed line `_build_record` makes of these fields, up to its next field."""
    return encode_record({"id": key, "sample_type": sample_type, "sample_ids": sample_ids})[:-1] + b","


def _bin_chunks(bins: Iterable[PackedBin]) -> Iterator[list[PackedBin]]:
    chunk: list[PackedBin] = []
    samples = 0
    for packed_bin in bins:
        chunk.append(packed_bin)
        samples += len(packed_bin[1])
        if samples >= RECORD_CHUNK_SAMPLES:
            yield chunk
            chunk, samples = [], 0
    if chunk:
        yield chunk


def _encode_chunk(chunk: tuple[str, str, list[PackedBin]]) -> tuple[int, bytes]:
    source, sample_type, bins = chunk
    records = [encode_record(packed.record) + b"\n"
               for packed in build_records(source, bins, lookup.attached(), sample_type)]
    return len(records), b"".join(records)


def read_records(jsonl_path: Path, samples: SampleRows) -> Iterator[PackedRecord]:
    """Packed records from `packed_json`, with each member's media ref looked up in `samples` (media_refs)."""
    with open(jsonl_path, "rb") as handle:
        for line_number, line in enumerate(handle, start=1):
            yield record_of_line(line, samples, jsonl_path, line_number)


def record_of_line(line: bytes, samples: SampleRows, jsonl_path: Path, line_number: int) -> PackedRecord:
    """One `packed_json` line as a record with its media refs; errors name the file and line."""
    record = json.loads(line)
    sample_refs = []
    for sample_id in record["sample_ids"]:
        try:
            sample_refs.extend(samples[sample_id]["media_refs"])
        except KeyError:
            raise KeyError(f"{jsonl_path}:{line_number}: sample {sample_id!r} is not in the catalogue") from None
    members = [member for names in record["media_files"] for member in names]
    if len(members) != len(sample_refs):
        raise ValueError(
            f"{jsonl_path}:{line_number}: record {record['id']} names {len(members)} media "
            f"but its samples have {len(sample_refs)} in the catalogue"
        )
    return PackedRecord(record, tuple(RecordMedia(m, r) for m, r in zip(members, sample_refs)))
