"""Shared by the automation, Postgres and UI tests: a config with an inbox, and demo sources to drop in it."""

from __future__ import annotations

import shutil
from pathlib import Path

import dagster as dg

from vlm_assets.definitions import build_definitions
from vlm_assets.defs.automation.sensors import inbox_sensor
from vlm_assets.demo import CONFIG_NAME

INBOX_CONFIG = """\
storage: {{root: {root}}}
inbox: {inbox}
inbox_require_ready_marker: {marker}
model:
  processor: embedded
  processor_kwargs: {{min_pixels: 3136, max_pixels: 1003520}}
sample: {{sample_type: packed_multi_mix_qa, max_token_len: 8192}}
packing: {{min_fill_ratio: 0.0}}  # a few demo samples cannot fill 8192-token bins
wds: {{maxcount: 4, maxsize: 50000000}}
frame_cache: {{num_frames: 16, frame_size: 112, rows: 4, cols: 4, jpeg_quality: 90, videos_per_shard: 2}}
"""


def write_inbox_config(directory: Path, require_ready_marker: bool = False, video_sources: tuple[str, ...] = ()) -> Path:
    """A config watching `directory/inbox` (small frame-cache settings for speed); `video_sources`
    are configured jsonl sources of that name at `directory/<name>.jsonl` (see drop_video_source)."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "inbox").mkdir(exist_ok=True)
    path = directory / CONFIG_NAME
    text = INBOX_CONFIG.format(root=directory / "data", inbox=directory / "inbox", marker=str(require_ready_marker).lower())
    if video_sources:
        text += "sources:\n" + "".join(
            f"  - {{name: {name}, kind: jsonl, path: ./{name}.jsonl, media_root: ./{name}}}\n" for name in video_sources)
    path.write_text(text)
    return path


def drop_video_source(demo_dir: Path, inbox: Path, name: str = "clips") -> Path:
    """Copy the demo's video JSONL into the inbox with its media in the sibling directory of the same stem."""
    shutil.copytree(demo_dir / "media", inbox / name)
    shutil.copyfile(demo_dir / "video_train.jsonl", inbox / f"{name}.jsonl")
    return inbox / f"{name}.jsonl"


def drop_flat_source(demo_dir: Path, inbox: Path, name: str = "photos") -> Path:
    shutil.copytree(demo_dir / "flat", inbox / name)
    return inbox / name


def tick(sensor: dg.SensorDefinition, instance: dg.DagsterInstance, defs: dg.Definitions, cursor: str | None = None):
    """One sensor evaluation, applying its dynamic-partition requests and storing its asset events as the daemon does."""
    with dg.build_sensor_context(instance_ref=instance.get_ref(), cursor=cursor, definitions=defs, resources=defs.resources) as context:
        result = sensor.evaluate_tick(context)
    for request in result.dynamic_partitions_requests or []:
        if isinstance(request, dg.DeleteDynamicPartitionsRequest):
            for key in request.partition_keys:
                instance.delete_dynamic_partition(request.partitions_def_name, key)
        else:
            instance.add_dynamic_partitions(request.partitions_def_name, list(request.partition_keys))
    for event in result.asset_events or []:
        instance.report_runless_asset_event(event)
    return result


def register_inbox_entries(config: Path, home: Path) -> set[str]:
    """Tick the real inbox sensor until it registers the inbox's finished entries; the new `sources` partitions."""
    defs = build_definitions(config)
    with dg.DagsterInstance.from_config(str(home)) as instance:
        before = set(instance.get_dynamic_partitions("sources"))
        cursor = None
        for _ in range(2):  # an entry is taken once it is unchanged from one tick to the next
            cursor = tick(inbox_sensor, instance, defs, cursor).cursor
        return set(instance.get_dynamic_partitions("sources")) - before
