import json
import tarfile
from pathlib import Path

from vlm_assets.catalog.build import MediaValidator, iter_catalog_chunks
from vlm_assets_tests.catalog_support import build_catalog
from vlm_assets.media.checks import MediaCheckLog
from vlm_assets.catalog.messages import normalize_record
from vlm_assets.config import SourceConfig


def by_id(frame):
    return {row.sample_id: row for row in frame.itertuples(index=False)}


def test_demo_flat_dir_catalogue_counts_and_reasons(demo_app):
    frame = build_catalog(demo_app.source("demo_images"), "messages")
    rows = by_id(frame)
    assert len(frame) == 17
    assert (frame.status == "ok").sum() == 13
    assert "malformed JSON" in rows["demo_images/bad_malformed.json"].reason
    assert "bad_malformed.json" in rows["demo_images/bad_malformed.json"].reason
    assert "missing media" in rows["demo_images/bad_missing_media.json"].reason
    assert "unreadable image" in rows["demo_images/bad_broken_image.json"].reason
    assert "ambiguous media" in rows["demo_images/bad_ambiguous.json"].reason
    stem = rows["demo_images/0009.json"]
    assert list(stem.media_keys) == ["demo_images/0009.jpg"]
    pair = rows["demo_images/0010.json"]
    assert list(pair.media_kinds) == ["image", "image"]
    assert json.loads(pair.messages)[0] == {
        "role": "user", "content": "Compare <image> with <image>. Which one is taller?"
    }
    assert rows["demo_images/0011.json"].media_type == "text"
    assert rows["demo_images/0002.json"].n_turns == 6


def test_demo_jsonl_uses_record_ids_and_rejects_missing_video(demo_app):
    rows = by_id(build_catalog(demo_app.source("demo_video"), "messages"))
    assert set(rows) == {f"demo_video/v{i}" for i in range(1, 7)}
    assert rows["demo_video/v3"].media_keys[0] == "demo_video/clips/no_extension"
    assert rows["demo_video/v3"].media_kinds[0] == "video"
    assert "missing media" in rows["demo_video/v5"].reason
    assert rows["demo_video/v1"].media_refs[0] == rows["demo_video/v6"].media_refs[0]


def test_demo_wds_reads_tar_members_in_place(demo_app):
    frame = build_catalog(demo_app.source("demo_wds"), "messages")
    rows = by_id(frame)
    assert len(frame) == 10
    assert rows["demo_wds/s0_000"].media_refs[0].startswith("tar:")
    assert rows["demo_wds/s0_000"].media_keys[0] == "demo_wds/pretrain-000000.tar/s0_000.jpg"
    assert "no .json" in rows["demo_wds/s1_004"].reason


def test_real_llama_factory_array_and_xtuner_jsonl(shared_data):
    llama = build_catalog(SourceConfig("llf", "jsonl", shared_data / "LLaMA-Factory/data/mllm_demo.json",
                                       shared_data / "LLaMA-Factory/data"))
    assert (llama.status == "ok").all() and len(llama) == 6
    assert list(llama.iloc[0].media_files) == ["mllm_demo_data/1.jpg", "mllm_demo_data/1.jpg"]
    videos = build_catalog(SourceConfig("xtv", "jsonl", shared_data / "xtuner/tests/resource/mllm_sft_video_example_data.jsonl",
                                        shared_data / "xtuner/tests"))
    assert (videos.status == "rejected").all()
    assert videos.reason.str.contains("missing media: .tennis", regex=True).all()
    images = build_catalog(SourceConfig("xt", "jsonl", shared_data / "xtuner/tests/resource/mllm_sft_single_image_example_data.jsonl",
                                        shared_data / "xtuner/tests"))
    assert (images.status == "ok").all()
    assert images.iloc[0].n_turns == 10


