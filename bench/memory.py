"""Memory per sample of each per-source step, from two source sizes.

    .venv/bin/python bench/memory.py [--small 20000] [--large 100000]

Two generated text-only jsonl sources (one- to three-turn chats of 10–400 words; text only, so
the numbers are the tables' own, not the media's) go through the real CLI, one asset at a time
(`vlm-assets run --workers 1 --select ASSET`; the upstream assets are already built and skipped).
Each step runs in a fresh wrapper process whose waited-for descendants are the CLI and its
worker, so the wrapper's RUSAGE_CHILDREN peak RSS is the peak of that step's processes. A step's
memory per sample is the difference of its peaks at the two sizes over the difference of samples,
which cancels the fixed cost (Python, Dagster, the processor). Inputs are cached under
bench/out/memory/.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "bench" / "out" / "memory"
PYTHON = sys.executable
STEPS = ("sample_catalog", "sample_lengths", "packing_bins", "packed_json", "packed_wds_shards")
WORDS = "the a sky is blue because light scatters off small molecules in air more at short wavelengths".split()
PEAK_OF_CHILDREN = (
    "import resource, subprocess, sys\n"
    "code = subprocess.run(sys.argv[1:], stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT).returncode\n"
    "print(code, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)\n"
)


def write_source(samples: int) -> Path:
    # Its own folder: the folder is the source's media root, whose files are part of the catalogue's
    # fingerprint, so the runs' storage must not live in it.
    manifest = OUT / "inputs" / f"chat_{samples}.jsonl"
    if manifest.exists():
        return manifest
    rng = random.Random(samples)
    manifest.parent.mkdir(parents=True, exist_ok=True)
    with open(manifest.with_suffix(".partial"), "w", encoding="utf-8") as handle:
        for number in range(samples):
            messages = []
            for _turn in range(rng.randint(1, 3)):
                messages.append({"role": "user", "content": " ".join(rng.choices(WORDS, k=rng.randint(10, 120)))})
                messages.append({"role": "assistant", "content": " ".join(rng.choices(WORDS, k=rng.randint(10, 400)))})
            handle.write(json.dumps({"id": f"c{number}", "messages": messages}) + "\n")
    manifest.with_suffix(".partial").rename(manifest)
    return manifest


def peaks(samples: int) -> dict[str, float]:
    """Peak RSS (MiB) of each step's processes on a source of `samples` samples."""
    manifest = write_source(samples)
    site = OUT / "sites" / str(samples)
    return step_peaks(site, f"sources:\n  - {{name: chat, kind: jsonl, path: {manifest}}}\npacking: {{min_fill_ratio: 0.2}}\n",
                      STEPS, peak_of_children, f"{samples:>8} samples")


def peak_of_children(command: list[str], env: dict[str, str]) -> tuple[int, int]:
    """Run `command` in a wrapper process; its exit code and the wrapper's RUSAGE_CHILDREN peak RSS (KiB)."""
    output = subprocess.run([PYTHON, "-c", PEAK_OF_CHILDREN, *command], env=env, cwd=ROOT,
                            capture_output=True, text=True, check=True).stdout.split()
    return int(output[0]), int(output[1])


def step_peaks(site: Path, config: str, steps: Sequence[str], peak_of: Callable[[list[str], dict[str, str]], tuple[int, int]],
               label: str) -> dict[str, float]:
    """Peak RSS (MiB) of each of `steps`, built one at a time by `vlm-assets run --workers 1` with `config`
    (YAML, `storage` added: under `site`, which is made afresh and removed after), as `peak_of(command,
    env)` measures it (exit code, KiB)."""
    shutil.rmtree(site, ignore_errors=True)
    site.mkdir(parents=True)
    path = site / "vlm_assets.yaml"
    path.write_text(f"storage: {{root: {site / 'vlm_data'}}}\n{config}", encoding="utf-8")
    env = {**os.environ, "DAGSTER_HOME": str(site / "home")}
    env.pop("VLM_ASSETS_STEP_PROCESSES", None)
    result = {}
    for step in steps:
        command = [PYTHON, "-m", "vlm_assets.cli", "run", "--config", str(path), "--workers", "1", "--select", step]
        code, peak = peak_of(command, env)
        if code != 0:
            raise SystemExit(f"{' '.join(command)} failed (exit {code}); see {site / 'home'}")
        result[step] = peak / 1024
        print(f"  {label}  {step:<18} peak {result[step]:8.0f} MiB", flush=True)
    shutil.rmtree(site)
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--small", type=int, default=20_000)
    parser.add_argument("--large", type=int, default=100_000)
    args = parser.parse_args()
    small, large = peaks(args.small), peaks(args.large)
    print(f"\n| step | peak at {args.small} (MiB) | peak at {args.large} (MiB) | bytes per sample |")
    print("|---|---:|---:|---:|")
    for step in STEPS:
        per_sample = (large[step] - small[step]) * 1024 * 1024 / (args.large - args.small)
        print(f"| {step} | {small[step]:.0f} | {large[step]:.0f} | {per_sample:.0f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
