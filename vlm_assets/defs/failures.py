"""A failed step's cause in one line, for the CLI's report and the sensors' logs."""

from __future__ import annotations

import re

ERRNO_MESSAGE = re.compile(r"\[Errno \d+\] (?P<reason>[^:']+): '(?P<path>[^']*)'")


def root_cause(error) -> str:
    """One line naming what went wrong: the first of the chained errors that is not Dagster's wrapper."""
    if error is None:
        return "unknown error"
    while error.cause is not None and error.cls_name.startswith("Dagster"):
        error = error.cause
    message = (error.message or "").strip()
    found = ERRNO_MESSAGE.search(message)
    if found:
        return f"{found['reason']}: {found['path']}"
    first = message.splitlines()[0] if message else error.cls_name
    first = re.sub(r"^[\w.]+(Error|Exception|Failure): ", "", first)
    return first if error.cls_name in {"Failure", "ConfigError"} else f"{first} ({error.cls_name})"
