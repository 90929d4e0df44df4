"""Throughput of ``podtrain prepare`` against the tokenizer's own batch-encode speed, per core.

    .venv/bin/python bench/prepare_throughput.py [--byte-mb 32] [--bpe-mb 8] [--vocab 8192] [--repeats 2]

The corpus is the built-in one (this interpreter's standard library), copied into a temporary
directory as many times as needed to reach the size asked for. For each tokenizer it measures, in
the same run:

* own:     the tokenizer alone on the same text already in memory, one core
           (bytes: ``numpy.frombuffer(...).astype(uint16)``; BPE: ``encode_batch_fast`` with
           ``TOKENIZERS_PARALLELISM=false``);
* own x2:  (BPE) the library's own multi-threaded encode_batch_fast with 2 rayon threads, so the
           2-worker figure can be read against what the machine gives the tokenizer itself;
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
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# One core per tokenizer call, here and in the workers: the measurement is per core.
os.environ["TOKENIZERS_PARALLELISM"] = "false"

import numpy as np  # noqa: E402

from podtrain.data.prepare import pipeline as prep  # noqa: E402
from podtrain.data.prepare.builtin import builtin_files  # noqa: E402
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
            extra: dict | None = None, own_passes: int = 1, rates: dict | None = None) -> list[str]:
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
    if rates is not None:
        rates.update(rate)
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


def own_threads_rate(tok_file: Path, corpus: Path, threads: int) -> float:
    """MB/s of the tokenizer's own multi-threaded ``encode_batch_fast`` (rayon, ``threads``), run in
    a fresh process because the thread count is fixed when the library first uses its pool."""
    env = dict(os.environ, TOKENIZERS_PARALLELISM="true", RAYON_NUM_THREADS=str(threads))
    out = subprocess.run([sys.executable, __file__, "--own-encode", str(tok_file), str(corpus)],
                         env=env, capture_output=True, text=True, check=True).stdout
    return float(out.split()[-1])


def own_encode_main(tok_file: str, corpus: str) -> int:
    """Child mode: print the best-of-2 MB/s of encode_batch_fast over the corpus."""
    import tokenizers
    tok = tokenizers.Tokenizer.from_file(tok_file)
    texts = [p.read_bytes().decode("utf-8", "replace") for p in sorted(Path(corpus).rglob("*.py"))]
    mb = sum(len(t.encode("utf-8")) for t in texts) / 1e6
    secs = min(timed(lambda: tok.encode_batch_fast(texts, add_special_tokens=False))[0] for _ in range(2))
    print(f"{mb / secs:.4f}")
    return 0


def main() -> int:
    if len(sys.argv) == 4 and sys.argv[1] == "--own-encode":
        return own_encode_main(sys.argv[2], sys.argv[3])
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
        rates: dict[str, float] = {}
        for line in measure("bpe", work / "bpe_corpus", mb_of(bpe_blobs), str(tok_file),
                            lambda: bpe.encode_batch(texts), work, args.repeats, rates=rates):
            print(line)
        # The tokenizer's own scaling on this machine, for the 2-worker figure to be read against.
        own1, own2 = (own_threads_rate(tok_file, work / "bpe_corpus", n) for n in (1, 2))
        print(f"bpe    own encode_batch_fast, rayon 1 thread: {own1:.2f} MB/s, 2 threads: {own2:.2f} MB/s "
              f"(own scaling {own2 / own1:.2f}x); prepare 2 workers / own 2 threads = {rates['w2'] / own2:.2f}")
    print("ratio (wall) = prepare MB/s per worker / the tokenizer's own MB/s on one core (target >= 0.8)")
    print("ratio (cpu)  = MB per CPU-second of prepare (main + workers) / of the tokenizer alone")
    print(f"load average at the end: {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")
    return 0


if __name__ == "__main__":
    sys.exit(main())
