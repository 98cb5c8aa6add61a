"""Types for the CLIs' numeric options. argparse names a type that refuses a value by its function's
name (`invalid _positive_int value: 'abc'`); these say what the option expects instead."""

from __future__ import annotations

import argparse
from collections.abc import Callable


def whole_number(minimum: int | None = None) -> Callable[[str], int]:
    """An argparse `type` accepting whole numbers of at least `minimum` (any, when None)."""
    expected = "a whole number" if minimum is None else f"a whole number ≥ {minimum}"

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}") from None
        if minimum is not None and value < minimum:
            raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}")
        return value

    return parse
