"""Progress bars of `vlm-assets run`: one per step in flight that reports its progress (vlm_assets.progress).

On a terminal, tqdm draws a bar per step with its rate and time left, and the CLI's own lines are
written above the bars. Elsewhere (a log file, CI, a terminal of unknown width) a step's progress
is one line every PLAIN_EVERY_S seconds, in tqdm's wording.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TextIO

from tqdm import tqdm

from vlm_assets.orchestration.task import label
from vlm_assets.progress import Progress, progress_path, read_progress

PLAIN_EVERY_S = 30.0

Node = tuple[str, "str | None"]


def _terminal_width(stream: TextIO) -> int:
    """Columns of the terminal `stream` writes to; 0 for none, or one that does not say (tqdm draws nothing there)."""
    try:
        return os.get_terminal_size(stream.fileno()).columns if stream.isatty() else 0
    except (OSError, ValueError, AttributeError):
        return 0


class ProgressView:
    def __init__(self, directory: Path, stream: TextIO = sys.stdout, interactive: bool | None = None,
                 plain_every_s: float = PLAIN_EVERY_S) -> None:
        self.directory, self.stream, self.plain_every_s = directory, stream, plain_every_s
        self.interactive = _terminal_width(stream) > 0 if interactive is None else interactive
        self.bars: dict[Node, tqdm] = {}
        self.started: dict[Node, float] = {}
        self.printed_at: dict[Node, float] = {}

    def echo(self, print_line: Callable[[str], None]) -> Callable[[str], None]:
        """`print_line`, clearing the bars around each line while any is drawn."""
        def write(line: str) -> None:
            if self.bars:
                tqdm.write(line, file=self.stream)
            else:
                print_line(line)
        return write

    def refresh(self, in_flight: Iterable[Node]) -> None:
        current = set(in_flight)
        for node in [node for node in self.started if node not in current]:
            self._finish(node)
        for node in current:
            self.started.setdefault(node, time.monotonic())
            progress = read_progress(progress_path(self.directory, *node))
            if progress is not None:
                self._show(node, progress)

    def close(self) -> None:
        for node in list(self.started):
            self._finish(node)

    def _show(self, node: Node, progress: Progress) -> None:
        if self.interactive:
            bar = self.bars.get(node)
            if bar is None:
                bar = self.bars[node] = tqdm(desc=label(*node), total=progress.total, unit=f" {progress.unit}", unit_scale=True,
                                             file=self.stream, leave=False, dynamic_ncols=True)
            bar.total = progress.total
            bar.update(progress.done - bar.n)
            return
        now = time.monotonic()
        if now - self.printed_at.get(node, self.started[node]) >= self.plain_every_s:
            self.printed_at[node] = now
            meter = tqdm.format_meter(progress.done, progress.total, now - self.started[node], unit=f" {progress.unit}",
                                      unit_scale=True, ncols=0)
            print(f"  … {label(*node)}: {meter.strip()}", file=self.stream, flush=True)

    def _finish(self, node: Node) -> None:
        bar = self.bars.pop(node, None)
        if bar is not None:
            bar.close()
        self.started.pop(node, None)
        self.printed_at.pop(node, None)
        progress_path(self.directory, *node).unlink(missing_ok=True)
