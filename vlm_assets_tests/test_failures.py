"""A failed step's cause in one line, as `vlm-assets run` and the inbox sensor report it (vlm_assets.defs.failures)."""

from __future__ import annotations

import errno
from collections import Counter

import dagster as dg

from vlm_assets.defs.failures import failure_of, nothing_left

# What a processor that takes no video made of a source of videos, two of them cut short.
REFUSED_VIDEOS = Counter({
    "processor Gemma3Processor takes no video": 9,
    "InvalidDataError: [Errno 1094995529] Invalid data found when processing input: '…/nasa_13013_truncated_half.mp4'": 2,
})


def cause_of_failed_step(raised: Exception) -> str:
    @dg.asset
    def failing() -> None:
        raise raised

    result = dg.materialize([failing], raise_on_error=False)
    [cause] = [cause for cause in map(failure_of, result.all_events) if cause]
    return cause


def test_a_failure_counting_reasons_is_summarised_by_its_first_line_not_an_error_quoted_in_it():
    cause = cause_of_failed_step(nothing_left("hvideos", "token lengths", REFUSED_VIDEOS, ""))
    assert cause == ("hvideos: no sample left after token lengths (11 rejected): 9 × processor Gemma3Processor "
                     "takes no video; 2 × InvalidDataError: [Errno 1094995529] Invalid data found when processing "
                     "input: '…/nasa_13013_truncated_half.mp4'")


def test_an_os_error_is_summarised_as_what_failed_on_which_path():
    cause = cause_of_failed_step(OSError(errno.ENOSPC, "No space left on device", "/data/vlm/lengths/a.parquet"))
    assert cause == "No space left on device: /data/vlm/lengths/a.parquet"


def test_a_medium_changed_since_the_catalogue_is_summarised_by_its_own_message():
    from vlm_assets.media.checks import MediumChanged

    message = "/data/photos/5.png: unreadable since the catalogue was built (FileNotFoundError: No such file or directory)"
    assert cause_of_failed_step(MediumChanged(message)) == message
