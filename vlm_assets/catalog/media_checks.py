"""Remembered media checks: a file proven readable is not decoded again until it changes.

One JSON-lines log per source. A line is appended as soon as a check passes, so an interrupted
catalogue build keeps what it already proved; a finished build rewrites the log (atomically) to
the media it used. Only passes are remembered: a failure may be transient (network storage), so
it is checked again on the next build.
"""

from __future__ import annotations

import copy
import json
import os
from collections import ChainMap
from collections.abc import MutableMapping
from pathlib import Path
from typing import TextIO

from vlm_assets.atomic import atomic_write_text
from vlm_assets.catalog.media import is_object_ref, is_tar_ref, object_facts, tar_member_path
from vlm_assets.object_store import head


RESOLVED_RECENTLY_S = 30.0
# A pass of an object medium keeps what its check learnt of the content after this separator
# ("<extension>:<height>x<width>"), so a later build need not read the object to learn it again.
FACTS_SEPARATOR = "|"


def media_fingerprint(ref: str, check: str) -> str:
    """Size and modification time of the file holding the media (of an object: its size and ETag),
    plus what the check proved.

    Raises OSError when the file is missing (the check itself then reports it).
    """
    return f"{_identity(ref)}:{check}"


def _identity(ref: str, live: bool = False) -> str:
    """`live`: of an object, as the store has it now, even when the ref pins the version resolved."""
    file = tar_member_path(ref) if is_tar_ref(ref) else ref
    if is_object_ref(file):
        facts = object_facts(file)
        if facts.size is not None and not live:
            return f"{facts.size}:{facts.etag}"
        # Asked right after the medium was resolved (one HEAD proves it exists): that answer will do.
        info = head(facts.url, max_age=0.0 if live else RESOLVED_RECENTLY_S)
        if info is None:
            raise FileNotFoundError(f"{facts.url} does not exist")
        return f"{info.size}:{info.etag}"
    stat = os.stat(file)
    return f"{stat.st_size}:{stat.st_mtime_ns}"


class MediaCheckLog:
    """`append=False`: passes are kept in memory only, for a worker process that reports them
    (`take_used`) to the build, which records them (`adopt`): one writer appends to the log."""

    def __init__(self, path: Path, append: bool = True) -> None:
        self.path = path
        self.append = append
        self._passed: MutableMapping[str, str]
        self._passed, self._file_is_compact = _read_log(path)
        self._used: dict[str, str] = {}
        self._appender: TextIO | None = None

    def passed(self, ref: str, fingerprint: str) -> bool:
        """True when `ref` passed this check before and its file has not changed since."""
        stored = self._passed.get(ref)
        if stored is None or not (stored == fingerprint or stored.startswith(fingerprint + FACTS_SEPARATOR)):
            return False
        self._used[ref] = stored
        return True

    def holds_any(self) -> bool:
        return bool(self._passed)

    def facts(self, ref: str) -> str:
        """What the pass of `ref` recorded of its content ("" when nothing)."""
        return self._passed.get(ref, "").partition(FACTS_SEPARATOR)[2]

    def record_pass(self, ref: str, fingerprint: str) -> None:
        if not self.append or ref in self._passed:
            self._file_is_compact = False  # the file no longer holds each pass once, as _passed has it
        if self.append:
            if self._appender is None:
                self.path.parent.mkdir(parents=True, exist_ok=True)
                self._appender = open(self.path, "a", encoding="utf-8")
            self._appender.write(json.dumps({"ref": ref, "fingerprint": fingerprint}) + "\n")
            self._appender.flush()
        self._passed[ref] = fingerprint
        self._used[ref] = fingerprint

    def keep_unchanged(self) -> str:
        """Every remembered pass whose file is unchanged counts as used by this build (its rows are
        kept, not checked again); returns the first whose file changed or vanished, or ""."""
        for ref, fingerprint in self._passed.items():
            if is_object_ref(ref) or (is_tar_ref(ref) and is_object_ref(tar_member_path(ref))):
                try:
                    identity = _identity(ref, live=True)
                except OSError:
                    return ref
                if not fingerprint.startswith(f"{identity}:"):
                    return ref
                continue
            try:
                stat = os.stat(tar_member_path(ref) if is_tar_ref(ref) else ref)
            except OSError:
                return ref
            # media_fingerprint's size and mtime, compared as the fingerprint's start: a million media
            # are a million stat calls, and little else.
            if not fingerprint.startswith(f"{stat.st_size}:{stat.st_mtime_ns}:"):
                return ref
        self._used.update(self._passed)
        return ""

    def reader(self) -> MediaCheckLog:
        """A log over this one's passes that never writes its file, as a chunk worker's is, for a
        worker in this same process: the passes are not parsed (and held) a second time."""
        reader = copy.copy(self)
        reader.append, reader._appender, reader._used = False, None, {}
        reader._passed = ChainMap({}, self._passed)  # what the reader proves stays its own, to be adopted
        return reader

    def take_used(self) -> dict[str, str]:
        """The checks passed or remembered since the last call."""
        used, self._used = self._used, {}
        return used

    def adopt(self, used: dict[str, str]) -> None:
        """Take another process's `take_used()`: its new passes are recorded here."""
        for ref, fingerprint in used.items():
            if self._passed.get(ref) == fingerprint:
                self._used[ref] = fingerprint
            else:
                self.record_pass(ref, fingerprint)

    def compact(self) -> None:
        """Keep only the media of this build (drops entries of removed or changed files).

        A log that already holds exactly those, one line each (a build that used every medium
        remembered, as one extending its catalogue does), is left as it is.
        """
        self.close()
        if self._file_is_compact and self._used == self._passed:
            return
        lines = (json.dumps({"ref": ref, "fingerprint": fingerprint}) + "\n" for ref, fingerprint in self._used.items())
        atomic_write_text(self.path, "".join(lines))
        self._passed, self._file_is_compact = dict(self._used), True

    def close(self) -> None:
        if self._appender is not None:
            self._appender.close()
            self._appender = None


# The log is parsed this many bytes of lines at a time: a million-line log read whole would hold its
# text, its lines and their parse at once (420 MB beside the 430 MB of passes it gives).
_PARSE_BYTES = 8 << 20


def _read_log(path: Path) -> tuple[dict[str, str], bool]:
    """The passes a log holds, and whether it holds each once, on whole lines."""
    if not path.is_file():
        return {}, True
    passed: dict[str, str] = {}
    lines_read, compact = 0, True
    with open(path, encoding="utf-8") as handle:
        while lines := handle.readlines(_PARSE_BYTES):
            lines_read += len(lines)
            compact = _parse_lines(lines, passed) and compact and lines[-1].endswith("\n")
    return passed, compact and len(passed) == lines_read


def _parse_lines(lines: list[str], passed: dict[str, str]) -> bool:
    """Add the passes of `lines` to `passed`; False when a line is not a pass (it is skipped)."""
    try:
        # One parse of many lines runs at C speed (a big source's log holds millions of lines).
        entries = json.loads("[" + ",".join(lines) + "]")
        batch = {entry["ref"]: entry["fingerprint"] for entry in entries}
        if all(isinstance(value, str) for value in batch.values()):
            passed.update(batch)
            return True
    except (ValueError, KeyError, TypeError):
        pass
    for line in lines:
        try:
            entry = json.loads(line)
            passed[entry["ref"]] = entry["fingerprint"]
        except (ValueError, KeyError, TypeError):
            continue  # a line cut short by an interrupted build: that check simply runs again
    return False
