"""A hostile corpus: nothing outside a source's allowed roots is opened, every input record is one row.

The corpus is built in tmp_path: media named by absolute path in and out of the source, symlinks
(named, same-stem, chained, to a record file) in and out, deeply nested and oversized records,
a WebDataset tar holding one key twice and a link member, JSONL with repeated ids, a JSON array
with a bad element, and symlinked sub-folders in, out and looping. An audit hook records every
file the process opens below the forbidden directory, so "never opened" is observed, not assumed.
"""

from __future__ import annotations

import io
import json
import re
import os
import sys
import tarfile
from pathlib import Path

import dagster as dg
import pandas as pd
import pytest
from PIL import Image

from vlm_assets_tests.catalog_support import build_catalog
from vlm_assets.config import ConfigError, SourceConfig, load_config
from vlm_assets.defs.catalog.assets import sample_catalog
from vlm_assets.defs.resources import SOURCES_PARTITIONS, VlmConfig
from vlm_assets.layout import StorageLayout

DEEP = "[" * 500_000  # far past any parser's recursion limit
RECORD_LIMIT = 600_000  # max_record_bytes of the corpus' sources: above DEEP, so depth is what refuses it


# -- watching what is opened -------------------------------------------------------------------

_forbidden: list[Path] = []  # directories no read may touch while a test watches
_opened: list[str] = []


def _audit(event: str, args: tuple) -> None:
    if not _forbidden or event not in ("open", "os.scandir", "os.listdir"):
        return
    target = args[0] if args else None
    if isinstance(target, bytes):
        target = os.fsdecode(target)
    if isinstance(target, (str, os.PathLike)):
        path = Path(os.path.abspath(target))
        if any(path.is_relative_to(root) for root in _forbidden):
            _opened.append(f"{event} {path}")


sys.addaudithook(_audit)  # audit hooks cannot be removed; it is inert unless a test sets _forbidden


@pytest.fixture
def watch_outside():
    """Call with directories; at the end the test fails if anything below them was opened or listed."""

    def watch(*directories: Path) -> None:
        _forbidden.extend(Path(os.path.realpath(directory)) for directory in directories)

    yield watch
    opened = list(_opened)
    _forbidden.clear()
    _opened.clear()
    assert not opened, f"files outside the allowed roots were read: {opened}"


# -- the corpus --------------------------------------------------------------------------------

def _jpeg(path: Path, shade: int = 90) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new("RGB", (32, 24), (shade, 120, 200)).save(path, "JPEG")
    return path


def _sample(media: list[str] | None = None, **extra) -> dict:
    record = {"messages": [{"role": "user", "content": "What is this?"}, {"role": "assistant", "content": "A colour."}]}
    if media is not None:
        record["images"] = media
    return {**record, **extra}


def _write(path: Path, record) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(record if isinstance(record, str) else json.dumps(record))


