"""A deterministic demo dataset in all three input kinds, with its config.

Images of varied sizes, aspect ratios and formats (one with an EXIF rotation),
short PyAV-encoded videos (one without an extension), single- and multi-turn
conversations in the accepted message styles, and a few deliberately bad samples
so the rejects table has something to show.
"""

from __future__ import annotations

import io
import json
import os
import random
import tarfile
import tempfile
from collections.abc import Callable
from fractions import Fraction
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw

from vlm_assets.atomic import atomic_write_text, same_bytes
from vlm_assets.wording import plural

CONFIG_NAME = "vlm_assets.yaml"

DEMO_CONFIG = """\
# vlm-assets demo configuration (paths are relative to this file)
storage: {root: ./vlm_data}
inbox: ./vlm_inbox
# Each source is its own Energon dataset; packed_wds/metadataset.yaml blends them by weight
# (the share of drawn bins), with sample_type (default: sample.sample_type), source and subflavors.
sources:
  - {name: demo_images, kind: flat_dir, path: ./flat, weight: 2}
  - {name: demo_video, kind: jsonl, path: ./video_train.jsonl, media_root: ./media, weight: 1,
     subflavors: {modality: video}}
  - {name: demo_wds, kind: wds, path: ./wds, sample_type: packed_vqa, weight: 1}
model:
  processor: embedded
  processor_kwargs: {min_pixels: 3136, max_pixels: 1003520}
sample: {sample_type: packed_multi_mix_qa, max_token_len: 8192, text_key: messages}
packing: {min_fill_ratio: 0.2}
wds: {maxcount: 4, maxsize: 50000000}
frame_cache: {num_frames: 64, frame_size: 384, rows: 4, cols: 16, jpeg_quality: 95, videos_per_shard: 2}
# Duplicates removed before the token lengths: exact ones always, near ones here too.
dedup: {near_images: true, near_videos: true, near_text: true}
package:
  name: demo_run
  compress: zstd
  include: [packed_wds, frame_cache]
  hyperparameters: {lr: 1.0e-5, global_batch_size: 8, max_token_len: 8192}
  # A stand-in for your trainer: shows what `vlm-assets package train` hands it.
  train_command: "echo train on {metadataset} with frames from {frame_cache}, lr={hp[lr]}"
"""

QUESTIONS = [
    ("What is in the picture?", "A few coloured shapes on a plain background."),
    ("Describe the image in one sentence.", "Geometric figures drawn over a gradient."),
    ("How many circles can you see?", "I can see several circles of different sizes."),
    ("What colour dominates?", "Warm tones dominate the scene."),
    ("Is there any text?", "No, there is no text in the image."),
]


