"""What the UI shows of an asset's metadata: reasons and errors cut only between words, tables narrow
and one row per line, long lists summed up instead of cut."""

import json
from collections import Counter
from pathlib import Path

from vlm_assets_tests.catalog_support import build_catalog
from vlm_assets.catalog.table import REASON_CHARS, reason_kind
from vlm_assets.config import SourceConfig
from vlm_assets.defs.catalog.assets import SHOWN_REASONS, reason_table_md
from vlm_assets.defs.frame_cache.assets import PLAN_ERROR_CHARS, plan_table_md
from vlm_assets.frames.plan import PlannedVideo
from vlm_assets.media.video_probe import VideoError, probe_video
from vlm_assets.packing.mix import MixEntry, mix_table_md
from vlm_assets.wording import ELLIPSIS, md_cell, shortened


def _deep(tmp_path: Path) -> Path:
    folder = tmp_path.joinpath(*(f"a_rather_long_folder_name_{level:02d}" for level in range(6)))
    folder.mkdir(parents=True)
    return folder


def _cut_between_words(short: str, whole: str) -> None:
    """`short` is `whole`'s leading words and an ellipsis: no word of it is cut."""
    assert short.endswith(f" {ELLIPSIS}"), short
    kept = short.removesuffix(f" {ELLIPSIS}").split()
    assert kept == whole.split()[: len(kept)], (short, whole)


def _table_rows(table: str) -> list[list[str]]:
    rows = [line for line in table.splitlines() if line.startswith("|")]
    return [row.removeprefix("| ").removesuffix(" |").split(" | ") for row in rows[2:]]


def test_shortened_keeps_whole_words_and_paths():
    assert shortened("short  reason\n  here", 40) == "short reason here"
    text = "missing media: 'photo.jpg' not found (looked in /data/some/where/deep/inside/a/tree)"
    for limit in range(10, len(text)):
        short = shortened(text, limit)
        _cut_between_words(short, text)
        assert len(short) <= limit or " " not in short.removesuffix(f" {ELLIPSIS}")
    # A first word longer than the limit is kept whole rather than cut inside the path.
    assert shortened("/a/very/long/path/to/file.png: unreadable", 8) == f"/a/very/long/path/to/file.png: {ELLIPSIS}"


def test_md_cell_keeps_a_row_on_one_line():
    assert md_cell("a | b\nc") == "a \\| b c"


def test_catalogue_reasons_are_cut_between_words(tmp_path):
    folder = _deep(tmp_path)
    (folder / "sample.json").write_text(json.dumps(
        {"messages": [{"role": "user", "content": "<image> what is it?"}], "images": ["photo_that_is_not_there.jpg"]}))
    source = SourceConfig("deep", "flat_dir", folder, folder)
    [reason] = build_catalog(source).reason
    assert "missing media" in reason and len(reason) > REASON_CHARS
    kind = reason_kind(reason)
    assert len(kind) <= REASON_CHARS and "[" not in kind  # the origin is left out, as before
    _cut_between_words(kind, reason)


def test_a_reason_kind_keeps_the_brackets_its_error_quotes():
    reason = "unreadable video 'a.mp4': cannot open video: [Errno 1094995529] Invalid data [/data/train.jsonl:7]"
    assert reason_kind(reason) == "unreadable video 'a.mp4': cannot open video: [Errno 1094995529] Invalid data"


def test_reason_table_lists_the_commonest_reasons_whole_and_counts_the_rest():
    reasons = Counter({f"reason number {n}": n + 1 for n in range(SHOWN_REASONS + 5)})
    table = reason_table_md(reasons)
    rows = _table_rows(table)
    assert len(rows) == SHOWN_REASONS
    assert rows[0] == [f"reason number {SHOWN_REASONS + 4}", f"{SHOWN_REASONS + 5}"]
    # The five least common: 1 + 2 + 3 + 4 + 5 samples.
    assert table.splitlines()[-1] == f"{ELLIPSIS} 5 more reasons (15 samples)"
    assert reason_table_md(Counter({"a | b": 2})).splitlines()[2] == "| a \\| b | 2 |"
    assert reason_table_md(Counter()) == "_none_"


def test_plan_table_cuts_a_video_error_between_words(tmp_path):
    video = _deep(tmp_path) / "broken.mp4"
    video.write_bytes(b"\x00not a video" * 200)
    try:
        probe_video(str(video))
        raise AssertionError(f"{video} probed as a video")
    except (VideoError, OSError) as error:
        message = str(error)
    assert len(message) > PLAN_ERROR_CHARS
    planned = PlannedVideo("v1", str(video), ["deep/broken.mp4"], "part-00000", error=message)
    [row] = _table_rows(plan_table_md([planned]))
    assert row[:4] == ["deep/broken.mp4", "part-00000", "0", "0"]
    _cut_between_words(row[4], message)


def test_mix_table_is_six_short_columns_and_names_sources_left_out():
    def entry(source, weight, bins):
        subflavors = {"sample_type": "packed_multi_mix_qa", "source": source, "language": "en"}
        return MixEntry(source, "packed_multi_mix_qa", weight, subflavors, samples=3 * bins, bins=bins, tokens=1000 * bins)

    table = mix_table_md([entry("chat", 1, 10), entry("vqa", 3, 10), entry("spare", 0, 4)])
    lines = table.splitlines()
    assert lines[0] == "| source | weight | samples | bins | % bins | % tokens |"
    assert _table_rows(table) == [
        ["chat", "1", "30", "10", "25.0%", "25.0%"],
        ["vqa", "3", "30", "10", "75.0%", "75.0%"],
        ["spare", "0", "12", "4", "–", "–"],
    ]
    assert lines[-1] == "Weight 0, left out of the blend: spare."
    # The long subflavors are not in the table (the asset gives them as JSON).
    assert "packed_multi_mix_qa" not in table and max(len(line) for line in lines) < 60
