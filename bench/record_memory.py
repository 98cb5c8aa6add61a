"""Peak memory of each per-source step for one very large record, against the same source without it.

    .venv/bin/python bench/record_memory.py [--turns 10000] [--megabytes 50] [--steps sample_catalog,...]

A JSON-lines source holds a few short chats and one chat of --turns turns, --megabytes MB of JSON in
all (the probe's worst case: one 50 MB record; `max_record_bytes` allows up to 64 MiB). The same
source without that record gives each step's fixed base. `max_token_len` is the largest the config
takes (2**20 tokens, about 4.5 MB of such text): a larger record is rejected by `packing_bins` as
over-long, so `packed_json` and `packed_wds_shards` never carry it; measure those with a record
that packs (`--megabytes 4`). Each step runs through the real CLI, one asset
at a time (`--workers 1`: the step's chunks run in its own process), and its peak is the largest
peak RSS (VmHWM) of the CLI and its worker processes, read from /proc every 20 ms while they run.
Reported per step: both peaks and the growth over the record's size; the bound in
docs/operations.md is a peak within 10 × the record over the base.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from memory import ROOT, STEPS, WORDS, step_peaks  # noqa: E402
from vlm_assets.config import MAX_TOKEN_LEN_BOUND  # noqa: E402
from vlm_assets_tests.run_support import descendants  # noqa: E402

OUT = ROOT / "bench" / "out" / "record_memory"
SMALL_CHATS = 20
POLL_S = 0.02


def peak_of_tree(command: list[str], env: dict[str, str]) -> tuple[int, int]:
    """Run `command`; its exit code and the largest peak RSS (KiB) of it and its descendants."""
    process = subprocess.Popen(command, env=env, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    peak = 0
    while process.poll() is None:
        peak = max([peak, *(_peak_kib(pid) for pid in {process.pid, *descendants(process.pid)})])
        time.sleep(POLL_S)
    return process.returncode, peak


def _peak_kib(pid: int) -> int:
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:  # gone meanwhile
        return 0
    return next((int(line.split()[1]) for line in status.splitlines() if line.startswith("VmHWM:")), 0)


def write_source(folder: Path, turns: int, megabytes: float) -> int:
    """The manifest (with the large record when `turns`) under `folder`; returns the large record's bytes."""
    folder.mkdir(parents=True, exist_ok=True)
    lines = [json.dumps({"id": f"small{number}", "messages": [
        {"role": "user", "content": " ".join(WORDS[number % len(WORDS):] + WORDS)},
        {"role": "assistant", "content": " ".join(WORDS)}]}) for number in range(SMALL_CHATS)]
    large = b""
    if turns:
        sentence = " ".join(WORDS) + ". "
        words_per_turn = max(1, int(megabytes * 1e6 / turns / len(sentence)))
        text = sentence * words_per_turn
        messages = [{"role": "user" if turn % 2 == 0 else "assistant", "content": text} for turn in range(turns)]
        large = json.dumps({"id": "large", "messages": messages}).encode("utf-8")
        lines.append(large.decode("utf-8"))
    (folder / "chat.jsonl").write_text("\n".join(lines) + "\n", encoding="utf-8")
    return len(large)


def peaks(name: str, turns: int, megabytes: float, steps: list[str]) -> tuple[dict[str, float], int]:
    """Peak RSS (MiB) of each step's processes, and the large record's bytes."""
    inputs = OUT / "inputs" / name
    record_bytes = write_source(inputs, turns, megabytes)
    config = (f"sources:\n  - {{name: chat, kind: jsonl, path: {inputs / 'chat.jsonl'}}}\n"
              f"sample: {{max_token_len: {MAX_TOKEN_LEN_BOUND}}}\npacking: {{min_fill_ratio: 0.0}}\n")
    result = step_peaks(OUT / "sites" / name, config, steps, peak_of_tree, f"{name:<6}")
    shutil.rmtree(inputs)
    return result, record_bytes


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--turns", type=int, default=10_000)
    parser.add_argument("--megabytes", type=float, default=50)
    parser.add_argument("--steps", default=",".join(STEPS))
    args = parser.parse_args()
    steps = args.steps.split(",")
    base, _ = peaks("base", 0, 0, steps)
    large, record_bytes = peaks("large", args.turns, args.megabytes, steps)
    record_mib = record_bytes / 2**20
    print(f"\nrecord: {args.turns} turns, {record_mib:.1f} MiB of JSON")
    print("| step | base peak (MiB) | peak with the record (MiB) | growth / record size |")
    print("|---|---:|---:|---:|")
    for step in steps:
        print(f"| {step} | {base[step]:.0f} | {large[step]:.0f} | {(large[step] - base[step]) / record_mib:.1f} × |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