def _tar(path: Path, members: list[tuple[str, bytes | str]]) -> None:
    """`members`: (name, bytes) for a regular file, (name, "->target") for a symbolic link."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with tarfile.open(path, "w") as archive:
        for name, data in members:
            info = tarfile.TarInfo(name)
            if isinstance(data, str):
                info.type, info.linkname = tarfile.SYMTYPE, data[2:]
                archive.addfile(info)
            else:
                info.size = len(data)
                archive.addfile(info, io.BytesIO(data))


@pytest.fixture
def corpus(tmp_path):
    """Three sources and their config; `outside` holds what no source may read."""
    outside = tmp_path / "outside"
    secret = _jpeg(outside / "secret.jpg", 10)
    _write(outside / "dir" / "a.json", _sample())
    allowed = tmp_path / "allowed"
    pic = _jpeg(allowed / "pic.jpg", 50)
    _write(allowed / "more" / "m.json", _sample())
    _jpeg(allowed / "more" / "m.jpg")

    flat = tmp_path / "flat"
    inside = _jpeg(flat / "in.jpg")
    _write(flat / "abs_in.json", _sample([str(inside)]))
    _write(flat / "abs_out.json", _sample([str(secret)]))
    _write(flat / "abs_allowed.json", _sample([str(pic)]))
    _write(flat / "dotdot.json", _sample(["../outside/secret.jpg"]))
    (flat / "link_in.jpg").symlink_to(inside)
    _write(flat / "named_link_in.json", _sample(["link_in.jpg"]))
    (flat / "link_out.jpg").symlink_to(secret)
    _write(flat / "named_link_out.json", _sample(["link_out.jpg"]))
    (flat / "hop.jpg").symlink_to("link_out.jpg")  # a chain: hop -> link_out -> outside
    _write(flat / "hop.json", _sample(["hop.jpg"]))
    (flat / "stem_in.jpg").symlink_to(inside)
    _write(flat / "stem_in.json", _sample())
    (flat / "stem_out.jpg").symlink_to(secret)
    _write(flat / "stem_out.json", _sample())
    (flat / "leak.json").symlink_to(outside / "dir" / "a.json")
    _write(flat / "deep.json", DEEP)
    _write(flat / "big.json", _sample([], padding="x" * RECORD_LIMIT))
    _write(flat / "sub" / "s.json", _sample())
    (flat / "alias").symlink_to("sub")
    (flat / "more").symlink_to(allowed / "more")
    (flat / "away").symlink_to(outside / "dir")
    (flat / "loop").symlink_to(".")

    jdir = tmp_path / "jsonl"
    media = jdir / "media"
    _jpeg(media / "x.jpg")
    lines = [
        json.dumps(_sample(["x.jpg"], id="a")),
        json.dumps(_sample(["x.jpg"], id="b")),
        json.dumps(_sample(["x.jpg"], id="a")),  # the same id again
        DEEP,
        json.dumps(_sample(["x.jpg"], id="c", padding="y" * RECORD_LIMIT)),
        json.dumps(_sample([str(secret)], id="d")),
        "",
        json.dumps(_sample(["x.jpg"], id=7)),
    ]
    (jdir / "manifest.jsonl").write_text("\n".join(lines) + "\n")
    elements = [json.dumps(_sample(["x.jpg"])), "[" * 2000 + "]" * 2000, json.dumps(_sample(["x.jpg"]))]
    (jdir / "array.json").write_text("[" + ",\n".join(elements) + "]")

    wds = tmp_path / "wds"
    image = (flat / "in.jpg").read_bytes()

    def caption(text: str) -> bytes:
        return json.dumps({"texts": text}).encode()

    _tar(wds / "pretrain-000000.tar", [
        ("k1.jpg", image), ("k1.json", caption("first")),
        ("k1.jpg", image), ("k1.json", caption("second")),  # the same key again
        ("k2.jpg", image), ("k2.json", caption("fine")),
        ("k3.jpg", f"->{secret}"), ("k3.json", caption("a link member")),
        ("k4.jpg", image), ("k4.json", DEEP.encode()),
    ])
    _tar(outside / "evil.tar", [("e1.jpg", image), ("e1.json", caption("outside"))])
    (wds / "pretrain-000001.tar").symlink_to(outside / "evil.tar")

    config = tmp_path / "vlm_assets.yaml"
    config.write_text(f"""
storage: {{root: {tmp_path / "out"}}}
sources:
  - {{name: flat, kind: flat_dir, path: ./flat, allowed_roots: [./allowed], max_record_bytes: {RECORD_LIMIT}}}
  - {{name: jl, kind: jsonl, path: ./jsonl/manifest.jsonl, media_root: ./jsonl/media, max_record_bytes: {RECORD_LIMIT}}}
  - {{name: arr, kind: jsonl, path: ./jsonl/array.json, media_root: ./jsonl/media}}
  - {{name: w, kind: wds, path: ./wds}}
