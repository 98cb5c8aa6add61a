"""Huge images: a source's `max_image_pixels` refuses them from their header, before any decode, and
the exact length path decodes each distinct image of a sample once."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from vlm_assets.catalog.build import MediaValidator
from vlm_assets_tests.catalog_support import build_catalog
from vlm_assets.media.images import decoded_rgb
from vlm_assets.media.checks import MediaCheckLog
from vlm_assets.config import DEFAULT_MAX_IMAGE_PIXELS, ConfigError, FrameCacheConfig, SourceConfig, load_config
from vlm_assets.tokens.lengths import LengthCounter, SampleForLength, oriented_image_size
from vlm_assets.tokens.profile import prove_fast_path

HUGE_SIDE = 12000  # 144 M pixels: 432 MB once decoded as RGB, 0.3 MB as a solid-colour PNG
DECODED_HUGE_MB = HUGE_SIDE * HUGE_SIDE * 3 // 2**20


@pytest.fixture(scope="module")
def huge_png(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("huge") / "huge.png"
    Image.new("RGB", (HUGE_SIDE, HUGE_SIDE), (40, 90, 160)).save(path, compress_level=1)
    return path


def _write_record(folder: Path, name: str, images: list[str]) -> None:
    turns = [{"role": "user", "content": "<image>" * len(images) + "What is this?"},
             {"role": "assistant", "content": "A colour."}]
    (folder / f"{name}.json").write_text(json.dumps({"messages": turns, "images": images} if images else {"messages": turns}))


def _huge_source(folder: Path, huge_png: Path) -> Path:
    folder.mkdir(exist_ok=True)
    os.link(huge_png, folder / "huge.png")
    Image.new("RGB", (64, 48), (200, 10, 10)).save(folder / "small.png")
    _write_record(folder, "huge", ["huge.png"] * 4)
    _write_record(folder, "mixed", ["small.png", "huge.png"])
    _write_record(folder, "small", ["small.png"])
    _write_record(folder, "text", [])
    return folder


def test_an_image_above_the_limit_is_a_rejected_row_and_the_rest_of_the_source_is_catalogued(tmp_path, huge_png):
    folder = _huge_source(tmp_path / "s", huge_png)
    validator = MediaValidator()
    frame = build_catalog(SourceConfig("s", "flat_dir", folder, folder), validator=validator)
    rows = {row.sample_id: row for row in frame.itertuples()}
    assert {sample: row.status for sample, row in rows.items()} == {
        "s/huge.json": "rejected", "s/mixed.json": "rejected", "s/small.json": "ok", "s/text.json": "ok"}
    too_large = (f"image 'huge.png' 12000×12000 (144,000,000 pixels) is above sources[].max_image_pixels (40,000,000): "
                 f"{folder / 'huge.png'}")
    assert rows["s/huge.json"].reason == f"{too_large} [{folder / 'huge.json'}]"
    assert rows["s/mixed.json"].reason == f"{too_large} [{folder / 'mixed.json'}]"
    assert validator.decoded == 1  # small.png; huge.png was measured from its header only


def test_cataloguing_a_sample_naming_a_huge_image_four_times_never_decodes_it(tmp_path, huge_png):
    folder = _huge_source(tmp_path / "s", huge_png)
    # Pillow's own decompression-bomb warning would fire at 89 M pixels: it must not (our limit replaces it).
    script = (
        "import sys, warnings\n"
        "from pathlib import Path\n"
        "from PIL import Image\n"
        "warnings.simplefilter('error', Image.DecompressionBombWarning)\n"
        "from vlm_assets_tests.catalog_support import build_catalog\n"
        "from vlm_assets.config import SourceConfig\n"
        "folder = Path(sys.argv[1])\n"
        "frame = build_catalog(SourceConfig('s', 'flat_dir', folder, folder))\n"
        "assert list(frame.status) == ['rejected', 'rejected', 'ok', 'ok'], list(frame.reason)\n"
        "print([int(line.split()[1]) for line in open('/proc/self/status') if line.startswith('VmHWM:')][0] // 1024)\n"
    )
    done = subprocess.run([sys.executable, "-c", script, str(folder)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    peak_mb = int(done.stdout.split()[-1])
    assert peak_mb < DECODED_HUGE_MB, f"cataloguing peaked at {peak_mb} MB: the image was decoded"


def test_max_image_pixels_is_per_source_and_a_lower_limit_checks_remembered_images_again(tmp_path):
    folder = tmp_path / "s"
    folder.mkdir()
    Image.new("RGB", (300, 200), (10, 20, 30)).save(folder / "a.png")
    _write_record(folder, "a", ["a.png"])
    log = tmp_path / "checks.sqlite"

    def build(limit: int) -> tuple[str, str, MediaValidator]:
        validator = MediaValidator(check_log=MediaCheckLog(log))
        row = build_catalog(SourceConfig("s", "flat_dir", folder, folder, max_image_pixels=limit), validator=validator).iloc[0]
        return row.status, row.reason, validator

    status, _, validator = build(60_000)  # exactly 300 × 200: at the limit is within it
    assert (status, validator.decoded) == ("ok", 1)
    status, _, validator = build(60_000)
    assert (status, validator.decoded, validator.remembered) == ("ok", 0, 1)
    status, reason, validator = build(59_999)  # remembered as passing a higher limit: not good enough
    assert (status, validator.decoded, validator.remembered) == ("rejected", 0, 0)
    assert reason.startswith("image 'a.png' 300×200 (60,000 pixels) is above sources[].max_image_pixels (59,999): ")


def test_a_limit_above_pillows_own_guard_is_honoured_and_below_it_our_reason_stands(tmp_path):
    folder = tmp_path / "s"
    folder.mkdir()
    Image.new("1", (14000, 13000), 1).save(folder / "bomb.png")  # 182 M pixels: past Pillow's error threshold
    _write_record(folder, "bomb", ["bomb.png"])
    refused = build_catalog(SourceConfig("s", "flat_dir", folder, folder)).iloc[0]
    assert refused.status == "rejected"
    assert refused.reason.startswith("image 'bomb.png' 14000×13000 (182,000,000 pixels) is above sources[].max_image_pixels")
    accepted = build_catalog(SourceConfig("s", "flat_dir", folder, folder, max_image_pixels=200_000_000)).iloc[0]
    assert (accepted.status, accepted.reason) == ("ok", "")
    assert oriented_image_size(str(folder / "bomb.png")) == (13000, 14000)  # the fast path's header read


def test_max_image_pixels_is_validated_naming_the_key(tmp_path):
    (tmp_path / "data").mkdir()
    base = "storage: {root: ./out}\nsources:\n  - {name: s, kind: flat_dir, path: ./data%s}\n"
    for setting, message in {
        "max_image_pixels: 0": r"sources\[0\]\.max_image_pixels: must be >= 1, got 0",
        "max_image_pixels: lots": r"sources\[0\]\.max_image_pixels: expected an integer, got 'lots'",
        "max_image_pixels: true": r"sources\[0\]\.max_image_pixels: expected an integer, got True",
        "max_image_pixels: 1.5e7": r"sources\[0\]\.max_image_pixels: expected an integer",
    }.items():
        (tmp_path / "c.yaml").write_text(base % f", {setting}")
        with pytest.raises(ConfigError, match=message) as error:
            load_config(tmp_path / "c.yaml")
        assert str(tmp_path / "c.yaml") in str(error.value)
    (tmp_path / "c.yaml").write_text(base % ", max_image_pixels: 1000")
    assert load_config(tmp_path / "c.yaml").sources[0].max_image_pixels == 1000
    (tmp_path / "c.yaml").write_text(base % "")
    assert load_config(tmp_path / "c.yaml").sources[0].max_image_pixels == DEFAULT_MAX_IMAGE_PIXELS


# -- the exact length path ------------------------------------------------------------------------

_watched: list[str] = []  # paths whose opens are counted while a test watches
_opens: list[str] = []


def _count_opens(event: str, args: tuple) -> None:
    if _watched and event == "open" and isinstance(args[0], str) and args[0] in _watched:
        _opens.append(args[0])


sys.addaudithook(_count_opens)  # audit hooks cannot be removed; it is inert unless a test fills _watched


def test_the_exact_path_decodes_a_file_named_several_times_once(tmp_path, processor):
    first, second = str(tmp_path / "a.png"), str(tmp_path / "b.jpg")
    Image.new("RGB", (300, 200), (10, 120, 30)).save(first)
    Image.new("RGB", (120, 90), (200, 20, 30)).save(second)
    refs = [first, second, first, first]
    sample = SampleForLength("s/1", json.dumps([{"role": "user", "content": "<image>" * 4 + "What?"}]),
                             ["image"] * 4, refs)
    counter = LengthCounter(processor, FrameCacheConfig(), modalities=prove_fast_path(processor, FrameCacheConfig()))
    _watched.extend(refs)
    try:
        exact = counter.exact(sample)
    finally:
        opened = list(_opens)
        _watched.clear()
        _opens.clear()
    assert sorted(opened) == sorted([first, second])
    assert exact.status == "ok"
    assert exact.image_tokens == 3 * counter.image_tokens(first) + counter.image_tokens(second)
    assert counter.count([sample]) == [exact]  # the fast path, from headers, agrees


def test_images_decode_as_transformers_load_image_loads_them(tmp_path, shared_data):
    from transformers.image_utils import load_image

    images = shared_data / "Pillow/Tests/images"
    paths = [images / name for name in ("hopper.gif", "pil123p.png", "pil123rgba.png", "pil_sample_cmyk.jpg",
                                        "hopper_orientation_3.jpg", "hopper_orientation_6.jpg", "transparent.webp")]
    rotated = tmp_path / "rotated.jpg"
    exif = Image.Exif()
    exif[0x0112] = 8  # displayed turned a quarter: 40 × 24 stored, 24 × 40 shown
    gradient = np.arange(40 * 24, dtype=np.uint8).reshape(24, 40)
    Image.fromarray(gradient, "L").save(rotated, exif=exif)
    for path in [*paths, rotated]:
        ours, theirs = decoded_rgb(str(path)), load_image(Image.open(path))
        assert ours.mode == theirs.mode == "RGB" and ours.size == theirs.size, path
        assert np.array_equal(np.asarray(ours), np.asarray(theirs)), path
    assert decoded_rgb(str(rotated)).size == (24, 40)
