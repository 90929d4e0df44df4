"""``podtrain prepare`` against HF datatrove's tokenizer step, and in 2 parts + merge against one process.

    .venv/bin/pip install -e '.[bench]'      # datatrove
    .venv/bin/python bench/prepare_scale.py [--mb 16] [--workers 2] [--vocab 8192] [--repeats 2]

The corpus: the built-in one (this interpreter's standard library), each source file one JSONL
record, repeated to ``--mb`` MB over ``4 x workers`` JSONL files (datatrove hands whole files to its
tasks). The tokenizer: a byte-level BPE trained once by podtrain, passed to both as tokenizer.json.

(a) datatrove: ``JsonlReader -> DocumentTokenizer`` (EOS after each document, no shuffling, the
    .ds/.index/.metadata files it writes) under ``LocalPipelineExecutor(tasks=W, workers=W)``
    (start method spawn, as podtrain's workers, so both CPU times count every process);
    podtrain: ``podtrain prepare CORPUS --tokenizer tokenizer.json --workers W`` at its defaults
    (3% validation split, sha256 + fsync of every shard, manifest). Both as a fresh subprocess, run
    alternately, best of ``--repeats``; the token counts must agree (the same work was done).
    Printed: MB/s of each and podtrain / datatrove (goal >= 1.0).
(b) ``--num-parts 2``: both parts at once (``--workers W/2`` each, as two nodes would) then
    ``prepare merge``, against one ``prepare --workers W``; each split's concatenated shards must be
    byte-identical. Printed: seconds of each and one / parts.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path


from podtrain.data.manifest import read_manifest
from podtrain.data.prepare.builtin import builtin_files

ENV = dict(os.environ, TOKENIZERS_PARALLELISM="false", OMP_NUM_THREADS="1")  # one core per worker
PODTRAIN = [sys.executable, "-m", "podtrain.cli"]


def build_corpus(root: Path, mb: float, files: int) -> float:
    """JSONL files of built-in documents in ``root`` holding ``mb`` MB of text; returns the MB."""
    root.mkdir(parents=True)
    docs = [f.path.read_text(encoding="utf-8", errors="replace") for f in builtin_files()]
    handles = [open(root / f"part{i:03d}.jsonl", "w", encoding="utf-8") for i in range(files)]
    total, i = 0, 0
    while total < mb * 1e6:
        text = docs[i % len(docs)]
        if text:
            handles[i % files].write(json.dumps({"text": text, "id": str(i)}) + "\n")
            total += len(text.encode("utf-8"))
        i += 1
    for h in handles:
        h.close()
    return total / 1e6


def cpu_children() -> float:
    """CPU seconds of every reaped child process (and what they reaped) so far."""
    t = os.times()
    return t.children_user + t.children_system


def run(cmd: list[str]) -> float:
    """Seconds of one command (which must succeed)."""
    t0 = time.perf_counter()
    subprocess.run(cmd, env=ENV, check=True, stdout=subprocess.DEVNULL)
    return time.perf_counter() - t0


def timed_cpu(fn, best: dict[str, float], label: str) -> None:
    """Keep the best wall and the best CPU seconds (children's) of ``fn`` under ``label``."""
    c0 = cpu_children()
    wall = fn()
    best[label] = min(best.get(label, float("inf")), wall)
    best[label + "_cpu"] = min(best.get(label + "_cpu", float("inf")), cpu_children() - c0)


DATATROVE_CHILD = """
import sys
from datatrove.executor import LocalPipelineExecutor
from datatrove.pipeline.readers import JsonlReader
from datatrove.pipeline.tokens import DocumentTokenizer
corpus, out, logs, tok, workers = sys.argv[1:6]
if __name__ == "__main__":
    LocalPipelineExecutor(
        [JsonlReader(corpus, glob_pattern="*.jsonl", add_file_path=False),
         DocumentTokenizer(out, tokenizer_name_or_path=tok, eos_token="<|endoftext|>",
                           shuffle_documents=False)],
        tasks=int(workers), workers=int(workers), logging_dir=logs,
        # spawn (podtrain's start method too): the workers are this process's children, so their
        # CPU time is counted (forkserver's would be the server's, never reaped by us).
        start_method="spawn").run()
"""


def datatrove_tokens(out: Path) -> int:
    """Tokens datatrove wrote (its .ds files hold uint16 ids)."""
    return sum(p.stat().st_size // 2 for p in out.rglob("*.ds"))


def podtrain_tokens(out: Path) -> int:
    """Tokens in every split of a podtrain data directory."""
    return sum(s["tokens"] for s in read_manifest(out).raw["splits"].values())


def stream(out: Path, split: str) -> bytes:
    """A split's concatenated shards."""
    m = read_manifest(out)
    return b"".join(s.path.read_bytes() for s in m.shards(split))


def compare_datatrove(work: Path, corpus: Path, tok: Path, mb: float, workers: int, repeats: int) -> None:
    """(a): podtrain prepare vs datatrove's DocumentTokenizer, same corpus, tokenizer and workers."""
    child = work / "datatrove_child.py"
    child.write_text(DATATROVE_CHILD)
    best: dict[str, float] = {}
    for _ in range(repeats):
        for d in ("dt_out", "dt_logs", "pt_out"):
            shutil.rmtree(work / d, ignore_errors=True)
        timed_cpu(lambda: run([sys.executable, str(child), str(corpus), str(work / "dt_out"),
                               str(work / "dt_logs"), str(tok), str(workers)]), best, "datatrove")
        timed_cpu(lambda: run(PODTRAIN + ["prepare", str(corpus), "--out", str(work / "pt_out"), "--tokenizer",
                                          str(tok), "--workers", str(workers), "--no-progress"]), best, "podtrain")
    n_dt, n_pt = datatrove_tokens(work / "dt_out"), podtrain_tokens(work / "pt_out")
    assert n_dt == n_pt, f"token counts differ: datatrove {n_dt}, podtrain {n_pt}"
    dt, pt = mb / best["datatrove"], mb / best["podtrain"]
    print(f"(a) {mb:.1f} MB, {n_pt:,} tokens (equal in both), {workers} workers: datatrove {dt:.2f} MB/s "
          f"({best['datatrove']:.1f}s), podtrain {pt:.2f} MB/s ({best['podtrain']:.1f}s); "
          f"podtrain / datatrove = {pt / dt:.2f}x (wall); CPU seconds datatrove {best['datatrove_cpu']:.1f}, "
          f"podtrain {best['podtrain_cpu']:.1f}: {best['datatrove_cpu'] / best['podtrain_cpu']:.2f}x")


def compare_parts(work: Path, corpus: Path, tok: Path, workers: int, repeats: int) -> None:
    """(b): 2 parts at once + merge vs one process, same total workers; identical streams asserted."""
    half = max(1, workers // 2)
    best: dict[str, float] = {}

    def parts() -> float:
        t0 = time.perf_counter()
        procs = [subprocess.Popen(PODTRAIN + ["prepare", str(corpus), "--out", str(work / "parts"),
                                              "--tokenizer", str(tok), "--workers", str(half),
                                              "--num-parts", "2", "--part", str(i), "--no-progress"],
                                  env=ENV, stdout=subprocess.DEVNULL) for i in range(2)]
        assert all(p.wait() == 0 for p in procs)
        subprocess.run(PODTRAIN + ["prepare", "merge", str(work / "parts")], env=ENV, check=True,
                       stdout=subprocess.DEVNULL)
        return time.perf_counter() - t0

    for _ in range(repeats):
        for d in ("one", "parts"):
            shutil.rmtree(work / d, ignore_errors=True)
        timed_cpu(lambda: run(PODTRAIN + ["prepare", str(corpus), "--out", str(work / "one"), "--tokenizer",
                                          str(tok), "--workers", str(workers), "--no-progress"]), best, "one")
        timed_cpu(parts, best, "parts")
    for split in ("train", "val"):
        a, b = stream(work / "one", split), stream(work / "parts", split)
        assert a == b, f"{split}: the 2-part stream differs from the one-process stream"
    print(f"(b) one process x{workers} workers {best['one']:.1f}s; 2 parts x{half} workers + merge "
          f"{best['parts']:.1f}s; identical train and val streams ({len(stream(work / 'one', 'train')):,} "
          f"+ {len(stream(work / 'one', 'val')):,} bytes); one / parts = {best['one'] / best['parts']:.2f}x (wall); "
          f"CPU seconds one {best['one_cpu']:.1f}, parts {best['parts_cpu']:.1f}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mb", type=float, default=16.0)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args()
    try:
        import datatrove  # noqa: F401
    except ImportError:
        print("datatrove is not installed: pip install -e '.[bench]'", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="podtrain-bench-") as tmp:
        work = Path(tmp)
        mb = build_corpus(work / "corpus", args.mb, 4 * args.workers)
        tok_dir = work / "tok"
        # The tokenizer: trained once on the first 4 MB of the corpus (not what is timed).
        subprocess.run(PODTRAIN + ["prepare", str(work / "corpus"), "--out", str(tok_dir), "--tokenizer",
                                   f"bpe:{args.vocab}", "--train-tokenizer-only", "--bpe-train-bytes",
                                   str(4 << 20)], env=ENV, check=True, stdout=subprocess.DEVNULL)
        tok = tok_dir / "tokenizer" / "tokenizer.json"
        print(f"cores {os.cpu_count()}, load average {os.getloadavg()[0]:.1f}; corpus {mb:.1f} MB in "
              f"{4 * args.workers} JSONL files; tokenizer bpe:{args.vocab}")
        compare_datatrove(work, work / "corpus", tok, mb, args.workers, args.repeats)
        compare_parts(work, work / "corpus", tok, args.workers, args.repeats)
    print(f"load average at the end: {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")
    return 0


if __name__ == "__main__":
    sys.exit(main())
