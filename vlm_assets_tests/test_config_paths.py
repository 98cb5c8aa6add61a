"""Config paths are checked at load: storage root, source paths, and that there is a source at all."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from vlm_assets.config import ConfigError, load_config

SOURCE = "sources: [{name: a, kind: jsonl, path: train.jsonl}]\n"


@pytest.fixture
def site(tmp_path: Path) -> Path:
    (tmp_path / "train.jsonl").write_text("")
    return tmp_path


def write(directory: Path, text: str) -> Path:
    path = directory / "cfg.yaml"
    path.write_text(text)
    return path


def refusal(path: Path) -> str:
    with pytest.raises(ConfigError) as error:
        load_config(path)
    return str(error.value)


def test_a_storage_root_that_is_a_file_is_refused(site):
    (site / "taken").write_text("")
    path = write(site, "storage: {root: taken}\n" + SOURCE)
    assert refusal(path) == f"{path}: storage.root: storage.root is not a directory: {site / 'taken'}"


def test_a_storage_root_below_a_file_cannot_be_created(site):
    (site / "taken").write_text("")
    path = write(site, "storage: {root: taken/deeper/data}\n" + SOURCE)
    assert refusal(path) == (
        f"{path}: storage.root: cannot create {site / 'taken/deeper/data'}: {site / 'taken'} is not a directory"
    )


@pytest.mark.skipif(os.geteuid() == 0, reason="root may write to any directory")
def test_a_storage_root_below_a_read_only_directory_cannot_be_created(site):
    locked = site / "locked"
    locked.mkdir(mode=0o555)
    path = write(site, "storage: {root: locked/data}\n" + SOURCE)
    try:
        assert refusal(path) == f"{path}: storage.root: cannot create {locked / 'data'}: {locked} is not writable"
    finally:
        locked.chmod(0o755)


def test_a_missing_storage_root_below_a_writable_directory_is_accepted_and_not_created(site):
    app = load_config(write(site, "storage: {root: new/data}\n" + SOURCE))
    assert app.storage_root == site / "new" / "data"
    assert not (site / "new").exists()


@pytest.mark.parametrize(
    ("source", "key", "missing"),
    [
        ("{name: a, kind: jsonl, path: absent.jsonl}", "sources[1].path", "absent.jsonl"),
        ("{name: a, kind: jsonl, path: train.jsonl, media_root: media}", "sources[1].media_root", "media"),
        ("{name: a, kind: flat_dir, path: /nonexistent/vlm-assets/folder}", "sources[1].path", "/nonexistent/vlm-assets/folder"),
    ],
)
def test_a_missing_source_path_names_file_key_and_path(site, source, key, missing):
    path = write(site, f"sources:\n  - {{name: ok, kind: jsonl, path: train.jsonl}}\n  - {source}\n")
    assert refusal(path) == f"{path}: {key}: {site / missing} does not exist"  # an absolute `missing` stays itself


def test_an_empty_config_file_says_what_to_add(site):
    path = write(site, "")
    message = refusal(path)
    assert message.startswith(f"{path}: the config is empty; add a `sources:` list")


@pytest.mark.parametrize("text", ["storage: {root: out}\n", "sources: []\n", "sources:\n"])
def test_a_config_without_sources_says_what_to_add(site, text):
    path = write(site, text)
    message = refusal(path)
    assert message.startswith(f"{path}: sources: no sources configured; add a `sources:` list, e.g. ")
    assert "or an `inbox:` directory" in message


def test_an_inbox_can_stand_in_for_configured_sources(site):
    app = load_config(write(site, "inbox: ./drop\n"))
    assert app.sources == () and app.inbox == site / "drop"
