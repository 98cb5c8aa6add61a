"""`vlm-assets demo DIR` over an earlier demo: unchanged files untouched, an edited config kept."""

from __future__ import annotations

from vlm_assets.demo import DEMO_CONFIG, write_demo


def test_writing_the_demo_again_changes_nothing_and_keeps_an_edited_config(tmp_path):
    notes: list[str] = []
    config = write_demo(tmp_path / "demo", notes.append)
    files = {path: path.stat().st_mtime_ns for path in (tmp_path / "demo").rglob("*") if path.is_file()}
    assert len(files) > 30 and config.read_text() == DEMO_CONFIG
    edited = DEMO_CONFIG.replace("max_token_len: 8192", "max_token_len: 4096")
    assert edited != DEMO_CONFIG
    config.write_text(edited)

    notes.clear()
    assert write_demo(tmp_path / "demo", notes.append) == config
    assert config.read_text() == edited
    assert {path: path.stat().st_mtime_ns for path in files if path != config} == {
        path: mtime for path, mtime in files.items() if path != config}
    assert notes[0] == f"demo data: all {len(files) - 1} files already there, none written"
    assert notes[1] == f"kept your edited {config} (delete it to get the demo's own config back)"
    assert not [path for path in (tmp_path / "demo").iterdir() if path.name.startswith(".demo-staging-")]
