"""`podtrain eval` throughput (requests/s) against lm-eval's own HFLM on the exported folder: same
task, same documents, same batch size, same machine, measured side by side in one run.

    .venv/bin/python bench/eval_throughput.py [--run RUN_DIR] [--limit 200] [--nproc 2] [--batch-size 32]

Without --run, a tiny-preset run is trained for a few steps on the built-in corpus first. Then:
  1. `podtrain export RUN_DIR` (the folder HFLM loads),
  2. HFLM (pretrained=the folder, batch_size) on podtrain-next-line, one process,
  3. `podtrain eval RUN_DIR` in this process (1 rank), and under torchrun with --nproc ranks.
Printed ratios (requests/s, request counts equal):
  podtrain 1 rank / HFLM            goal >= 1.0
  podtrain N ranks / HFLM           goal ~N
Model load and task set-up are outside the timed part on both sides (evaluation only).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
REPO = Path(__file__).resolve().parents[1]
TASK = "podtrain-next-line"


def make_run(root: Path) -> Path:
    """A tiny run trained 20 steps on the built-in corpus (the model only has to be real)."""
    data, run = root / "data", root / "run"
    cli = [sys.executable, "-m", "podtrain.cli"]
    subprocess.run(cli + ["prepare", "builtin", "--out", str(data), "--no-progress"], check=True,
                   stdout=subprocess.DEVNULL)
    subprocess.run(cli + ["train", "configs/demo.yaml", f"data.path={data}", f"run.dir={run}",
                          "train.steps=20", "data.seq_len=128", "train.micro_batch_size=8",
                          "train.global_batch_size=8", "eval.every=0", "ckpt.every=0", "log.progress=off",
                          "data.verify=false", "monitor.watchdog=false"], check=True, cwd=REPO,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return run


def podtrain_one_rank(run: Path, limit: int, batch_size: int) -> tuple[float, int, float]:
    """(requests/s, requests, acc) of `podtrain eval` in this process."""
    from podtrain.distributed.env import ClusterEnv
    from podtrain.distributed.group import DistContext
    from podtrain.eval.evaluator import TaskEvaluator
    from podtrain.eval.source import load_source

    ctx = DistContext(env=ClusterEnv.detect({}), backend="gloo", device=torch.device("cpu"), initialized=False)
    src = load_source(run, None, None, ctx)
    evaluator = TaskEvaluator([TASK], [], limit, src.manifest, src.tokenizer, batch_size)
    results, mine = evaluator.run(src.model, ctx)
    return mine["requests"] / mine["seconds"], mine["requests"], results["results"][TASK]["acc,none"]


def hflm(folder: Path, run: Path, limit: int, batch_size: int) -> tuple[float, int, float]:
    """(requests/s, requests, acc) of lm-eval's HFLM on the exported folder, same task files."""
    from lm_eval.evaluator import simple_evaluate
    from lm_eval.models.huggingface import HFLM

    from podtrain.eval.harness import TaskSet
    from podtrain.eval.source import load_source
    from podtrain.eval.tasks import shipped_task_dirs

    from podtrain.distributed.env import ClusterEnv
    from podtrain.distributed.group import DistContext

    ctx = DistContext(env=ClusterEnv.detect({}), backend="gloo", device=torch.device("cpu"), initialized=False)
    src = load_source(run, None, None, ctx)
    tasks = TaskSet([TASK], shipped_task_dirs([TASK], src.manifest, src.tokenizer))
    lm = HFLM(pretrained=str(folder), batch_size=batch_size, device="cpu", dtype="float32")
    calls = {"n": 0}
    inner = lm.loglikelihood

    def counted(requests, *a, **k):
        calls["n"] += len(requests)
        return inner(requests, *a, **k)

    lm.loglikelihood = counted
    t0 = time.perf_counter()
    results = simple_evaluate(model=lm, tasks=[TASK], limit=limit, task_manager=tasks.manager, log_samples=False)
    seconds = time.perf_counter() - t0
    return calls["n"] / seconds, calls["n"], results["results"][TASK]["acc,none"]


def podtrain_ranks(run: Path, limit: int, batch_size: int, nproc: int, out: Path) -> tuple[float, int, float]:
    """(requests/s, requests, acc) of `podtrain eval` under torchrun with ``nproc`` ranks."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           "-m", "podtrain.cli", "eval", str(run), "--tasks", TASK, "--limit", str(limit),
           "--batch-size", str(batch_size), "--out", str(out)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    subprocess.run(cmd, check=True, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    result = json.loads(out.read_text())
    meta = result["podtrain"]
    return meta["requests_per_s"], meta["requests"], result["results"][TASK]["acc,none"]


def main() -> int:
    """Run both sides and print the ratios."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--run", type=Path, default=None, help="run directory (default: train a tiny one)")
    parser.add_argument("--limit", type=int, default=200, help="documents (default 200: 800 requests)")
    parser.add_argument("--nproc", type=int, default=2, help="ranks of the multi-rank run (default 2; 0: skip)")
    parser.add_argument("--batch-size", type=int, default=32)
    args = parser.parse_args()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        os.environ.setdefault("PODTRAIN_CACHE", str(root / "cache"))
        run = args.run or make_run(root)
        folder = root / "export"
        subprocess.run([sys.executable, "-m", "podtrain.cli", "export", str(run), str(folder)], check=True,
                       cwd=REPO, stdout=subprocess.DEVNULL)
        base_rps, base_n, base_acc = hflm(folder, run, args.limit, args.batch_size)
        one_rps, one_n, one_acc = podtrain_one_rank(run, args.limit, args.batch_size)
        print(f"HFLM (exported folder)   {base_rps:8.1f} requests/s  ({base_n} requests, acc {base_acc:.3f})")
        print(f"podtrain eval, 1 rank    {one_rps:8.1f} requests/s  ({one_n} requests, acc {one_acc:.3f})"
              f"  ratio {one_rps / base_rps:.2f}x (goal >= 1.0)")
        if args.nproc > 1:
            n_rps, n_n, n_acc = podtrain_ranks(run, args.limit, args.batch_size, args.nproc, root / "n.json")
            print(f"podtrain eval, {args.nproc} ranks   {n_rps:8.1f} requests/s  ({n_n} requests, acc "
                  f"{n_acc:.3f})  ratio {n_rps / base_rps:.2f}x (goal ~{args.nproc})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
