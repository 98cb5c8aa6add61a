"""Packed records (docs/formats.md): one JSON object per bin, laid out as its sample type's consumer
(LoongForge's VLM task encoder) reads it; each sample of the bin is one child.

Every type:
- ``messages``: per child ``{"messages": [...]}``, its whole conversation as the catalogue holds it
  (role/content strings, ``<image>`` / ``<video>`` placeholders kept); packed_chat_mix reads it.
- ``media_files``: per child, the tar member names after ``<key>.``; written after the texts, so
  `vlm_assets.packing.verify` finds it without parsing them.
- ``_meta``: ``pack_id``, ``sample_ids``, ``token_lens``, ``total_token_len``.
By type:
- packed_captioning / packed_vqa: top-level ``prompts`` (the user turn, placeholder kept),
  ``captions`` (the answer) and ``images``; child i's one image is member ``img{i}.jpg``.
- packed_multi_mix_qa: ``texts.prompts`` / ``texts.captions``, per child the list of its user / its
  assistant turns.
Members elsewhere are ``img<k>.<ext>`` / ``vid<k>.<ext>`` (k counts the record's media), the
extension one the consumer routes by; the bytes are the original file's, which its decoders
recognise by content.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

from vlm_assets.catalog import lookup
from vlm_assets.media.refs import media_extension
from vlm_assets.catalog.schema import media_type_of
from vlm_assets.parallel import ordered_map

SINGLE_IMAGE_SAMPLE_TYPES = frozenset({"packed_vqa", "packed_captioning"})
MEMBER_PREFIX = {"image": "img", "video": "vid"}
# Extensions the consumer tells images from videos by; another format's member takes the first one
# (Matroska: webm, its subset).
CONSUMER_EXTENSIONS = {"image": ("jpg", "jpeg", "png", "webp", "bmp", "gif", "tiff"),
                       "video": ("mp4", "avi", "mov", "webm")}
_EXTENSION_ALIASES = {"tif": "tiff", "jpe": "jpg", "mkv": "webm", "m4v": "mp4"}
PackedBin = tuple[int, Sequence[str], Sequence[int]]  # (bin_id, sample_ids, lengths)
# Samples per chunk of bins a process turns into records: a fraction of a second of work each.
RECORD_CHUNK_SAMPLES = 4096


@dataclass(frozen=True)
class RecordMedia:
    member: str  # "img0.jpg": the tar member name after "<key>."
    ref: str  # where the bytes are (vlm_assets.media.refs)
    stamp: str = ""  # the file's stamp when the catalogue checked it (media.checks.medium_stamp); "": unknown


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


def member_extension(kind: str, ref: str, name: str) -> str:
    """The extension of a media member: the file's own where the consumer knows it."""
    extension = media_extension(ref, name).lower()
    extension = _EXTENSION_ALIASES.get(extension, extension)
    return extension if extension in CONSUMER_EXTENSIONS[kind] else CONSUMER_EXTENSIONS[kind][0]


def turns_of(conversation: list[dict[str, Any]], role: str) -> list[str]:
    return [str(message.get("content", "")) for message in conversation if message.get("role") == role]


# The catalogue columns a packed record is made of.
RECORD_COLUMNS = ("messages", "media_files", "media_kinds", "media_refs", "media_keys")
SampleRows = Mapping[str, Mapping[str, Any]]  # sample id -> {catalogue column: value}


def build_records(
    source: str, bins: Iterable[PackedBin], samples: SampleRows, sample_type: str
) -> Iterator[PackedRecord]:
    """One packed record per bin `(bin_id, sample_ids, lengths)`, in bin order."""
    for bin_id, sample_ids, lengths in bins:
        yield _build_record(record_id(source, int(bin_id)), list(sample_ids), list(lengths), samples, sample_type)


def _build_record(
    key: str, sample_ids: list[str], lengths: list[int], samples: SampleRows, sample_type: str
) -> PackedRecord:
    single_image = sample_type in SINGLE_IMAGE_SAMPLE_TYPES
    conversations, media_files, media_keys, kinds = [], [], [], []
    media: list[RecordMedia] = []
    for child, sample_id in enumerate(sample_ids):
        sample = samples[sample_id]
        raw_messages, names_written, media_kinds, media_refs, keys = (sample[column] for column in RECORD_COLUMNS)
        conversations.append(json.loads(raw_messages))
        names = []
        for name, kind, ref in zip(names_written, media_kinds, media_refs):
            member = (f"img{child}.jpg" if single_image
                      else f"{MEMBER_PREFIX[kind]}{len(media)}.{member_extension(kind, ref, name)}")
            media.append(RecordMedia(member, ref))
            names.append(member)
            kinds.append(kind)
        media_files.append(names)
        media_keys.append(list(keys))
    lengths = [int(length) for length in lengths]
    record: dict[str, Any] = {
        "id": key,
        "sample_type": sample_type,
        "sample_ids": sample_ids,
        "lengths": lengths,
        "messages": [{"messages": conversation} for conversation in conversations],
    }
    if single_image:
        record["prompts"] = [turns_of(conversation, "user")[0] for conversation in conversations]
        record["captions"] = [turns_of(conversation, "assistant")[0] for conversation in conversations]
    elif sample_type == "packed_multi_mix_qa":
        record["texts"] = {"prompts": [turns_of(conversation, "user") for conversation in conversations],
                           "captions": [turns_of(conversation, "assistant") for conversation in conversations]}
    record["media_files"] = media_files
    if single_image:
        record["images"] = [item.member for item in media]
    record["media_keys"] = media_keys
    record["media_type"] = media_type_of(kinds)
    record["_meta"] = {"pack_id": key, "sample_ids": sample_ids, "token_lens": lengths,
                       "total_token_len": sum(lengths)}
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
        # The lookup's index is a file of this machine's.
        for records, data in ordered_map(_encode_chunk, chunks, processes, lookup.attach,
                                         (str(samples.path), samples.columns), reads_local_files=True):
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
            # Compared as the bytes encode_record writes them (its keys in this order, first), so
            # a kept record's conversation is never parsed to read three fields.
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


def record_of_line(line: bytes, samples: SampleRows, jsonl_path: Path, line_number: int) -> PackedRecord:
    """One `packed_json` line as a record with its media refs (and their stamps where `samples` has
    the catalogue's `media_stamps`); errors name the file and line."""
    record = json.loads(line)
    sample_refs, sample_stamps = [], []
    for sample_id in record["sample_ids"]:
        try:
            row = samples[sample_id]
        except KeyError:
            raise KeyError(f"{jsonl_path}:{line_number}: sample {sample_id!r} is not in the catalogue") from None
        refs, stamps = row["media_refs"], list(row.get("media_stamps") or ())
        sample_refs.extend(refs)
        sample_stamps.extend(stamps + [""] * (len(refs) - len(stamps)))
    members = [member for names in record["media_files"] for member in names]
    if len(members) != len(sample_refs):
        raise ValueError(
            f"{jsonl_path}:{line_number}: record {record['id']} names {len(members)} media "
            f"but its samples have {len(sample_refs)} in the catalogue"
        )
    return PackedRecord(record, tuple(RecordMedia(member, ref, stamp)
                                      for member, ref, stamp in zip(members, sample_refs, sample_stamps)))
