"""What `vlm-assets run` costs before its first step, in CPU-seconds, piece by piece, and the embedded
processor's load against the same directory as transformers' `save_pretrained` writes it.

    .venv/bin/python bench/run_start.py [--repeats 5]

Every measurement is a fresh interpreter (imports are most of the cost), its CPU read from the
kernel's accounting of the finished child (user + system), the median over --repeats rounds; the
rounds alternate the variants so a busy machine slows each alike. It prints:
  processor load     AutoProcessor.from_pretrained of the embedded Qwen2-VL processor, after its
                     classes are imported: as vlm-assets writes it (the added tokens listed in
                     tokenizer_config.json) vs a copy without them (transformers 5's save_pretrained
                     leaves them out, and each load then parses the 18 MB tokenizer.json once more)
  preloads           what `run` loads before it forks its workers, one piece after the other in
                     one process (each piece's CPU, and the sum): the worker module (Dagster, the
                     definitions' modules), the Energon loader (torch), the processor classes
                     (torchvision, transformers), the processor, the stored text spec's tokenizer;
                     under imports_without_gc, as `run` loads them, vs with the garbage collector
                     running throughout
  CLI                `vlm-assets run --plan` on the demo, everything built (imports, the instance,
                     the plan): what the CLI process costs when it has nothing to build
Nothing here is asserted; CI does not run it.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from vlm_assets.demo import write_demo
from vlm_assets.tokens.processor import embedded_processor_dir

OUT = Path(__file__).resolve().parent / "out" / "run_start"
VLM_ASSETS = Path(sys.executable).with_name("vlm-assets")

LOAD = """
import sys, time
from transformers import AutoProcessor
started = time.process_time()
AutoProcessor.from_pretrained(sys.argv[1], local_files_only=True)
print(time.process_time() - started)
"""

PRELOADS = """
import contextlib, json, os, sys, time
import vlm_assets.parallel
if sys.argv[1] == "running":  # the baseline: no pause anywhere, the package's own ones (processor loads) included
    vlm_assets.parallel.imports_without_gc = contextlib.nullcontext
pieces, last = {}, time.process_time()

def done(name):
    global last
    now = time.process_time()
    pieces[name] = now - last
    last = now

def load():
    import vlm_assets.orchestration.task
    done("worker module (Dagster, definitions)")
    import vlm_assets.packing.energon_loader
    done("Energon loader (torch)")
    from vlm_assets.tokens.processor import import_processor_classes, shared_processor
    import_processor_classes()
    done("processor classes (torchvision, transformers)")
    from vlm_assets.config import load_config
    app = load_config(os.environ["VLM_ASSETS_CONFIG"])
    shared_processor(app.model)
    done("processor")
    from vlm_assets.tokens.text import spec_text, stored_text_spec
    spec = stored_text_spec(app.model)
    if spec is not None:
        spec_text(spec)
    done("text spec tokenizer")


# As `run` loads them before forking its workers ("paused"), or with the collector on throughout ("running").
with vlm_assets.parallel.imports_without_gc():
    load()
print(json.dumps(pieces))
"""


def child_cpu(command: list[str], env: dict[str, str] | None = None) -> tuple[float, str]:
    """The CPU-seconds (user + system) of `command` and its children, and what it printed."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    result = subprocess.run(command, capture_output=True, text=True, env=env)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if result.returncode != 0:
        raise SystemExit(f"{' '.join(command)} failed:\n{result.stdout[-2000:]}{result.stderr[-2000:]}")
    return (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime), result.stdout


def without_added_tokens(embedded: Path) -> Path:
    """A copy of the embedded processor whose tokenizer_config.json does not list the added tokens."""
    copy = OUT / "embedded-as-saved"
    if not copy.exists():
        staging = Path(tempfile.mkdtemp(dir=OUT))
        shutil.copytree(embedded, staging, dirs_exist_ok=True)
        config = json.loads((staging / "tokenizer_config.json").read_text(encoding="utf-8"))
        config.pop("added_tokens_decoder")
        (staging / "tokenizer_config.json").write_text(json.dumps(config, indent=2), encoding="utf-8")
        staging.rename(copy)
    return copy


def built_demo() -> tuple[Path, dict[str, str]]:
    """The demo config, its graph built once (so `--plan` finds every output), and the environment to run it in."""
    config = OUT / "demo" / "vlm_assets.yaml"
    env = {**os.environ, "DAGSTER_HOME": str(OUT / "home"), "VLM_ASSETS_CONFIG": str(config)}
    if not (OUT / "built").exists():
        shutil.rmtree(OUT / "demo", ignore_errors=True)
        shutil.rmtree(OUT / "home", ignore_errors=True)
        (OUT / "home").mkdir(parents=True)
        write_demo(OUT / "demo")
        child_cpu([str(VLM_ASSETS), "run", "--config", str(config)], env)
        (OUT / "built").touch()
    return config, env


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    OUT.mkdir(parents=True, exist_ok=True)
    embedded = embedded_processor_dir()
    as_saved = without_added_tokens(embedded)
    config, env = built_demo()

    loads: dict[str, list[float]] = {"added tokens listed (ours)": [], "as save_pretrained writes it": []}
    collector = ("paused", "running")
    pieces: dict[str, dict[str, list[float]]] = {state: {} for state in collector}
    plans: list[float] = []
    for _ in range(args.repeats):
        for name, directory in (("added tokens listed (ours)", embedded), ("as save_pretrained writes it", as_saved)):
            loads[name].append(float(child_cpu([sys.executable, "-c", LOAD, str(directory)])[1].split()[-1]))
        for state in collector:
            printed = child_cpu([sys.executable, "-c", PRELOADS, state], env)[1]
            for name, seconds in json.loads(printed.splitlines()[-1]).items():
                pieces[state].setdefault(name, []).append(seconds)
        plans.append(child_cpu([str(VLM_ASSETS), "run", "--config", str(config), "--plan"], env)[0])

    print(f"CPU-seconds, median of {args.repeats} fresh processes each")
    print("\nembedded processor load (classes imported before)")
    ours, baseline = (statistics.median(values) for values in loads.values())
    for name, values in loads.items():
        print(f"  {name:<40} {statistics.median(values):6.2f}")
    print(f"  saved per load                           {baseline - ours:6.2f} ({baseline / ours:.2f}x)")
    print("\nwhat `vlm-assets run` loads before forking its workers (demo config), the garbage collector paused (ours) / running")
    for name in pieces["paused"]:
        paused, running = (statistics.median(pieces[state][name]) for state in collector)
        print(f"  {name:<48} {paused:6.2f} {running:6.2f}")
    paused, running = (sum(statistics.median(values) for values in pieces[state].values()) for state in collector)
    print(f"  {'sum of the medians':<48} {paused:6.2f} {running:6.2f} ({running / paused:.2f}x)")
    print(f"\n`vlm-assets run --plan` (the CLI alone, demo built)   {statistics.median(plans):6.2f}")


if __name__ == "__main__":
    main()
