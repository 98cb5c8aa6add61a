"""Remembered media checks: a file proven readable is not decoded again until it changes.

One SQLite file per source, a row per medium that passed. Passes are committed every few seconds
as a build goes, so an interrupted catalogue build keeps what it already proved; a finished build
deletes the rows of media it no longer used. Only passes are remembered: a failure may be transient
(network storage), so it is checked again on the next build. The rows stay on disk: a build holds
none of them in memory, whatever the number of media (a million passes are about 200 MB as Python
objects, in every process that checks media).
"""

from __future__ import annotations

import os
import sqlite3
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import Executor, Future
from pathlib import Path

from vlm_assets.atomic import naming_a_full_disk
from vlm_assets.media.refs import (
    OBJECT_PREFIX,
    TAR_PREFIX,
    describe_ref,
    is_object_ref,
    is_tar_ref,
    object_facts,
    tar_member_path,
)
from vlm_assets.object_store import URL_SCHEME, head


RESOLVED_RECENTLY_S = 30.0
# How the refs of media that are not a plain file begin: a tar member's, an object's.
_NOT_A_PATH = (TAR_PREFIX, OBJECT_PREFIX, URL_SCHEME)
# A pass of an object medium keeps what its check learnt of the content after this separator
# ("<extension>:<height>x<width>"), so a later build need not read the object to learn it again.
FACTS_SEPARATOR = "|"


def media_fingerprint(ref: str, check: str) -> str:
    """The medium's stamp (`medium_stamp`) plus what the check proved.

    Raises OSError when the file is missing (the check itself then reports it).
    """
    return f"{medium_stamp(ref)}:{check}"


def medium_stamp(ref: str, live: bool = False) -> str:
    """What any change to the file holding the medium changes: its size, modification and change
    times (of an object: its size and ETag). The catalogue records it beside each medium, and every
    later step that reads the medium compares it (`verify_medium_stamp`). `live`: of an object, as
    the store has it now, even when the ref pins the version resolved.

    Raises OSError when the file is missing."""
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
    return _file_stamp(os.stat(file))


def medium_stamp_or_failure(ref: str) -> str:
    """`medium_stamp`, or the name of the error that kept it from being taken (a missing file)."""
    try:
        return medium_stamp(ref)
    except OSError as error:
        return type(error).__name__


def _file_stamp(stat: os.stat_result) -> str:
    return f"{stat.st_size}:{stat.st_mtime_ns}:{stat.st_ctime_ns}"


class MediumChanged(OSError):
    """A medium is not the one the catalogue checked and measured: it changed, vanished or became
    unreadable since. A fault of the machine or of an edit, not of the sample: the step fails, and
    the next run catalogues the medium anew (the catalogue's fingerprint holds the same stamps)."""


def verify_medium_stamp(ref: str, catalogued: str) -> None:
    """Raise MediumChanged, naming the file, unless `ref` still has the stamp `catalogued` ("":
    nothing recorded, nothing to compare)."""
    if not catalogued:
        return
    try:
        now = medium_stamp(ref)
    except OSError as error:
        raise MediumChanged(f"{describe_ref(ref)}: unreadable since the catalogue was built ({error}); "
                            "restore it, or run again to catalogue the source anew") from error
    if now != catalogued:
        raise MediumChanged(f"{describe_ref(ref)}: changed since the catalogue was built (stamp {catalogued} "
                            f"-> {now}); run again to catalogue it anew")


def medium_read_failure(error: BaseException, refs: Sequence[str]) -> MediumChanged | None:
    """The MediumChanged a failure reading catalogued media (`refs`) stands for, or None when the
    failure is the sample's own: the operating system's error with an errno (missing, denied, an I/O
    error) is the machine's, and names its file where it knows it. A decoder's error is the sample's,
    even where it carries an errno (PyAV's errors are OSErrors with FFmpeg's codes)."""
    if isinstance(error, MediumChanged):
        return error
    if isinstance(error, OSError) and error.errno is not None and type(error).__module__ == "builtins":
        where = error.filename or ", ".join(describe_ref(ref) for ref in refs)
        return MediumChanged(f"{where}: unreadable since the catalogue was built "
                             f"({type(error).__name__}: {error.strerror or error}); restore it, "
                             "or run again to catalogue the source anew")
    return None


