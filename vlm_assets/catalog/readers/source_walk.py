"""The files below a source directory that a reader may read, and a reason for each one it may not."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from vlm_assets.catalog.media_resolution import SourceScope, is_file, real_path


@dataclass(frozen=True)
class WalkEntry:
    """A file found below a source directory (`path` as reached, `real` its real path), or a reason not to read one."""

    path: Path
    real: Path
    refused: str = ""
    special: bool = False  # exists but is not a regular file (a FIFO, a device, a socket)


class SourceWalk:
    """Files below `root` whose name is `wanted`, sorted by path; names starting with "." are skipped.

    A symlinked folder is followed when its real path stays inside the source's scope and was not
    read already; otherwise it becomes a refused entry saying why (so nothing below it is silently
    missing). A file reached twice (through links) is read once, preferably where it lies; its
    other paths become refused entries. A file whose real path is outside the scope, or that is
    not a regular file, is refused too. `listings` keeps each folder's names (for same-stem media).
    """

    def __init__(self, root: Path, scope: SourceScope, wanted: Callable[[str], bool]) -> None:
        self.scope = scope
        self.wanted = wanted
        self.listings: dict[Path, list[str]] = {}
        self._visited: dict[Path, Path] = {}  # real folder -> the path it was read at
        self._found: list[WalkEntry] = []
        pending: list[tuple[Path, Path]] = [(root, real_path(root))]  # (path as reached, real path)
        links: list[Path] = []  # symlinked folders, followed once every plain folder is read
        self._visited[pending[0][1]] = root
        while pending or links:
            if pending:
                self._read_folder(*pending.pop(), pending, links)
                continue
            link = links.pop(0)
            real = real_path(link)
            if not scope.contains(real):
                self._refuse(link, real, f"symlinked folder {link} leads outside the source: it resolves to {real}, "
                             f"outside {scope.describe()}; not searched for samples (add it to the source's "
                             "allowed_roots to read it)")
            elif real in self._visited:
                self._refuse(link, real, f"symlinked folder {link} is {self._visited[real]} again (to {real}; a link "
                             "loop or a second link to one folder): its samples are read once, there")
            else:
                self._visited[real] = link
                pending.append((link, real))

    def _refuse(self, path: Path, real: Path, reason: str) -> None:
        self._found.append(WalkEntry(path, real, reason))

    def _read_folder(self, folder: Path, real: Path, pending: list[tuple[Path, Path]], links: list[Path]) -> None:
        try:
            with os.scandir(folder) as iterator:
                entries = sorted(iterator, key=lambda entry: entry.name)
        except OSError as error:
            self._refuse(folder, real, f"unreadable folder {folder}: {error}")
            return
        self.listings[folder] = [entry.name for entry in entries]
        for entry in entries:
            if entry.name.startswith("."):
                continue
            path = folder / entry.name
            link = _is_link(entry)
            if not _is_utf8(entry.name) and (_is_dir(entry) or self.wanted(entry.name)):
                # Ids, origins and reasons are UTF-8 text: the entry is named with its bytes escaped.
                spelt = folder / _escaped(entry.name)
                self._refuse(spelt, real / _escaped(entry.name),
                             f"{spelt}: its name is not UTF-8 (its bytes escaped here): rename it to read its samples")
            elif _is_dir(entry):
                if link:
                    links.append(path)
                elif real / entry.name in self._visited:  # below a followed link, already read at another path
                    self._refuse(path, real / entry.name, f"folder {path} is {self._visited[real / entry.name]} again "
                                 "(reached through a symlinked folder): its samples are read once, there")
                else:
                    self._visited[real / entry.name] = path
                    pending.append((path, real / entry.name))
            elif self.wanted(entry.name):
                if link:
                    target = real_path(path)
                    self._found.append(WalkEntry(path, target, special=target.exists() and not is_file(target)))
                else:
                    self._found.append(WalkEntry(path, real / entry.name, special=not _is_regular(entry)))
        links.sort()

    def entries(self) -> list[WalkEntry]:
        first: dict[Path, Path] = {}
        # A file reached at several paths is read at its own path if the walk got there, else at the first.
        for entry in sorted(self._found, key=lambda entry: (entry.path != entry.real, entry.path)):
            if not entry.refused and self.scope.contains(entry.real):
                first.setdefault(entry.real, entry.path)
        result = []
        for entry in sorted(self._found, key=lambda entry: entry.path):
            if entry.refused:
                result.append(entry)
            elif not self.scope.contains(entry.real):
                result.append(WalkEntry(entry.path, entry.real, self.scope.escape_reason(f"file {entry.path}", entry.real)))
            elif entry.special:
                result.append(WalkEntry(entry.path, entry.real, f"{entry.path} is not a regular file"))
            elif first[entry.real] != entry.path:
                result.append(WalkEntry(entry.path, entry.real, (
                    f"file {entry.path} is {first[entry.real]} again (through a symlink): read once, there")))
            else:
                result.append(entry)
        return result


def _is_utf8(name: str) -> bool:
    """Whether a name as os.scandir decodes it was valid UTF-8 (undecodable bytes become lone surrogates)."""
    try:
        name.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _escaped(name: str) -> str:
    return os.fsencode(name).decode("utf-8", "backslashreplace")


def _is_dir(entry: os.DirEntry[str]) -> bool:
    try:
        return entry.is_dir()
    except OSError:
        return False


def _is_link(entry: os.DirEntry[str]) -> bool:
    try:
        return entry.is_symlink()
    except OSError:
        return False


def _is_regular(entry: os.DirEntry[str]) -> bool:
    try:
        return entry.is_file(follow_symlinks=False)
    except OSError:
        return False
