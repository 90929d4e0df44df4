"""podtrain at its DEFAULTS against a bare DDP loop and HF Trainer, paired by round, in one run.

    .venv/bin/python bench/train_throughput.py [--steps 30] [--rounds 4] [--compile] [--no-hf]
        [--no-1rank] [--versus SRC] [--src SRC]

On a shared machine absolute times mean little: what this prints are ratios paired by round.
One clock for every contender (``bare_ddp.RankTimer``): the ranks themselves time the wall between
two barriers, from the end of the 10th optimizer step to the end of the last, and each rank's CPU
seconds (user + sys, all threads) over the same window; podtrain runs its unchanged CLI under
``podtrain_timed.py``, which puts that timer around its steps. Each round runs every configuration
twice, in an order that cancels drift and the order effect within the round (A B B A, then B A A B
the next round: a linear drift and a bonus for running second hit every configuration alike);
a configuration's value in a round is the geometric mean of its two runs, and the verdict is on
the median over rounds of the rounds' ratios. The order effect itself is printed: from the pair
podtrain/bare, how much faster a run is when it follows the other (sqrt of the ratio with bare
first over the ratio with podtrain first), so it is seen, not guessed. The same model (tiny
preset), data (the built-in corpus's shard), global batch (32 x 256 tokens, micro-batch 8 with
accumulation), fp32, and warmup + cosine AdamW with clipping at 1.0. podtrain runs at its
defaults (hang watchdog, straggler monitor, stop-signal agreement, guard, goodput, garbage
collection on its schedule, async checkpointing all on) with only evaluation and intermediate
checkpoints off (``eval.every=0 ckpt.every=0``, as the baselines have neither) and the progress
bar off. With ``--compile`` podtrain runs ``train.compile=true`` against a compiled bare loop (HF
Trainer is left out). ``--versus SRC`` adds podtrain from another source tree (``git archive
<commit> src | tar -x -C DIR``; SRC=DIR/src) to each round, for bisecting; ``--src SRC`` runs
podtrain itself from such a tree.
Printed, the median over rounds of each round's ratio:
  podtrain / bare DDP loop      target >= 0.99   (PASS/MISS)
  podtrain / HF Trainer         target >= 1.00
  2 ranks / (2 x 1 rank)        scaling efficiency of podtrain, target >= 0.95
and CPU seconds per step per rank (podtrain / bare), the figure load distorts least.
"""

import argparse
import importlib.util
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from podtrain.launch.local import free_port

REPO = Path(__file__).resolve().parents[1]
PY = sys.executable
WARMUP = 10  # optimizer steps before the clocks start, for every contender alike
TARGET_BARE = 0.99
SEQ = 256


def torchrun(nproc, *args, src=None):
    # One thread per rank in every configuration, so "1 rank" is one rank's share of a 2-rank job
    # and the 2-vs-1 ratio measures DDP's scaling, not thread scaling.
    env = dict(os.environ, OMP_NUM_THREADS="1", TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1")
    if src:
        env["PYTHONPATH"] = os.pathsep.join([str(src), *filter(None, [env.get("PYTHONPATH")])])
    cmd = [PY, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}", "--rdzv-backend=c10d",
           f"--rdzv-endpoint=127.0.0.1:{free_port()}", *args]
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1800, cwd=REPO)


def timed(name, out, nproc):
    """The ranks' ``RankTimer`` lines -> tokens/s (rank 0's clock: the barriers make them equal)
    and CPU seconds per step (the ranks' mean)."""
    lines, decoder, at = [], json.JSONDecoder(), out.stdout.find('{"timed"')
    while at >= 0:  # each rank's line (robust to two lines run together in the shared pipe)
        line, end = decoder.raw_decode(out.stdout, at)
        lines.append(line)
        at = out.stdout.find('{"timed"', end)
    if out.returncode or len(lines) != nproc:
        sys.exit(f"{name} failed:\n{out.stdout[-2000:]}\n{out.stderr[-3000:]}")
    rank0 = next(x for x in lines if x["rank"] == 0)
    return {"tokens_per_s": rank0["tokens_per_s"],
            "cpu_s_per_step": statistics.mean(x["cpu_s_per_step"] for x in lines),
            "faults_per_step": statistics.mean(x["minor_faults_per_step"] for x in lines)}


def script(name, script_name, data, steps, *extra):
    out = torchrun(2, str(REPO / "bench" / script_name), "--data", data, "--steps", str(steps),
                   "--warmup", str(WARMUP), *extra)
    return timed(name, out, 2)


def podtrain(data, steps, nproc, compile_, src=None):
    src = src.resolve() if src else None
    with tempfile.TemporaryDirectory() as run_dir:
        global_batch = 32 if nproc == 2 else 16  # 1 rank: half the global batch, same per-rank work
        out = torchrun(nproc, str(REPO / "bench" / "podtrain_timed.py"), "--warmup", str(WARMUP),
                       "--steps", str(steps), "--tokens-per-step", str(global_batch * SEQ),
                       str(REPO / "configs/demo.yaml"), f"data.path={data}", f"run.dir={run_dir}",
                       f"train.steps={steps}", f"train.global_batch_size={global_batch}", f"data.seq_len={SEQ}",
                       "eval.every=0", "ckpt.every=0", "log.progress=off",
                       f"train.compile={'true' if compile_ else 'false'}", src=src)
        return timed("podtrain", out, nproc)


