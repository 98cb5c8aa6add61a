"""Coordination between processes that share one `storage.root`: named file locks and liveness.

Locks are POSIX record locks (`fcntl.lockf`), which NFS implements through its lock manager, so
they also hold between machines that mount the same storage. The kernel (or the NFS server, when
a client machine is lost) drops them when their process dies, so a killed writer never blocks
anyone. Lock files live in `<storage.root>/.locks/` and are never part of an output.

POSIX locks belong to the process, not the file descriptor: closing any descriptor of a locked
file releases the process's lock on it. So a process opens each lock file once and keeps it
open for as long as it holds it (re-entrant use shares the descriptor), and never probes a lock
file that it holds itself.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

LOCK_DIR = ".locks"
PROCESS_DIR = "processes"
WAIT_POLL_S = 0.2
WAIT_REPORT_EVERY_S = 30.0


@dataclass
class _Held:
    fd: int
    shared: bool
    count: int


_held: dict[Path, _Held] = {}
_held_guard = threading.RLock()


def _hold_nothing_after_fork() -> None:
    """A forked child holds none of its parent's locks (fcntl locks belong to a process) and is not
    its parent: it starts with no lock and no liveness token of its own (process_token)."""
    global _held_guard
    for held in _held.values():
        os.close(held.fd)
    _held.clear()
    _tokens.clear()
    _held_guard = threading.RLock()


os.register_at_fork(after_in_child=_hold_nothing_after_fork)


def lock_path(root: Path, name: str) -> Path:
    return Path(root) / LOCK_DIR / f"{name.replace('/', '__')}.lock"


def _try_lock(fd: int, shared: bool) -> bool:
    try:
        fcntl.lockf(fd, (fcntl.LOCK_SH if shared else fcntl.LOCK_EX) | fcntl.LOCK_NB)
        return True
    except OSError as error:
        if error.errno in (errno.EACCES, errno.EAGAIN):
            return False
        raise


@contextlib.contextmanager
def file_lock(
    root: Path,
    name: str,
    *,
    shared: bool = False,
    on_wait: Callable[[str], None] | None = None,
) -> Iterator[None]:
    """Hold the lock `name` under `root` (exclusive, or shared with other readers) for the block.

    Waits as long as another process holds it, reporting through `on_wait` every 30 s.
    """
    path = lock_path(root, name)
    with _held_guard:
        held = _held.get(path)
        if held is not None:
            if held.shared and not shared:
                raise RuntimeError(f"lock {name!r} is held shared by this process; it cannot be upgraded")
            held.count += 1
    if held is not None:
        try:
            yield
        finally:
            _release(path)
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        started = reported = time.monotonic()
        while not _try_lock(fd, shared):
            if on_wait is not None and time.monotonic() - reported >= WAIT_REPORT_EVERY_S:
                reported = time.monotonic()
                on_wait(f"waiting {reported - started:.0f} s for {'shared ' if shared else ''}lock {name!r} ({path}), "
                        "held by another run")
            time.sleep(WAIT_POLL_S)
    except BaseException:
        os.close(fd)
        raise
    with _held_guard:
        _held[path] = _Held(fd, shared, 1)
    try:
        yield
    finally:
        _release(path)


def _release(path: Path) -> None:
    with _held_guard:
        held = _held[path]
        held.count -= 1
        if held.count:
            return
        del _held[path]
    os.close(held.fd)  # closing drops the lock


@contextlib.contextmanager
def file_locks(
    root: Path,
    exclusive: Iterable[str] = (),
    shared: Iterable[str] = (),
    on_wait: Callable[[str], None] | None = None,
) -> Iterator[None]:
    """Several locks, always taken in name order, so holders of overlapping sets cannot deadlock.

    Every place that holds more than one lock takes them through here.
    """
    wanted = {name: False for name in exclusive}
    for name in shared:
        wanted.setdefault(name, True)
    with contextlib.ExitStack() as stack:
        for name in sorted(wanted):
            stack.enter_context(file_lock(root, name, shared=wanted[name], on_wait=on_wait))
        yield


# -- liveness ---------------------------------------------------------------------------------

_tokens: dict[Path, Path] = {}


def process_token(root: Path) -> Path:
    """A lock file this process holds until it exits: proof of life for the runs it executes.

    Another process (on any machine that shares `root`) can tell from it whether we are alive
    (`process_alive`); it is released by the kernel when we die, however we die.
    """
    root = Path(root)
    with _held_guard:
        token = _tokens.get(root)
        if token is not None and token.parent.is_dir():
            return token
        directory = root / LOCK_DIR / PROCESS_DIR
        directory.mkdir(parents=True, exist_ok=True)
        token = directory / f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}.lock"
        fd = os.open(token, os.O_RDWR | os.O_CREAT, 0o644)
        fcntl.lockf(fd, fcntl.LOCK_EX)
        _held[token] = _Held(fd, False, 1)
        _tokens[root] = token
        return token


def process_alive(token: Path) -> bool:
    """Whether the process that created `token` (with process_token) still runs."""
    token = Path(token)
    with _held_guard:
        if token in _held:
            return True
    try:
        fd = os.open(token, os.O_RDWR)
    except FileNotFoundError:
        return False
    try:
        return not _try_lock(fd, shared=False)
    finally:
        os.close(fd)


def remove_dead_tokens(root: Path) -> int:
    """Delete the liveness files of processes that are gone; returns how many."""
    directory = Path(root) / LOCK_DIR / PROCESS_DIR
    removed = 0
    for token in directory.glob("*.lock") if directory.is_dir() else []:
        if not process_alive(token):
            token.unlink(missing_ok=True)
            removed += 1
    return removed


def local_writer_gone(host: str, pid: int) -> bool:
    """True when (host, pid) names a process of this machine that no longer runs.

    A writer on another machine cannot be checked from here, so it counts as alive.
    """
    if host != socket.gethostname():
        return False
    if pid == os.getpid():
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    return False


def writer_tag() -> str:
    """`<host>-<pid>`: put into temp names so stale-file cleanup can tell whether the writer is gone."""
    return f"{socket.gethostname()}-{os.getpid()}"


def parse_writer_tag(tag: str) -> tuple[str, int] | None:
    host, _, pid = tag.rpartition("-")
    if not host or not pid.isdigit():
        return None
    return host, int(pid)
