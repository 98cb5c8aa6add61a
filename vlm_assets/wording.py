"""Counts in log lines and messages (`1 sample`, `2 samples`) and text shortened for the UI's tables."""

from __future__ import annotations

ELLIPSIS = "…"


def plural(count: int, noun: str, nouns: str | None = None) -> str:
    """`count` and `noun`, or `nouns` (default `noun + "s"`) unless count is 1."""
    return f"{count} {noun if count == 1 else nouns or noun + 's'}"


def shortened(text: str, limit: int) -> str:
    """`text` with its whitespace collapsed, cut after its last whole word within `limit` characters and
    ended with " …"; a word (a path is one) is never cut, so a first word longer than `limit` is kept whole."""
    words = text.split()
    collapsed = " ".join(words)
    if len(collapsed) <= limit:
        return collapsed
    kept = words[0]
    for word in words[1:]:
        if len(kept) + 1 + len(word) + 1 + len(ELLIPSIS) > limit:
            break
        kept += " " + word
    return f"{kept} {ELLIPSIS}"


def md_cell(text: str) -> str:
    """`text` as one markdown table cell: on one line, its pipes escaped so they do not split the row."""
    return " ".join(text.split()).replace("|", "\\|")
