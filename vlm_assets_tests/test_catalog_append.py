"""Lines appended to a JSON-lines source: the catalogue keeps the rows read before and reads only the
new lines, giving the bytes a full read gives; whatever it cannot prove unchanged is read in full."""

from __future__ import annotations

import json
import os
import random
from pathlib import Path

import pytest
from PIL import Image

from vlm_assets.catalog.build import MediaValidator
from vlm_assets.media.checks import MediaCheckLog
from vlm_assets.catalog.table import ROWS_PER_WRITE, write_catalog
from vlm_assets.config import SourceConfig

SETTINGS = "catalogue settings"


def _words(seed: int) -> str:
    # Long, varied texts: the messages column's dictionary fills up, so page boundaries matter.
    rng = random.Random(seed)
    return " ".join(rng.choice(["why", "sky", "blue", "light", "scatter"]) for _ in range(rng.randint(1, 80)))


def _lines(first: int, count: int, ids: bool = True) -> str:
    lines = []
    for number in range(first, first + count):
        record = {"messages": [{"role": "user", "content": "<image>what " * (number % 2) + f"q{number}"},
                               {"role": "assistant", "content": _words(number)}],
                  "images": ["a.jpg"] * (number % 2)}
        if ids:
            record["id"] = f"r{number % 9000}"  # records from 9,000 on repeat earlier ids: rejected duplicates
        lines.append(json.dumps(record))
    return "\n".join(lines) + "\n"


@pytest.fixture
def source(tmp_path) -> SourceConfig:
    Image.new("RGB", (40, 30), (1, 2, 3)).save(tmp_path / "a.jpg")
    body = _lines(0, 10_000).splitlines()
    body[5] = json.dumps({"id": "late", "messages": [{"role": "user", "content": "<image>"}], "images": ["late.jpg"]})
    body[7] = "{not json"
    body[8] = ""  # a blank line: not a record
    (tmp_path / "train.jsonl").write_text("\n".join(body) + "\n")
    return SourceConfig("train", "jsonl", tmp_path / "train.jsonl", tmp_path)


def _build(source: SourceConfig, target: Path, processes: int = 1, mark: bool = True):
    checks = MediaCheckLog(target.with_suffix(".checks.sqlite"))
    return write_catalog(source, target, "messages", MediaValidator(check_log=checks), processes,
                         read_mark=target.with_suffix(".read.json") if mark else None, settings=SETTINGS)


def _full_read(source: SourceConfig, tmp_path: Path) -> bytes:
    _build(source, tmp_path / "full.parquet", mark=False)
    return (tmp_path / "full.parquet").read_bytes()


def test_appended_lines_alone_are_read_and_the_catalogue_is_the_full_reads(source, tmp_path):
    catalog = tmp_path / "catalog.parquet"
    first = _build(source, catalog)
    assert first.kept == 0 and first.read_in_full == "no read mark from an earlier build"
    assert first.samples == 9_999
    # The image a kept reject named arrives with the new lines: that reject is checked again.
    Image.new("RGB", (40, 30), (9, 9, 9)).save(tmp_path / "late.jpg")
    with source.path.open("a") as handle:
        handle.write(_lines(10_000, 600))
    extended = _build(source, catalog, processes=2)
    assert extended.kept == 9_999 and extended.read_in_full == ""
    # Bad JSON; then duplicates: r9000–r9999 but the ids of lines 5, 7 and 8, and all 600 new lines.
    assert extended.samples == 10_599 and extended.rejected == 1 + 997 + 600
    assert catalog.read_bytes() == _full_read(source, tmp_path)
    assert ROWS_PER_WRITE < extended.samples  # the kept rows spanned whole row groups and a partial one

    # A second append extends the extended catalogue.
    with source.path.open("a") as handle:
        handle.write(_lines(20_000, 10))
    assert _build(source, catalog).kept == 10_599
    assert catalog.read_bytes() == _full_read(source, tmp_path)


def _edit_first_line(source: SourceConfig, tmp_path: Path) -> None:
    text = source.path.read_text()
    source.path.write_text(text.replace("q0", "Q0", 1) + _lines(10_000, 5))


