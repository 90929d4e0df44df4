"""podtrain at its DEFAULTS against a bare DDP loop and HF Trainer, and 2 ranks against 1, in one run.

    .venv/bin/python bench/train_throughput.py [--steps 40] [--rounds 3] [--compile]

Every configuration runs once per round, in the same order each round (bare, HF Trainer, podtrain
2 ranks, podtrain 1 rank), so the machine's drift hits them alike; each reports steady-state
tokens/s after a warm-up of 10 optimizer steps. The same model (tiny preset), data (the built-in
corpus's shard), global batch (32 x 256 tokens, micro-batch 8 with accumulation), fp32, and
warmup + cosine AdamW with clipping at 1.0. podtrain runs at its defaults (hang watchdog,
straggler monitor, stop-signal agreement, async checkpointing all on) with only evaluation and
intermediate checkpoints off (``eval.every=0 ckpt.every=0``, as the baselines have neither) and
the progress bar off. With ``--compile`` podtrain runs ``train.compile=true`` against a compiled
bare loop (HF Trainer is left out). Printed ratios of medians:
  podtrain / bare DDP loop      target >= 1.00
  podtrain / HF Trainer         target >= 1.00
  2 ranks / (2 x 1 rank)        scaling efficiency of podtrain, target >= 0.95
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
WARMUP = 10  # optimizer steps before measuring; podtrain's first log interval (log.every=10)


def torchrun(nproc, *args):
    # One thread per rank in every configuration, so "1 rank" is one rank's share of a 2-rank job
    # and the 2-vs-1 ratio measures DDP's scaling, not thread scaling.
    env = dict(os.environ, OMP_NUM_THREADS="1", TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1")
    cmd = [PY, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}", "--rdzv-backend=c10d",
           f"--rdzv-endpoint=127.0.0.1:{free_port()}", *args]
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1800, cwd=REPO)


def script_tokens_per_s(name, script, data, steps, *extra):
    out = torchrun(2, str(REPO / "bench" / script), "--data", data, "--steps", str(steps),
                   "--warmup", str(WARMUP), *extra)
    lines = [line for line in out.stdout.splitlines() if line.startswith("{")]
    if out.returncode or not lines:
        sys.exit(f"{name} failed:\n{out.stdout[-2000:]}\n{out.stderr[-3000:]}")
    return json.loads(lines[-1])["tokens_per_s"]


def podtrain(data, steps, nproc, compile_):
    with tempfile.TemporaryDirectory() as run_dir:
        global_batch = 32 if nproc == 2 else 16  # 1 rank: half the global batch, same per-rank work
        out = torchrun(nproc, "-m", "podtrain.cli", "train", str(REPO / "configs/demo.yaml"),
                       f"data.path={data}", f"run.dir={run_dir}", f"train.steps={steps}",
                       f"train.global_batch_size={global_batch}", "eval.every=0", "ckpt.every=0",
                       "log.progress=off", f"train.compile={'true' if compile_ else 'false'}")
        if out.returncode:
            sys.exit(f"podtrain failed:\n{out.stderr[-3000:]}")
        records = [json.loads(x) for x in Path(run_dir, "metrics.jsonl").read_text().splitlines()]
        steady = [r for r in records if r.get("kind") == "train" and r["step"] > WARMUP]
        # tokens/s of the steady log intervals (10 steps each), weighted by their duration
        tokens = sum(r["tokens_per_s"] * r["step_time_s"] for r in steady)
        return tokens / sum(r["step_time_s"] for r in steady)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--compile", action="store_true")
    ap.add_argument("--data", default=str(REPO / "data/builtin"))
    args = ap.parse_args()
    if not Path(args.data, "manifest.json").exists():
        subprocess.run([PY, "-m", "podtrain.cli", "prepare", "builtin", "--out", args.data], check=True)
    runs = {"bare": lambda: script_tokens_per_s("bare loop", "bare_ddp.py", args.data, args.steps,
                                                *(["--compile"] if args.compile else []))}
    if not args.compile:
        runs["hf_trainer"] = lambda: script_tokens_per_s("HF Trainer", "hf_trainer_baseline.py",
                                                         args.data, args.steps)
    runs["podtrain"] = lambda: podtrain(args.data, args.steps, 2, args.compile)
    runs["podtrain_1rank"] = lambda: podtrain(args.data, args.steps, 1, args.compile)
    results = {k: [] for k in runs}
    for r in range(args.rounds):
        for name, fn in runs.items():
            results[name].append(fn())
        print(f"round {r + 1}: " + ", ".join(f"{k} {v[-1]:,.0f}" for k, v in results.items())
              + " tok/s", flush=True)
    med = {k: statistics.median(v) for k, v in results.items()}
    print(f"\nmedian tokens/s over {args.rounds} rounds (2 ranks, CPU/gloo, 1 thread each, tiny "
          f"preset, seq 256, global batch 32, {args.steps} steps, compile={args.compile}):")
    for k, v in med.items():
        print(f"  {k:<16} {v:>10,.0f}   rounds: {', '.join(f'{x:,.0f}' for x in results[k])}")
    bare_name = "compiled bare DDP loop" if args.compile else "bare DDP loop"
    print(f"podtrain / {bare_name + ':':<24} {med['podtrain'] / med['bare']:.3f}   (target >= 1.00)")
    if "hf_trainer" in med:
        print(f"podtrain / {'HF Trainer:':<24} {med['podtrain'] / med['hf_trainer']:.3f}   (target >= 1.00)")
    print(f"scaling 2 ranks vs 1:               {med['podtrain'] / (2 * med['podtrain_1rank']):.3f}"
          f"   (target >= 0.95)")


if __name__ == "__main__":
    main()
