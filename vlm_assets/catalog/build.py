"""Build one source's sample catalogue: every record becomes an ok row or a rejected row with a reason."""

from __future__ import annotations

import contextlib
import itertools
import json
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from vlm_assets.media.images import ImageTooLarge, opened_image, oriented_image_size
from vlm_assets.media.refs import (
    OBJECT_PREFIX,
    ObjectFacts,
    kind_from_name,
    object_facts,
    read_media_head,
    recently_read,
    sniff_extension,
)
from vlm_assets.media.checks import FACTS_SEPARATOR, MediaCheckLog, medium_stamp
from vlm_assets.media.trainer_decoder import trainer_clip_view
from vlm_assets.media.video_probe import SampledFrames
from vlm_assets.media.copies import MediaCopies
from vlm_assets.catalog.media_resolution import ResolvedMedia, SourceScope
from vlm_assets.catalog.messages import MediaItem, NormalizedSample, SampleError, finalize_untyped, normalize_record
from vlm_assets.catalog.readers import RawRecord, read_source
from vlm_assets.catalog.readers.flat_dir import FolderListing, ObjectFolderListing
from vlm_assets.catalog.readers.jsonl import IdSurvey, LineRange, line_ranges, read_jsonl_range, survey_range
from vlm_assets.catalog.records import RecordLimits, is_json_array
from vlm_assets.catalog.schema import STATUS_OK, STATUS_REJECTED, media_type_of
from vlm_assets.catalog.seen_ids import SeenIds
from vlm_assets.config import DEFAULT_MAX_IMAGE_PIXELS, SourceConfig
from vlm_assets.object_store import is_file, location_size, open_location, resolved
from vlm_assets.parallel import ordered_map, store_reading_processes



class VideoRenderer(Protocol):
    """Decodes a video to check it and keeps what that decode made: the frame cache's mosaic spool
    (vlm_assets.frames.spool.MosaicSpool), which the catalogue is given rather than builds on."""

    def render(self, ref: str) -> SampledFrames: ...


# Checks a validator holds the outcome of (a medium named by several records is checked once while
# held): about 15 MB.
CHECKS_HELD = 65_536