# Passes recorded are committed at least this often: a kill loses the checks of these seconds at most,
# and a commit (a sync of the file) per chunk of records would cost seconds per million records.
COMMIT_EVERY_S = 2.0
# A writer waits this long for a reader's lookup to end before it commits, and a reader for a commit.
BUSY_TIMEOUT_S = 60.0
_SCHEMA = "CREATE TABLE IF NOT EXISTS passes (ref TEXT PRIMARY KEY, fingerprint TEXT NOT NULL, build INTEGER NOT NULL) WITHOUT ROWID"
_UPSERT = ("INSERT INTO passes (ref, fingerprint, build) VALUES (?, ?, ?) "
           "ON CONFLICT (ref) DO UPDATE SET fingerprint = excluded.fingerprint, build = excluded.build")


class MediaCheckLog:
    """The check log of one source at `path`.

    `append=True` (the build's own log): passes and uses are written to the file, under this
    build's number, and `compact` drops the rows this build did not use. `append=False` (a chunk
    worker's, in any process): the file is only read; passes and uses are kept until `take_used`
    hands them to the build, which records them (`adopt`): one writer per log.
    """

    def __init__(self, path: Path, append: bool = True) -> None:
        self.path = path
        self.append = append
        self._build = time.time_ns()
        self._connection: sqlite3.Connection | None = None
        self._committed_at = 0.0
        self._used: dict[str, str] = {}  # a reader's, until take_used
        # keep_unchanged used every pass the file held: each row is then this build's or kept.
        self._kept_all = False
        self._last: tuple[str, str | None] = ("", None)  # (ref, stored fingerprint) of the last lookup

    def passed(self, ref: str, fingerprint: str) -> bool:
        """True when `ref` passed this check before and its file has not changed since."""
        stored = self._stored(ref)
        if stored is None or not (stored == fingerprint or stored.startswith(fingerprint + FACTS_SEPARATOR)):
            return False
        self._mark_used(ref, stored)
        return True

    def identity(self, ref: str) -> str:
        """The stamp (`medium_stamp`) `ref`'s file had when it last passed, or "" when the log holds
        no pass of it."""
        return (self._stored(ref) or "").partition(FACTS_SEPARATOR)[0].rpartition(":")[0]

    def holds_any(self) -> bool:
        connection = self._open()
        return connection is not None and bool(connection.execute("SELECT 1 FROM passes LIMIT 1").fetchall())

    def facts(self, ref: str) -> str:
        """What the pass of `ref` recorded of its content ("" when nothing)."""
        return (self._stored(ref) or "").partition(FACTS_SEPARATOR)[2]

    def record_pass(self, ref: str, fingerprint: str) -> None:
        self._mark_used(ref, fingerprint)

    def keep_unchanged(self) -> str:
        """Every remembered pass whose file is unchanged counts as used by this build (its rows are
        kept, not checked again); returns the first whose file changed or vanished, or ""."""
        changed = self.first_changed()
        if not changed:
            self.keep_all()
        return changed

    def keep_all(self) -> None:
        """Count every remembered pass as used by this build: `first_changed` found none changed."""
        self._kept_all = True

    def first_changed(self, this_build: bool = False) -> str:
        """The first remembered pass whose file changed or vanished since it passed, or "".
        `this_build`: of the passes this build recorded or used only."""
        for ref, fingerprint in self.passes(this_build):
            # A plain file's ref is its path: told apart by one prefix test (a million media, a million tests).
            if not ref.startswith(_NOT_A_PATH):
                file = ref
            elif is_object_ref(ref) or is_object_ref(tar_member_path(ref)):
                try:
                    identity = medium_stamp(ref, live=True)
                except OSError:
                    return ref
                if not fingerprint.startswith(f"{identity}:"):
                    return ref
                continue
            else:
                file = tar_member_path(ref)
            try:
                stat = os.stat(file)
            except OSError:
                return ref
            # media_fingerprint's stamp, compared as the fingerprint's start: a million media are a
            # million stat calls, and little else.
            if not fingerprint.startswith(_file_stamp(stat) + ":"):
                return ref
        return ""

    def passes(self, this_build: bool = False) -> Iterator[tuple[str, str]]:
        """(ref, fingerprint) of every pass the file holds (`this_build`: that this build recorded or
        used), by ref; read a page at a time."""
        connection = self._open()
        if connection is None:
            return
        query = f"SELECT ref, fingerprint FROM passes WHERE ref > ?{' AND build = ?' if this_build else ''} ORDER BY ref LIMIT 4096"
        builds = (self._build,) if this_build else ()
        after = ""
        while rows := connection.execute(query, (after, *builds)).fetchall():
            yield from rows
            after = rows[-1][0]

    def take_used(self) -> dict[str, str]:
        """The checks passed or remembered since the last call (of a reader)."""
        used, self._used = self._used, {}
        return used

    def adopt(self, used: dict[str, str]) -> None:
        """Take a reader's `take_used()`: its passes are recorded here, and used by this build."""
        with naming_a_full_disk(self.path):
            connection = self._open(create=True)
            connection.executemany(_UPSERT, ((ref, fingerprint, self._build) for ref, fingerprint in used.items()))
            self._commit_soon()

    def compact(self) -> None:
        """Keep only the media of this build (drops rows of removed or changed files)."""
        with naming_a_full_disk(self.path):
            connection = self._open()
            if connection is not None and self.append and not self._kept_all:
                connection.execute("DELETE FROM passes WHERE build != ?", (self._build,))
            self.close()

    def close(self) -> None:
        if self._connection is not None:
            self._commit()
            self._connection.close()
            self._connection = None

    def _stored(self, ref: str) -> str | None:
        if self._last[0] != ref:
            connection = self._open()
            # fetchall: the statement ends here, so a reader never holds the file against the writer's commit.
            rows = connection.execute("SELECT fingerprint FROM passes WHERE ref = ?", (ref,)).fetchall() if connection else []
            self._last = (ref, rows[0][0] if rows else None)
        return self._last[1]

    def _mark_used(self, ref: str, fingerprint: str) -> None:
        self._last = (ref, fingerprint)
        if not self.append:
            self._used[ref] = fingerprint
            return
        with naming_a_full_disk(self.path):
            self._open(create=True).execute(_UPSERT, (ref, fingerprint, self._build))
            self._commit_soon()

    def _open(self, create: bool = False) -> sqlite3.Connection | None:
        """The connection, opened on first use; None for a log with no file yet, unless `create`
        (only the writer creates one)."""
        if self._connection is not None:
            return self._connection
        if not self.path.is_file():
            if not (self.append and create):
                return None
            self.path.parent.mkdir(parents=True, exist_ok=True)
        try:
            self._connection = _connect(self.path, self.append)
        except sqlite3.DatabaseError:
            if not self.append:
                return None
            # Not a log this version can read (cut short by a crash of the machine, or another file):
            # it is only a cache of checks, so they are made again.
            self.path.replace(self.path.with_name(self.path.name + ".unreadable"))
            self._connection = _connect(self.path, self.append)
        return self._connection

    def _commit_soon(self) -> None:
        if time.monotonic() - self._committed_at >= COMMIT_EVERY_S:
            self._commit()

    def _commit(self) -> None:
        if self._connection is not None and self._connection.in_transaction:
            with naming_a_full_disk(self.path):
                self._connection.commit()
        self._committed_at = time.monotonic()


