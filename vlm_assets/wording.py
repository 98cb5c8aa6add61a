"""Counts in log lines and messages: `1 sample`, `2 samples`."""

from __future__ import annotations


def plural(count: int, noun: str, nouns: str | None = None) -> str:
    """`count` and `noun`, or `nouns` (default `noun + "s"`) unless count is 1."""
    return f"{count} {noun if count == 1 else nouns or noun + 's'}"