def _change_an_image(source: SourceConfig, tmp_path: Path) -> None:
    Image.new("RGB", (40, 30), (200, 0, 0)).save(tmp_path / "a.jpg")
    os.utime(tmp_path / "a.jpg", ns=(1, 1))
    with source.path.open("a") as handle:
        handle.write(_lines(10_000, 5))


def _append_records_without_ids(source: SourceConfig, tmp_path: Path) -> None:
    with source.path.open("a") as handle:
        handle.write(_lines(10_000, 5, ids=False))


def _append_half_a_line(source: SourceConfig, tmp_path: Path) -> None:
    with source.path.open("a") as handle:
        handle.write('{"id": "half", "messages": [')


@pytest.mark.parametrize(("change", "reason", "processes"), [
    (_edit_first_line, "bytes (read before) changed", 1),
    (_change_an_image, "media checked before changed: ", 1),
    # The kept rows' media are checked on a process of their own while the new lines are read: the
    # change is found once they are, and the source is then read again, in full.
    (_change_an_image, "media checked before changed: ", 2),
    (_append_records_without_ids, "change how all records are named", 1),
])
def test_a_catalogue_that_cannot_be_extended_is_read_in_full_and_says_why(source, tmp_path, change, reason, processes):
    catalog = tmp_path / "catalog.parquet"
    _build(source, catalog)
    change(source, tmp_path)
    rebuilt = _build(source, catalog, processes)
    assert rebuilt.kept == 0 and reason in rebuilt.read_in_full
    assert catalog.read_bytes() == _full_read(source, tmp_path)


def test_a_file_ending_in_part_of_a_line_leaves_no_mark_and_is_read_in_full_next_time(source, tmp_path):
    catalog = tmp_path / "catalog.parquet"
    _build(source, catalog)
    _append_half_a_line(source, tmp_path)
    cut = _build(source, catalog)
    assert cut.kept == 9_999 and not catalog.with_suffix(".read.json").exists()
    with source.path.open("a") as handle:
        handle.write('{"role": "user", "content": "hi"}]}\n')
    whole = _build(source, catalog)
    assert whole.kept == 0 and whole.read_in_full == "no read mark from an earlier build"
    assert catalog.read_bytes() == _full_read(source, tmp_path)


def test_an_extension_whose_file_or_new_media_move_while_read_publishes_nothing(source, tmp_path):
    from vlm_assets.catalog.table import SourceChangedError

    catalog = tmp_path / "catalog.parquet"
    _build(source, catalog)
    published = catalog.read_bytes()
    for name in ("new.jpg", "next.jpg"):
        Image.new("RGB", (40, 30), (5, 5, 5)).save(tmp_path / name)
    with source.path.open("a") as handle:
        for number, name in enumerate(["new.jpg", "next.jpg"]):
            handle.write(json.dumps({"id": f"n{number}", "messages": [{"role": "user", "content": "<image>?"}],
                                     "images": [name]}) + "\n")

    class Moving(MediaValidator):
        """Makes a change once the last new medium is checked: the earlier one's was proven then."""

        def __init__(self, change) -> None:
            super().__init__(check_log=MediaCheckLog(catalog.with_suffix(".checks.sqlite")))
            self.change = change

        def error_for(self, ref: str, kind: str) -> str:
            if ref.endswith("next.jpg"):
                self.change()
            return super().error_for(ref, kind)

    def _extend(change) -> None:
        write_catalog(source, catalog, "messages", Moving(change), read_mark=catalog.with_suffix(".read.json"),
                      settings=SETTINGS)

    def grow() -> None:
        with source.path.open("a") as handle:
            handle.write(_lines(20_000, 1))

    with pytest.raises(SourceChangedError, match=r"train.jsonl changed while it was read; nothing was published"):
        _extend(grow)
    assert catalog.read_bytes() == published
    source.path.write_bytes(source.path.read_bytes()[:-len(_lines(20_000, 1))])

    def edit_new_medium() -> None:
        Image.new("RGB", (40, 31), (6, 6, 6)).save(tmp_path / "new.jpg")

    with pytest.raises(SourceChangedError, match=r"changed \(the medium .*new.jpg since it was checked\) while it was read"):
        _extend(edit_new_medium)
    assert catalog.read_bytes() == published

    # Nothing moving: built (in full, the edited medium's earlier pass being remembered) as a full read gives.
    assert _build(source, catalog).samples == 10_001
    assert catalog.read_bytes() == _full_read(source, tmp_path)


