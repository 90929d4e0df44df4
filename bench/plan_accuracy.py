"""`podtrain plan --instance-type local` against real runs of several configs, side by side.

    .venv/bin/python bench/plan_accuracy.py [--rounds 5] [--steps 20] [--configs demo,short,wide,one-rank]
                                            [--max-minutes M]

Each round plans, runs and plans again every config (plan, run, plan, ...): the prediction is the
mean of the plans just before and just after its run, so the shared machine's drift during the run
hits both sides alike: each ratio is a plan and a run of the same round. The plan times this host's
step at the run's shapes (``plan/layertime.py``: a real decoder layer, the LM head and loss, the
optimizer; the line names the path it took and how long planning took); it is made in this process (as `podtrain plan CONFIG --instance-type local --nproc N --json` makes it,
without a second interpreter's start-up). The run is `podtrain launch local` at podtrain's defaults
(gloo, fp32 on CPU), shortened to --steps, with evaluation and checkpoints off (the plan shows them
apart from the step); its step time is the mean of metrics.jsonl's step_time_s after the first log
interval (start-up). The configs, all on the built-in corpus:

* demo: configs/demo.yaml's model and batch (2 ranks);
* short: the demo's model on 128-token sequences, micro-batch 16 (2 ranks);
* wide: a 384-wide, 4-block Llama (config.json written here), micro-batch 4 (2 ranks);
* one-rank: the demo's model and batch on 1 rank with both cores.

Printed: predicted / measured per config and round, then per config how many rounds are within
+-25% (the target: all, on a quiet machine) and the machine's load average, since other processes
slow the run and the calibration differently. --max-minutes starts no round after that much time
(a loaded machine can take many times longer): the summary then counts the rounds done.
"""

import argparse
import contextlib
import io
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PY = sys.executable
TOLERANCE = 0.25
WIDE = {"model_type": "llama", "hidden_size": 384, "intermediate_size": 1024, "num_hidden_layers": 4,
        "num_attention_heads": 6, "num_key_value_heads": 6, "max_position_embeddings": 2048,
        "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": True, "vocab_size": 320}


def configs(tmp):
    """Name -> (ranks, overrides on configs/demo.yaml)."""
    wide = Path(tmp) / "wide.json"
    wide.write_text(json.dumps(WIDE))
    demo = ["model.preset=tiny", "data.seq_len=256", "train.micro_batch_size=8", "train.global_batch_size=32"]
    return {
        "demo": (2, demo),
        "short": (2, ["model.preset=tiny", "data.seq_len=128", "train.micro_batch_size=16",
                      "train.global_batch_size=32"]),
        "wide": (2, [f"model.preset={wide}", "data.seq_len=256", "train.micro_batch_size=4",
                     "train.global_batch_size=16"]),
        "one-rank": (1, demo),
    }


def podtrain(*args, timeout=900):
    out = subprocess.run([PY, "-m", "podtrain.cli", *args], capture_output=True, text=True,
                         timeout=timeout, cwd=REPO)
    if out.returncode:
        sys.exit(f"podtrain {' '.join(args)} failed:\n{out.stderr[-3000:]}")
    return out.stdout


def predicted(ranks, overrides):
    """The plan's step seconds, its machine line, its step dict and the seconds planning took."""
    from podtrain.cli import main as cli

    text = io.StringIO()
    start = time.perf_counter()
    with contextlib.redirect_stdout(text):
        code = cli(["plan", "configs/demo.yaml", "--instance-type", "local", "--nproc", str(ranks), "--json",
                    *overrides])
    if code:
        sys.exit(f"podtrain plan {' '.join(overrides)} exited {code}")
    took = time.perf_counter() - start
    plan = json.loads(text.getvalue())
    return plan["step"]["step_s"], plan["machine"], plan["step"], took


def measured(ranks, overrides, run_dir, steps):
    """Mean step_time_s of a real run after its first log interval."""
    podtrain("launch", "local", "configs/demo.yaml", "--nproc", str(ranks), *overrides, f"run.dir={run_dir}",
             f"train.steps={steps}", f"log.every={max(1, steps // 4)}", "log.progress=off",
             "eval.every=0", "ckpt.every=0")
    lines = [json.loads(x) for x in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in lines if r["kind"] == "train"][1:]
    return statistics.mean(r["step_time_s"] for r in train)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--configs", default="demo,short,wide,one-rank", help="comma-separated names")
    parser.add_argument("--max-minutes", type=float, default=None, help="start no round after this")
    args = parser.parse_args()
    start = time.monotonic()
    os.chdir(REPO)
    with tempfile.TemporaryDirectory() as tmp:
        data = f"{tmp}/data"
        podtrain("prepare", "builtin", "--out", data)
        table = configs(tmp)
        names = args.configs.split(",")
        unknown = [n for n in names if n not in table]
        if unknown:
            sys.exit(f"--configs: unknown {', '.join(unknown)} (known: {', '.join(table)})")
        ratios = {name: [] for name in names}
        for k in range(args.rounds):
            if k and args.max_minutes and time.monotonic() - start > 60 * args.max_minutes:
                print(f"--max-minutes {args.max_minutes:g} reached: {k} of {args.rounds} rounds run")
                break
            for name in names:
                ranks, overrides = table[name]
                overrides = [*overrides, f"data.path={data}"]
                before, machine, step, took = predicted(ranks, overrides)
                meas = measured(ranks, overrides, f"{tmp}/run-{name}-{k}", args.steps)
                after = predicted(ranks, overrides)[0]
                pred = (before + after) / 2
                ratios[name].append(pred / meas)
                print(f"round {k + 1} {name:8s}: predicted {pred:.3f} s/step ({before:.3f} before the run, "
                      f"{after:.3f} after), measured {meas:.3f} s/step, "
                      f"predicted/measured {pred / meas:.2f} ({step.get('compute_path', 'flops')} path, planned in "
                      f"{took:.1f} s; peak {machine['peak_flops'] / 1e9:.1f} GFLOP/s x "
                      f"{machine['efficiency']:.2f}; load average {os.getloadavg()[0]:.1f})", flush=True)
    print(f"\nwithin +-{TOLERANCE:.0%} (load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores):")
    every = True
    for name, rs in ratios.items():
        within = sum(1 - TOLERANCE <= r <= 1 + TOLERANCE for r in rs)
        every &= within == len(rs)
        print(f"  {name:8s} {within} of {len(rs)} rounds (predicted/measured {', '.join(f'{r:.2f}' for r in rs)}; "
              f"median {statistics.median(rs):.2f})")
    print(f"all configs within +-{TOLERANCE:.0%} in every round: {'yes' if every else 'no'}")


if __name__ == "__main__":
    main()