def test_real_broken_media_are_rejected_with_the_file_named(tmp_path, real_file):
    for name in ("truncated_jpeg.jpg", "broken.png", "hopper_orientation_6.jpg"):
        (tmp_path / f"{Path(name).stem}.json").write_text(json.dumps(
            {"messages": [{"role": "user", "content": "<image>?"}, {"role": "assistant", "content": "!"}],
             "images": [str(real_file(f"Pillow/Tests/images/{name}"))]}))
    # The images stay where they are: their directory is an allowed root of the source.
    images = real_file("Pillow/Tests/images/broken.png").parent
    rows = by_id(build_catalog(SourceConfig("p", "flat_dir", tmp_path, tmp_path, allowed_roots=(images,))))
    assert "unreadable image" in rows["p/truncated_jpeg.json"].reason and "truncated_jpeg.jpg" in rows["p/truncated_jpeg.json"].reason
    assert "unreadable image" in rows["p/broken.json"].reason and "broken.png" in rows["p/broken.json"].reason
    assert rows["p/hopper_orientation_6.json"].status == "ok"


def test_real_undecodable_video_is_rejected_at_the_catalogue(tmp_path, real_file):
    corrupted = real_file("decord/tests/test_data/corrupted.mp4")
    fine = real_file("LLaMA-Factory/data/mllm_demo_data/4.mp4")
    lines = [json.dumps({"messages": [{"role": "user", "content": "<video>?"}], "videos": [str(path)]})
             for path in (corrupted, fine)]
    (tmp_path / "v.jsonl").write_text("\n".join(lines))
    frame = build_catalog(SourceConfig("v", "jsonl", tmp_path / "v.jsonl", tmp_path,
                                       allowed_roots=(corrupted.parent, fine.parent)))
    assert list(frame.status) == ["rejected", "ok"]
    assert "corrupted.mp4" in frame.iloc[0].reason and "unreadable video" in frame.iloc[0].reason


def test_hostile_media_path_is_rejected(tmp_path):
    source_dir = tmp_path / "src"
    source_dir.mkdir()
    (tmp_path / "secret.jpg").write_bytes(b"not really")
    (source_dir / "a.json").write_text(json.dumps(
        {"messages": [{"role": "user", "content": "hi"}], "images": ["../secret.jpg"]}))
    row = build_catalog(SourceConfig("h", "flat_dir", source_dir, source_dir)).iloc[0]
    assert row.status == "rejected" and "escapes" in row.reason


def test_jsonl_without_unique_ids_names_records_by_content_and_keeps_going(tmp_path):
    path = tmp_path / "data.jsonl"
    lines = ['{"messages": [{"role": "user", "content": "a"}]}', "{broken", '{"texts": "caption only"}',
             '{"messages": [{"role": "user", "content": "a"}]}']
    path.write_text("\n".join(lines) + "\n")
    frame = build_catalog(SourceConfig("j", "jsonl", path, tmp_path))
    first, caption = frame.sample_id[0], frame.sample_id[2]
    assert frame.sample_id[1] == "j/line-2" and frame.sample_id[3] == f"{first}-2"  # a repeat is numbered, not rejected
    assert list(frame.status) == ["ok", "rejected", "ok", "ok"]
    assert "data.jsonl:2" in frame.iloc[1].reason

    # A line inserted at the top (even one more copy) leaves every other record its id.
    path.write_text('{"texts": "new"}\n' + "\n".join(lines) + "\n")
    moved = build_catalog(SourceConfig("j", "jsonl", path, tmp_path))
    assert list(moved.sample_id[1:]) == [first, "j/line-3", caption, f"{first}-2"]
    path.write_text("\n".join([lines[0], *lines]) + "\n")
    assert list(build_catalog(SourceConfig("j", "jsonl", path, tmp_path)).sample_id) == [
        first, f"{first}-2", "j/line-3", caption, f"{first}-3"]


def test_message_styles_normalise_to_role_content_with_placeholders():
    llava = normalize_record({"conversations": [{"from": "human", "value": "Look <image> here"},
                                                {"from": "gpt", "value": "ok"}], "image": "a.jpg"})
    assert llava.messages[0] == {"role": "user", "content": "Look <image> here"}
    assert [item.name for item in llava.media] == ["a.jpg"]
    openai = normalize_record({"messages": [{"role": "user", "content": [
        {"type": "text", "text": "first "}, {"type": "image_url", "image_url": {"url": "x.png"}},
        {"type": "text", "text": " then"}]}]})
    assert openai.messages[0]["content"] == "first <image> then"
    no_placeholder = normalize_record({"messages": [{"role": "user", "content": "Q?"}, {"role": "assistant", "content": "A"}],
                                       "videos": ["v.mp4"], "images": ["i.jpg"]})
    assert no_placeholder.messages[0]["content"] == "<image><video>Q?"
    seed = normalize_record({"texts": [{"role": "user", "content": "describe"}], "media_files": [["a.jpg"], ["b.jpg"]],
                             "media_type": "image"})
    assert [item.name for item in seed.media] == ["a.jpg", "b.jpg"]


