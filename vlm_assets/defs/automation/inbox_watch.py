"""When an inbox entry is (re)launched, waits, or is done: the inbox sensor's decision, without Dagster.

An entry is launched once its fingerprint (files, bytes, newest mtime) is the same on two
consecutive ticks (a copy in progress keeps changing it) and, when the config asks for one, its
`_READY` marker exists. It is done only once a run launched for that fingerprint succeeded; a run
that failed is retried on a later tick after a back-off of 1, 2, 4 … ticks (capped), each attempt
under a run key of its own. The outcome of a run is read from the Dagster instance, never assumed,
so a lost cursor falls back on the runs themselves.

The cursor holds one small record per entry present in the inbox (its fingerprint, attempts, and
back-off), so it is bounded by the inbox and drains as entries vanish.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from enum import Enum

from vlm_assets.inbox import INBOX_PREFIX, READY_MARKER, InboxEntry

MAX_BACKOFF_TICKS = 64


def fingerprint_key(entry: InboxEntry) -> str:
    files, size, newest = entry.fingerprint
    return f"{files}f-{size}b-{newest:.6f}"


def backoff_ticks(failed_attempt: int) -> int:
    """Ticks to sit out after attempt `failed_attempt` (1-based) failed: 1, 2, 4 … up to the cap."""
    return min(2 ** (failed_attempt - 1), MAX_BACKOFF_TICKS)


def run_key(name: str, fingerprint: str, attempt: int) -> str:
    """Dagster launches one run per run key, so every attempt has its own; the first keeps the plain form."""
    return f"{name}@{fingerprint}" + (f"#{attempt}" if attempt > 1 else "")


class RunState(Enum):
    IN_PROGRESS = "in progress"
    SUCCEEDED = "succeeded"
    FAILED = "failed"


@dataclass(frozen=True)
class RunOutcome:
    """The newest run launched for an entry, as the Dagster instance reports it."""

    run_id: str
    fingerprint: str
    attempt: int
    state: RunState
    why: str = ""  # for a failed run: the first failure's cause


@dataclass(frozen=True)
class EntryState:
    fingerprint: str  # seen at the last tick
    attempt: int = 0  # runs launched for this fingerprint
    done: bool = False  # a run for this fingerprint succeeded
    retry_in: int | None = None  # after a failed attempt: ticks left before the next one

    def to_json(self) -> dict:
        data: dict = {"fp": self.fingerprint}
        if self.attempt:
            data["attempt"] = self.attempt
        if self.done:
            data["done"] = True
        if self.retry_in is not None:
            data["retry_in"] = self.retry_in
        return data

    @classmethod
    def from_json(cls, data: dict) -> EntryState:
        return cls(str(data["fp"]), int(data.get("attempt", 0)), bool(data.get("done", False)), data.get("retry_in"))


@dataclass(frozen=True)
class InboxCursor:
    entries: dict[str, EntryState] = field(default_factory=dict)  # name -> state, for entries present
    # A cursor of the form {"mark": newest mtime launched, "waiting": {name: fingerprint}} names no
    # built entries: a registered entry no newer than its mark counts as done. Read, never written.
    legacy_mark: float = 0.0

    @classmethod
    def from_json(cls, text: str | None) -> InboxCursor:
        if not text:
            return cls()
        data = json.loads(text)
        if "mark" in data:
            return cls({name: EntryState(key) for name, key in data.get("waiting", {}).items()}, float(data["mark"]))
        return cls({name: EntryState.from_json(state) for name, state in data.get("entries", {}).items()})

    def to_json(self) -> str:
        return json.dumps({"entries": {name: state.to_json() for name, state in self.entries.items()}},
                          sort_keys=True, separators=(",", ":"))


@dataclass(frozen=True)
class Launch:
    entry: InboxEntry
    attempt: int

    @property
    def run_key(self) -> str:
        return run_key(self.entry.source.name, fingerprint_key(self.entry), self.attempt)


@dataclass(frozen=True)
class InboxDecision:
    launches: list[Launch]
    waiting: dict[str, str]  # name -> why it waits (still copying, its run in progress, failed and backing off)
    failed: dict[str, str]  # name -> its failed run and when it is retried (a subset of `waiting`)
    built: list[str]  # entries whose run succeeded since the last tick
    cursor: InboxCursor


def decide(
    entries: list[InboxEntry],
    cursor: InboxCursor,
    registered: set[str],
    require_ready_marker: bool,
    latest_run: Callable[[str], RunOutcome | None],
    interval_s: int,
) -> InboxDecision:
    """Entries to launch now (with their attempt), those waiting (with why), and the next cursor.

    `latest_run(name)` is the newest run launched for an entry (a RunOutcome) or None.
    """
    launches: list[Launch] = []
    waiting: dict[str, str] = {}
    failed: dict[str, str] = {}
    built: list[str] = []
    states: dict[str, EntryState] = {}
    for entry in entries:
        name, key = entry.source.name, fingerprint_key(entry)
        state = cursor.entries.get(name)
        if state is None and name in registered and entry.fingerprint[2] <= cursor.legacy_mark:
            state = EntryState(key, done=True)
        unchanged = state is not None and state.fingerprint == key
        if unchanged and state.done and name in registered:
            states[name] = state
            continue
        if require_ready_marker and not entry.ready_marker:
            states[name] = state if unchanged else EntryState(key)
            waiting[name] = f"no {READY_MARKER} marker yet"
            continue
        if not unchanged or state.done:  # a built entry whose partition was deleted is new again
            states[name] = EntryState(key)
            waiting[name] = "new or still changing; picked up when unchanged at the next tick"
            continue
        run = latest_run(name)
        if run is not None and run.fingerprint == key and run.attempt > state.attempt:
            state = EntryState(key, run.attempt)  # launched under a cursor that was lost
        if state.attempt == 0:
            if run is not None and run.state is RunState.IN_PROGRESS:
                states[name] = state
                waiting[name] = f"run {run.run_id} for its earlier files is still in progress"
            else:
                launches.append(Launch(entry, 1))
                states[name] = EntryState(key, 1)
            continue
        if run is None or run.fingerprint != key or run.attempt != state.attempt:
            states[name] = state
            waiting[name] = f"attempt {state.attempt} requested; its run has not started yet"
        elif run.state is RunState.IN_PROGRESS:
            states[name] = state
            waiting[name] = f"run {run.run_id} (attempt {state.attempt}) in progress"
        elif run.state is RunState.SUCCEEDED:
            states[name] = replace(state, done=True, retry_in=None)
            built.append(name)
        else:
            retry_in = backoff_ticks(state.attempt) if state.retry_in is None else state.retry_in - 1
            if retry_in <= 0:
                launches.append(Launch(entry, state.attempt + 1))
                states[name] = EntryState(key, state.attempt + 1)
            else:
                states[name] = replace(state, retry_in=retry_in)
                failed[name] = waiting[name] = (
                    f"run {run.run_id} failed ({run.why or 'no reason recorded'}); "
                    f"retry {state.attempt + 1} in ~{retry_in * interval_s} s"
                )
    return InboxDecision(launches, waiting, failed, built, InboxCursor(states))


def vanished_sources(entries: list[InboxEntry], registered: set[str], configured: set[str]) -> list[str]:
    """Registered inbox sources (not configured ones) whose entry is no longer in the inbox."""
    present = {entry.source.name for entry in entries}
    return sorted(name for name in registered
                  if name.startswith(INBOX_PREFIX) and name not in configured and name not in present)
