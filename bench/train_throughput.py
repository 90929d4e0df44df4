"""podtrain's training throughput against a bare DDP loop, and 2 ranks against 1, in one run.

    .venv/bin/python bench/train_throughput.py [--steps 40] [--rounds 2] [--compile]

Runs alternate (bare, podtrain, bare, podtrain, ...) so the machine's drift hits both alike; each
reports steady-state tokens/s (after a warm-up). Printed ratios:
  podtrain / bare           target >= 0.97 (>= 1.0 with --compile)
  2 ranks / (2 x 1 rank)    scaling efficiency, target >= 0.95
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from podtrain.launch.local import free_port

REPO = Path(__file__).resolve().parents[1]
PY = sys.executable


def torchrun(nproc, *args, env_extra=None):
    # One thread per rank in every configuration, so "1 rank" is one rank's share of a 2-rank job
    # and the 2-vs-1 ratio measures DDP's scaling, not thread scaling.
    env = dict(os.environ, OMP_NUM_THREADS="1", TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1")
    env.update(env_extra or {})
    cmd = [PY, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}", "--rdzv-backend=c10d",
           f"--rdzv-endpoint=127.0.0.1:{free_port()}", *args]
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900, cwd=REPO)


def bare(data, steps, compile_):
    out = torchrun(2, str(REPO / "bench/bare_ddp.py"), "--data", data, "--steps", str(steps),
                   *(["--compile"] if compile_ else []))
    lines = [line for line in out.stdout.splitlines() if line.startswith("{")]
    if out.returncode or not lines:
        sys.exit(f"bare loop failed:\n{out.stderr[-3000:]}")
    return json.loads(lines[-1])["tokens_per_s"]


def podtrain(data, steps, nproc, compile_, warmup=5):
    with tempfile.TemporaryDirectory() as run_dir:
        global_batch = 32 if nproc == 2 else 16  # 1 rank: half the global batch, same per-rank work
        out = torchrun(nproc, "-m", "podtrain.cli", "train", str(REPO / "configs/demo.yaml"),
                       f"data.path={data}", f"run.dir={run_dir}", f"train.steps={steps}",
                       f"train.global_batch_size={global_batch}", f"log.every={warmup}",
                       "eval.every=0", "ckpt.every=0", "log.progress=off", "monitor.watchdog=false",
                       f"train.compile={'true' if compile_ else 'false'}")
        if out.returncode:
            sys.exit(f"podtrain failed:\n{out.stderr[-3000:]}")
        records = [json.loads(x) for x in Path(run_dir, "metrics.jsonl").read_text().splitlines()]
        steady = [r for r in records if r.get("kind") == "train" and r["step"] > warmup]
        # tokens/s of the steady intervals, weighted by their duration
        tokens = sum(r["tokens_per_s"] * r["step_time_s"] * warmup for r in steady)
        seconds = sum(r["step_time_s"] * warmup for r in steady)
        return tokens / seconds


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--compile", action="store_true")
    ap.add_argument("--data", default=str(REPO / "data/builtin"))
    args = ap.parse_args()
    if not Path(args.data, "manifest.json").exists():
        subprocess.run([PY, "-m", "podtrain.cli", "prepare", "builtin", "--out", args.data], check=True)
    results = {"bare": [], "podtrain": [], "podtrain_1rank": []}
    for r in range(args.rounds):
        results["bare"].append(bare(args.data, args.steps, args.compile))
        results["podtrain"].append(podtrain(args.data, args.steps, 2, args.compile))
        results["podtrain_1rank"].append(podtrain(args.data, args.steps, 1, args.compile))
        print(f"round {r + 1}: " + ", ".join(f"{k} {v[-1]:,.0f} tok/s" for k, v in results.items()), flush=True)
    med = {k: statistics.median(v) for k, v in results.items()}
    print(f"\nmedian tokens/s (2 ranks, CPU/gloo, tiny preset, seq 256, global batch 32, "
          f"compile={args.compile}):")
    for k, v in med.items():
        print(f"  {k:<16} {v:>10,.0f}")
    print(f"podtrain / bare DDP loop:   {med['podtrain'] / med['bare']:.3f}")
    print(f"scaling 2 ranks vs 1:       {med['podtrain'] / (2 * med['podtrain_1rank']):.3f}")


if __name__ == "__main__":
    main()
