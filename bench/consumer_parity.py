"""Consumer parity: every packed child, encoded by LoongForge's own training-side code, is as long as we packed it.

    .venv/bin/python bench/consumer_parity.py --loongforge PATH [--out bench/out/consumer_parity]
                                              [--combos qwen2-vl:qwen2_vl,qwen3-vl:qwen3_vl] [--max-token-len 8192]
                                              [--shared DIR] [--workers 2]

PATH is a checkout of LoongForge (baidu-baige/LoongForge); its code is imported from there at run time and run
unchanged. Nothing of it is copied here.

What it does, in one run:
  1. Source: held-out real media of ../shared/data (the images and clips that vlm_assets_tests/
     test_chat_templates.py and the demo do not use: JPEG, PNG with a palette and with alpha, WebP, GIF, CMYK,
     grayscale, extreme aspect ratios, an animated WebP; MP4 at 23.976, 25, 28 and 30 fps, AVI of two codecs,
     AV1 in Matroska, HEVC, 10-bit H.264, a MOV rotated by 90 degrees, one of 4 frames with unordered
     timestamps, a damaged MP4) in samples of each kind: text only, one image, several images, one clip, two
     clips, multi-turn, answers starting with white space and (packed_chat_mix only) a system turn. They are
     written as a jsonl file twice: one source of packed_chat_mix, one of packed_multi_mix_qa (no system turns:
     that type carries none). Samples our packing rejects are listed with their reasons.
  2. For each (chat template, processor family) that LoongForge registers for the Qwen-VL families -
     qwen2-vl with Qwen2-VL and with Qwen2.5-VL, qwen3-vl with Qwen3-VL, qwen2.5-vl-hf with Qwen2.5-VL,
     qwen3-vl-hf with Qwen3-VL - a config (model.processor: the family's processor directory, built offline by
     vlm_assets_tests/processor_families.py; trainer.chat_template: the template; trainer: the defaults) and
     `vlm-assets run --select energon_dataset` through the CLI, on a fresh Dagster instance.
  3. The consumer, in a process of its own per (combination, source): LoongForge's VLMTaskEncoder built as its
     training does (`build_task_encoder(args)`, the chat template and tokenizer from its global_vars with the
     processor directory as --hf-tokenizer-path, `--training-phase sft`, `--chat-template`, the trainer's media
     arguments as flags), and Energon's own `get_train_dataset` over the source's prepared dataset as
     LoongForge's dataloader provider calls it (image_decode="pil"; one pass: repeat=False, no shuffle buffer;
     no online packing: the packs are offline). Every packed sample goes through its cooker and packed encoder
     (_resize_image/_resize_video, the template's media plugin, encode_multiturn or encode_openai) and its batch
     (cu_lengths); a child's length is its span in cu_lengths, i.e. len(input_ids) of that child.
  4. Ours: the per-child lengths the packing recorded, `_meta.token_lens` of each shard's `.json` member.

It prints, per processor and template: children equal / total, packs whose children LoongForge encodes longer
than max_token_len (a pack LoongForge's pack_selected_samples refuses at --seq-length max_token_len), packs the
encoder failed on (LoongForge's error handler drops such a pack whole; each of its children is then encoded alone
to name the one that fails), and every differing child: its id, ours, LoongForge's, its modality. A control
encodes shards packed under qwen2-vl with qwen2.5-vl-hf, whose text rule differs, to show the comparison can
fail. results.json in --out keeps every row. The exit code is 0 when every child of every combination is equal.

Where the virtualenv lacks Megatron-LM (megatron.core, megatron.training) or Hugging Face `datasets`, the
consumer process puts small stand-ins for exactly these names in sys.modules, none of which computes a token,
resizes a medium or renders a template (see UNNEEDED_IMPORTS); they are listed in the output. `qwen_vl_utils`
(which LoongForge's encoder imports smart_resize and smart_nframes from) must be installed:
`.venv/bin/pip install qwen-vl-utils`.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tarfile
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "bench" / "out" / "consumer_parity"
SHARED = ROOT.parent / "shared" / "data"
SEQ_LENGTH = 1 << 20  # the consumer's --seq-length while measuring: no child or pack is cut or refused
DEFAULT_COMBOS = ("qwen2-vl:qwen2_vl", "qwen2-vl:qwen2_5_vl", "qwen3-vl:qwen3_vl", "qwen2.5-vl-hf:qwen2_5_vl",
                  "qwen3-vl-hf:qwen3_vl")
FAMILY_NAMES = {"qwen2_vl": "Qwen2-VL", "qwen2_5_vl": "Qwen2.5-VL", "qwen3_vl": "Qwen3-VL"}
SOURCES = {"parity_chat": "packed_chat_mix", "parity_qa": "packed_multi_mix_qa"}

# Held-out media: none of these is in vlm_assets_tests/test_chat_templates.py (CLIPS, DOG, CATS, HOPPER) or the demo.
IMAGES = {
    "flower_webp": "Pillow/Tests/images/flower.webp",  # 480x360 WebP
    "flower2": "Pillow/Tests/images/flower2.jpg",  # 300x225
    "cmyk": "Pillow/Tests/images/pil_sample_cmyk.jpg",  # CMYK JPEG
    "gray": "Pillow/Tests/images/hopper_gray.jpg",  # mode L
    "palette": "Pillow/Tests/images/pil123p.png",  # mode P
    "rgba": "Pillow/Tests/images/pil123rgba.png",  # RGBA PNG
    "transparent": "Pillow/Tests/images/transparent.webp",  # RGBA WebP
    "gif": "Pillow/Tests/images/hopper.gif",
    "exif6": "Pillow/Tests/images/hopper_orientation_6.jpg",  # EXIF orientation 6
    "animated_webp": "Pillow/Tests/images/iss634.webp",  # 42 frames, RGBA
    "tall": "clip-retrieval/tests/test_clip_inference/test_images/123_456.jpg",  # 123x456
    "wide": "clip-retrieval/tests/test_clip_inference/test_images/456_123.jpg",  # 456x123
    "mid": "clip-retrieval/tests/test_clip_inference/test_images/524_316.jpg",
    "lf1": "LLaMA-Factory/data/mllm_demo_data/1.jpg",
    "lf2": "LLaMA-Factory/data/mllm_demo_data/2.jpg",
    "lf3": "LLaMA-Factory/data/mllm_demo_data/3.jpg",
}
VIDEOS = {
    "lf_mp4_25fps": "LLaMA-Factory/data/mllm_demo_data/1.mp4",  # 640x360, 25 fps, 9.7 s
    "lf_avi_h264": "LLaMA-Factory/data/mllm_demo_data/2.avi",  # 320x240, 29.917 fps
    "lf_mp4_23976": "LLaMA-Factory/data/mllm_demo_data/3.mp4",  # 640x360, 23.976 fps
    "mmaction_mp4_28fps": "mmaction2/demo/demo.mp4",  # 340x256, 28 fps, 10 s
    "mmaction_avi_mpeg4": "mmaction2/tests/data/test.avi",  # MPEG-4 part 2 + MP3
    "av1_mkv": "torchcodec/test/resources/av1_video.mkv",  # AV1 in Matroska (a .webm member)
    "hevc_mp4": "torchcodec/test/resources/h265_video.mp4",  # 128x128, 10 frames
    "h264_10bit": "torchcodec/test/resources/h264_10bits.mp4",  # yuv420p10le, 200x200
    "mov_rot0": "decord/tests/test_data/video_0.mov",  # 3 frames
    "mov_rot270": "decord/tests/test_data/video_270.mov",  # display matrix: rotated by 90
    "mov_unordered": "decord/tests/test_data/unordered.mov",  # 4 frames, 0.125 s, timestamps out of order
    "mp4_corrupted": "decord/tests/test_data/corrupted.mp4",  # its header says 50 frames; 28 decode
}

# The imports LoongForge's VLM encoder path makes that a training install has and this virtualenv need not:
# module -> what stands in for it. Used only where the real module cannot be imported. None of them takes part
# in a child's tokens: Megatron's argument and global-variable plumbing (get_args, the initialised checks), the
# tokenizer wrapper's abstract base class (its __init__ keeps the path as an identifier; every method the
# encoder calls is LoongForge's AutoTokenizerFromHF's own), the padded vocabulary size (an embedding-table size),
# and the names the Hugging Face SFT dataset path (`datasets`, Megatron's dataset config and parallel state)
# imports at module level, which loongforge.data's __init__ pulls in.
UNNEEDED_IMPORTS = {
    "megatron.core": "package",
    "megatron.core.utils": "log_single_rank (logging)",
    "megatron.core.parallel_state": "get_virtual_pipeline_model_parallel_rank (-> None)",
    "megatron.core.datasets": "package",
    "megatron.core.datasets.utils": "Split, normalize (HF SFT dataset splits)",
    "megatron.core.datasets.blended_megatron_dataset_config":
        "BlendedMegatronDatasetConfig (HF SFT dataset config base)",
    "megatron.core.datasets.megatron_tokenizer": "MegatronLegacyTokenizer (abstract base of AutoTokenizerFromHF)",
    "megatron.training": "get_args (returns the harness's argument namespace)",
    "megatron.training.global_vars": "_ensure_var_is_initialized, _ensure_var_is_not_initialized (asserts)",
    "megatron.training.tokenizer": "build_tokenizer (Megatron's own tokenizers: not used with HFTokenizer)",
    "megatron.training.tokenizer.tokenizer": "_vocab_size_with_padding (padded embedding size)",
    "datasets": "Dataset, IterableDataset, DatasetDict, Features, Value, load_dataset, concatenate_datasets, "
                "interleave_datasets (HF SFT dataset path)",
}


# ---- the source -------------------------------------------------------------------------------------------
def _turns(*texts: str) -> list[dict[str, str]]:
    return [{"role": "user" if index % 2 == 0 else "assistant", "content": text} for index, text in enumerate(texts)]


def held_out_records() -> list[dict]:
    """The samples: id, messages, images/videos (names relative to the shared data folder)."""
    records: list[dict] = [
        {"id": "text_one", "messages": _turns("What is the capital of France?", "Paris.")},
        {"id": "text_multi", "messages": _turns("Write a haiku about rain.",
                                                "Soft rain on the roof\nthe garden drinks slowly\nclouds move east",
                                                "Now one in 中文.", "雨落屋顶上")},
        # Answers that start with white space: the legacy templates tokenise an answer apart from the assistant
        # header before it, and the *-hf templates open their generation span between the two.
        {"id": "text_answer_newline", "messages": _turns("List two cities.", "\n\n1. Paris\n2. Lyon",
                                                         "And one more?", " \nNice.")},
        {"id": "image_answer_newline", "messages": _turns("<image>What is it?", "\nA flower."),
         "images": [IMAGES["lf3"]]},
    ]
    for key, path in IMAGES.items():
        records.append({"id": f"image_{key}", "messages": _turns("<image>\nDescribe this picture.",
                                                                 f"It is a picture ({key})."), "images": [path]})
    records += [
        {"id": "images_two", "messages": _turns("Compare <image> with <image>.", "The first is brighter."),
         "images": [IMAGES["lf1"], IMAGES["lf2"]]},
        {"id": "images_three_turns", "messages": _turns("<image> What is here?", "Flowers.", "And here? <image>",
                                                        "A face.", "Last one: <image>", "A wide strip."),
         "images": [IMAGES["flower2"], IMAGES["gray"], IMAGES["wide"]]},
        {"id": "image_multi_turn", "messages": _turns("<image>How many colours?", "Several.", "Which one dominates?",
                                                      "Red.", "Is it a photo?", "Yes."), "images": [IMAGES["mid"]]},
    ]
    for key, path in VIDEOS.items():
        records.append({"id": f"video_{key}", "messages": _turns("<video>\nWhat happens in this clip?",
                                                                 "Something moves."), "videos": [path]})
    records += [
        {"id": "videos_two", "messages": _turns("Compare <video> and <video>.", "They differ.", "How?", "In pace."),
         "videos": [VIDEOS["mmaction_avi_mpeg4"], VIDEOS["hevc_mp4"]]},
        {"id": "video_multi_turn", "messages": _turns("<video> Who is there?", "A person.", "What next?", "They go."),
         "videos": [VIDEOS["lf_mp4_23976"]]},
        {"id": "system_text", "messages": [{"role": "system", "content": "Answer in one word."},
                                           *_turns("Sky colour?", "Blue.")]},
        {"id": "system_image", "messages": [{"role": "system", "content": "You are a botanist."},
                                            *_turns("<image>Name it.", "A flower.")],
         "images": [IMAGES["flower_webp"]]},
        {"id": "system_empty", "messages": [{"role": "system", "content": ""}, *_turns("Hi?", "Hello.")]},
        {"id": "system_video", "messages": [{"role": "system", "content": "Be brief."},
                                            *_turns("<video>Summarise.", "A demo.", "More?", "No.")],
         "videos": [VIDEOS["mmaction_avi_mpeg4"]]},
    ]
    return records


def write_sources(out: Path, shared: Path) -> dict[str, Path]:
    missing = [path for path in (*IMAGES.values(), *VIDEOS.values()) if not (shared / path).is_file()]
    if missing:
        raise SystemExit(f"missing real media under {shared}: {', '.join(missing)} (pass --shared DIR)")
    records = held_out_records()
    paths = {}
    for source, sample_type in SOURCES.items():
        path = out / "source" / f"{source}.jsonl"
        path.parent.mkdir(parents=True, exist_ok=True)
        kept = [record for record in records
                if sample_type == "packed_chat_mix" or not any(m["role"] == "system" for m in record["messages"])]
        path.write_text("".join(json.dumps(record, ensure_ascii=False) + "\n" for record in kept), encoding="utf-8")
        paths[source] = path
    return paths


CONFIG = """\
storage: {{root: {root}}}
sources:
{sources}
model: {{processor: {processor}}}
sample: {{sample_type: packed_chat_mix, max_token_len: {max_token_len}}}
trainer: {{chat_template: {template}}}
"""


def write_config(workdir: Path, template: str, processor: Path, sources: dict[str, Path], shared: Path,
                 max_token_len: int) -> Path:
    lines = "\n".join(f"  - {{name: {name}, kind: jsonl, path: {json.dumps(str(path))}, "
                      f"media_root: {json.dumps(str(shared))}, sample_type: {SOURCES[name]}}}"
                      for name, path in sources.items())
    config = workdir / "vlm_assets.yaml"
    config.write_text(CONFIG.format(root=json.dumps(str(workdir / "vlm_data")), sources=lines,
                                    processor=json.dumps(str(processor)), template=template,
                                    max_token_len=max_token_len), encoding="utf-8")
    return config


def run_pipeline(workdir: Path, config: Path, workers: int) -> float:
    """`vlm-assets run` through its CLI on a fresh instance; returns its wall seconds."""
    cli = Path(sys.executable).parent / "vlm-assets"
    command = [str(cli)] if cli.is_file() else [sys.executable, "-m", "vlm_assets.cli"]
    command += ["run", "--config", str(config), "--select", "energon_dataset", "--workers", str(workers)]
    env = {key: value for key, value in os.environ.items() if key not in ("VLM_ASSETS_CONFIG", "VLM_ASSETS_PG_HOST")}
    env["DAGSTER_HOME"] = str(workdir / "dagster_home")
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])
    started = time.perf_counter()
    with open(workdir / "vlm-assets-run.log", "w", encoding="utf-8") as log:
        result = subprocess.run(command, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    if result.returncode != 0:
        tail = (workdir / "vlm-assets-run.log").read_text(encoding="utf-8")[-3000:]
        raise SystemExit(f"{' '.join(command)} failed ({result.returncode}); its log ends:\n{tail}")
    return time.perf_counter() - started


# ---- ours: what the packing recorded ----------------------------------------------------------------------
def packed_children(dataset: Path) -> dict[str, dict]:
    """child key -> {sample_id, ours, modality, pack} from every shard's `.json` member (`_meta.token_lens`)."""
    children = {}
    for shard in sorted(dataset.rglob("*.tar")):
        if ".nv-meta" in shard.parts:
            continue
        with tarfile.open(shard) as archive:
            for member in archive:
                if not member.name.endswith(".json"):
                    continue
                record = json.loads(archive.extractfile(member).read())
                meta = record["_meta"]
                for index, (sample_id, length) in enumerate(zip(meta["sample_ids"], meta["token_lens"], strict=True)):
                    children[f"{record['id']}.q{index:03d}"] = {
                        "sample_id": sample_id, "ours": int(length), "pack": record["id"],
                        "modality": _modality(record, index)}
    return children


