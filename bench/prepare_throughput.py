"""Throughput of ``podtrain prepare`` against the tokenizer's own batch-encode speed, per core.

    .venv/bin/python bench/prepare_throughput.py [--byte-mb 32] [--bpe-mb 8] [--vocab 8192] [--repeats 2]

The corpus is the built-in one (this interpreter's standard library), copied into a temporary
directory as many times as needed to reach the size asked for. For each tokenizer it measures, in
the same run:

* own:     the tokenizer alone on the same text already in memory, one core
           (bytes: ``numpy.frombuffer(...).astype(uint16)``; BPE: ``encode_batch_fast`` with
           ``TOKENIZERS_PARALLELISM=false``);
* prepare: the whole ``podtrain prepare`` (walk, read, decode, split, tokenize, write, sha256,
           fsync, manifest; worker start-up included) with 1 and with 2 workers.

It prints MB of text per second, per core, the ratio prepare/own per core (target >= 0.8) and the
2-worker/1-worker scaling. The BPE tokenizer is trained once up front (its time is printed
separately) and then passed as a tokenizer file, so the prepare timings measure encoding only.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

# One core per tokenizer call, here and in the workers: the measurement is per core.
os.environ["TOKENIZERS_PARALLELISM"] = "false"

import numpy as np  # noqa: E402

from podtrain.data import prepare as prep  # noqa: E402
from podtrain.data.builtin import builtin_files  # noqa: E402
from podtrain.data.tokenizer import HFTokenizer  # noqa: E402


def build_corpus(root: Path, mb: float) -> list[bytes]:
    """Copy the built-in corpus into ``root`` until it holds ``mb`` MB; return the file contents."""
    files = [(f.name, f.path.read_bytes()) for f in builtin_files()]
    want, total, copy, blobs = mb * 1e6, 0, 0, []
    while total < want:
        for name, blob in files:
            if total >= want:
                break
            path = root / f"copy{copy:02d}" / name
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(blob)
            blobs.append(blob)
            total += len(blob)
        copy += 1
    return blobs


def mb_of(blobs: list[bytes]) -> float:
    """Total size in MB."""
    return sum(len(b) for b in blobs) / 1e6


def timed(fn) -> tuple[float, float]:
    """(wall seconds, CPU seconds of this process and its reaped children) of one call of ``fn``.

    CPU seconds make the per-core figure meaningful on a shared machine: they do not grow when
    other programs take the cores away.
    """
    c0, t0 = os.times(), time.perf_counter()
    fn()
    wall, c1 = time.perf_counter() - t0, os.times()
    cpu = (c1.user - c0.user) + (c1.system - c0.system) + \
        (c1.children_user - c0.children_user) + (c1.children_system - c0.children_system)
    return wall, cpu


OWN_BYTES_PASSES = 20  # one pass takes milliseconds: too short for the CPU clock's 10 ms ticks


def own_bytes(blobs: list[bytes]) -> None:
    """The byte tokenizer's own work, OWN_BYTES_PASSES times: a view and a widening copy."""
    for _ in range(OWN_BYTES_PASSES):
        for b in blobs:
            np.frombuffer(b, dtype=np.uint8).astype(np.uint16)


def io_floor(paths: list[Path], out: Path) -> None:
    """What any correct byte-level prepare must do, on one core: read, widen, write, sha256, fsync."""
    digest = hashlib.sha256()
    with open(out, "wb") as fh:
        for p in paths:
            arr = np.frombuffer(p.read_bytes(), dtype=np.uint8).astype(np.uint16)
            fh.write(arr)
            digest.update(arr)
        fh.flush()
        os.fsync(fh.fileno())
    out.unlink()


def run_prepare(corpus: Path, out: Path, tokenizer: str, workers: int) -> prep.PrepareResult:
    """A fresh prepare of ``corpus`` into ``out``."""
    shutil.rmtree(out, ignore_errors=True)
    return prep.prepare(prep.PrepareOptions(inputs=(str(corpus),), out=out, tokenizer=tokenizer,
                                            workers=workers, progress=False))


