"""`podtrain plan configs/demo.yaml --instance-type local` against the real 2-rank demo, in one run.

    .venv/bin/python bench/plan_accuracy.py [--steps 40] [--rounds 5]

Rounds alternate (plan, run, plan, run, ...) so the shared machine's drift hits both alike. The
plan measures this host at the run's shapes (``plan/calibrate.py``). The run is the demo as
`make demo` starts it (2 ranks, gloo, podtrain's defaults), shortened to --steps; its step time is
the mean of metrics.jsonl's step_time_s after the first interval (start-up). Printed:
predicted / measured step time per round, how many rounds are within +-25% (the target: all, on a
quiet machine) and the machine's load average, since other processes slow the run and the
calibration differently.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PY = sys.executable


def podtrain(*args, timeout=900):
    out = subprocess.run([PY, "-m", "podtrain.cli", *args], capture_output=True, text=True,
                         timeout=timeout, cwd=REPO)
    if out.returncode:
        sys.exit(f"podtrain {' '.join(args)} failed:\n{out.stderr[-3000:]}")
    return out.stdout


def predicted(data):
    plan = json.loads(podtrain("plan", "configs/demo.yaml", "--instance-type", "local", "--nproc", "2",
                               "--json", f"data.path={data}"))
    return plan["step"]["step_s"], plan


def measured(data, run_dir, steps):
    podtrain("launch", "local", "configs/demo.yaml", "--nproc", "2", f"data.path={data}",
             f"run.dir={run_dir}", f"train.steps={steps}", "log.progress=off")
    lines = [json.loads(x) for x in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in lines if r["kind"] == "train"][1:]
    return statistics.mean(r["step_time_s"] for r in train)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        data = f"{tmp}/data"
        podtrain("prepare", "builtin", "--out", data)
        ratios = []
        for k in range(args.rounds):
            pred, plan = predicted(data)
            meas = measured(data, f"{tmp}/run{k}", args.steps)
            ratios.append(pred / meas)
            print(f"round {k + 1}: predicted {pred:.3f} s/step (peak {plan['machine']['peak_flops'] / 1e9:.1f} "
                  f"GFLOP/s x {plan['machine']['efficiency']:.2f}; {plan['machine']['compute_source']}), "
                  f"measured {meas:.3f} s/step, predicted/measured {pred / meas:.2f}, "
                  f"load average {os.getloadavg()[0]:.1f}", flush=True)
    within = sum(0.75 <= r <= 1.25 for r in ratios)
    print(f"{within} of {len(ratios)} rounds within +-25% (median predicted/measured "
          f"{statistics.median(ratios):.2f}; load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores)")


if __name__ == "__main__":
    main()
