"""Deduplication throughput: our signatures and decisions vs the plain library calls, side by side.

Generates --samples image samples (a JPEG of --size pixels each, a tenth of them resized and
re-encoded copies of others, each with a caption) and as many text-only samples (a tenth with
changed punctuation), as a catalogue. Then alternates, --repeat times:

- signatures, images then texts: (a) `source_signatures` on one process (what `sample_dedup` runs per
  core: SHA-256 of every medium, its pHash with JPEG draft decoding, the conversation's MinHash, from
  the catalogue's rows) against (b) the plain loop: `imagehash.phash(Image.open(path))` per image, and
  a datasketch `MinHash` updated shingle by shingle per text;
- decisions: (a) `decide` over those signatures (banded pHash index, MinHash LSH) against (b) the naive
  loop comparing every sample with every kept one (Hamming distance, `MinHash.jaccard`).

Prints the medians (images/s/core and texts/s/core for the signatures, samples/s for the decisions)
and the ratios. Then, for each of --index-sizes, fills the banded pHash index with that many random
hashes (in a process of its own) and times queries of hashes a few bits from stored ones, with the
bytes its arrays hold per hash and the process's peak resident growth per hash; and for each of
--decision-sizes, decides over that many distinct image samples with captions (near images and
texts on), with the signatures' memory and the decision's peak growth per sample.

    .venv/bin/python bench/dedup.py [--samples 2000] [--size 640] [--repeat 3] [--index-sizes 1000000 10000000]
                                    [--decision-sizes 200000]
                                    [--workdir bench/out/dedup]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import resource
import shutil
import statistics
import time
from collections import defaultdict
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import imagehash
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from datasketch import LeanMinHash, MinHash
from PIL import Image

from vlm_assets.config import DedupConfig, FrameCacheConfig
from vlm_assets.dedup.decide import decide
from vlm_assets.dedup.index import BandedHashIndex, hamming
from vlm_assets.dedup.signatures import (
    SampleSignature, conversation_text, minhash_of, source_signatures, text_shingles,
)

SETTINGS = DedupConfig(near_images=True, near_text=True)
WORDS = "tile colour grid warm cold row picture shade corner bright dark light pattern block edge".split()


def make_source(directory: Path, samples: int, size: int, seed: int = 0) -> tuple[Path, Path, list[Path], list[str]]:
    """Catalogues of `samples` image samples and of `samples` text-only ones; the image paths, the
    text-only samples' texts."""
    rng = np.random.default_rng(seed)
    media = directory / "media"
    media.mkdir(parents=True, exist_ok=True)
    rows, paths, texts = [], [], []
    for index in range(samples):
        path = media / f"{index:06d}.jpg"
        if index % 10 == 9:  # a resized, re-encoded copy of an earlier image
            original = Image.open(paths[int(rng.integers(0, index - 1))])
            original.resize((size * 9 // 10, size * 27 // 40)).save(path, "JPEG", quality=70)
        else:
            blocks = rng.integers(0, 256, (6, 8, 3), dtype=np.uint8)
            Image.fromarray(blocks).resize((size, size * 3 // 4), Image.Resampling.BICUBIC).save(path, "JPEG", quality=90)
        paths.append(path)
        caption = " ".join(rng.choice(WORDS, 24))
        messages = [{"role": "user", "content": "<image>Describe the picture."}, {"role": "assistant", "content": caption}]
        texts.append(conversation_text(json.dumps(messages)))
        stat = path.stat()
        rows.append((f"bench/i{index:06d}", messages, ["image"], [str(path)], [f"{stat.st_size}:{stat.st_mtime_ns}:0"]))
    for index in range(samples):
        words = " ".join(rng.choice(WORDS, 40))
        if index % 10 == 9:
            words = texts[samples + int(rng.integers(0, index - 1))].split(": ", 2)[-1].replace(" ", ", ", 3)
        messages = [{"role": "user", "content": "Write about tiles."}, {"role": "assistant", "content": words}]
        texts.append(conversation_text(json.dumps(messages)))
        rows.append((f"bench/t{index:06d}", messages, [], [], []))
    catalogs = directory / "images.parquet", directory / "texts.parquet"
    for catalog, part in zip(catalogs, (rows[:samples], rows[samples:])):
        pq.write_table(pa.table({
            "sample_id": [row[0] for row in part], "status": ["ok"] * len(part),
            "messages": [json.dumps(row[1]) for row in part], "media_kinds": [row[2] for row in part],
            "media_refs": [row[3] for row in part], "media_stamps": [row[4] for row in part],
        }), catalog)
    return *catalogs, paths, texts[samples:]


def ours_signatures(catalog: Path, workdir: Path) -> tuple[float, list[SampleSignature]]:
    store = workdir / "signatures.parquet"
    store.unlink(missing_ok=True)
    start = time.perf_counter()
    table = source_signatures(catalog, store, SETTINGS, workdir / "spool", FrameCacheConfig(), processes=1, persist=False)
    return time.perf_counter() - start, table.signatures


def plain_images(paths: list[Path]) -> float:
    start = time.perf_counter()
    for path in paths:
        imagehash.phash(Image.open(path))
    return time.perf_counter() - start


def plain_texts(texts: list[str]) -> float:
    start = time.perf_counter()
    for text in texts:
        minhash = MinHash(num_perm=SETTINGS.text_permutations, seed=1, scheme="affine32")
        for shingle in text_shingles(text, SETTINGS.text_shingle_chars):
            minhash.update(shingle)
    return time.perf_counter() - start


def ours_decisions(signatures: list[SampleSignature]) -> tuple[float, int]:
    start = time.perf_counter()
    removed = len(decide([("bench", signatures)], SETTINGS)["bench"].removed)
    return time.perf_counter() - start, removed


def naive_decisions(signatures: list[SampleSignature]) -> tuple[float, int]:
    """Every sample against every kept one: the loop the index replaces."""
    start = time.perf_counter()
    kept: list[tuple[SampleSignature, LeanMinHash]] = []
    removed = 0
    for sample in sorted(signatures, key=lambda signature: signature.sample_id):
        minhash = minhash_of(sample.text_minhash)
        duplicate = False
        for other, other_minhash in kept:
            if other.media_kinds != sample.media_kinds:
                continue
            media_near = all(hamming(a[0], b[0]) <= SETTINGS.image_distance
                             for a, b in zip(sample.media_hashes, other.media_hashes))
            if media_near and minhash.jaccard(other_minhash) >= SETTINGS.text_threshold:
                duplicate = True
                break
        if duplicate:
            removed += 1
        else:
            kept.append((sample, minhash))
    return time.perf_counter() - start, removed


def resident_bytes() -> int:
    return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def index_scale(size: int, queries: int = 10_000, seed: int = 0) -> tuple[float, float, float, float]:
    """(queries/s, bytes per hash the index's arrays hold, the process's resident growth per hash at
    its peak, seconds to add them) of the banded index holding `size` random 64-bit hashes."""
    rng = np.random.default_rng(seed)
    hashes = rng.integers(0, 2**63, size, dtype=np.int64).tolist()
    before = resident_bytes()
    index = BandedHashIndex(SETTINGS.image_distance)
    start = time.perf_counter()
    for item, value in enumerate(hashes):
        index.add(item, (value,))
    filled = time.perf_counter() - start
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - before
    probes = [hashes[int(at)] ^ sum(1 << int(bit) for bit in rng.choice(64, 3, replace=False))
              for at in rng.integers(0, size, queries)]
    start = time.perf_counter()
    for probe in probes:
        index.candidates((probe,))
    return queries / (time.perf_counter() - start), index.memory_bytes() / size, peak / size, filled


def decision_scale(size: int, seed: int = 0) -> tuple[float, float, float]:
    """(samples/s, the signatures' bytes per sample, the decision's peak resident growth per sample)
    of `decide` over `size` one-image samples with captions, all distinct, near images and texts on."""
    rng = np.random.default_rng(seed)
    before = resident_bytes()
    signatures = [SampleSignature(f"bench/{index:09d}", "0" * 32, ("image",), (f"{index:064x}",),
                                  ((int(rng.integers(0, 2**63)),),), f"{size + index:064x}",
                                  rng.integers(0, 2**32, SETTINGS.text_permutations).astype("<u4").tobytes())
                  for index in range(size)]
    held = resident_bytes() - before
    start = time.perf_counter()
    decide([("bench", signatures)], SETTINGS)
    seconds = time.perf_counter() - start
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - before - held
    return size / seconds, held / size, peak / size


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--samples", type=int, default=2000, help="image samples, and as many text-only ones")
    parser.add_argument("--size", type=int, default=640, help="image width in pixels (height: 3/4 of it)")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--index-sizes", type=int, nargs="*", default=[1_000_000, 10_000_000])
    parser.add_argument("--decision-sizes", type=int, nargs="*", default=[200_000])
    parser.add_argument("--workdir", type=Path, default=Path("bench/out/dedup"))
    args = parser.parse_args()
    shutil.rmtree(args.workdir, ignore_errors=True)
    images, texts, paths, text_list = make_source(args.workdir, args.samples, args.size)
    timings: dict[str, list[float]] = defaultdict(list)
    removed = {}
    for _ in range(args.repeat):
        seconds, image_signatures = ours_signatures(images, args.workdir)
        timings["ours images"].append(seconds)
        timings["plain images"].append(plain_images(paths))
        seconds, text_signatures = ours_signatures(texts, args.workdir)
        timings["ours texts"].append(seconds)
        timings["plain texts"].append(plain_texts(text_list))
        signatures = image_signatures + text_signatures
        seconds, removed["ours"] = ours_decisions(signatures)
        timings["ours decisions"].append(seconds)
        seconds, removed["naive"] = naive_decisions(signatures)
        timings["naive decisions"].append(seconds)
    median = {name: statistics.median(values) for name, values in timings.items()}
    n = args.samples
    print(f"{n} images of {args.size} px with captions, {n} texts; {args.repeat} rounds, medians, one process:")
    print(f"  images     ours  {n / median['ours images']:8.0f} /s/core (sha256, pHash, caption MinHash)   "
          f"plain {n / median['plain images']:8.0f} /s/core (imagehash.phash)   "
          f"ours/plain {median['plain images'] / median['ours images']:.2f}x")
    print(f"  texts      ours  {n / median['ours texts']:8.0f} /s/core (sha256, MinHash)                 "
          f"plain {n / median['plain texts']:8.0f} /s/core (MinHash.update per shingle)   "
          f"ours/plain {median['plain texts'] / median['ours texts']:.2f}x")
    print(f"  decisions  ours  {2 * n / median['ours decisions']:8.0f} samples/s ({removed['ours']} removed)        "
          f"naive {2 * n / median['naive decisions']:8.0f} samples/s ({removed['naive']} removed)   "
          f"ours/naive {median['naive decisions'] / median['ours decisions']:.1f}x")
    for size in args.index_sizes:
        # In a fresh process each: its peak resident set is the index's alone.
        with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
            rate, held, peak, filled = pool.submit(index_scale, size).result()
        print(f"  index      {size:,} image hashes (distance {SETTINGS.image_distance}): {rate:8.0f} queries/s, "
              f"{held:.0f} bytes per hash held, peak resident growth {peak:.0f} bytes per hash, added in {filled:.1f} s")
    for size in args.decision_sizes:
        with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
            rate, held, peak = pool.submit(decision_scale, size).result()
        print(f"  decisions  {size:,} distinct image samples with captions: {rate:8.0f} samples/s, signatures "
              f"{held:.0f} bytes per sample, the decision's peak resident growth {peak:.0f} bytes per sample")


if __name__ == "__main__":
    main()