def test_wds_tar_with_named_media_members(tmp_path):
    shard = tmp_path / "shards" / "pretrain-000000.tar"
    shard.parent.mkdir()
    with tarfile.open(shard, "w") as archive:
        for name, data in [("k1.json", json.dumps({"messages": [{"role": "user", "content": "<image>hi"}], "images": ["img.jpg"]}).encode()),
                           ("k1.img.jpg", b"")]:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            import io
            archive.addfile(info, io.BytesIO(data))
    row = build_catalog(SourceConfig("w", "wds", shard.parent, shard.parent)).iloc[0]
    assert row.status == "rejected" and "unreadable image" in row.reason  # empty member, found by name
    # The reason is the same in every run: no in-memory file's address in it.
    assert "object at 0x" not in row.reason and "cannot identify image file" in row.reason


def test_record_without_a_conversation_is_rejected_with_no_messages(tmp_path):
    (tmp_path / "a.json").write_text(json.dumps({"images": []}))
    (tmp_path / "b.json").write_text(json.dumps({"messages": [{"role": "system", "content": "only a system turn"}]}))
    (tmp_path / "c.json").write_text(json.dumps(["not", "an", "object"]))
    rows = by_id(build_catalog(SourceConfig("n", "flat_dir", tmp_path, tmp_path)))
    assert rows["n/a.json"].reason.startswith("no messages")
    assert rows["n/b.json"].reason.startswith("no messages")
    assert "expected a JSON object" in rows["n/c.json"].reason


def _media_source(tmp_path, shared_data):
    """A jsonl source over copies of two real videos, a real image and a corrupted video."""
    media = tmp_path / "media"
    media.mkdir()
    real = {
        "a.mp4": shared_data / "LLaMA-Factory/data/mllm_demo_data/4.mp4",
        "b.avi": shared_data / "LLaMA-Factory/data/mllm_demo_data/2.avi",
        "c.jpg": shared_data / "Pillow/Tests/images/hopper_gray.jpg",
        "bad.mp4": shared_data / "decord/tests/test_data/corrupted.mp4",
    }
    lines = []
    for name, path in real.items():
        (media / name).write_bytes(path.read_bytes())
        field = "images" if name.endswith(".jpg") else "videos"
        lines.append(json.dumps({"id": name, "messages": [{"role": "user", "content": "?"}], field: [name]}))
    (tmp_path / "s.jsonl").write_text("\n".join(lines) + "\n")
    return SourceConfig("s", "jsonl", tmp_path / "s.jsonl", media), media


def _build(source, log_path):
    validator = MediaValidator(8, MediaCheckLog(log_path))
    return build_catalog(source, validator=validator), validator


def test_unchanged_media_are_not_decoded_again(tmp_path, shared_data):
    source, media = _media_source(tmp_path, shared_data)
    log_path = tmp_path / "checks.sqlite"
    first, validator = _build(source, log_path)
    assert list(first.status) == ["ok", "ok", "ok", "rejected"]
    assert (validator.decoded, validator.remembered) == (4, 0)

    again, validator = _build(source, log_path)
    assert (validator.decoded, validator.remembered) == (1, 3)  # the failure is checked again
    assert again.drop(columns="reason").equals(first.drop(columns="reason"))

    # Replaced by broken bytes: the changed file is decoded again and rejected, the rest remembered.
    (media / "a.mp4").write_bytes((media / "a.mp4").read_bytes()[:3000])
    changed, validator = _build(source, log_path)
    assert list(changed.status) == ["rejected", "ok", "ok", "rejected"]
    assert "a.mp4" in changed.iloc[0].reason
    assert (validator.decoded, validator.remembered) == (2, 2)
    remembered = [ref for ref, _ in MediaCheckLog(log_path, append=False).passes()]
    assert sorted(Path(ref).name for ref in remembered) == ["b.avi", "c.jpg"]