class MediaValidator:
    """Decodes each media file once to prove it is readable; results are cached per ref.

    An image is first measured from its header: one larger than `max_image_pixels` (the source's
    `iter_catalog_chunks` sets it) is refused with an `ImageTooLarge` reason and never decoded.
    Videos are decoded at the frames the frame cache samples (`num_frames`), so a video that
    passes here also passes token counting and frame extraction. With a `check_log`, media that
    passed in an earlier build and have not changed since are not decoded again. With a
    `mosaic_spool`, that one decode also renders the video's frame-cache mosaic and keeps it for
    the frame-cache plan and shards, so they need not decode the video again.
    """

    def __init__(
        self, num_frames: int = 64, check_log: MediaCheckLog | None = None, mosaic_spool: VideoRenderer | None = None,
        max_image_pixels: int = DEFAULT_MAX_IMAGE_PIXELS, media_copies: MediaCopies | None = None,
    ) -> None:
        self.num_frames = num_frames
        self.check_log = check_log
        self.mosaic_spool = mosaic_spool
        self.max_image_pixels = max_image_pixels
        self.media_copies = media_copies
        self.decoded = 0
        self.remembered = 0
        self._errors: dict[tuple[str, str], str] = {}  # (ref, check) -> error
        self._content_facts: dict[str, str] = {}  # pinned object image ref -> "<extension>:<height>x<width>"
        self._stamps: dict[str, str] = {}  # ref -> its medium_stamp, taken before the check read it
        self._trainer_views: dict[str, str] = {}  # video ref -> TrainerClipView.text() ("" : none)
        # No check remembered when the build began (a source's first): each medium will be read to be checked.
        self.checks_every_medium = check_log is None or not check_log.holds_any()

    def error_for(self, ref: str, kind: str) -> str:
        check = self._check_name(kind)
        if (ref, check) not in self._errors:
            if len(self._errors) >= CHECKS_HELD:
                self._forget_oldest_checks()
            self._errors[ref, check] = self._check(ref, kind, check)
        return self._errors[ref, check]

    def _forget_oldest_checks(self) -> None:
        """Drop the older half of the checks held: a medium named again after that is looked up in
        the check log (or decoded) again, and memory stays the same for any number of media."""
        for ref, check in list(itertools.islice(self._errors, CHECKS_HELD // 2)):
            del self._errors[ref, check]
            self._content_facts.pop(ref, None)
            self._stamps.pop(ref, None)
            self._trainer_views.pop(ref, None)

    def stamp_of(self, ref: str) -> str:
        """The stamp `ref`'s file had when it was checked ("" when it could not be taken)."""
        if ref not in self._stamps:
            self._stamps[ref] = self._stamp_now(ref)
        return self._stamps[ref]

    @staticmethod
    def _stamp_now(ref: str) -> str:
        try:
            return medium_stamp(ref)
        except OSError:
            return ""  # missing file: its check names it

    def _check(self, ref: str, kind: str, check: str) -> str:
        # Taken before the medium is read: a change while it is read then shows in a later step.
        stamp = self._stamps[ref] = self._stamp_now(ref)
        fingerprint = f"{stamp}:{check}" if stamp and self.check_log is not None else None
        if self.check_log is not None:
            if fingerprint and self.check_log.passed(ref, fingerprint):
                self.remembered += 1
                if kind == "video":
                    self._trainer_views[ref] = self.check_log.facts(ref)
                elif ref.startswith(OBJECT_PREFIX):
                    self._content_facts[ref] = self.check_log.facts(ref)
                return ""
        facts = ""
        if kind == "image":
            error = _image_error(ref, self.max_image_pixels)
        else:
            error, facts = _video_check(ref, self.num_frames, self.mosaic_spool)
            self._trainer_views[ref] = facts
        if not isinstance(error, ImageTooLarge):
            self.decoded += 1
        # Of an image only: a video's ref stays as resolved, the key its spooled mosaic is found by.
        if not error and kind == "image" and ref.startswith(OBJECT_PREFIX):
            # The object was just read whole (media.py keeps it): learning these costs no request.
            self._content_facts[ref] = facts = _image_facts(ref)
            kept = recently_read(ref)
            if self.media_copies is not None and kept is not None:
                self.media_copies.keep(ref, kept)
        if not error and fingerprint and self.check_log is not None:
            self.check_log.record_pass(ref, f"{fingerprint}{FACTS_SEPARATOR}{facts}" if facts else fingerprint)
        return error

    def trainer_view_of(self, ref: str) -> str:
        """What the trainer's decoder makes of video `ref` (TrainerClipView.text(); "" when not proven)."""
        return self._trainer_views.get(ref, "")

    def checked_ref(self, ref: str) -> str:
        """`ref`, of a pinned object image with what its check learnt (extension, size) added."""
        facts = self._content_facts.get(ref)
        if not facts:
            return ref
        extension, _, dims = facts.partition(":")
        height, _, width = dims.partition("x")
        pinned = object_facts(ref)
        return ObjectFacts(pinned.url, pinned.size, pinned.etag, extension,
                           (int(height), int(width)) if dims else None).ref()

    def _check_name(self, kind: str) -> str:
        # A pass proves the image within this limit: a lower limit checks every image again.
        # A video's pass keeps what the trainer's decoder makes of it: one kept before it did is checked again.
        return f"video@{self.num_frames}+trainer-view" if kind == "video" else f"image@{self.max_image_pixels}px"


def _image_facts(ref: str) -> str:
    height, width = oriented_image_size(ref)
    return f"{sniff_extension(read_media_head(ref, 64)) or ''}:{height}x{width}"


def _image_error(ref: str, max_image_pixels: int) -> str:
    try:
        with opened_image(ref) as image:
            too_large = ImageTooLarge.of(image.size, max_image_pixels)
            if too_large:
                return too_large
            image.load()
    except Exception as error:  # Pillow raises many types for bad data
        # Pillow names an in-memory file (a tar member) by its object's address: a reason that
        # would differ from run to run, so the catalogue's bytes would too.
        return f"{type(error).__name__}: {OBJECT_ADDRESS.sub('', str(error))}"
    return ""


OBJECT_ADDRESS = re.compile(r" ?<[\w.]+ object at 0x[0-9a-fA-F]+>")


VALIDATION_FRAME_SIZE = 28


def _video_check(ref: str, num_frames: int, mosaic_spool: VideoRenderer | None) -> tuple[str, str]:
    """Why the video cannot be read ("" when it can), and what the trainer's decoder makes of it
    (TrainerClipView.text(), "" when not proven), learnt from the frame count this decode proved."""
    from vlm_assets.media.video import FrameResizer, read_sampled_frames

    try:
        if mosaic_spool is not None:
            sampled = mosaic_spool.render(ref)
        else:
            # Converting each frame (tiny) proves the scaler handles its pixel format too.
            resize = FrameResizer(VALIDATION_FRAME_SIZE)
            sampled = read_sampled_frames(ref, num_frames, lambda _index, frame: resize(frame))
    except Exception as error:  # PyAV raises FFmpeg errors of many types
        return f"{type(error).__name__}: {error}", ""
    view = trainer_clip_view(ref, sampled.total_frames)
    return "", view.text() if view is not None else ""


def _kind_of(item: MediaItem, resolved: ResolvedMedia) -> str:
    if item.kind:
        return item.kind
    kind = kind_from_name(resolved.name)
    if kind:
        return kind
    sniffed = sniff_extension(read_media_head(resolved.ref, 64))
    kind = kind_from_name(f"x.{sniffed}") if sniffed else None
    if kind is None:
        raise SampleError(f"cannot tell whether media {resolved.name!r} is an image or a video")
    return kind


def _ok_row(raw: RawRecord, text_key: str, validator: MediaValidator) -> dict:
    stem_media: dict[str, ResolvedMedia] = {}

    def fallback() -> list[MediaItem]:
        for resolved in raw.resolver.same_stem_media():
            stem_media[resolved.name] = resolved
        return [MediaItem(kind_from_name(name) or "", name) for name in stem_media]

    sample: NormalizedSample = normalize_record(raw.record, text_key, fallback)
    resolved = [stem_media.get(item.name) or raw.resolver.resolve(item.name, fetch=validator.checks_every_medium)
                for item in sample.media]
    kinds = [_kind_of(item, media) for item, media in zip(sample.media, resolved)]
    if any(not item.kind for item in sample.media):
        sample = finalize_untyped(sample, kinds)
    for kind, media in zip(kinds, resolved):
        error = validator.error_for(media.ref, kind)
        if isinstance(error, ImageTooLarge):
            raise SampleError(f"image {media.name!r} {error}: {media.ref}")
        if error:
            raise SampleError(f"unreadable {kind} {media.name!r} ({media.ref}): {error}")
    return {
        "status": STATUS_OK,
        "reason": "",
        "messages": json.dumps(sample.messages, ensure_ascii=False),
        "n_turns": sample.n_turns,
        "media_files": [media.name for media in resolved],
        "media_kinds": kinds,
        "media_refs": [validator.checked_ref(media.ref) for media in resolved],
        "media_keys": [media.key for media in resolved],
        "media_stamps": [validator.stamp_of(media.ref) for media in resolved],
        "media_views": [validator.trainer_view_of(media.ref) if kind == "video" else ""
                        for kind, media in zip(kinds, resolved)],
        "media_type": media_type_of(kinds),
    }


def _rejected(reason: str) -> dict:
    return {
        "status": STATUS_REJECTED,
        "reason": reason,
        "messages": "[]",
        "n_turns": 0,
        "media_files": [],
        "media_kinds": [],
        "media_refs": [],
        "media_keys": [],
        "media_stamps": [],
        "media_views": [],
        "media_type": "text",
    }


# What one record's data can make fail; anything else is a bug here and stops the source.
_RECORD_ERRORS = (SampleError, OSError, ValueError, RecursionError)


# A chunk's work: at most this many records, and fewer when they hold videos.
CATALOG_CHUNK_WORK = 256
# Checking a video decodes it (and renders its sampled frames): seconds, the work of hundreds of
# image checks. So a chunk holds one video, and a video source spreads evenly over the processes.
VIDEO_CHECK_WORK = CATALOG_CHUNK_WORK // 2


def _with_duplicates_marked(records: Iterable[RawRecord], seen: SeenIds | None) -> Iterator[RawRecord]:
    """Records in reading order; a repeated sample id (of these or of `seen`, the ids read before with
    the origin each was first read from, which grows as they are read) becomes a reject under a distinct id."""
    with contextlib.ExitStack() as owned:
        if seen is None:
            seen = owned.enter_context(SeenIds())
        for raw in records:
            if raw.repeats_numbered and raw.sample_id in seen:
                raw.sample_id = _repeat_id(raw.sample_id, seen)
            elif raw.sample_id in seen:
                raw.error = _duplicate(raw.sample_id, seen, raw.origin)
                raw.record = None
                raw.sample_id = f"{raw.sample_id}#dup{len(seen)}"
            seen[raw.sample_id] = raw.origin
            yield raw


def _duplicate(sample_id: str, seen: SeenIds, origin: str) -> str:
    return f"duplicate sample id {sample_id!r}, first read from {seen[sample_id]} [{origin}]"


def _repeat_id(sample_id: str, seen: SeenIds) -> str:
    """The id of a repeat of a record named by its content: the first occurrence number (2, 3, …)
    not taken, so identical records keep distinct ids that a line inserted elsewhere does not shift."""
    occurrence = 2
    while f"{sample_id}-{occurrence}" in seen:
        occurrence += 1
    return f"{sample_id}-{occurrence}"


def _unique_row(row: dict, seen: SeenIds, repeats_numbered: bool) -> dict:
    """`row`, or, if its sample id was seen before, the row _with_duplicates_marked makes of it
    (`repeats_numbered`: the rows are named by their content)."""
    sample_id = row["sample_id"]
    if repeats_numbered and sample_id in seen:
        row = {**row, "sample_id": _repeat_id(sample_id, seen)}
    elif sample_id in seen:
        reason = _duplicate(sample_id, seen, row["origin"])
        row = {"sample_id": f"{sample_id}#dup{len(seen)}", "source": row["source"], "origin": row["origin"],
               **_rejected(reason)}
    seen[row["sample_id"]] = row["origin"]
    return row


def catalog_row(raw: RawRecord, source: str, text_key: str, validator: MediaValidator) -> dict:
    if raw.error:
        row = _rejected(raw.error)
    else:
        try:
            row = _ok_row(raw, text_key, validator)
        except SampleError as error:
            row = _rejected(f"{error} [{raw.origin}]")
        except _RECORD_ERRORS as error:
            row = _rejected(f"{type(error).__name__}: {error} [{raw.origin}]")
    row = {"sample_id": raw.sample_id, "source": source, "origin": raw.origin, **row}
    broken = _not_unicode(row)
    if broken:
        # JSON may spell a lone surrogate (\ud800), which Python decodes but no UTF-8 table can hold.
        row = {"sample_id": _escaped(raw.sample_id), "source": source, "origin": _escaped(raw.origin),
               **_rejected(f"its {broken} holds a lone surrogate (such as \\ud800), which is not valid Unicode "
                           f"[{_escaped(raw.origin)}]")}
    return row


def _not_unicode(row: dict) -> str:
    """The first field of `row` with text UTF-8 cannot encode ("" when there is none)."""
    for field, value in row.items():
        for text in value if isinstance(value, list) else [value]:
            if isinstance(text, str) and not text.isascii():
                try:
                    text.encode("utf-8")
                except UnicodeEncodeError:
                    return field
    return ""


def _escaped(text: str) -> str:
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def _check_work(raw: RawRecord) -> int:
    """Rough work of one record's checks: 1, plus VIDEO_CHECK_WORK per video it names or holds."""
    if raw.error:
        return 1
    names = [*_strings(raw.record), *raw.resolver.listed_media_names()]
    return 1 + VIDEO_CHECK_WORK * sum(1 for name in names if kind_from_name(name) == "video")


def _strings(value: Any) -> Iterator[str]:
    if isinstance(value, str):
        if len(value) < 4096:  # a file name, not text
            yield value
    elif isinstance(value, dict):
        for item in value.values():
            yield from _strings(item)
    elif isinstance(value, list):
        for item in value:
            yield from _strings(item)


def _chunked_by_work(records: Iterator[RawRecord], work_per_chunk: int) -> Iterator[list[RawRecord]]:
    """Chunks of at most `work_per_chunk` check work (so at most that many records), one record at least."""
    chunk: list[RawRecord] = []
    work = 0
    for raw in records:
        record_work = _check_work(raw)
        if chunk and work + record_work > work_per_chunk:
            yield chunk
            chunk, work = [], 0
        chunk.append(raw)
        work += record_work
    if chunk:
        yield chunk


# The validator of a chunk worker process (set up by _start_chunk_worker).
_chunk_worker: dict[str, Any] = {}


def _start_chunk_worker(
    source: SourceConfig, text_key: str, num_frames: int, check_log: Path | None, mosaic_spool: VideoRenderer | None,
    media_copies: MediaCopies | None,
) -> None:
    # The worker's log is read-only: it reports its checks with each chunk and the build records them.
    log = MediaCheckLog(check_log, append=False) if check_log is not None else None
    validator = MediaValidator(num_frames, log, mosaic_spool, source.max_image_pixels, media_copies)
    _chunk_worker.update(source=source.name, text_key=text_key, validator=validator, config=source,
                         scope=SourceScope(source))


def _checked_chunk(records: list[RawRecord]) -> tuple[list[dict], dict[str, str], int, int]:
    """(rows, checks passed or remembered, media decoded, media remembered) for one chunk."""
    validator: MediaValidator = _chunk_worker["validator"]
    decoded, remembered = validator.decoded, validator.remembered
    rows = [catalog_row(raw, _chunk_worker["source"], _chunk_worker["text_key"], validator) for raw in records]
    used = validator.check_log.take_used() if validator.check_log is not None else {}
    return rows, used, validator.decoded - decoded, validator.remembered - remembered


def _start_surveying(source: SourceConfig) -> None:
    _chunk_worker.update(config=source)


def _surveyed_range(lines: LineRange) -> IdSurvey:
    return survey_range(_chunk_worker["config"], lines)


def _checked_range(task: tuple[LineRange, bool]) -> tuple[list[dict], dict[str, str], int, int]:
    lines, use_ids = task
    return _checked_chunk(list(read_jsonl_range(_chunk_worker["config"], _chunk_worker["scope"], lines, use_ids)))


# A JSON-lines file at least this big is read by the chunk processes themselves, a range of lines
# each: one process reading and parsing every record caps a big source at a few thousand records
# per second, whatever the number of processes.
RANGE_READING_MIN_BYTES = 8 << 20
# Ranges of 64 KiB to 4 MiB: dozens per process, so a range of slow records (videos) at the end
# keeps one process busy only briefly.
RANGE_BYTES = (64 << 10, 4 << 20)
RANGES_PER_PROCESS = 64


def is_json_lines(source: SourceConfig) -> bool:
    """A `jsonl` source holding JSON lines (not one JSON array)."""
    if source.kind != "jsonl" or not is_file(source.path):
        return False
    with open_location(source.path) as handle:
        return not is_json_array(handle.read(4096))


@dataclass
class JsonlPart:
    """What of a JSON-lines source is read: from byte `start` (line `first_line`) to its end. A catalogue extended by appended lines reads only them, knowing
    how the records before were named (`before`) and their ids (`seen`, with their origins)."""

    start: int = 0
    first_line: int = 1
    before: IdSurvey = field(default_factory=IdSurvey)
    seen: SeenIds = field(default_factory=SeenIds)
    # The whole file's, once the part is surveyed: it names the part's records as the ones before.
    survey: IdSurvey | None = None

    def lines(self, source: SourceConfig) -> LineRange:
        return LineRange(self.start, location_size(source.path), self.first_line)


@dataclass
class FolderPart:
    """What of a flat_dir source is read: its record files from the `start`th on (in `listing`'s
    order). A catalogue extended by added files reads only them, knowing the ids before (`seen`)."""

    listing: FolderListing | ObjectFolderListing
    start: int = 0
    seen: SeenIds = field(default_factory=SeenIds)


def _read_in_ranges(source: SourceConfig, processes: int, part: JsonlPart | FolderPart | None) -> int:
    """The bytes per range to read `part` in, or 0 when its records are read here (see RANGE_READING_MIN_BYTES)."""
    if processes <= 1 or not isinstance(part, JsonlPart):
        return 0
    size = location_size(source.path) - part.start
    if size < RANGE_READING_MIN_BYTES:
        return 0
    low, high = RANGE_BYTES
    return max(low, min(high, size // (processes * RANGES_PER_PROCESS)))


def _part_records(source: SourceConfig, part: JsonlPart) -> Iterator[RawRecord]:
    """The raw records of `part`, read here: surveyed first, then read again, as read_jsonl reads a file."""
    lines = part.lines(source)
    part.survey = part.before + survey_range(source, lines, count_all=False)
    yield from read_jsonl_range(source, SourceScope(source), lines, part.survey.use_ids)


def _rows_read_in_ranges(source: SourceConfig, part: JsonlPart, range_bytes: int, processes: int,
                         settings: tuple) -> Iterator[tuple]:
    """Chunk results (rows, checks used, decoded, remembered) of `part` read in ranges.

    Two passes, as with one reader: every range's ids are surveyed first (records are named by
    their ids only if all have one), then each range is read again into rows. Duplicate ids are
    marked here, in reading order, as _with_duplicates_marked marks them.
    """
    ranges = list(line_ranges(resolved(source.path), range_bytes, part.start, part.first_line))
    surveys = list(ordered_map(_surveyed_range, ranges, processes, _start_surveying, (source,)))
    part.survey = sum(surveys, part.before)
    use_ids = part.survey.use_ids
    tasks = zip(ranges, itertools.repeat(use_ids))
    for rows, used, decoded, remembered in ordered_map(_checked_range, tasks, processes, _start_chunk_worker, settings):
        yield [_unique_row(row, part.seen, not use_ids) for row in rows], used, decoded, remembered


def iter_catalog_chunks(
    source: SourceConfig,
    text_key: str,
    validator: MediaValidator,
    processes: int = 1,
    chunk_work: int = CATALOG_CHUNK_WORK,
    part: JsonlPart | FolderPart | None = None,
) -> Iterator[list[dict]]:
    """One row per input record, in reading order, a chunk at a time: each record fails alone, none is dropped.

    With several processes the chunks' records are checked in the worker processes; a big JSON-lines
    file is also read and parsed there, a range of lines each (RANGE_READING_MIN_BYTES), other
    sources are read here. Duplicate ids are found here. The rows are the same as with one process.
    `validator` then only gathers the workers' counts and checks. Images are checked against the
    source's `max_image_pixels`. Of a JSON-lines source, only `part` is read (default: all of it);
    its `survey` is set once the rows start coming. Of a flat_dir source, only the record files of a
    `FolderPart`.
    """
    validator.max_image_pixels = source.max_image_pixels
    if source.on_object_store:
        processes = store_reading_processes(processes)
    log = validator.check_log
    settings = (source, text_key, validator.num_frames, log.path if log else None, validator.mosaic_spool,
                validator.media_copies)
    if part is None and is_json_lines(source):
        part = JsonlPart()
        try:
            yield from _catalog_chunks(source, text_key, validator, processes, chunk_work, part, settings)
        finally:
            part.seen.close()
        return
    yield from _catalog_chunks(source, text_key, validator, processes, chunk_work, part, settings)


def _catalog_chunks(source: SourceConfig, text_key: str, validator: MediaValidator, processes: int, chunk_work: int,
                    part: JsonlPart | FolderPart | None, settings: tuple) -> Iterator[list[dict]]:
    log = validator.check_log
    range_bytes = _read_in_ranges(source, processes, part)
    if range_bytes:
        results = _rows_read_in_ranges(source, part, range_bytes, processes, settings)
    else:
        if isinstance(part, FolderPart):
            records = part.listing.records(RecordLimits.of(source), part.start)
        else:
            records = _part_records(source, part) if part is not None else read_source(source)
        chunks = _chunked_by_work(_with_duplicates_marked(records, part.seen if part is not None else None), chunk_work)
        # Worker processes cost a start-up each; a source of one chunk is done here.
        opening = list(itertools.islice(chunks, 2))
        chunks = itertools.chain(opening, chunks)
        if processes <= 1 or len(opening) < 2:
            for chunk in chunks:
                yield [catalog_row(raw, source.name, text_key, validator) for raw in chunk]
            return
        results = ordered_map(_checked_chunk, chunks, processes, _start_chunk_worker, settings)
    for rows, used, decoded, remembered in results:
        if log is not None:
            log.adopt(used)
        validator.decoded += decoded
        validator.remembered += remembered
        yield rows