""")
    return {"config": config, "outside": outside, "secret": secret, "allowed": allowed, "flat": flat, "jdir": jdir, "wds": wds}


def _rows(source: SourceConfig) -> dict[str, tuple[str, str]]:
    frame = build_catalog(source)
    assert frame.sample_id.is_unique
    return {row.sample_id: (row.status, row.reason) for row in frame.itertuples()}


def _content_id(rows: dict[str, tuple[str, str]], source: str) -> str:
    """The one id of the rows that is a record's content digest with no repeat number (an id-less record's)."""
    [found] = [sample_id for sample_id in rows if re.fullmatch(rf"{source}/[0-9a-f]{{16}}", sample_id)]
    return found


def _expect(rows: dict[str, tuple[str, str]], expected: dict[str, tuple[str, ...]]) -> None:
    """`expected`: sample id -> ("ok",) or ("rejected", substrings the reason must contain)."""
    assert sorted(rows) == sorted(expected)  # every input record is a row, and nothing else is
    for sample_id, (status, *phrases) in expected.items():
        got_status, reason = rows[sample_id]
        assert got_status == status, (sample_id, reason)
        for phrase in phrases:
            assert phrase in reason, (sample_id, phrase, reason)


# -- the cases ---------------------------------------------------------------------------------

def test_flat_dir_reads_nothing_outside_and_accounts_for_every_file(corpus, watch_outside):
    watch_outside(corpus["outside"])
    app = load_config(corpus["config"])
    rows = _rows(app.source("flat"))
    flat, outside, secret = corpus["flat"], corpus["outside"], str(corpus["secret"])
    _expect(rows, {
        "flat/abs_in.json": ("ok",),
        "flat/abs_out.json": ("rejected", "escapes the source", secret, "allowed_roots"),
        "flat/abs_allowed.json": ("ok",),
        "flat/dotdot.json": ("rejected", "escapes the source", secret),
        "flat/named_link_in.json": ("ok",),
        "flat/named_link_out.json": ("rejected", "'link_out.jpg'", secret),
        "flat/hop.json": ("rejected", "'hop.jpg'", secret),
        "flat/stem_in.json": ("ok",),
        "flat/stem_out.json": ("rejected", "'stem_out.jpg'", secret),
        "flat/leak.json": ("rejected", str(flat / "leak.json"), str(outside / "dir" / "a.json")),
        "flat/deep.json": ("rejected", "nested too deeply", str(flat / "deep.json"), "max_json_depth (100)"),
        "flat/big.json": ("rejected", "record too large", str(flat / "big.json"), f"max_record_bytes ({RECORD_LIMIT})"),
        "flat/sub/s.json": ("ok",),
        "flat/alias": ("rejected", "symlinked folder", str(flat / "sub")),
        "flat/more/m.json": ("ok",),  # a symlinked folder into an allowed root is followed
        "flat/away": ("rejected", "symlinked folder", str(outside / "dir"), "not searched"),
        "flat/loop": ("rejected", "symlinked folder", "link loop"),
    })
    catalog = build_catalog(app.source("flat")).set_index("sample_id")
    assert list(catalog.at["flat/stem_in.json", "media_refs"]) == [str(flat / "in.jpg")]
    assert list(catalog.at["flat/more/m.json", "media_refs"]) == [str(corpus["allowed"] / "more" / "m.jpg")]
    assert [key.endswith("allowed/pic.jpg") for key in catalog.at["flat/abs_allowed.json", "media_keys"]] == [True]


def test_jsonl_bad_lines_fail_alone_and_repeated_ids_are_rejected_rows(corpus, watch_outside):
    watch_outside(corpus["outside"])
    manifest = corpus["jdir"] / "manifest.jsonl"
    rows = _rows(load_config(corpus["config"]).source("jl"))
    _expect(rows, {
        "jl/a": ("ok",),
        "jl/b": ("ok",),
        "jl/a#dup2": ("rejected", "duplicate sample id 'jl/a'", f"first read from {manifest}:1", f"{manifest}:3"),
        "jl/line-4": ("rejected", "nested too deeply", f"{manifest}:4"),
        "jl/line-5": ("rejected", "record too large", f"{manifest}:5", f"max_record_bytes ({RECORD_LIMIT})"),
        "jl/d": ("rejected", "escapes the source", str(corpus["secret"])),
        "jl/7": ("ok",),
    })


def test_json_array_element_fails_alone(corpus):
    rows = _rows(load_config(corpus["config"]).source("arr"))
    array = corpus["jdir"] / "array.json"
    ok = sorted(sample_id for sample_id, (status, _) in rows.items() if status == "ok")
    assert ok == [_content_id(rows, "arr"), f"{_content_id(rows, 'arr')}-2"], ok  # two equal records, named by content
    _expect(rows, {ok[0]: ("ok",), "arr/element-1": ("rejected", "nested too deeply", f"{array}[1]"), ok[1]: ("ok",)})


def test_broken_json_array_keeps_the_elements_before_and_around_the_damage(tmp_path):
    good = json.dumps(_sample())
    (tmp_path / "a.json").write_text(f'[{good}, {{"messages": [1,, 2]}}, {good}, {{"unclosed": [')
    rows = _rows(SourceConfig("a", "jsonl", tmp_path / "a.json", tmp_path))
    first = _content_id(rows, "a")
    _expect(rows, {
        first: ("ok",),
        "a/element-1": ("rejected", "malformed JSON", f"{tmp_path / 'a.json'}[1]"),
        f"{first}-2": ("ok",),  # the same record again: the same content id, numbered
        "a/element-3": ("rejected", "malformed JSON array", "never closed"),
    })


def test_wds_repeated_key_link_member_and_outside_shard_are_rejected_rows(corpus, watch_outside):
    watch_outside(corpus["outside"])
    shard = corpus["wds"] / "pretrain-000000.tar"
    rows = _rows(load_config(corpus["config"]).source("w"))
    _expect(rows, {
        "w/k1": ("ok",),
        "w/k1#dup1": ("rejected", "duplicate sample id 'w/k1'", f"first read from {shard}:k1", f"{shard}:k1#2"),
        "w/k2": ("ok",),
        "w/k3": ("rejected", "'k3.jpg'", "symbolic link", str(corpus["secret"])),
        "w/k4": ("rejected", "nested too deeply", f"{shard}:k4.json"),
        "w/pretrain-000001.tar": ("rejected", "escapes the source", str(corpus["outside"] / "evil.tar")),
    })
    first = build_catalog(load_config(corpus["config"]).source("w")).set_index("sample_id").loc["w/k1"]
    assert json.loads(first.messages)[-1]["content"] == "first"


def test_the_default_limits_refuse_hostile_records(tmp_path):
    """Without any limit configured, a 500,000-level record is one rejected row; its neighbours are kept."""
    _jpeg(tmp_path / "ok.jpg")
    _write(tmp_path / "ok.json", _sample())
    _write(tmp_path / "deep.json", DEEP)
    unclosed = '{"texts": "' + '\\"' * 200_000  # a string never closed: the depth scan must not retry at each quote
    (tmp_path / "lines.jsonl").write_text(f"{json.dumps(_sample())}\n{DEEP}\n{unclosed}\n{json.dumps(_sample())}\n")
    flat = _rows(SourceConfig("f", "flat_dir", tmp_path, tmp_path))
    _expect(flat, {"f/ok.json": ("ok",), "f/deep.json": ("rejected", "nested too deeply", "max_json_depth (100)")})
    lines = _rows(SourceConfig("l", "jsonl", tmp_path / "lines.jsonl", tmp_path))
    first = _content_id(lines, "l")
    _expect(lines, {
        first: ("ok",),
        "l/line-2": ("rejected", "nested too deeply", f"{tmp_path / 'lines.jsonl'}:2"),
        "l/line-3": ("rejected", "malformed JSON", "Unterminated string", f"{tmp_path / 'lines.jsonl'}:3"),
        f"{first}-2": ("ok",),
    })


def test_sample_catalog_asset_accounts_for_every_record(corpus, watch_outside):
    """Materialised through Dagster: the rows written are every input record, the rejects counted in the UI."""
    watch_outside(corpus["outside"])
    vlm_config = VlmConfig(config_path=str(corpus["config"]))
    instance = dg.DagsterInstance.ephemeral()
    names = ["flat", "jl", "arr", "w"]
    instance.add_dynamic_partitions(SOURCES_PARTITIONS.name, names)
    inputs = {"flat": 17, "jl": 7, "arr": 3, "w": 6}  # files + folder links, non-blank lines, elements, samples + shards
    layout = StorageLayout(corpus["config"].parent / "out")
    for name in names:
        result = dg.materialize([sample_catalog], partition_key=name, instance=instance, resources={"vlm_config": vlm_config})
        assert result.success
        metadata = result.asset_materializations_for_node("sample_catalog")[0].metadata
        catalog = pd.read_parquet(layout.catalog(name))
        assert len(catalog) == metadata["samples"].value == inputs[name]
        assert metadata["ok"].value + metadata["rejected"].value == inputs[name]
        assert catalog.sample_id.is_unique
    assert "duplicate sample id" in result.asset_materializations_for_node("sample_catalog")[0].metadata["rejects_by_reason"].value


def test_input_limit_keys_are_validated_naming_the_key(tmp_path):
    (tmp_path / "data").mkdir()
    base = "storage: {root: ./out}\nsources:\n  - {name: s, kind: flat_dir, path: ./data, %s}\n"
    cases = {
        "allowed_roots: ./data": "sources[0].allowed_roots: expected a list",
        "allowed_roots: [./nowhere]": "sources[0].allowed_roots[0]:",
        "allowed_roots: [3]": "sources[0].allowed_roots[0]: expected a directory path",
        "max_record_bytes: 0": "sources[0].max_record_bytes: must be >= 1",
        "max_record_bytes: big": "sources[0].max_record_bytes: expected an integer",
        "max_json_depth: 100000": "sources[0].max_json_depth: must be <= 500",
    }
    for setting, message in cases.items():
        (tmp_path / "c.yaml").write_text(base % setting)
        with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("]", r"\]")):
            load_config(tmp_path / "c.yaml")
    (tmp_path / "c.yaml").write_text(base % "allowed_roots: [./data], max_record_bytes: 10, max_json_depth: 5")
    source = load_config(tmp_path / "c.yaml").sources[0]
    assert (source.allowed_roots, source.max_record_bytes, source.max_json_depth) == ((tmp_path / "data",), 10, 5)


def test_odd_files_are_rows_not_hangs_or_crashes(tmp_path):
    """A FIFO named like a record, a dangling link, a line that is not UTF-8, a shard cut short."""
    flat = tmp_path / "flat"
    _write(flat / "ok.json", _sample())
    os.mkfifo(flat / "pipe.json")  # reading it would block forever
    (flat / "dangling.json").symlink_to("nowhere.json")
    _expect(_rows(SourceConfig("f", "flat_dir", flat, flat)), {
        "f/ok.json": ("ok",),
        "f/pipe.json": ("rejected", "not a regular file"),
        "f/dangling.json": ("rejected", "unreadable record file", str(flat / "dangling.json")),
    })

    lines = tmp_path / "lines.jsonl"
    lines.write_bytes(json.dumps(_sample()).encode() + b'\n{"texts": "caf\xe9"}\n' + json.dumps(_sample()).encode())
    line_rows = _rows(SourceConfig("l", "jsonl", lines, tmp_path))
    first = _content_id(line_rows, "l")
    _expect(line_rows, {first: ("ok",), "l/line-2": ("rejected", "not UTF-8", f"{lines}:2"), f"{first}-2": ("ok",)})

    shard = tmp_path / "wds" / "pretrain-000000.tar"
    _tar(shard, [(f"k{index}.json", json.dumps({"texts": "x" * 3000}).encode()) for index in range(4)])
    shard.write_bytes(shard.read_bytes()[:4000])  # cut inside the second member
    rows = _rows(SourceConfig("w", "wds", shard.parent, shard.parent))
    assert rows["w/k0"] == ("ok", "")
    assert rows["w/pretrain-000000.tar"][0] == "rejected" and str(shard) in rows["w/pretrain-000000.tar"][1]


def test_a_lone_surrogate_is_one_rejected_row_naming_its_line_or_file(tmp_path):
    lone = '{"messages": [{"role": "user", "content": "\\ud800 what?"}, {"role": "assistant", "content": "A colour."}]}'
    (tmp_path / "lines.jsonl").write_text("\n".join([json.dumps(_sample(id="a")), lone.replace("{", '{"id": "b", ', 1),
                                                     json.dumps(_sample(id="c"))]) + "\n")
    _expect(_rows(SourceConfig("l", "jsonl", tmp_path / "lines.jsonl", tmp_path)), {
        "l/a": ("ok",), "l/b": ("rejected", "lone surrogate", f"{tmp_path / 'lines.jsonl'}:2"), "l/c": ("ok",),
    })
    flat = tmp_path / "flat"
    _write(flat / "good.json", _sample())
    _write(flat / "odd.json", lone)
    _expect(_rows(SourceConfig("f", "flat_dir", flat, flat)), {
        "f/good.json": ("ok",), "f/odd.json": ("rejected", "lone surrogate", str(flat / "odd.json")),
    })


def test_names_that_are_not_utf8_are_rejected_rows_and_the_rest_is_catalogued(tmp_path):
    """Through the catalogue's writer, which spells each record file's path in its read mark: a record
    file or folder whose name is not UTF-8 is one rejected row naming it with its bytes escaped."""
    flat = tmp_path / "flat"
    _write(flat / "good.json", _sample())
    with open(os.path.join(os.fsencode(flat), b"caf\xe9.json"), "w") as handle:
        handle.write(json.dumps(_sample()))
    os.mkdir(os.path.join(os.fsencode(flat), b"dir\xff"))
    with open(os.path.join(os.fsencode(flat), b"dir\xff", b"inner.json"), "w") as handle:
        handle.write(json.dumps(_sample()))
    config = tmp_path / "vlm_assets.yaml"
    config.write_text(f"storage: {{root: {tmp_path / 'out'}}}\nsources:\n  - {{name: f, kind: flat_dir, path: {flat}}}\n")
    instance = dg.DagsterInstance.ephemeral()
    instance.add_dynamic_partitions(SOURCES_PARTITIONS.name, ["f"])
    result = dg.materialize([sample_catalog], partition_key="f", instance=instance,
                            resources={"vlm_config": VlmConfig(config_path=str(config))})
    assert result.success
    rows = pd.read_parquet(StorageLayout(tmp_path / "out").catalog("f")).set_index("sample_id")
    assert rows.status.to_dict() == {"f/caf\\xe9.json": "rejected", "f/dir\\xff": "rejected", "f/good.json": "ok"}
    assert rows.at["f/caf\\xe9.json", "reason"].startswith(f"{flat}/caf\\xe9.json: its name is not UTF-8")
    assert rows.at["f/dir\\xff", "reason"].startswith(f"{flat}/dir\\xff: its name is not UTF-8")