def test_each_video_records_what_the_trainers_decoder_makes_of_it_remembered_with_its_pass(tmp_path, shared_data):
    """A video's view (Energon's frame count and rate, its frames' size) is kept with its check, so an
    unchanged video keeps it undecoded; an AVI Energon's decoder cannot seek has none, an image none."""
    source, media = _media_source(tmp_path, shared_data)
    log_path = tmp_path / "checks.sqlite"
    first, _validator = _build(source, log_path)
    views = dict(zip(first.sample_id, first.media_views))
    assert [list(views[f"s/{name}"]) for name in ("a.mp4", "b.avi", "c.jpg")] == [["150 30.0 224 224"], [""], [""]]
    assert list(views["s/bad.mp4"]) == []  # rejected: no media listed

    again, validator = _build(source, log_path)
    assert validator.remembered == 3
    assert again.media_views.map(list).tolist() == first.media_views.map(list).tolist()


def test_a_check_log_commits_what_it_proved_while_the_build_goes_on(tmp_path, shared_data, monkeypatch):
    from vlm_assets.media import checks as media_checks

    monkeypatch.setattr(media_checks, "COMMIT_EVERY_S", 0.0)
    source, _ = _media_source(tmp_path, shared_data)
    log_path = tmp_path / "checks.sqlite"
    validator = MediaValidator(8, MediaCheckLog(log_path))
    chunks = iter_catalog_chunks(source, "messages", validator, chunk_work=1)
    next(chunks), next(chunks)  # two records checked; the build is still open, as one killed now would be
    # Another process (a reader, as a chunk worker's log is) already sees both passes.
    assert len(list(MediaCheckLog(log_path, append=False).passes())) == 2
    _, resumed = _build(source, log_path)
    assert (resumed.decoded, resumed.remembered) == (2, 2)


def _two_media_files(folder: Path) -> list[str]:
    for name in ("a.jpg", "b.jpg"):
        (folder / name).write_bytes(name.encode())
    return [str(folder / "a.jpg"), str(folder / "b.jpg")]


def _refs(log_path: Path) -> list[str]:
    return [ref for ref, _ in MediaCheckLog(log_path, append=False).passes()]


def test_a_finished_build_keeps_only_the_media_it_used(tmp_path):
    from vlm_assets.media.checks import media_fingerprint

    files = _two_media_files(tmp_path)
    log_path = tmp_path / "checks.sqlite"
    log = MediaCheckLog(log_path)
    for ref in files:
        log.record_pass(ref, media_fingerprint(ref, "image"))
    log.compact()
    assert _refs(log_path) == files

    # Every remembered medium used again, one new one checked: all three stay.
    (tmp_path / "c.jpg").write_bytes(b"c")
    files.append(str(tmp_path / "c.jpg"))
    again = MediaCheckLog(log_path)
    assert again.keep_unchanged() == ""
    again.record_pass(files[2], media_fingerprint(files[2], "image"))
    again.compact()
    assert _refs(log_path) == files

    # A medium left out of the build is dropped; a checked-again one stays.
    (tmp_path / "a.jpg").write_bytes(b"changed a")
    third = MediaCheckLog(log_path)
    assert third.keep_unchanged() == files[0]
    third.record_pass(files[0], media_fingerprint(files[0], "image"))
    third.compact()
    assert _refs(log_path) == [files[0]]  # keep_unchanged stopped at the first change: only a.jpg was used

    fourth = MediaCheckLog(log_path)
    assert fourth.passed(files[0], media_fingerprint(files[0], "image"))
    assert not fourth.passed(files[1], media_fingerprint(files[1], "image"))
    fourth.compact()
    assert _refs(log_path) == [files[0]]


