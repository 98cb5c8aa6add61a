"""sample_dedup: made duplicates of kept samples removed (exact, re-encoded and resized images, a re-encoded
clip, a caption with changed punctuation), what is not a duplicate kept, and the decisions reused and remade
as the issue asks: materialised through Dagster on a throwaway instance, on generated sources."""

from __future__ import annotations

import io
import json
import random
import shutil
import textwrap
from fractions import Fraction
from pathlib import Path

import av
import dagster as dg
import numpy as np
import pandas as pd
import pyarrow.parquet as pq
import pytest
from PIL import Image

from vlm_assets.config import ConfigError, load_config
from vlm_assets.dedup.index import BandedHashIndex, hamming
from vlm_assets.definitions import build_definitions
from vlm_assets.defs.resources import SOURCES_PARTITIONS, VlmConfig
from vlm_assets.layout import StorageLayout
from vlm_assets.orchestration.report import samples_by_source
from vlm_assets_tests.automation_support import register_inbox_entries
from vlm_assets_tests.run_support import run, snapshot

NEAR = "dedup: {near_images: true, near_videos: true, near_text: true, max_removed_share: 0.9}\n"


def _picture(seed: int) -> Image.Image:
    """A picture of coarse random blocks: pictures of different seeds have far-apart pHashes."""
    blocks = np.random.default_rng(seed).integers(0, 256, (6, 8, 3), dtype=np.uint8)
    return Image.fromarray(blocks).resize((320, 240), Image.Resampling.BICUBIC)


def _jpeg(image: Image.Image, quality: int = 92) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, "JPEG", quality=quality)
    return buffer.getvalue()


