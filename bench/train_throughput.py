"""podtrain at its DEFAULTS against a bare DDP loop and HF Trainer, paired by round, in one run.

    .venv/bin/python bench/train_throughput.py [--steps 30] [--rounds 6] [--compile] [--no-hf]
        [--no-1rank] [--versus SRC] [--src SRC]

On a shared machine absolute times mean little: what this prints are ratios paired by round.
Every configuration runs once per round, the order reversed every other round (bare, HF Trainer,
podtrain 2 ranks, podtrain 1 rank; then backwards), so the machine's drift hits them alike; each
reports steady-state tokens/s after a warm-up of 10 optimizer steps. Each round prints its own
ratios, and the verdict is on their median. The same model (tiny preset), data (the built-in
corpus's shard), global batch (32 x 256 tokens, micro-batch 8 with accumulation), fp32, and warmup
+ cosine AdamW with clipping at 1.0. podtrain runs at its defaults (hang watchdog, straggler
monitor, stop-signal agreement, guard, goodput, async checkpointing all on) with only evaluation
and intermediate checkpoints off (``eval.every=0 ckpt.every=0``, as the baselines have neither)
and the progress bar off. With ``--compile`` podtrain runs ``train.compile=true`` against a
compiled bare loop (HF Trainer is left out). ``--versus SRC`` adds podtrain from another source
tree (``git archive <commit> src | tar -x -C DIR``; SRC=DIR/src) to each round, for bisecting;
``--src SRC`` runs podtrain itself from such a tree.
Printed, the median over rounds of each round's ratio:
  podtrain / bare DDP loop      target >= 0.99   (PASS/MISS)
  podtrain / HF Trainer         target >= 1.00
  2 ranks / (2 x 1 rank)        scaling efficiency of podtrain, target >= 0.95
"""

import argparse
import importlib.util
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
WARMUP = 10  # optimizer steps before measuring (podtrain: its first log intervals, demo log.every=5)
TARGET_BARE = 0.99