class UnchangedMediaCheck:
    """`MediaCheckLog.keep_unchanged` of a build's log, going on while the build reads: on one of
    the build's `helpers` (spawned processes) when it has some (a million remembered media are a
    million stat calls, seconds), else here and now. `changed` waits for its answer."""

    def __init__(self, log: MediaCheckLog, helpers: Executor | None) -> None:
        self.log = log
        self._future: Future[str] | None = None
        self._changed = ""
        if helpers is not None:
            self._future = helpers.submit(first_changed_pass, log.path)
        else:
            self._changed = log.first_changed()

    def changed(self) -> str:
        """The first remembered pass whose file changed or vanished, or "": every pass then counts
        as used by this build."""
        if self._future is not None:
            self._changed = self._future.result()
            self._future = None
        if not self._changed:
            self.log.keep_all()
        return self._changed

    def close(self) -> None:
        """Stop waiting for the answer (a build that ends without it)."""
        if self._future is not None:
            self._future.cancel()
            self._future = None


def first_changed_pass(path: Path) -> str:
    """`MediaCheckLog.first_changed` of the log at `path`, read in this process."""
    log = MediaCheckLog(path, append=False)
    try:
        return log.first_changed()
    finally:
        log.close()


def _connect(path: Path, writer: bool) -> sqlite3.Connection:
    connection = sqlite3.connect(path, timeout=BUSY_TIMEOUT_S, check_same_thread=False)
    # The writer's transactions hold passes for COMMIT_EVERY_S; a reader's statements end at once.
    connection.execute("PRAGMA synchronous = NORMAL")
    if writer:
        # Room for the passes of COMMIT_EVERY_S: a transaction that outgrows the cache locks readers out.
        connection.execute("PRAGMA cache_size = -16384")
        connection.execute(_SCHEMA)
        connection.commit()
    else:
        connection.execute("SELECT 1 FROM passes LIMIT 1").fetchall()  # raises DatabaseError if it is no log
    return connection
