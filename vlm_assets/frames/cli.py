"""`vlm-assets frames get VIDEO --out DIR`: write one cached video's frames as PNG images."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from vlm_assets.config import ConfigError, default_config_path, load_config
from vlm_assets.layout import StorageLayout


def register(subparsers: argparse._SubParsersAction) -> None:
    frames = subparsers.add_parser(
        "frames", help="read the video frame cache",
        description="Read the video frame cache that `vlm-assets run` builds (frame_cache_shard, frame_cache_index).")
    actions = frames.add_subparsers(dest="frames_command", required=True, metavar="COMMAND")
    get = actions.add_parser(
        "get", help="write a cached video's sampled frames as images",
        description="Write the frames the cache holds for one video into the --out folder as frame_00.png …, and "
        "print which of the video's frames they are. Exit codes: 0 written; 1 the video is not in the cache or the "
        "cache cannot be read.")
    get.add_argument("video", help="media key of the video, e.g. demo_video/clips/a.mp4")
    get.add_argument("--out", required=True, type=Path, help="directory for frame_00.png …")
    get.add_argument("--config", default=None, help="config file (default: $VLM_ASSETS_CONFIG or vlm_assets.yaml)")
    get.add_argument("--cache", type=Path, default=None, help="frame cache directory (instead of --config)")
    get.set_defaults(func=get_frames)


def get_frames(args: argparse.Namespace) -> int:
    # Imported here: every `vlm-assets` command registers this one, and `run` starts its workers
    # only after the parser is built.
    from PIL import Image

    from vlm_assets.frames.reader import FrameCacheReader

    try:
        config_path = args.config or default_config_path()
        cache_dir = args.cache or _configured_cache_dir(config_path)
        reader = FrameCacheReader(cache_dir)
        frames = reader.read(args.video)
    except (ConfigError, FileNotFoundError, KeyError, OSError) as error:
        print(f"error: {error.args[0] if isinstance(error, KeyError) else error}", file=sys.stderr)
        return 1
    args.out.mkdir(parents=True, exist_ok=True)
    width = len(str(len(frames) - 1))
    for position, frame in enumerate(frames):
        Image.fromarray(frame).save(args.out / f"frame_{position:0{width}d}.png")
    record = reader.record(args.video)
    print(
        f"{args.video}: wrote {len(frames)} frames of {frames.shape[2]}×{frames.shape[1]} to {args.out} "
        f"(indices {record['frame_indices'][0]}…{record['frame_indices'][-1]} of {record['total_frames']}, {record['fps']:g} fps)"
    )
    return 0


def _configured_cache_dir(config_path: str) -> Path:
    app = load_config(config_path)
    return StorageLayout(app.storage_root).frame_cache_dir(app.frame_cache)