def torchrun(nproc, *args, src=None):
    # One thread per rank in every configuration, so "1 rank" is one rank's share of a 2-rank job
    # and the 2-vs-1 ratio measures DDP's scaling, not thread scaling.
    env = dict(os.environ, OMP_NUM_THREADS="1", TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1")
    if src:
        env["PYTHONPATH"] = os.pathsep.join([str(src), *filter(None, [env.get("PYTHONPATH")])])
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


def podtrain(data, steps, nproc, compile_, src=None):
    src = src.resolve() if src else None
    with tempfile.TemporaryDirectory() as run_dir:
        global_batch = 32 if nproc == 2 else 16  # 1 rank: half the global batch, same per-rank work
        out = torchrun(nproc, "-m", "podtrain.cli", "train", str(REPO / "configs/demo.yaml"),
                       f"data.path={data}", f"run.dir={run_dir}", f"train.steps={steps}",
                       f"train.global_batch_size={global_batch}", "eval.every=0", "ckpt.every=0",
                       "log.progress=off", f"train.compile={'true' if compile_ else 'false'}", src=src)
        if out.returncode:
            sys.exit(f"podtrain failed:\n{out.stderr[-3000:]}")
        records = [json.loads(x) for x in Path(run_dir, "metrics.jsonl").read_text().splitlines()]
        steady = [r for r in records if r.get("kind") == "train" and r["step"] > WARMUP]
        # tokens/s of the steady log intervals, weighted by their duration
        tokens = sum(r["tokens_per_s"] * r["step_time_s"] for r in steady)
        return tokens / sum(r["step_time_s"] for r in steady)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--compile", action="store_true")
    ap.add_argument("--no-hf", action="store_true", help="leave HF Trainer out")
    ap.add_argument("--no-1rank", action="store_true", help="leave podtrain's 1-rank run out")
    ap.add_argument("--versus", type=Path, help="also run podtrain from this src tree each round")
    ap.add_argument("--src", type=Path, help="run podtrain itself from this src tree (default: the installed one)")
    ap.add_argument("--data", default=str(REPO / "data/builtin"))
    args = ap.parse_args()
    if args.steps <= WARMUP:
        sys.exit(f"--steps must exceed the warm-up of {WARMUP} steps")
    if not Path(args.data, "manifest.json").exists():
        subprocess.run([PY, "-m", "podtrain.cli", "prepare", "builtin", "--out", args.data], check=True)
    runs = {"bare": lambda: script_tokens_per_s("bare loop", "bare_ddp.py", args.data, args.steps,
                                                *(["--compile"] if args.compile else []))}
    hf_missing = [m for m in ("accelerate",) if importlib.util.find_spec(m) is None]
    if hf_missing and not (args.compile or args.no_hf):
        print(f"HF Trainer left out: {', '.join(hf_missing)} not installed (the bench extra: "
              "pip install -e '.[bench]')", flush=True)
    if not (args.compile or args.no_hf or hf_missing):
        runs["hf_trainer"] = lambda: script_tokens_per_s("HF Trainer", "hf_trainer_baseline.py",
                                                         args.data, args.steps)
    runs["podtrain"] = lambda: podtrain(args.data, args.steps, 2, args.compile, src=args.src)
    if args.versus:
        runs["versus"] = lambda: podtrain(args.data, args.steps, 2, args.compile, src=args.versus)
    if not args.no_1rank:
        runs["podtrain_1rank"] = lambda: podtrain(args.data, args.steps, 1, args.compile, src=args.src)
    ratios = {"podtrain/bare": lambda t: t["podtrain"] / t["bare"]}
    if "hf_trainer" in runs:
        ratios["podtrain/hf"] = lambda t: t["podtrain"] / t["hf_trainer"]
        ratios["hf/bare"] = lambda t: t["hf_trainer"] / t["bare"]
    if "versus" in runs:
        ratios["podtrain/versus"] = lambda t: t["podtrain"] / t["versus"]
    if "podtrain_1rank" in runs:
        ratios["2 vs 1 rank"] = lambda t: t["podtrain"] / (2 * t["podtrain_1rank"])
    results = {k: [] for k in runs}
    per_round = {k: [] for k in ratios}
    for r in range(args.rounds):
        order = list(runs) if r % 2 == 0 else list(reversed(runs))  # alternate who goes first
        tps = {name: runs[name]() for name in order}
        for name, v in tps.items():
            results[name].append(v)
        for k, f in ratios.items():
            per_round[k].append(f(tps))
        print(f"round {r + 1} ({' -> '.join(order)}): "
              + ", ".join(f"{k} {v:,.0f}" for k, v in tps.items()) + " tok/s | "
              + ", ".join(f"{k} {v[-1]:.3f}" for k, v in per_round.items()), flush=True)
    print(f"\n2 ranks, CPU/gloo, 1 thread each, tiny preset, seq 256, global batch 32, {args.steps} steps "
          f"({WARMUP} warm-up), compile={args.compile}, {args.rounds} rounds:")
    for k, v in results.items():
        print(f"  {k:<16} median {statistics.median(v):>10,.0f} tok/s   rounds: {', '.join(f'{x:,.0f}' for x in v)}")
    print("ratios paired by round (median of the rounds' ratios):")
    for k, v in per_round.items():
        print(f"  {k:<18} {statistics.median(v):.3f}   rounds: {', '.join(f'{x:.3f}' for x in v)}")
    med = statistics.median(per_round["podtrain/bare"])
    bare_name = "the compiled bare DDP loop" if args.compile else "the bare DDP loop"
    print(f"{'PASS' if med >= TARGET_BARE else 'MISS'}: podtrain at its defaults / {bare_name} = {med:.3f} "
          f"paired median over {args.rounds} rounds (target >= {TARGET_BARE})")
    if "podtrain/hf" in per_round:
        print(f"  podtrain / HF Trainer {statistics.median(per_round['podtrain/hf']):.3f} (target >= 1.00)")
    if "2 vs 1 rank" in per_round:
        print(f"  scaling 2 ranks vs 1 {statistics.median(per_round['2 vs 1 rank']):.3f} (target >= 0.95)")


if __name__ == "__main__":
    main()