def _modality(record: dict, index: int) -> str:
    media = len(record["media_files"][index])
    kind = record["media_type"]
    turns = record["messages"][index]["messages"]
    label = "text" if kind == "text" else (kind if media == 1 else f"{media} {kind}s")
    users = sum(turn["role"] == "user" for turn in turns)
    extras = ([f"{users} user turns"] if users > 1 else []) + (["system"] if turns[0]["role"] == "system" else [])
    return label + (f" ({', '.join(extras)})" if extras else "")


# ---- theirs: LoongForge's encoder over Energon's loader, in a process of its own ----------------------------
def consumer_lengths(loongforge: Path, dataset: Path, processor: Path, template: str, trainer: dict,
                     result: Path) -> None:
    """Run in a child process: writes {child key: length, ...}, the packs that failed and the stand-ins used."""
    sys.path.insert(0, str(loongforge))
    stood_in = _stand_in_unneeded_imports()
    import argparse as argparse_module

    import megatron.training
    from megatron.energon import WorkerConfig, get_loader, get_train_dataset

    args = argparse_module.Namespace(
        # Megatron-LM's own arguments the path reads
        rank=0, seq_length=SEQ_LENGTH, micro_batch_size=1, num_workers=0, make_vocab_size_divisible_by=128,
        tensor_model_parallel_size=1, padded_vocab_size=None, vocab_size_in_config_file=None,
        # LoongForge's, as a user passes them (loongforge/train/arguments.py defaults otherwise)
        training_phase="sft", chat_template=template, chat_template_kwargs=None, task_encoder=None,
        tokenizer_type="HFTokenizer", hf_tokenizer_path=str(processor), hf_processor_path=None,
        use_fast_tokenizer=False, split_special_tokens=False, padding_side="right", additional_special_tokens=None,
        model_family=None, sft_dataset=None,
        # what its SFT validator sets when --sft-dataset-config is not given (train/validators.py)
        sft_dataset_config=str(loongforge / "configs" / "data" / "sft_dataset_config.yaml"),
        train_on_prompt=False, history_mask_loss=False, add_question_in_pretrain=False,
        packing_sft_data=False, packing_pretrain_data=False, enable_discard_sample=False, packing_buffer_size=None,
        max_packed_tokens=8192, num_images_expected=48, max_buffer_size=20, energon_pack_algo="balanced",
        **trainer,
    )
    if getattr(megatron.training, "_STAND_IN", False):
        megatron.training.get_args = lambda: args
    else:
        from megatron.training import global_vars  # a real Megatron-LM: its own global args

        global_vars.set_args(args)

    # loongforge.utils first, as its training entry points import it: loongforge.data and it import each other.
    from loongforge.utils.global_vars import set_loongforge_extra_global_vars
    from loongforge.data.multimodal import build_task_encoder

    set_loongforge_extra_global_vars(args)
    encoder = build_task_encoder(args)
    failures: list[dict] = []

    def record_failure(exception, sample, sources=None):
        """Energon's error handler (LoongForge's logs and skips the pack): the pack's error, and each of its
        children encoded alone by the same packed encoder, to tell which child fails."""
        key = str(getattr(sample, "__key__", "?")).rsplit("/", 1)[-1]
        alone = {}
        for index, child in enumerate(_one_child_packs(sample)):
            try:
                encoded = encoder.encode_packed_chat_mix(child) if hasattr(child, "packed_messages") \
                    else encoder.encode_packed_multi_mix_qa(child)
                alone[f"{key}.q{index:03d}"] = {"length": int(encoded.cu_lengths[-1])}
            except Exception as error:  # noqa: BLE001 - reported, as LoongForge's handler would log it
                alone[f"{key}.q{index:03d}"] = {"error": f"{type(error).__name__}: {error}"}
        failures.append({"key": key, "error": f"{type(exception).__name__}: {exception}", "alone": alone})

    worker_config = WorkerConfig(rank=0, world_size=1, num_workers=0, global_error_handler=record_failure)
    dataset_iter = get_train_dataset(
        str(dataset), split_part="train", batch_size=1, task_encoder=encoder, worker_config=worker_config,
        packing_buffer_size=None, shuffle_buffer_size=None, max_samples_per_sequence=None, repeat=False,
        image_decode="pil")
    lengths: dict[str, int] = {}
    for batch in get_loader(dataset_iter):
        for packed_key, cu_lengths in zip(batch["__key__"], batch["cu_lengths"], strict=True):
            spans = [int(b) - int(a) for a, b in zip(cu_lengths[:-1], cu_lengths[1:])]
            children = packed_key.split(",")
            if len(children) != len(spans):
                raise AssertionError(f"{packed_key}: {len(children)} children, {len(spans)} spans in cu_lengths")
            for child, span in zip(children, spans):
                lengths[child.rsplit("/", 1)[-1]] = span
    result.write_text(json.dumps({"lengths": lengths, "failures": failures, "stood_in": stood_in,
                                  "encoder": f"{type(encoder).__module__}.{type(encoder).__qualname__}",
                                  "template": type(encoder.chat_template).__name__,
                                  "plugin": type(encoder.chat_template.mm_plugin).__name__,
                                  "processor": type(encoder.processor).__name__}), encoding="utf-8")