def test_a_check_log_reader_sees_the_passes_and_leaves_what_it_proves_to_be_adopted(tmp_path):
    from vlm_assets.media.checks import media_fingerprint

    files = _two_media_files(tmp_path)
    log_path = tmp_path / "checks.sqlite"
    log = MediaCheckLog(log_path)
    log.record_pass(files[0], media_fingerprint(files[0], "image"))
    log.close()

    # What a chunk worker reads: the build's passes, without ever writing the file.
    reader = MediaCheckLog(log_path, append=False)
    assert reader.passed(files[0], media_fingerprint(files[0], "image"))
    reader.record_pass(files[1], media_fingerprint(files[1], "image"))
    assert _refs(log_path) == [files[0]]
    used = reader.take_used()
    assert set(used) == set(files)
    assert reader.take_used() == {}

    build = MediaCheckLog(log_path)
    build.adopt(used)  # as the build does with every worker's chunk: recorded, and used by this build
    build.compact()
    assert _refs(log_path) == files
    assert MediaCheckLog(log_path).passed(files[1], media_fingerprint(files[1], "image"))


def test_an_unreadable_log_is_set_aside(tmp_path):
    broken = tmp_path / "broken.sqlite"
    broken.write_bytes(b"not a database at all" * 100)
    assert not MediaCheckLog(broken, append=False).holds_any()  # a reader only finds nothing
    writer = MediaCheckLog(broken)
    writer.record_pass("/m/1.jpg", "1:1:image@1px")
    writer.compact()
    assert _refs(broken) == ["/m/1.jpg"]
    assert (tmp_path / "broken.sqlite.unreadable").read_bytes().startswith(b"not a database")


def test_a_source_that_changes_or_vanishes_while_read_publishes_no_catalogue(tmp_path):
    import pytest
    from PIL import Image

    from vlm_assets.catalog.table import SourceChangedError, write_catalog
    from vlm_assets.catalog.source_walk import source_snapshot, walk_source

    source_dir = tmp_path / "entry"
    source_dir.mkdir()
    Image.new("RGB", (8, 8)).save(source_dir / "a.png")
    for index in range(3):
        (source_dir / f"{index}.json").write_text(json.dumps(
            {"messages": [{"role": "user", "content": "<image>?"}], "images": ["a.png"]}))
    source = SourceConfig("inbox-entry", "flat_dir", source_dir, source_dir)
    (tmp_path / "out").mkdir()
    target = tmp_path / "out" / "catalog.parquet"

    class CopyStillArriving(MediaValidator):
        def error_for(self, ref: str, kind: str) -> str:
            (source_dir / "3.json").write_text(json.dumps({"messages": [{"role": "user", "content": "late"}]}))
            return super().error_for(ref, kind)

    with pytest.raises(SourceChangedError, match=r"'inbox-entry': .*entry changed \(4 files, .* after\)"):
        write_catalog(source, target, "messages", CopyStillArriving())
    assert not target.exists()

    # The step passes the snapshot of the walk its source digest came from: an edit after that walk counts.
    walked = walk_source(source, [tmp_path / "out"])
    assert walked.snapshot == source_snapshot(source, [tmp_path / "out"]) == (5, walked.snapshot[1], walked.snapshot[2])
    (source_dir / "3.json").write_text(json.dumps({"messages": [{"role": "user", "content": "edited after the walk"}]}))
    with pytest.raises(SourceChangedError, match=r"entry changed \(5 files, .* after\)"):
        write_catalog(source, target, "messages", MediaValidator(), before=walked.snapshot)
    assert not target.exists()

    class Deleted(MediaValidator):
        def error_for(self, ref: str, kind: str) -> str:
            for path in source_dir.iterdir():
                path.unlink()
            source_dir.rmdir()
            return super().error_for(ref, kind)

    with pytest.raises(SourceChangedError, match="vanished while it was read; nothing was published"):
        write_catalog(source, target, "messages", Deleted())
    assert not target.exists()
    with pytest.raises(SourceChangedError, match="does not exist"):
        write_catalog(source, target, "messages", MediaValidator())


def test_our_own_outputs_inside_a_source_folder_are_not_a_change(tmp_path):
    from vlm_assets.catalog.table import write_catalog

    (tmp_path / "0.json").write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}]}))
    (tmp_path / "vlm_data").mkdir()
    source = SourceConfig("s", "flat_dir", tmp_path, tmp_path)
    summary = write_catalog(source, tmp_path / "vlm_data" / "catalog.parquet", "messages", MediaValidator(),
                            excluded=[tmp_path / "vlm_data"])
    assert summary.samples == 1
