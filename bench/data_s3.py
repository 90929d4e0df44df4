"""Training from S3 against training from local disk, side by side in one run.

    .venv/bin/python bench/data_s3.py [--steps 40] [--rounds 2] [--data data/builtin]

The demo (configs/demo.yaml: the tiny preset, 2 CPU ranks over gloo, seq 256, global batch 32) is
trained for ``--steps`` steps by torchrun, reading the same prepared data from local disk and from
S3 (a moto server on loopback started here, the data uploaded with boto3; needs the `test` extra),
alternately, ``--rounds`` times each. Each S3 run starts with an EMPTY cache (data.cache_dir is a
fresh folder, data.cache_gb at its default), so it includes fetching every block it reads.
Figures are over the steady steps (after the first 5) of every round: data wait per step (what
the step waited for its batch, rank 0, ``data_wait_s``), its share of step time, and tokens/s.
Goal (issue 21): the data wait from S3 within 5% of local, i.e. the read-ahead hides S3.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))
sys.path.insert(0, str(REPO / "tests"))  # the loopback S3 server the tests use


def train(data: str, steps: int, cache_dir: str | None) -> list[dict]:
    """One 2-rank demo training run reading ``data``; its train metrics lines."""
    from podtrain.launch.local import free_port

    with tempfile.TemporaryDirectory() as run_dir:
        env = dict(os.environ, OMP_NUM_THREADS="1", TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1")
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", "--rdzv-backend=c10d",
               f"--rdzv-endpoint=127.0.0.1:{free_port()}", "-m", "podtrain.cli", "train",
               str(REPO / "configs/demo.yaml"), f"data.path={data}", f"run.dir={run_dir}",
               f"train.steps={steps}", "log.every=1", "eval.every=0", "ckpt.every=0", "log.progress=off",
               "data.verify=false"]
        if cache_dir:
            cmd.append(f"data.cache_dir={cache_dir}")
        out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1800)
        if out.returncode:
            sys.exit(out.stderr[-3000:])
        rows = [json.loads(x) for x in Path(run_dir, "metrics.jsonl").read_text().splitlines()]
        return [r for r in rows if r["kind"] == "train"]


def summary(rows: list[dict]) -> tuple[float, float, float, float]:
    """(mean data wait per step in ms, its share of step time, tokens/s, first step's wait in ms)."""
    steady = [r for r in rows if r["step"] > 5]
    wait = sum(r["data_wait_s"] for r in steady) / len(steady)
    share = sum(r["data_wait_s"] for r in steady) / sum(r["step_time_s"] for r in steady)
    tps = sum(r["tokens_per_s"] for r in steady) / len(steady)
    return 1e3 * wait, share, tps, 1e3 * rows[0]["data_wait_s"]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--data", default=str(REPO / "data/builtin"))
    args = ap.parse_args()
    if not Path(args.data, "manifest.json").exists():
        subprocess.run([sys.executable, "-m", "podtrain.cli", "prepare", "builtin", "--out", args.data], check=True)
    from s3_server import restore_env, start_with_env

    server, saved = start_with_env()
    try:
        bucket = server.new_bucket()
        local = Path(args.data)
        files = [p for p in sorted(local.rglob("*")) if p.is_file() and ".prepare" not in p.parts]
        for path in files:
            server.boto.upload_file(str(path), bucket, f"builtin/{path.relative_to(local).as_posix()}")
        url = f"s3://{bucket}/builtin"
        size = sum(p.stat().st_size for p in files)
        print(f"data: {local} ({size / 1e6:.1f} MB) and {url} (moto on loopback); demo shapes, 2 ranks, "
              f"{args.steps} steps x {args.rounds} rounds each, alternating")
        runs: dict[str, list[dict]] = {"local": [], "s3": []}
        for _ in range(args.rounds):
            runs["local"] += train(str(local), args.steps, None)
            with tempfile.TemporaryDirectory() as cache:  # a cold cache every S3 run
                runs["s3"] += train(url, args.steps, cache)
    finally:
        server.stop()
        restore_env(saved)
    figures = {name: summary(rows) for name, rows in runs.items()}
    for name, (wait, share, tps, first) in figures.items():
        print(f"  {name:6s} data wait {wait:7.3f} ms/step ({100 * share:.3f}% of step time), "
              f"{tps:>9,.0f} tokens/s, first step waited {first:7.1f} ms")
    (lw, ls, lt, _), (sw, ss, st, _) = figures["local"], figures["s3"]
    print(f"S3 / local: tokens/s {st / lt:.3f}x; data wait per step {sw / lw:.2f}x ({sw - lw:+.3f} ms); data wait share of step time {100 * ss:.3f}% vs "
          f"{100 * ls:.3f}% (difference {100 * (ss - ls):+.3f} points of step time; goal: within 5%)")


if __name__ == "__main__":
    main()