def measure(name: str, corpus: Path, mb: float, tokenizer: str, own, work: Path, repeats: int,
            extra: dict | None = None, own_passes: int = 1) -> list[str]:
    """Best-of-``repeats`` MB/s of own, prepare x1 and prepare x2, run alternately (same load)."""
    best: dict[str, float] = {}
    runs = {"own": own,
            "w1": lambda: run_prepare(corpus, work / f"out_{name}", tokenizer, 1),
            "w2": lambda: run_prepare(corpus, work / f"out_{name}", tokenizer, 2),
            **(extra or {})}
    for _ in range(repeats):
        for label, fn in runs.items():
            wall, cpu = timed(fn)
            best[label] = min(best.get(label, float("inf")), wall)
            best[label + "_cpu"] = min(best.get(label + "_cpu", float("inf")), cpu)
    rate = {k: mb * (own_passes if k.startswith("own") else 1) / v for k, v in best.items()}
    rows = []
    for workers in (1, 2):
        r, rc = rate[f"w{workers}"], rate[f"w{workers}_cpu"]
        rows.append(f"{name:<6} {workers:>7} {mb:>7.1f} {r:>9.1f} {r / workers:>10.1f} {rate['own']:>9.1f} "
                    f"{r / workers / rate['own']:>7.2f} {rc:>9.1f} {rate['own_cpu']:>9.1f} "
                    f"{rc / rate['own_cpu']:>7.2f}")
    rows.append(f"{name:<6} scaling 2 workers / 1 worker (wall): {rate['w2'] / rate['w1']:.2f}x")
    for label in extra or {}:
        rows.append(f"{name:<6} {label}: {rate[label]:.1f} MB/s; prepare x1 / it = "
                    f"{rate['w1'] / rate[label]:.2f} (wall)")
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--byte-mb", type=float, default=32.0)
    ap.add_argument("--bpe-mb", type=float, default=8.0)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args()
    print(f"cores available: {prep.default_workers()}, python {sys.version.split()[0]}")
    with tempfile.TemporaryDirectory(prefix="podtrain-bench-") as tmp:
        work = Path(tmp)
        byte_blobs = build_corpus(work / "byte_corpus", args.byte_mb)
        bpe_blobs = build_corpus(work / "bpe_corpus", args.bpe_mb)

        t0 = time.perf_counter()
        trained = run_prepare(work / "bpe_corpus", work / "trained", f"bpe:{args.vocab}", 2)
        train_s = time.perf_counter() - t0
        tok_file = work / "trained" / trained.manifest["tokenizer"]["files"][0]
        import tokenizers
        bpe = HFTokenizer(tokenizers.Tokenizer.from_file(str(tok_file)), 0, "bpe", "bench")
        texts = [b.decode("utf-8", "replace") for b in bpe_blobs]
        print(f"BPE bpe:{args.vocab} trained + encoded on {args.bpe_mb:.0f} MB in {train_s:.1f}s (2 workers)")

        header = (f"{'tok':<6} {'workers':>7} {'MB':>7} {'MB/s':>9} {'MB/s/core':>10} {'own MB/s':>9} "
                  f"{'ratio':>7} {'MB/cpu-s':>9} {'own':>9} {'ratio':>7}")
        print(header)
        print("-" * len(header))
        byte_paths = sorted((work / "byte_corpus").rglob("*.py"))
        floor = {"io floor (read+widen+write+sha256+fsync, 1 core)":
                 lambda: io_floor(byte_paths, work / "floor.bin")}
        for line in measure("byte", work / "byte_corpus", mb_of(byte_blobs), "byte",
                            lambda: own_bytes(byte_blobs), work, args.repeats, floor, OWN_BYTES_PASSES):
            print(line)
        for line in measure("bpe", work / "bpe_corpus", mb_of(bpe_blobs), str(tok_file),
                            lambda: bpe.encode_batch(texts), work, args.repeats):
            print(line)
    print("ratio (wall) = prepare MB/s per worker / the tokenizer's own MB/s on one core (target >= 0.8)")
    print("ratio (cpu)  = MB per CPU-second of prepare (main + workers) / of the tokenizer alone")
    print(f"load average at the end: {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")
    return 0


if __name__ == "__main__":
    sys.exit(main())
