"""Progress of long steps: what a step writes (vlm_assets.progress) and what `vlm-assets run` shows of it."""

from __future__ import annotations

import io

from vlm_assets.orchestration.progress_view import ProgressView
from vlm_assets.progress import PROGRESS_DIR_ENV_VAR, ProgressFile, progress_path, read_progress


def test_a_step_writes_its_progress_only_under_vlm_assets_run(tmp_path, monkeypatch):
    monkeypatch.delenv(PROGRESS_DIR_ENV_VAR, raising=False)
    quiet = ProgressFile("sample_lengths", "big", "samples")
    quiet.update(10, 100)
    assert quiet.path is None and not list(tmp_path.iterdir())

    monkeypatch.setenv(PROGRESS_DIR_ENV_VAR, str(tmp_path))
    progress = ProgressFile("sample_lengths", "big", "samples")
    progress.update(10, 100)
    progress.update(20, 100)  # within WRITE_EVERY_S of the first: not written
    recorded = read_progress(progress_path(tmp_path, "sample_lengths", "big"))
    assert (recorded.done, recorded.total, recorded.unit) == (10, 100, "samples")


def test_without_a_terminal_progress_is_a_line_with_rate_and_time_left(tmp_path, monkeypatch):
    monkeypatch.setenv(PROGRESS_DIR_ENV_VAR, str(tmp_path))
    out = io.StringIO()
    view = ProgressView(tmp_path, stream=out, interactive=False, plain_every_s=0)
    node = ("sample_lengths", "big")
    view.refresh([node])  # nothing reported yet: nothing shown
    assert out.getvalue() == ""
    ProgressFile(*node, "samples").update(2000, 5000)
    view.refresh([node])
    line = out.getvalue().strip()
    assert line.startswith("… sample_lengths [big]: 40%") and "2.00k/5.00k" in line and "samples/s" in line and "<" in line
    view.refresh([])  # the step finished: its file goes
    assert not progress_path(tmp_path, *node).exists()


def test_on_a_terminal_each_step_in_flight_has_a_bar_and_lines_print_above_them(tmp_path, monkeypatch):
    monkeypatch.setenv(PROGRESS_DIR_ENV_VAR, str(tmp_path))
    out = io.StringIO()
    view = ProgressView(tmp_path, stream=out, interactive=True)
    echo = view.echo(lambda line: out.write(line + "\n"))
    nodes = [("sample_lengths", "big"), ("frame_cache_shard", "part-00000")]
    ProgressFile(*nodes[0], "samples").update(300, 1200)
    ProgressFile(*nodes[1], "videos").update(3, 8)
    view.refresh(nodes)
    assert set(view.bars) == set(nodes)
    echo("▶ packing_bins [small]")
    view.close()
    text = out.getvalue()
    assert "sample_lengths [big]" in text and "300/1.20k" in text and "frame_cache_shard [part-00000]" in text
    assert "▶ packing_bins [small]" in text
    assert not view.bars and not list(tmp_path.iterdir())