def _clip(path: Path, seed: int, bit_rate: int) -> None:
    """A two-second clip of moving random blocks, encoded at `bit_rate`."""
    rng = np.random.default_rng(seed)
    base = np.asarray(Image.fromarray(rng.integers(0, 256, (6, 8, 3), dtype=np.uint8)).resize((160, 120)))
    with av.open(str(path), "w", format="mp4") as container:
        stream = container.add_stream("mpeg4", rate=Fraction(12, 1))
        stream.width, stream.height, stream.pix_fmt, stream.bit_rate = 160, 120, "yuv420p", bit_rate
        for index in range(24):
            frame = np.roll(base, index * 3, axis=1)
            for packet in stream.encode(av.VideoFrame.from_ndarray(np.ascontiguousarray(frame), format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)


def _sample(folder: Path, stem: str, text: tuple[str, str], media: tuple[str, bytes] | None = None,
            video: bool = False) -> None:
    placeholder = "<video>" if video else "<image>"
    record: dict = {"messages": [{"role": "user", "content": (placeholder if media else "") + text[0]},
                                 {"role": "assistant", "content": text[1]}]}
    if media is not None:
        name, data = media
        (folder / name).write_bytes(data)
        record["videos" if video else "images"] = [name]
    (folder / f"{stem}.json").write_text(json.dumps(record))


CAPTION = ("Describe the picture in detail.", "A grid of coloured tiles in warm and cold tones, arranged in rows.")
QUESTION = ("What is the dominant colour of the top left corner?", "It is a muted teal shade with some grey.")
STORY = ("Write two sentences about a lighthouse.",
         "The lighthouse stood alone on the cliff, its lamp turning all night. Ships passed it safely until dawn.")
CLIP_QUESTION = ("What moves in this clip?", "A pattern of coloured blocks slides steadily to the right.")
OTHER = ("How many rows of tiles are there?", "There are six rows of tiles in the picture.")


@pytest.fixture
def site(tmp_path: Path) -> Path:
    """Two sources: `first` holds the originals, `second` their made duplicates and the negatives."""
    first, second = tmp_path / "first", tmp_path / "second"
    first.mkdir()
    second.mkdir()
    picture_a, picture_b = _picture(1), _picture(2)
    _sample(first, "a1", CAPTION, ("a1.jpg", _jpeg(picture_a)))
    _sample(first, "a2", QUESTION, ("a2.jpg", _jpeg(picture_b)))
    _sample(first, "a3", STORY)
    _clip(first / "a4.mp4", 7, 800_000)
    _sample(first, "a4", CLIP_QUESTION, ("a4.mp4", (first / "a4.mp4").read_bytes()), video=True)
    # Made duplicates, each with its conversation matching too.
    _sample(second, "b1", CAPTION, ("b1.jpg", _jpeg(picture_a)))  # the same bytes
    resized = picture_a.resize((296, 222), Image.Resampling.LANCZOS)
    _sample(second, "b2", CAPTION, ("b2.jpg", _jpeg(resized, quality=60)))  # resized and re-encoded
    width, height = picture_a.size
    cropped = picture_a.crop((width * 3 // 100, height * 3 // 100, width, height))
    _sample(second, "b7", CAPTION, ("b7.jpg", _jpeg(cropped)))  # 3 % cut off two edges
    _sample(second, "b5", (STORY[0], STORY[1].replace(",", "").replace(".", "!")))  # punctuation changed
    _clip(second / "b6.mp4", 7, 150_000)  # the same clip at another bitrate
    _sample(second, "b6", CLIP_QUESTION, ("b6.mp4", (second / "b6.mp4").read_bytes()), video=True)
    # Not duplicates: a distinct picture with the same caption, the same picture with another question.
    _sample(second, "b3", CAPTION, ("b3.jpg", _jpeg(_picture(3))))
    _sample(second, "b4", OTHER, ("b4.jpg", _jpeg(picture_b)))
    return tmp_path


def _config(site: Path, dedup: str = NEAR, sources: tuple[str, ...] = ("first", "second")) -> Path:
    path = site / "vlm_assets.yaml"
    listed = "".join(f"\n          - {{name: {name}, kind: flat_dir, path: ./{name}}}" for name in sources)
    path.write_text(textwrap.dedent(f"""\
        storage: {{root: {site / "data"}}}
        inbox: {site / "inbox"}
        sources:{listed}
        model:
          processor: embedded
          processor_kwargs: {{min_pixels: 3136, max_pixels: 50176}}
        sample: {{sample_type: packed_multi_mix_qa, max_token_len: 2048}}
        frame_cache: {{num_frames: 8, frame_size: 64, rows: 2, cols: 4}}
        """) + dedup)
    return path


def _build(config: Path, instance: dg.DagsterInstance, assets: list[str], source: str) -> dg.ExecuteInProcessResult:
    defs = build_definitions(config)
    return dg.materialize(list(defs.assets) + list(defs.asset_checks or []), selection=dg.AssetSelection.assets(*assets),
                          partition_key=source, instance=instance, resources=defs.resources, raise_on_error=False)


def _dedup_metadata(result: dg.ExecuteInProcessResult) -> dict:
    [event] = [event for event in result.get_asset_materialization_events() if event.asset_key.path == ["sample_dedup"]]
    return {key: getattr(value, "value", value) for key, value in event.materialization.metadata.items()}


def _reasons(config: Path, source: str) -> dict[str, str]:
    table = pd.read_parquet(StorageLayout(load_config(config).storage_root).dedup(source))
    return dict(zip(table.sample_id, table.reason))


@pytest.fixture
def instance():
    with dg.instance_for_test() as instance:
        instance.add_dynamic_partitions(SOURCES_PARTITIONS.name, ["first", "second"])
        yield instance


def test_made_duplicates_are_rejected_rows_naming_the_sample_kept(site, instance):
    config = _config(site)
    for source in ("first", "second"):
        result = _build(config, instance, ["sample_catalog", "sample_dedup", "sample_lengths"], source)
        assert result.success, [event.message for event in result.all_events if event.is_failure]
    reasons = _reasons(config, "second")
    assert set(reasons) == {"second/b1.json", "second/b2.json", "second/b5.json", "second/b6.json", "second/b7.json"}
    assert reasons["second/b1.json"] == "exact duplicate of first/a1.json"
    assert reasons["second/b2.json"] == "near-duplicate image of first/a1.json (distance 0)"
    assert reasons["second/b7.json"] == "near-duplicate image of first/a1.json (distance 8)"
    assert reasons["second/b5.json"].startswith("near-duplicate text of first/a3.json (jaccard ")
    assert reasons["second/b6.json"].startswith("near-duplicate video of first/a4.json (distance ")
    assert _reasons(config, "first") == {}

    # The lengths reject exactly those rows, in catalogue order, with the same reasons.
    layout = StorageLayout(load_config(config).storage_root)
    lengths, catalog = pd.read_parquet(layout.lengths("second")), pd.read_parquet(layout.catalog("second"))
    assert list(lengths.sample_id) == list(catalog.sample_id)
    rejected = lengths[lengths.status == "rejected"]
    assert dict(zip(rejected.sample_id, rejected.reason)) == reasons
    assert (rejected.token_len == 0).all() and (lengths[lengths.status == "ok"].token_len > 0).all()

    metadata = _dedup_metadata(result)
    assert metadata["removed"] == 5 and metadata["samples"] == 7
    assert metadata["removed_by_kind"] == {"exact": 1, "near_image": 2, "near_video": 1, "near_text": 1, "same_media": 0}
    assert "| first/a1.json | 3 |" in metadata["largest_clusters"]
    assert metadata["example_pairs"].count("data:image/jpeg;base64,") >= 4
    assert "image bits" in metadata["distance_histogram"] and "text jaccard" in metadata["distance_histogram"]
    assert metadata["sources_ahead"] == ["first"]
    # The first source's signatures were stored by its own step, not computed again.
    assert metadata["signatures_computed_ahead"] == 0

    # The run summary counts the source's duplicates together, by kind, among its rejected samples.
    assert _build(config, instance, ["packing_bins"], "second").success
    [line] = [line for line in samples_by_source(load_config(config), instance) if line.startswith("  second:")]
    assert line == ("  second: 2 packed, 5 rejected: 5 × removed as duplicates "
                    "(2 near image, 1 exact, 1 near text, 1 near video)"), line


def test_reused_media_with_other_text_are_kept_and_counted_and_media_only_removes_them(site, instance):
    # The same picture asked about twice in one source: kept twice, counted as reused.
    shutil.copy(site / "first" / "a2.jpg", site / "first" / "a5.jpg")
    _sample(site / "first", "a5", OTHER, ("a5.jpg", (site / "first" / "a2.jpg").read_bytes()))
    config = _config(site)
    first = _build(config, instance, ["sample_catalog", "sample_dedup"], "first")
    assert _reasons(config, "first") == {}
    assert "1 media reused by 2 or more samples" in _dedup_metadata(first)["images_reused"]

    config = _config(site, "dedup: {media_only: true, near_images: true, max_removed_share: 0.9}\n")
    assert _build(config, instance, ["sample_catalog", "sample_dedup"], "first").success
    assert _reasons(config, "first") == {"first/a5.json": "same media as first/a2.json (media_only)"}
    assert _build(config, instance, ["sample_catalog", "sample_dedup"], "second").success
    second = _reasons(config, "second")
    assert second["second/b4.json"] == "same media as first/a2.json (media_only)"
    assert second["second/b2.json"] == "near-duplicate image of first/a1.json (distance 0, media_only)"
    assert "second/b3.json" not in second and "second/b5.json" not in second  # a distinct picture; text only, not near


def test_a_rerun_keeps_the_same_and_a_changed_threshold_decides_again_without_hashing(site, instance):
    config = _config(site)
    for source in ("first", "second"):
        assert _build(config, instance, ["sample_catalog", "sample_dedup"], source).success
    layout = StorageLayout(load_config(config).storage_root)
    decisions, signatures = layout.dedup("second"), layout.dedup_signatures("second")
    decided_bytes, signed_bytes, signed_at = decisions.read_bytes(), signatures.read_bytes(), signatures.stat().st_mtime_ns

    def lengths_fingerprint(path: Path) -> str:
        return VlmConfig(config_path=str(path)).fingerprints(instance).of("sample_lengths", "second")

    lengths_before = lengths_fingerprint(config)
    rerun = _build(config, instance, ["sample_dedup"], "second")
    assert _dedup_metadata(rerun)["signatures_computed"] == 0 and _dedup_metadata(rerun)["signatures_written"] is False
    assert decisions.read_bytes() == decided_bytes
    assert lengths_fingerprint(config) == lengths_before  # the same decisions: the lengths stay up to date

    # A distance the cropped copy exceeds: it is kept, and nothing is hashed again.
    stricter = _config(site, NEAR.replace("near_images: true", "near_images: true, image_distance: 4"))
    result = _build(stricter, instance, ["sample_dedup"], "second")
    assert _dedup_metadata(result)["signatures_computed"] == 0
    assert "second/b7.json" not in _reasons(stricter, "second") and "second/b2.json" in _reasons(stricter, "second")
    assert signatures.read_bytes() == signed_bytes and signatures.stat().st_mtime_ns == signed_at
    # Other decisions: the lengths are stale.
    assert lengths_fingerprint(stricter) != lengths_before


def test_an_appended_sample_is_signed_alone_and_checked_against_the_stored_signatures(site, instance):
    config = _config(site)
    for source in ("first", "second"):
        assert _build(config, instance, ["sample_catalog", "sample_dedup"], source).success
    _sample(site / "second", "b9", STORY)  # a copy of first/a3 arriving later
    result = _build(config, instance, ["sample_catalog", "sample_dedup"], "second")
    metadata = _dedup_metadata(result)
    assert metadata["signatures_computed"] == 1 and metadata["signatures_computed_ahead"] == 0
    assert _reasons(config, "second")["second/b9.json"] == "exact duplicate of first/a3.json"


def test_a_source_wholly_duplicating_kept_data_is_built_empty(site, instance):
    # `second` holds only copies of `first`'s samples (a drop of data already kept).
    shutil.rmtree(site / "second")
    shutil.copytree(site / "first", site / "second")
    config = _config(site)
    lineage = ["sample_catalog", "sample_dedup", "sample_lengths", "packing_bins", "packed_json", "packed_wds_shards",
               "energon_dataset"]
    assert _build(config, instance, lineage, "first").success
    result = _build(config, instance, lineage, "second")
    assert result.success, [event.message for event in result.all_events if event.is_failure]
    assert all(check.passed for check in result.get_asset_check_evaluations())
    why = ("0 samples: every sample was a duplicate or rejected (4 duplicates of samples kept before, "
           "0 rejected otherwise)")
    metadata = {event.asset_key.path[0]: event.materialization.metadata
                for event in result.get_asset_materialization_events()}
    for asset in ("sample_lengths", "packing_bins", "energon_dataset"):
        assert metadata[asset]["empty"].value == why, asset
    layout = StorageLayout(load_config(config).storage_root)
    rejects = pd.read_parquet(layout.rejects("second"))
    assert dict(zip(rejects.sample_id, rejects.reason)) == {
        f"second/a{index}.json": f"exact duplicate of first/a{index}.json" for index in range(1, 5)}
    # No shard, no Energon dataset: the record saying why in their place.
    assert list(layout.packed_wds("second").iterdir()) == [layout.empty_dataset("second")]
    assert json.loads(layout.empty_dataset("second").read_text())["why"] == why
    [line] = [line for line in samples_by_source(load_config(config), instance) if line.startswith("  second:")]
    assert line == ("  second: 0 packed (empty: every sample was a duplicate or rejected, it adds nothing to the "
                    "shards), 4 rejected: 4 × removed as duplicates (4 exact)"), line


def test_a_source_emptied_after_it_was_packed_loses_its_dataset_and_gets_it_back(site, instance):
    shutil.rmtree(site / "second")
    shutil.copytree(site / "first", site / "second")
    lineage = ["sample_catalog", "sample_dedup", "sample_lengths", "packing_bins", "packed_json", "packed_wds_shards",
               "energon_dataset"]
    layout = StorageLayout(load_config(_config(site)).storage_root)

    def build_both(priority: str) -> None:
        config = _config(site, NEAR.replace("max_removed_share: 0.9}", f"max_removed_share: 0.9, priority: [{priority}]}}"))
        for source in ("first", "second"):
            result = _build(config, instance, lineage, source)
            assert result.success, [event.message for event in result.all_events if event.is_failure]
            assert all(check.passed for check in result.get_asset_check_evaluations()
                       if check.severity == dg.AssetCheckSeverity.ERROR)  # fill_ratio warns of so few samples

    def contents(source: str) -> list[str]:
        return sorted(path.name for path in layout.packed_wds(source).iterdir())

    build_both("first")
    assert "empty.json" not in contents("first") and ".nv-meta" in contents("first")
    assert contents("second") == ["empty.json"]
    # `second` kept first now: `first` holds only its duplicates, and its shards and Energon dataset go.
    build_both("second")
    assert contents("first") == ["empty.json"]
    assert "empty.json" not in contents("second") and ".nv-meta" in contents("second")
    build_both("first")
    assert "empty.json" not in contents("first") and ".nv-meta" in contents("first")


@pytest.mark.processes
def test_an_inbox_drop_of_kept_data_builds_and_adds_nothing_to_the_shards(site, tmp_path):
    config, home = _config(site, sources=("first",)), tmp_path / "home"
    built = run(config, home, "--workers", "2")
    assert built.returncode == 0, built.stdout[-4000:]
    layout = StorageLayout(load_config(config).storage_root)
    shards_before = snapshot(layout.packed_wds_root)

    shutil.copytree(site / "first", site / "inbox" / "drop")  # data already kept, dropped again
    assert register_inbox_entries(config, home) == {"inbox-drop"}
    result = run(config, home, "--workers", "2")
    assert result.returncode == 0, result.stdout[-4000:]
    assert ("  inbox-drop: 0 packed (empty: every sample was a duplicate or rejected, it adds nothing to the shards), "
            "4 rejected: 4 × removed as duplicates (4 exact)") in result.stdout, result.stdout[-4000:]

    # The kept source's shards, its Energon dataset and the training mix are as they were.
    shards_after = snapshot(layout.packed_wds_root)
    assert shards_after == {**shards_before, "inbox-drop/empty.json": shards_after["inbox-drop/empty.json"]}
    assert json.loads(layout.empty_dataset("inbox-drop").read_text())["why"] == (
        "0 samples: every sample was a duplicate or rejected (4 duplicates of samples kept before, 0 rejected otherwise)")
    rejects = pd.read_parquet(layout.rejects("inbox-drop"))
    assert dict(zip(rejects.sample_id, rejects.reason)) == {
        f"inbox-drop/a{index}.json": f"exact duplicate of first/a{index}.json" for index in range(1, 5)}
    # Built, the empty source is up to date: a rerun builds nothing.
    rerun = run(config, home, "--workers", "2")
    assert rerun.returncode == 0 and " 0 materialisation(s)" in rerun.stdout, rerun.stdout[-4000:]


def test_in_append_mode_a_packed_sample_stays_kept_whatever_the_id_of_a_later_copy(site, instance):
    config = _config(site, NEAR + "packing: {mode: append}\n")
    lineage = ["sample_catalog", "sample_dedup", "sample_lengths", "packing_bins"]
    for source in ("first", "second"):
        assert _build(config, instance, lineage, source).success
    layout = StorageLayout(load_config(config).storage_root)
    bins_before = {source: pq.read_table(layout.bins(source)) for source in ("first", "second")}
    second_before = _reasons(config, "second")
    assert "second/b3.json" not in second_before  # packed in `second`

    # Copies arriving later in `first`, the source kept first: one whose id sorts before its packed copy
    # in `first`, one of a sample packed in `second`.
    _sample(site / "first", "a0", STORY)
    _sample(site / "first", "a5", CAPTION, ("a5.jpg", (site / "second" / "b3.jpg").read_bytes()))
    for source in ("first", "second"):
        result = _build(config, instance, lineage, source)
        assert result.success, [event.message for event in result.all_events if event.is_failure]
    assert _reasons(config, "first") == {"first/a0.json": "exact duplicate of first/a3.json",
                                         "first/a5.json": "exact duplicate of second/b3.json"}
    assert _reasons(config, "second") == second_before
    for source, before in bins_before.items():
        after = pq.read_table(layout.bins(source))
        assert after.slice(0, before.num_rows).equals(before), source  # where they were packed
    assert pq.read_table(layout.bins("first")).num_rows == bins_before["first"].num_rows  # nothing new to pack

    # The keep order is stable: deciding again keeps the same ones, to the byte.
    decided = layout.dedup("first").read_bytes()
    assert _build(config, instance, ["sample_dedup"], "first").success
    assert layout.dedup("first").read_bytes() == decided


def test_signatures_interrupted_part_way_resume_from_the_parts_kept_and_give_the_same_table(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from vlm_assets.config import DedupConfig, FrameCacheConfig
    from vlm_assets.dedup.signatures import SIGNATURE_CHUNK_ROWS, signature_parts, source_signatures

    rows = 4 * SIGNATURE_CHUNK_ROWS + 30
    catalog = tmp_path / "catalog.parquet"
    pq.write_table(pa.table({
        "sample_id": [f"s/{number:05d}" for number in range(rows)], "status": ["ok"] * rows,
        "messages": [json.dumps([{"role": "user", "content": f"tell me about tile {number}"},
                                 {"role": "assistant", "content": f"tile {number} is {number % 7} shades warm"}])
                     for number in range(rows)],
        "media_kinds": [[] for _ in range(rows)], "media_refs": [[] for _ in range(rows)],
        "media_stamps": [[] for _ in range(rows)],
    }), catalog)
    settings, frame_cache = DedupConfig(near_text=True), FrameCacheConfig()

    def sign(store: Path, **options):
        return source_signatures(catalog, store, settings, tmp_path / "spool", frame_cache, **options)

    whole = sign(tmp_path / "whole.parquet")
    store = tmp_path / "interrupted.parquet"

    def interrupt_after_two_chunks(done: int) -> None:
        if done >= 2 * SIGNATURE_CHUNK_ROWS:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        sign(store, progress=interrupt_after_two_chunks, checkpoint_rows=SIGNATURE_CHUNK_ROWS)
    assert not store.exists() and len(list(signature_parts(store).glob("*.parquet"))) == 2

    resumed = sign(store)
    assert (resumed.resumed, resumed.computed) == (2 * SIGNATURE_CHUNK_ROWS, rows - 2 * SIGNATURE_CHUNK_ROWS)
    assert store.read_bytes() == (tmp_path / "whole.parquet").read_bytes()
    assert resumed.signatures == whole.signatures
    assert not signature_parts(store).exists()  # all they held is in the table


def test_the_check_fails_when_a_source_loses_more_than_its_share(site, instance):
    config = _config(site, NEAR.replace("max_removed_share: 0.9", "max_removed_share: 0.25"))
    assert _build(config, instance, ["sample_catalog", "sample_dedup"], "first").success
    result = _build(config, instance, ["sample_catalog", "sample_dedup"], "second")
    [check] = [evaluation for evaluation in result.get_asset_check_evaluations()
               if evaluation.check_name == "dedup_within_share"]
    assert not check.passed
    assert check.description.startswith("4 samples of 7 removed as near duplicates (57.1%), above "
                                        "dedup.max_removed_share (25%); 1 exact copy removed too, not counted")


def test_exact_only_by_default_keeps_near_duplicates(site, instance):
    config = _config(site, "")
    for source in ("first", "second"):
        assert _build(config, instance, ["sample_catalog", "sample_dedup"], source).success
    assert _reasons(config, "second") == {"second/b1.json": "exact duplicate of first/a1.json"}


def test_source_priority_decides_which_copy_is_kept(site, instance):
    config = _config(site, "dedup: {priority: [second]}\n")
    for source in ("second", "first"):
        assert _build(config, instance, ["sample_catalog", "sample_dedup"], source).success
    assert _reasons(config, "second") == {}
    assert _reasons(config, "first") == {"first/a1.json": "exact duplicate of second/b1.json"}


def test_the_banded_index_finds_every_hash_within_the_distance():
    rng = random.Random(5)
    hashes = [rng.getrandbits(64) for _ in range(400)]
    # Near copies: a few bits flipped in some of them.
    hashes += [value ^ sum(1 << bit for bit in rng.sample(range(64), rng.randrange(0, 9))) for value in hashes[:100]]
    for distance in (0, 3, 6, 8, 10, 17):
        index = BandedHashIndex(distance)
        for item, value in enumerate(hashes):
            index.add(item, (value,))
        for query in hashes[::7]:
            within = {item for item, value in enumerate(hashes) if hamming(value, query) <= distance}
            assert index.candidates((query,)) == within


@pytest.mark.parametrize("distance", [0, 3, 10])
def test_the_banded_index_finds_them_too_once_its_hashes_are_in_merged_sorted_runs(distance):
    # Enough hashes for several runs of the buffer's size, merged; videos' frames as a second position.
    rng = np.random.default_rng(7)
    stored = rng.integers(0, 2**64, 60_000, dtype=np.uint64)
    # Band values at the top of their range (at distance 0 a single 64-bit band: the top of its type).
    stored[:50] = np.uint64(2**64 - 1) ^ rng.integers(0, 2**10, 50, dtype=np.uint64)
    stored[50] = np.uint64(2**64 - 1)
    frames = rng.integers(0, 2**64, 60_000, dtype=np.uint64)
    index = BandedHashIndex(distance)
    for item, (value, frame) in enumerate(zip(stored.tolist(), frames.tolist())):
        index.add(item, (value, frame) if item % 2 else (value,))
    assert index.memory_bytes() < 200 * 2 * len(stored)
    for at in rng.integers(0, len(stored), 150).tolist() + list(range(10)) + [50]:
        flipped = int(rng.integers(0, distance + 3))
        query = int(stored[at]) ^ sum(1 << int(bit) for bit in rng.choice(64, flipped, replace=False))
        frame = int(frames[at]) ^ (7 if distance else 0)
        bits = np.bitwise_count(stored ^ np.uint64(query))
        frame_bits = np.bitwise_count(frames ^ np.uint64(frame))
        within = set(np.flatnonzero(bits <= distance).tolist()) | {
            item for item in np.flatnonzero(frame_bits <= distance).tolist() if item % 2}
        assert index.candidates((query, frame)) == within


@pytest.mark.parametrize(("dedup", "message"), [
    ("dedup: {text_threshold: 1.5}", "dedup.text_threshold: must be a Jaccard similarity in (0, 1], got 1.5"),
    ("dedup: {near_text: yes please}", "dedup.near_text: expected true or false, got 'yes please'"),
    ("dedup: {priority: [third]}", "dedup.priority: no configured source named 'third' (known: first, second)"),
    ("dedup: {image_distance: 40}", "dedup.image_distance: must be <= 32, got 40"),
    ("dedup: {bogus: 1}", "dedup.bogus: unknown key"),
])
def test_dedup_settings_are_validated_naming_the_key(site, dedup, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")):
        load_config(_config(site, dedup + "\n"))