# flat_dir sources: record files added after the ones read before.

def _record(name: str, images: list[str] | None) -> dict:
    record = {"messages": [{"role": "user", "content": f"<image>what is {name}?"},
                           {"role": "assistant", "content": _words(len(name))}]}
    if images is not None:
        record["images"] = images
    return record


def _write(folder: Path, name: str, images: list[str] | None = None, image: bool = True) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    if image:
        Image.new("RGB", (20, 20), (len(name), 0, 0)).save(folder / f"{name}.jpg")
    (folder / f"{name}.json").write_text(json.dumps(_record(name, [f"{name}.jpg"] if images is None else images)))


@pytest.fixture
def folder(tmp_path) -> SourceConfig:
    root = tmp_path / "folder"
    for number in range(300):
        _write(root, f"{number:04d}")
    _write(root, "0300", image=False)  # missing image: a reject, checked again on each extension
    _write(root / "0000", "0301", ["shared.jpg"], image=False)  # found in the root, not beside it
    Image.new("RGB", (20, 20)).save(root / "shared.jpg")
    _write(root, "0302", [])  # names no media: takes the file sharing its stem, if any
    _write(root, "0303", ["0303.jpg"])
    (root / "0304.json").write_text("{not json")
    return SourceConfig("folder", "flat_dir", root, root)


def test_added_record_files_alone_are_read_and_the_catalogue_is_the_full_reads(folder, tmp_path):
    catalog = tmp_path / "catalog.parquet"
    first = _build(folder, catalog)
    assert first.samples == 305 and first.rejected == 2
    root = folder.path
    for number in range(305, 400):
        _write(root, f"{number:04d}")
    _write(root / "sub2", "0400")  # a new folder sorting after the files read
    Image.new("RGB", (20, 20)).save(root / "0300.jpg")  # the kept reject's image arrives: now ok
    Image.new("RGB", (20, 20)).save(root / "0000" / "shared.jpg")  # a kept row's name is now ambiguous
    Image.new("RGB", (20, 20)).save(root / "0302.png")  # a media-less record now has a same-stem image
    extended = _build(folder, catalog, processes=2)
    assert extended.kept == 305 and extended.read_in_full == ""
    # 0300 is ok now; 0301's name and 0302's stem are ambiguous; 0304 is still not JSON.
    assert extended.samples == 401 and extended.rejected == 3
    reasons = " ".join(extended.reject_reasons)
    assert "ambiguous media: 'shared.jpg'" in reasons and "several files share its stem (0302.jpg, 0302.png)" in reasons
    assert catalog.read_bytes() == _full_read(folder, tmp_path)

    _write(root / "sub2", "0401")
    assert _build(folder, catalog).kept == 401
    assert catalog.read_bytes() == _full_read(folder, tmp_path)


def _edit_a_record(folder: SourceConfig) -> None:
    (folder.path / "0001.json").write_text(json.dumps(_record("edited", ["0001.jpg"])))
    _write(folder.path, "0500")


def _add_a_file_among_the_read_ones(folder: SourceConfig) -> None:
    _write(folder.path, "0001a")


def _change_an_image_of_the_folder(folder: SourceConfig) -> None:
    Image.new("RGB", (20, 20), (200, 0, 0)).save(folder.path / "0007.jpg")
    os.utime(folder.path / "0007.jpg", ns=(1, 1))
    _write(folder.path, "0500")


@pytest.mark.parametrize(("change", "reason", "processes"), [
    (_edit_a_record, "record files are not the ones read before", 1),
    (_add_a_file_among_the_read_ones, "record files are not the ones read before", 1),
    (_change_an_image_of_the_folder, "media checked before changed: ", 1),
    (_change_an_image_of_the_folder, "media checked before changed: ", 2),
    (lambda folder: None, "no record file was added", 1),
])
def test_a_folder_catalogue_that_cannot_be_extended_is_read_in_full_and_says_why(folder, tmp_path, change, reason,
                                                                                   processes):
    catalog = tmp_path / "catalog.parquet"
    _build(folder, catalog)
    change(folder)
    rebuilt = _build(folder, catalog, processes)
    assert rebuilt.kept == 0 and reason in rebuilt.read_in_full
    assert catalog.read_bytes() == _full_read(folder, tmp_path)