def _drawing(rng: random.Random, width: int, height: int) -> Image.Image:
    gradient = np.linspace(0, 255, width, dtype=np.uint8)[None, :, None]
    base = np.broadcast_to(gradient, (height, width, 3)).copy()
    base[..., 1] = rng.randrange(256)
    image = Image.fromarray(base, "RGB")
    draw = ImageDraw.Draw(image)
    for _ in range(6):
        x0, y0 = rng.randrange(width), rng.randrange(height)
        x1, y1 = x0 + rng.randrange(8, max(9, width // 2)), y0 + rng.randrange(8, max(9, height // 2))
        colour = tuple(rng.randrange(256) for _ in range(3))
        (draw.ellipse if rng.random() < 0.5 else draw.rectangle)([x0, y0, x1, y1], fill=colour)
    return image


def _save_image(image: Image.Image, path: Path, exif_orientation: int | None = None) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fmt = {"jpg": "JPEG", "png": "PNG", "webp": "WEBP"}[path.suffix.lstrip(".")]
    kwargs = {}
    if exif_orientation:
        exif = Image.Exif()
        exif[0x0112] = exif_orientation
        kwargs["exif"] = exif.tobytes()
    image.save(path, fmt, **kwargs)


def _encode_video(path: Path, *, frames: int, size: tuple[int, int], fps: int, codec: str, container_format: str) -> None:
    import av

    path.parent.mkdir(parents=True, exist_ok=True)
    width, height = size
    # bitexact: no random segment id or muxing date, so the same demo has the same bytes every time.
    with av.open(str(path), "w", format=container_format, options={"fflags": "+bitexact"}) as container:
        stream = container.add_stream(codec, rate=Fraction(fps, 1))
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        for index in range(frames):
            t = index / frames
            array = np.zeros((height, width, 3), dtype=np.uint8)
            array[..., 0] = np.uint8(255 * t)
            x = int((width - 20) * t)
            array[height // 3: height // 3 + 20, x: x + 20] = (255, 255, 0)
            for packet in stream.encode(av.VideoFrame.from_ndarray(array, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)


def _turns(rng: random.Random, n_turns: int, placeholder: str = "<image>") -> list[dict[str, str]]:
    messages = []
    for turn in range(n_turns):
        question, answer = rng.choice(QUESTIONS)
        messages.append({"role": "user", "content": (placeholder if turn == 0 else "") + question})
        messages.append({"role": "assistant", "content": answer})
    return messages


def _write_json(path: Path, payload: object) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, ensure_ascii=False, indent=1), encoding="utf-8")


def _flat_dir(root: Path, rng: random.Random) -> None:
    sizes = [(640, 480), (480, 640), (1024, 256), (300, 300), (1280, 720), (200, 900), (96, 64), (800, 600)]
    formats = ["jpg", "png", "webp", "jpg", "png", "jpg", "webp", "jpg"]
    for index, (size, fmt) in enumerate(zip(sizes, formats), start=1):
        stem = f"{index:04d}"
        _save_image(_drawing(rng, *size), root / "photos" / f"{stem}.{fmt}")
        _write_json(root / f"{stem}.json", {"messages": _turns(rng, 1 + index % 3), "images": [f"photos/{stem}.{fmt}"]})
    # EXIF orientation 6: stored 640x360, displayed (and tokenised) as 360x640.
    _save_image(_drawing(rng, 640, 360), root / "0009.jpg", exif_orientation=6)
    _write_json(root / "0009.json", {"messages": _turns(rng, 1)})  # media found by the same stem
    # Two images, LLaVA-style conversation, placeholders mid-text.
    _save_image(_drawing(rng, 512, 384), root / "photos" / "pair_a.jpg")
    _save_image(_drawing(rng, 384, 512), root / "photos" / "pair_b.png")
    _write_json(root / "0010.json", {
        "conversations": [
            {"from": "human", "value": "Compare <image> with <image>. Which one is taller?"},
            {"from": "gpt", "value": "The second image is taller than it is wide."},
        ],
        "images": ["photos/pair_a.jpg", "photos/pair_b.png"],
    })
    _write_json(root / "0011.json", {"messages": [
        {"role": "system", "content": "You are a concise assistant."},
        {"role": "user", "content": "Say hello in French."},
        {"role": "assistant", "content": "Bonjour."},
    ]})
    _write_json(root / "0012.json", {"texts": [
        {"role": "user", "content": "<image>Caption this."},
        {"role": "assistant", "content": "A gradient with shapes."},
    ], "images": ["photos/0001.jpg"]})
    long_answer = " ".join(f"word{i % 97}" for i in range(9000))
    _write_json(root / "0013.json", {"messages": [
        {"role": "user", "content": "Write a very long list."}, {"role": "assistant", "content": long_answer},
    ]})
    # Deliberately bad samples.
    (root / "bad_malformed.json").write_text('{"messages": [ {"role": "user", "content": "oops"', encoding="utf-8")
    _write_json(root / "bad_missing_media.json", {"messages": _turns(rng, 1), "images": ["photos/does_not_exist.jpg"]})
    (root / "photos" / "broken.png").write_bytes(b"\x89PNG\r\n\x1a\n" + b"\x00" * 40)
    _write_json(root / "bad_broken_image.json", {"messages": _turns(rng, 1), "images": ["photos/broken.png"]})
    _save_image(_drawing(rng, 64, 64), root / "bad_ambiguous.jpg")
    _save_image(_drawing(rng, 64, 64), root / "bad_ambiguous.png")
    _write_json(root / "bad_ambiguous.json", {"messages": _turns(rng, 1)})


def _video_source(root: Path, rng: random.Random) -> None:
    media = root / "media"
    _encode_video(media / "clips" / "bouncing.mp4", frames=48, size=(320, 240), fps=24, codec="mpeg4", container_format="mp4")
    _encode_video(media / "clips" / "sweep.mkv", frames=40, size=(256, 144), fps=20, codec="mpeg4", container_format="matroska")
    _encode_video(media / "clips" / "no_extension", frames=30, size=(160, 160), fps=15, codec="mpeg4", container_format="mp4")
    _save_image(_drawing(rng, 448, 336), media / "stills" / "frame_still.jpg")
    records = [
        {"id": "v1", "messages": [{"role": "user", "content": "<video>What moves in the clip?"},
                                  {"role": "assistant", "content": "A yellow square moves from left to right."}],
         "videos": ["clips/bouncing.mp4"]},
        {"id": "v2", "messages": [{"role": "user", "content": "<video>Describe the colours."},
                                  {"role": "assistant", "content": "The background fades from black to red."},
                                  {"role": "user", "content": "And the square?"},
                                  {"role": "assistant", "content": "It stays yellow throughout."}],
         "videos": ["clips/sweep.mkv"]},
        {"id": "v3", "messages": [{"role": "user", "content": "<video>How long is this?"},
                                  {"role": "assistant", "content": "About two seconds."}],
         "videos": ["clips/no_extension"]},
        {"id": "v4", "messages": [{"role": "user", "content": "Is the still from the first clip? <image>"},
                                  {"role": "assistant", "content": "It resembles it."}],
         "images": ["stills/frame_still.jpg"]},
        {"id": "v5", "messages": [{"role": "user", "content": "<video>What happens?"},
                                  {"role": "assistant", "content": "Nothing: this clip is missing."}],
         "videos": ["clips/missing.mp4"]},
        {"id": "v6", "messages": [{"role": "user", "content": "<video>Same clip, second question."},
                                  {"role": "assistant", "content": "The square reaches the right edge."}],
         "videos": ["clips/bouncing.mp4"]},
    ]
    lines = [json.dumps(record, ensure_ascii=False) for record in records]
    (root / "video_train.jsonl").write_text("\n".join(lines) + "\n", encoding="utf-8")


def _tar_add(archive: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size, info.mtime, info.mode = len(data), 0, 0o644
    archive.addfile(info, io.BytesIO(data))


def _wds_source(root: Path, rng: random.Random) -> None:
    shard_dir = root / "wds"
    shard_dir.mkdir(parents=True, exist_ok=True)
    for shard in range(2):
        with tarfile.open(shard_dir / f"pretrain-{shard:06d}.tar", "w", format=tarfile.USTAR_FORMAT) as archive:
            for index in range(5):
                key = f"s{shard}_{index:03d}"
                buffer = io.BytesIO()
                _drawing(rng, rng.choice([224, 336, 512, 768]), rng.choice([224, 336, 512])).save(buffer, "JPEG", quality=90)
                _tar_add(archive, f"{key}.jpg", buffer.getvalue())
                if shard == 1 and index == 4:
                    continue  # an image without its json: rejected with a reason
                record = {"messages": _turns(rng, 1 + index % 2), "images": ["jpg"]}
                _tar_add(archive, f"{key}.json", json.dumps(record).encode())


def write_demo(directory: str | Path, note: Callable[[str], None] = lambda line: None) -> Path:
    """Write the demo dataset and its config under `directory`; returns the config path.

    Files whose bytes are already there are left untouched (a rerun over an earlier demo changes
    nothing, so nothing is rebuilt), and a config the user edited is kept (`note` says so).
    """
    root = Path(directory).resolve()
    root.mkdir(parents=True, exist_ok=True)
    rng = random.Random(1234)
    # Generated beside the target (a hidden folder, which no source reads) and moved in file by file.
    with tempfile.TemporaryDirectory(prefix=".demo-staging-", dir=root) as staging_name:
        staging = Path(staging_name)
        _flat_dir(staging / "flat", rng)
        _video_source(staging, rng)
        _wds_source(staging, rng)
        files = [path for path in sorted(staging.rglob("*")) if path.is_file()]
        changed = 0
        for path in files:
            target = root / path.relative_to(staging)
            if not same_bytes(path, target):
                target.parent.mkdir(parents=True, exist_ok=True)
                os.replace(path, target)
                changed += 1
    if not changed:
        note(f"demo data: all {plural(len(files), 'file')} already there, none written")
    else:
        note(f"demo data: {changed} of {plural(len(files), 'file')} written"
             + (", the others were already there" if changed < len(files) else ""))
    config_path = root / CONFIG_NAME
    if config_path.is_file() and config_path.read_text(encoding="utf-8") != DEMO_CONFIG:
        note(f"kept your edited {config_path} (delete it to get the demo's own config back)")
    else:
        atomic_write_text(config_path, DEMO_CONFIG)
    return config_path
