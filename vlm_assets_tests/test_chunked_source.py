"""One big source split into chunks over several processes gives the tables one process gives."""

from __future__ import annotations

import json
import random

import pandas as pd
import pytest
from PIL import Image

from vlm_assets.atomic import write_parquet
from vlm_assets.catalog.build import build_catalog
from vlm_assets.catalog.schema import STATUS_OK
from vlm_assets.config import FrameCacheConfig, ModelConfig, SourceConfig
from vlm_assets.parallel import STEP_PROCESSES_ENV_VAR, step_processes
from vlm_assets.tokens.lengths import LengthCounter, SampleForLength
from vlm_assets.tokens.processor import shared_processor
from vlm_assets.tokens.table import write_length_table

MODEL = ModelConfig(processor_kwargs={"min_pixels": 3136, "max_pixels": 1003520})
FRAME_CACHE = FrameCacheConfig()
CHUNK_ROWS = 32


@pytest.fixture(scope="module")
def catalog(tmp_path_factory):
    """A jsonl source of 150 samples: text only, one or two images of assorted sizes, a few broken."""
    root = tmp_path_factory.mktemp("big_source")
    rng = random.Random(7)
    for number in range(12):
        size = (rng.randint(40, 900), rng.randint(40, 900))
        Image.new("RGB", size, (number * 20, 90, 160)).save(root / f"img{number}.jpg")
    lines = []
    for number in range(150):
        images = [f"img{rng.randrange(12)}.jpg" for _ in range(rng.choice([0, 1, 1, 2]))]
        if number % 37 == 5:
            images = ["missing.jpg"]
        prompt = "<image>" * len(images) + " ".join(["word"] * rng.randint(1, 300))
        lines.append(json.dumps({
            "id": f"s{number}",
            "images": images,
            "messages": [{"role": "user", "content": prompt}, {"role": "assistant", "content": "answer " * number}],
        }))
    (root / "train.jsonl").write_text("\n".join(lines) + "\n")
    source = SourceConfig("big", "jsonl", root / "train.jsonl", root)
    frame = build_catalog(source)
    assert (frame.status != STATUS_OK).sum() == 4 and (frame.status == STATUS_OK).sum() == 146
    path = root / "catalog.parquet"
    write_parquet(frame, path)
    return path


def test_chunked_lengths_on_two_processes_equal_one_process_and_the_whole_source_at_once(catalog, tmp_path):
    one, two = tmp_path / "one.parquet", tmp_path / "two.parquet"
    progress: list[tuple[int, int]] = []
    summary_one = write_length_table(catalog, one, MODEL, FRAME_CACHE, 1, chunk_rows=CHUNK_ROWS)
    summary_two = write_length_table(
        catalog, two, MODEL, FRAME_CACHE, 2, lambda done, total: progress.append((done, total)), chunk_rows=CHUNK_ROWS
    )
    assert summary_two.processes == 2 and summary_one.processes == 1
    assert one.read_bytes() == two.read_bytes()
    assert progress == [(min(done, 150), 150) for done in range(CHUNK_ROWS, 150 + CHUNK_ROWS, CHUNK_ROWS)]

    # Reference: every sample of the source counted in one call, no chunks.
    frame = pd.read_parquet(catalog)
    counter = LengthCounter(shared_processor(MODEL), FRAME_CACHE)
    ok = frame[frame.status == STATUS_OK]
    expected = counter.fast_many([
        SampleForLength(row.sample_id, row.messages, list(row.media_kinds), list(row.media_refs))
        for row in ok.itertuples(index=False)
    ])
    table = pd.read_parquet(two)
    assert table.sample_id.tolist() == frame.sample_id.tolist()
    assert table[table.status == STATUS_OK].token_len.tolist() == [result.token_len for result in expected]
    assert summary_two.ok_token_lens.tolist() == [result.token_len for result in expected]
    rejected = table[table.status != STATUS_OK]
    assert rejected.reason.tolist() == frame[frame.status != STATUS_OK].reason.tolist()
    assert rejected.reason.str.contains("missing.jpg").all()


def test_step_processes_setting(monkeypatch):
    monkeypatch.setenv(STEP_PROCESSES_ENV_VAR, "3")
    assert step_processes() == 3
    for bad in ("0", "many"):
        monkeypatch.setenv(STEP_PROCESSES_ENV_VAR, bad)
        with pytest.raises(ValueError, match=STEP_PROCESSES_ENV_VAR):
            step_processes()