def _one_child_packs(sample) -> list:
    """A cooked packed sample as one packed sample per child (its fields' i-th entries), else []."""
    from dataclasses import fields, replace

    names = {field.name for field in fields(sample)} if hasattr(sample, "__dataclass_fields__") else set()
    if "packed_messages" in names:
        return [replace(sample, packed_messages=[messages],
                        packed_images=None if sample.packed_images is None else [sample.packed_images[index]],
                        packed_videos=None if sample.packed_videos is None else [sample.packed_videos[index]])
                for index, messages in enumerate(sample.packed_messages)]
    if "contexts" in names and "answers" in names:
        return [replace(sample, contexts=[contexts], answers=[sample.answers[index]],
                        images=None if sample.images is None else [sample.images[index]],
                        videos=None if sample.videos is None else [sample.videos[index]])
                for index, contexts in enumerate(sample.contexts)]
    return []


def _stand_in_unneeded_imports() -> list[str]:
    """Put a stand-in for each of UNNEEDED_IMPORTS that cannot be imported; returns their names."""
    import abc
    import enum
    import importlib
    import logging
    import types
    from collections import OrderedDict

    def importable(name: str) -> bool:
        try:
            importlib.import_module(name)
            return True
        except ModuleNotFoundError:
            return False

    def refuse(what: str):
        def call(*_args, **_kwargs):
            raise NotImplementedError(f"{what} is a stand-in: the VLM encoder path does not use it")
        return call

    class MegatronLegacyTokenizer(abc.ABC):
        def __init__(self, *tokenizer_paths: str, **tokenizer_options):
            self.unique_identifiers = OrderedDict(
                [("class", type(self).__name__), ("tokenizer_path", list(tokenizer_paths)), *tokenizer_options.items()])

    class Split(enum.Enum):
        train = 0
        valid = 1
        test = 2

    def normalize(weights):
        total = sum(weights)
        return [weight / total for weight in weights]

    def vocab_size_with_padding(orig_vocab_size, args):
        multiple = args.make_vocab_size_divisible_by * args.tensor_model_parallel_size
        return -(-orig_vocab_size // multiple) * multiple

    def ensure_initialized(var, name):
        assert var is not None, f"{name} is not initialized."

    def ensure_not_initialized(var, name):
        assert var is None, f"{name} is already initialized."

    contents = {
        "megatron.core": {},
        "megatron.core.utils": {"log_single_rank": lambda logger, *args, **kwargs: logger.log(*args, **kwargs)},
        "megatron.core.parallel_state": {"get_virtual_pipeline_model_parallel_rank": lambda: None},
        "megatron.core.datasets": {},
        "megatron.core.datasets.utils": {"Split": Split, "normalize": normalize},
        "megatron.core.datasets.blended_megatron_dataset_config": {
            "BlendedMegatronDatasetConfig": type("BlendedMegatronDatasetConfig", (), {})},
        "megatron.core.datasets.megatron_tokenizer": {"MegatronLegacyTokenizer": MegatronLegacyTokenizer},
        "megatron.training": {"_STAND_IN": True, "get_args": None},
        "megatron.training.global_vars": {"_ensure_var_is_initialized": ensure_initialized,
                                          "_ensure_var_is_not_initialized": ensure_not_initialized},
        "megatron.training.tokenizer": {"build_tokenizer": refuse("Megatron's build_tokenizer")},
        "megatron.training.tokenizer.tokenizer": {"_vocab_size_with_padding": vocab_size_with_padding},
        "datasets": {**{name: type(name, (), {"__init__": refuse(f"datasets.{name}")})
                        for name in ("Dataset", "IterableDataset", "DatasetDict", "Features", "Value")},
                     **{name: refuse(f"datasets.{name}")
                        for name in ("load_dataset", "concatenate_datasets", "interleave_datasets")}},
    }
    assert set(contents) == set(UNNEEDED_IMPORTS)
    stood_in = []
    for name, attributes in contents.items():  # parents first
        if name in sys.modules or importable(name):
            continue
        module = types.ModuleType(name, f"stand-in for {name} (bench/consumer_parity.py): {UNNEEDED_IMPORTS[name]}")
        module.__path__ = []  # a package, so that its stand-in children import
        module.__dict__.update(attributes)
        sys.modules[name] = module
        parent, _, child = name.rpartition(".")
        if parent:
            setattr(sys.modules[parent], child, module)
        stood_in.append(name)
    logging.getLogger("megatron.energon").setLevel(logging.WARNING)
    return stood_in


# ---- the comparison ---------------------------------------------------------------------------------------
def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--loongforge", type=Path, required=True, help="a checkout of baidu-baige/LoongForge")
    parser.add_argument("--out", type=Path, default=OUT, help="working folder (default bench/out/consumer_parity)")
    parser.add_argument("--combos", default=",".join(DEFAULT_COMBOS),
                        help="template:family pairs (families: qwen2_vl, qwen2_5_vl, qwen3_vl)")
    parser.add_argument("--max-token-len", type=int, default=8192, help="sample.max_token_len (bin capacity)")
    parser.add_argument("--shared", type=Path, default=SHARED, help="the real media folder (default ../shared/data)")
    parser.add_argument("--workers", type=int, default=2, help="vlm-assets run --workers")
    parser.add_argument("--consumer", nargs=5, metavar=("DATASET", "PROCESSOR", "TEMPLATE", "TRAINER", "RESULT"),
                        help=argparse.SUPPRESS)  # the child process of step 3
    args = parser.parse_args()
    loongforge = args.loongforge.resolve()
    if args.consumer:
        dataset, processor, template, trainer, result = args.consumer
        consumer_lengths(loongforge, Path(dataset), Path(processor), template, json.loads(trainer), Path(result))
        return 0
    if not (loongforge / "loongforge" / "data" / "multimodal" / "vlm_task_encoder.py").is_file():
        raise SystemExit(f"--loongforge {args.loongforge}: not a LoongForge checkout (no loongforge/data/multimodal/"
                         "vlm_task_encoder.py)")

    sys.path.insert(0, str(ROOT))
    from dataclasses import asdict

    from vlm_assets.config import TrainerConfig
    from vlm_assets_tests.processor_families import family_processor_dirs

    combos = [tuple(combo.split(":")) for combo in args.combos.split(",")]
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    shared = args.shared.resolve()
    sources = write_sources(out, shared)
    directories = family_processor_dirs(tuple(sorted({family for _t, family in combos})), out / "processors")
    trainer = {key: value for key, value in asdict(TrainerConfig()).items() if key != "chat_template"}
    revision = _revision(loongforge)
    print(f"LoongForge: {loongforge} ({revision}); media: {shared}; max_token_len {args.max_token_len}; "
          f"trainer (ours and LoongForge's flags): {trainer}")
    print(f"source: {sum(1 for _ in sources['parity_chat'].open())} samples (packed_chat_mix), "
          f"{sum(1 for _ in sources['parity_qa'].open())} (packed_multi_mix_qa): {len(IMAGES)} images, "
          f"{len(VIDEOS)} clips, held out\n")

    rows, all_equal = [], True
    for template, family in combos:
        workdir = out / "runs" / f"{template}-{family}"
        shutil.rmtree(workdir, ignore_errors=True)
        workdir.mkdir(parents=True)
        config = write_config(workdir, template, directories[family], sources, shared, args.max_token_len)
        seconds = run_pipeline(workdir, config, args.workers)
        for source, sample_type in SOURCES.items():
            dataset = workdir / "vlm_data" / "packed_wds" / source
            started = time.perf_counter()
            theirs = encode_with_loongforge(loongforge, dataset, directories[family], template, trainer,
                                            workdir / f"consumer-{source}.json")
            row = compare(FAMILY_NAMES[family], template, sample_type, packed_children(dataset), theirs,
                          args.max_token_len)
            row["seconds"] = (seconds, time.perf_counter() - started)
            row["rejects"] = rejected(workdir / "vlm_data" / "packing" / f"{source}.rejects.parquet")
            rows.append(row)
            all_equal &= row["equal"] == row["total"] and not row["failures"]
    report(rows)
    (out / "results.json").write_text(json.dumps(rows, indent=1, ensure_ascii=False), encoding="utf-8")
    control(loongforge, out, combos, directories, trainer, args.max_token_len)
    return 0 if all_equal else 1


def encode_with_loongforge(loongforge: Path, dataset: Path, processor: Path, template: str, trainer: dict,
                           result: Path) -> dict:
    """consumer_lengths in a process of its own (LoongForge keeps its template and tokenizer in globals)."""
    child = subprocess.run(
        [sys.executable, __file__, "--loongforge", str(loongforge), "--consumer", str(dataset), str(processor),
         template, json.dumps(trainer), str(result)],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if child.returncode != 0:
        raise SystemExit(f"LoongForge's encoder could not be run on {dataset}:\n{child.stdout[-4000:]}")
    return json.loads(result.read_text(encoding="utf-8"))


def rejected(path: Path) -> list[tuple[str, str]]:
    """(sample id, reason) of the samples our packing left out (they reach no shard)."""
    import pyarrow.parquet as pq

    return [(row["sample_id"], row["reason"]) for row in pq.read_table(path).to_pylist()] if path.is_file() else []


# The check that the comparison can fail: shards packed for one template, encoded by LoongForge under another
# of the same family whose text rule differs (the *-hf templates end every turn with a newline).
CONTROL = ("qwen2-vl", "qwen2_5_vl", "qwen2.5-vl-hf")


def control(loongforge: Path, out: Path, combos: list, directories: dict, trainer: dict, capacity: int) -> None:
    packed_under, family, encoded_under = CONTROL
    if (packed_under, family) not in combos:
        return
    dataset = out / "runs" / f"{packed_under}-{family}" / "vlm_data" / "packed_wds" / "parity_chat"
    theirs = encode_with_loongforge(loongforge, dataset, directories[family], encoded_under, trainer,
                                    out / "runs" / "control.json")
    row = compare(FAMILY_NAMES[family], encoded_under, "packed_chat_mix", packed_children(dataset), theirs, capacity)
    differences = Counter(
        "pack dropped" if mismatch["theirs"] is None else f"{mismatch['theirs'] - mismatch['ours']:+d}"
        for mismatch in row["mismatches"])
    print(f"\ncontrol (the comparison can fail): {FAMILY_NAMES[family]} shards packed under {packed_under}, encoded "
          f"by LoongForge under {encoded_under}: {len(row['mismatches'])} of {row['total']} children differ "
          f"(LoongForge minus ours: {dict(sorted(differences.items()))})")


def compare(processor: str, template: str, sample_type: str, ours: dict, theirs: dict, capacity: int) -> dict:
    lengths = theirs["lengths"]
    alone = {key: result for failure in theirs["failures"] for key, result in failure.get("alone", {}).items()}
    mismatches, packs = [], Counter()
    for key, child in ours.items():
        measured = lengths.get(key)
        if measured is not None:
            packs[child["pack"]] += measured
        if measured != child["ours"]:
            mismatches.append({**child, "theirs": measured, "alone": alone.get(key)})
    unknown = sorted(set(lengths) - set(ours))
    return {"processor": processor, "template": template, "sample_type": sample_type, "total": len(ours),
            "equal": len(ours) - len(mismatches), "mismatches": mismatches, "unknown": unknown,
            "overflowing": sorted(pack for pack, total in packs.items() if total > capacity),
            "failures": theirs["failures"], "stood_in": theirs["stood_in"],
            "consumer": f"{theirs['encoder']} / {theirs['template']} + {theirs['plugin']} / {theirs['processor']}"}


def report(rows: list[dict]) -> None:
    print(f"{'processor':<12}{'template':<15}{'sample type':<21}{'children equal':>16}{'packs over':>12}"
          f"{'failed':>8}{'left out':>10}{'run s':>8}{'encode s':>10}")
    for row in rows:
        print(f"{row['processor']:<12}{row['template']:<15}{row['sample_type']:<21}"
              f"{row['equal']:>7} / {row['total']:<6}{len(row['overflowing']):>12}{len(row['failures']):>8}"
              f"{len(row['rejects']):>10}{row['seconds'][0]:>8.0f}{row['seconds'][1]:>10.0f}")
    totals: dict[tuple[str, str], Counter] = {}
    for row in rows:
        total = totals.setdefault((row["processor"], row["template"]), Counter())
        total["equal"] += row["equal"]
        total["total"] += row["total"]
        dropped = [mismatch for mismatch in row["mismatches"] if mismatch["theirs"] is None]
        total["dropped"] += len(dropped)
        total["alone equal"] += sum(1 for mismatch in dropped
                                    if (mismatch["alone"] or {}).get("length") == mismatch["ours"])
        total["alone fail"] += sum(1 for mismatch in dropped if "error" in (mismatch["alone"] or {}))
    print("\nprocessor | template | children equal / total | in packs LoongForge drops: equal alone, failing alone")
    for (processor, template), total in totals.items():
        print(f"{processor} | {template} | {total['equal']} / {total['total']} | {total['dropped']}: "
              f"{total['alone equal']}, {total['alone fail']}")
    for row in rows:
        label = f"{row['processor']} {row['template']} {row['sample_type']}"
        for mismatch in row["mismatches"]:
            if mismatch["theirs"] is not None:
                print(f"  {label}: {mismatch['sample_id']} ({mismatch['pack']}): ours {mismatch['ours']}, "
                      f"LoongForge {mismatch['theirs']}, {mismatch['modality']}")
        for failure in row["failures"]:
            # LoongForge's error handler logs the pack and skips it: none of its children is trained on.
            children = [mismatch for mismatch in row["mismatches"] if mismatch["pack"] == failure["key"]]
            equal_alone = sum(1 for child in children if (child["alone"] or {}).get("length") == child["ours"])
            print(f"  {label}: pack {failure['key']} ({len(children)} children) fails in LoongForge's encoder, "
                  f"which drops it: {failure['error']}; its children encoded alone: {equal_alone} equal to ours")
            for child in children:
                alone = child["alone"] or {}
                if alone.get("length") != child["ours"]:
                    theirs = alone["length"] if "length" in alone else f"fails ({alone.get('error', 'not encoded')})"
                    print(f"    {child['sample_id']}: ours {child['ours']}, LoongForge alone {theirs}, "
                          f"{child['modality']}")
        for key in row["unknown"]:
            print(f"  {label}: LoongForge encoded a child {key} that no shard records")
        if row["overflowing"]:
            print(f"  {label}: packs LoongForge encodes longer than max_token_len: {', '.join(row['overflowing'])}")
    rejects = sorted({reject for row in rows for reject in row["rejects"]})
    if rejects:
        print("\nleft out by our packing (in no shard, so in neither count):")
        for sample_id, reason in rejects:
            print(f"  {sample_id}: {reason}")
    consumers = sorted({row["consumer"] for row in rows})
    stood_in = sorted({name for row in rows for name in row["stood_in"]})
    print("\nconsumer: " + "; ".join(consumers))
    print("stand-ins for unneeded imports: " + (", ".join(stood_in) if stood_in else "none"))


def _revision(loongforge: Path) -> str:
    try:
        return subprocess.run(["git", "-C", str(loongforge), "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "revision unknown: not a git work tree"


if __name__ == "__main__":
    sys.exit(main())
