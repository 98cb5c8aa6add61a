"""Peak memory of one sample naming a huge image several times, in the catalogue and in the exact length path.

    .venv/bin/python bench/huge_images.py [--side 12000] [--references 4] [--distinct] [--limit PIXELS]

A solid-colour side×side PNG (a few hundred KB on disk, side² × 3 bytes decoded) is written once under
bench/out/huge_images/, and a flat_dir source holds one sample naming it --references times (--distinct:
naming that many different such PNGs). Each step runs
in a fresh process whose peak RSS (VmHWM) is reported:
  catalogue    write_catalog of the source (--limit: its sources[].max_image_pixels; default: the product's)
  baseline     a lengths process: the modules imported and the embedded processor loaded, counting nothing
  lengths      the baseline, then every ok row of that catalogue counted by the exact path
               (LengthCounter.exact: the processor called as a trainer calls it), the step's costliest path
  uncatalogued the baseline, then the sample as written counted by the exact path, whether or not the
               catalogue accepts it: what the catalogue's limit spares the lengths step
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "bench" / "out" / "huge_images"

STEP = r"""
import json, sys
from pathlib import Path
from vlm_assets.catalog.build import MediaValidator
from vlm_assets_tests.catalog_support import read_catalog
from vlm_assets.catalog.table import write_catalog
from vlm_assets.config import FrameCacheConfig, ModelConfig, SourceConfig
from vlm_assets.tokens.lengths import LengthCounter, SampleForLength
from vlm_assets.tokens.processor import load_processor

step, folder, limit = sys.argv[1], Path(sys.argv[2]), sys.argv[3]
catalog = folder.parent / (folder.name + ".catalog.parquet")
result = {}
if step == "catalogue":
    kwargs = {"max_image_pixels": int(limit)} if limit else {}
    write_catalog(SourceConfig("huge", "flat_dir", folder, folder, **kwargs), catalog, "messages", MediaValidator())
    frame = read_catalog(catalog)
    result = {"status": frame.status[0], "reason": frame.reason[0][:120]}
else:
    counter = LengthCounter(load_processor(ModelConfig()), FrameCacheConfig())
    if step == "lengths":
        frame = read_catalog(catalog)
        ok = frame[frame.status == "ok"]
        samples = [SampleForLength(row.sample_id, row.messages, list(row.media_kinds), list(row.media_refs))
                   for row in ok.itertuples()]
    elif step == "uncatalogued":
        record = json.loads((folder / "s.json").read_text())
        samples = [SampleForLength("huge/s", json.dumps(record["messages"]), ["image"] * len(record["images"]),
                                   [str(folder / name) for name in record["images"]])]
    if step != "baseline":
        counted = [counter.exact(sample) for sample in samples]
        result = {"counted": len(counted), "token_lens": [one.token_len for one in counted]}
for line in open("/proc/self/status"):
    if line.startswith("VmHWM:"):
        result["peak_rss_mb"] = int(line.split()[1]) // 1024
print(json.dumps(result, ensure_ascii=False))
"""


def write_source(side: int, references: int, distinct: bool) -> Path:
    from PIL import Image

    folder = OUT / f"side{side}_{'distinct' if distinct else 'refs'}{references}"
    folder.mkdir(parents=True, exist_ok=True)
    names = [f"huge{index}.png" for index in range(references)] if distinct else ["huge.png"] * references
    for index, name in enumerate(dict.fromkeys(names)):
        if not (folder / name).exists():
            Image.new("RGB", (side, side), (40, 90, 160 - index)).save(folder / name)
    record = {"messages": [{"role": "user", "content": "<image>" * references + "What?"},
                           {"role": "assistant", "content": "A colour."}],
              "images": names}
    (folder / "s.json").write_text(json.dumps(record))
    return folder


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--side", type=int, default=12000)
    parser.add_argument("--references", type=int, default=4)
    parser.add_argument("--distinct", action="store_true", help="name --references different images")
    parser.add_argument("--limit", type=int, default=None, help="sources[].max_image_pixels of the catalogue step")
    args = parser.parse_args()
    folder = write_source(args.side, args.references, args.distinct)
    size = (folder / json.loads((folder / "s.json").read_text())["images"][0]).stat().st_size
    print(f"{args.side}×{args.side} PNG ({size // 1024} KB) named {args.references}×"
          + (" (different files)" if args.distinct else ""))
    for step in ("catalogue", "baseline", "lengths", "uncatalogued"):
        done = subprocess.run([sys.executable, "-c", STEP, step, str(folder), str(args.limit or "")],
                              capture_output=True, text=True, cwd=ROOT)
        if done.returncode:
            print(f"{step}: failed\n{done.stderr[-2000:]}")
            continue
        print(f"{step:12s} {done.stdout.strip().splitlines()[-1]}")


if __name__ == "__main__":
    main()