def geomean(values):
    return math.prod(values) ** (1 / len(values))


def round_order(names, r):
    """A B B A, and B A A B the next round: within a round every configuration's mean position is
    the same (a linear drift cancels), and each runs once after and once before the others."""
    first = list(names) if r % 2 == 0 else list(reversed(names))
    return first + list(reversed(first))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--rounds", type=int, default=4)
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
    runs = {"bare": lambda: script("bare loop", "bare_ddp.py", args.data, args.steps,
                                   *(["--compile"] if args.compile else []))}
    hf_missing = [m for m in ("accelerate",) if importlib.util.find_spec(m) is None]
    if hf_missing and not (args.compile or args.no_hf):
        print(f"HF Trainer left out: {', '.join(hf_missing)} not installed (the bench extra: "
              "pip install -e '.[bench]')", flush=True)
    if not (args.compile or args.no_hf or hf_missing):
        runs["hf_trainer"] = lambda: script("HF Trainer", "hf_trainer_baseline.py", args.data, args.steps)
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
    cpu = {k: [] for k in runs}
    per_round = {k: [] for k in ratios}
    cpu_ratio, order_effect = [], []
    for r in range(args.rounds):
        order = round_order(runs, r)
        got = {name: [] for name in runs}
        for name in order:
            got[name].append(runs[name]())
        tps = {name: geomean([x["tokens_per_s"] for x in v]) for name, v in got.items()}
        cps = {name: statistics.mean(x["cpu_s_per_step"] for x in v) for name, v in got.items()}
        faults = {name: statistics.mean(x["faults_per_step"] for x in v) for name, v in got.items()}
        for name in runs:
            results[name].append(tps[name])
            cpu[name].append(cps[name])
        for k, f in ratios.items():
            per_round[k].append(f(tps))
        cpu_ratio.append(cps["podtrain"] / cps["bare"])
        # The pair podtrain/bare in the round's first half and in its second, where their order is
        # reversed: the square root of the two ratios' quotient is the bonus of running second.
        pt, bare = got["podtrain"], got["bare"]
        after_bare = pt[0]["tokens_per_s"] / bare[0]["tokens_per_s"]  # the half where bare ran first
        before_bare = pt[1]["tokens_per_s"] / bare[1]["tokens_per_s"]
        if order.index("podtrain") < order.index("bare"):
            after_bare, before_bare = before_bare, after_bare
        order_effect.append(math.sqrt(after_bare / before_bare))
        print(f"round {r + 1} ({' '.join(order)}): "
              + ", ".join(f"{k} {v:,.0f}" for k, v in tps.items()) + " tok/s | "
              + ", ".join(f"{k} {v[-1]:.3f}" for k, v in per_round.items())
              + f" | CPU s/step podtrain {cps['podtrain']:.3f} bare {cps['bare']:.3f} ({cpu_ratio[-1]:.3f})"
              + f" | running second x{order_effect[-1]:.3f}"
              + " | minor page faults/step " + ", ".join(f"{k} {v:,.0f}" for k, v in faults.items()), flush=True)
    print(f"\n2 ranks, CPU/gloo, 1 thread each, tiny preset, seq {SEQ}, global batch 32, {args.steps} steps "
          f"({WARMUP} warm-up), compile={args.compile}, {args.rounds} rounds, each configuration twice a round:")
    for k, v in results.items():
        print(f"  {k:<16} median {statistics.median(v):>10,.0f} tok/s   rounds: {', '.join(f'{x:,.0f}' for x in v)}")
    print("CPU seconds per optimizer step per rank (user + sys, all threads; load distorts it least):")
    for k, v in cpu.items():
        print(f"  {k:<16} median {statistics.median(v):.4f}   rounds: {', '.join(f'{x:.4f}' for x in v)}")
    print(f"  podtrain/bare CPU per step, paired by round: median {statistics.median(cpu_ratio):.3f}   rounds: "
          + ", ".join(f"{x:.3f}" for x in cpu_ratio))
    print(f"order effect: a run right after the other contender is x{statistics.median(order_effect):.3f} "
          f"as fast (median over rounds: {', '.join(f'{x:.3f}' for x in order_effect)}); cancelled in the "
          "ratios below by the A B B A order")
    print("ratios paired by round (median of the rounds' ratios):")
    for k, v in per_round.items():
        print(f"  {k:<18} {statistics.median(v):.3f}   rounds: {', '.join(f'{x:.3f}' for x in v)}")
    med = statistics.median(per_round["podtrain/bare"])
    bare_name = "the compiled bare DDP loop" if args.compile else "the bare DDP loop"
    print(f"{'PASS' if med >= TARGET_BARE else 'MISS'}: podtrain at its defaults / {bare_name} = {med:.3f} "
          f"paired median over {args.rounds} rounds (target >= {TARGET_BARE}); geometric mean "
          f"{geomean(per_round['podtrain/bare']):.3f}")
    if "podtrain/hf" in per_round:
        print(f"  podtrain / HF Trainer {statistics.median(per_round['podtrain/hf']):.3f} (target >= 1.00)")
    if "2 vs 1 rank" in per_round:
        print(f"  scaling 2 ranks vs 1 {statistics.median(per_round['2 vs 1 rank']):.3f} (target >= 0.95)")


if __name__ == "__main__":
    main()
