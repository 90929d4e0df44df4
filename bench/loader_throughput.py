"""How fast one rank can receive batches, against how fast the tiny model consumes them.

    .venv/bin/python bench/loader_throughput.py [--steps 200] [--train-steps 40]

1. Loader alone: rank 0 of 2, the demo's shapes (seq 256, micro-batch 8, global batch 32), thread
   and worker-process modes; tokens/s this rank receives.
2. A real 2-rank training run of the tiny preset (torchrun): tokens/s one rank consumes, and
   data_wait_s as a share of step time (target < 1%).
Printed side by side: loader tokens/s / consumption tokens/s (headroom; > 1 means the loader keeps
ahead) and the data-wait share.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def loader_tokens_per_s(data, steps, workers):
    import torch

    from podtrain.data.loader import ShardedLoader

    torch.set_num_threads(1)
    ld = ShardedLoader(data, 256, 32, 8, rank=0, world_size=2, seed=0, num_workers=workers, prefetch=4)
    ld.next()  # start-up (thread or workers) is not throughput
    t0 = time.perf_counter()
    for _ in range(steps):
        ld.next()
    elapsed = time.perf_counter() - t0
    ld.close()
    return steps * 16 * 256 / elapsed  # this rank's share: 16 sequences of 256 targets per step


def training_consumption(data, steps):
    from podtrain.launch.local import free_port

    with tempfile.TemporaryDirectory() as run_dir:
        env = dict(os.environ, OMP_NUM_THREADS="1", TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1")
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", "--rdzv-backend=c10d",
               f"--rdzv-endpoint=127.0.0.1:{free_port()}", "-m", "podtrain.cli", "train",
               str(REPO / "configs/demo.yaml"), f"data.path={data}", f"run.dir={run_dir}",
               f"train.steps={steps}", "log.every=5", "eval.every=0", "ckpt.every=0", "log.progress=off"]
        out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900)
        if out.returncode:
            sys.exit(out.stderr[-3000:])
        rows = [json.loads(x) for x in Path(run_dir, "metrics.jsonl").read_text().splitlines()]
        steady = [r for r in rows if r["kind"] == "train" and r["step"] > 5]
        per_rank = sum(r["tokens_per_s"] for r in steady) / len(steady) / 2
        wait_share = sum(r["data_wait_s"] for r in steady) / sum(r["step_time_s"] for r in steady)
        return per_rank, wait_share


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--train-steps", type=int, default=40)
    ap.add_argument("--data", default=str(REPO / "data/builtin"))
    args = ap.parse_args()
    if not Path(args.data, "manifest.json").exists():
        subprocess.run([sys.executable, "-m", "podtrain.cli", "prepare", "builtin", "--out", args.data], check=True)
    thread = loader_tokens_per_s(args.data, args.steps, 0)
    workers = loader_tokens_per_s(args.data, args.steps, 2)
    consume, wait_share = training_consumption(args.data, args.train_steps)
    print(f"loader, background thread:  {thread:>12,.0f} tokens/s to one rank")
    print(f"loader, 2 worker processes: {workers:>12,.0f} tokens/s to one rank")
    print(f"tiny model consumes:        {consume:>12,.0f} tokens/s per rank (2-rank training)")
    print(f"headroom (thread loader / consumption): {thread / consume:,.0f}x")
    print(f"data_wait_s share of step time in training: {100 * wait_share:.3f}%  (target < 1%)")


if __name__ == "__main__":
    main()
