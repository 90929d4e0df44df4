"""What peer replicas (``ckpt.local_replicas``) cost the step loop: local saves at every step on
2 simulated nodes (forked ranks over gloo, one rank per node, each with its own local directory),
without replicas (K=0, the local tier alone) and with them (K=1, the default), side by side.

    .venv/bin/python bench/replica_stall.py [--preset mid] [--steps 12] [--rounds 2] [--step-s 0.3]
                                            [--local-every 1,4] [--dir /dev/shm]

Each configuration runs the same loop: a simulated training step (``--step-s`` seconds: a wait,
as a GPU step is for the host's cores; ``--step-kind cpu``: matmuls on them), then, every ``--local-every`` steps, ``Checkpointer.save(local=True)`` (podtrain's defaults
otherwise). Each cadence is measured: 1 (a local save at every step, the most demanding: here the
copies never catch up and share the one disk with every save) and 4 (the copies finish between
saves). Printed per configuration: the median and p90 time the step
loop spent in ``save`` (its stall: host copy plus any wait for the previous save), the loop's
total time, and how many local steps were replicated. The verdict line compares K=1 with K=0:
target median stall ratio <= 1.25 (the noise of this shared machine) — replicas must cost the
step loop no more than the local save they follow.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "src"), str(ROOT / "tests")]

from multirank import gloo_context, run_ranks  # noqa: E402
from podtrain.ckpt.checkpointer import Checkpointer  # noqa: E402
from podtrain.config_sections import CkptSection  # noqa: E402
from podtrain.model import build_model, preset_config  # noqa: E402


def _loop(rank: int, world: int, base: str, k: int, preset: str, steps: int, step_s: float, step_kind: str,
          every: int):
    """One rank = one node: train-like steps, a local save every ``every``; its stalls and totals."""
    os.environ.update({"GROUP_RANK": str(rank), "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1",
                       "PODTRAIN_HOSTNAME": f"node{rank}"})  # replicas are placed by host name
    ctx = gloo_context()
    model = build_model(preset_config(preset), seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    for p in model.parameters():  # AdamW state without paying for a forward/backward
        p.grad = torch.randn_like(p) * 1e-3
    opt.step()
    x, w = torch.randn(256, 512), torch.randn(512, 512) / 512 ** 0.5
    t0 = time.perf_counter()
    for _ in range(10):
        torch.tanh(x @ w)
    per_op = (time.perf_counter() - t0) / 10
    cfg = CkptSection(local_dir=f"{base}/node{rank}", local_every=every, local_replicas=k)
    ck = Checkpointer(Path(base) / "run", cfg, ctx)
    waits: list[float] = []
    settle = ck._settle

    def timed_settle(must, *tier):  # how much of the stall is waiting for the previous save
        t0 = time.perf_counter()
        try:
            return settle(must, *tier)
        finally:
            waits.append(time.perf_counter() - t0)

    ck._settle = timed_settle
    stalls, state = [], {"step": 0, "tokens_seen": 0, "run_id": "bench", "config": {}}
    loop0 = time.perf_counter()
    for step in range(1, steps + 1):
        if step_kind == "device":  # a GPU step: the host waits for the device, its cores are free
            time.sleep(step_s)
        else:
            for _ in range(max(1, int(step_s / per_op))):
                x = torch.tanh(x @ w)
        if step % every:
            continue
        t0 = time.perf_counter()
        ck.save(step, model, opt, None, {**state, "step": step}, local=True)
        stalls.append(time.perf_counter() - t0)
    loop_s = time.perf_counter() - loop0
    ck.close()
    replicator = ck._local_writer.replicator  # None without replicas
    replicated = replicator.replicated if replicator is not None else 0
    return stalls[1:], loop_s, replicated, waits[1:]  # the first save allocates the host buffers


def _cadence(args, every: int) -> str:
    """K=0 and K=1 side by side at one local-save cadence; its verdict line."""
    steps = args.steps * every  # the same number of saves at every cadence
    results: dict[int, list] = {0: [], 1: []}
    for r in range(args.rounds):
        for k in (0, 1):  # interleaved: the machine's load drifts
            base = tempfile.mkdtemp(prefix="podtrain-replica-bench-", dir=args.dir)
            try:
                out = run_ranks(_loop, 2, base, k, args.preset, steps, args.step_s, args.step_kind, every,
                                timeout=1800)
            finally:
                shutil.rmtree(base, ignore_errors=True)
            stalls = [s for rank_stalls, *_ in out for s in rank_stalls]
            waits = [w for *_, rank_waits in out for w in rank_waits]
            results[k].append((stalls, max(o[1] for o in out), min(o[2] for o in out)))
            print(f"local_every={every} round {r + 1} K={k}: median stall {statistics.median(stalls) * 1e3:.0f} ms, "
                  f"of which waiting for the previous save {statistics.median(waits) * 1e3:.0f} ms, "
                  f"loop {results[k][-1][1]:.1f} s, {results[k][-1][2]} of {args.steps} local steps replicated")
    summary = {}
    for k, runs in results.items():
        stalls = sorted(s for run in runs for s in run[0])
        summary[k] = (statistics.median(stalls), stalls[int(0.9 * (len(stalls) - 1))],
                      statistics.mean(run[1] for run in runs))
        print(f"local_every={every} K={k}: stall median {summary[k][0] * 1e3:6.0f} ms  p90 "
              f"{summary[k][1] * 1e3:6.0f} ms  loop {summary[k][2]:6.1f} s  ({args.steps} local saves, 2 nodes)")
    ratio = summary[1][0] / summary[0][0]
    return (f"local_every={every}: peer replicas / local save alone, median stall: {ratio:.2f} (target <= 1.25) "
            f"{'PASS' if ratio <= 1.25 else 'FAIL'}; loop time ratio {summary[1][2] / summary[0][2]:.2f}")


def _mid_config() -> str:
    """A llama config between the tiny preset and gpt2-124m, written to a temp file."""
    import json

    path = Path(tempfile.mkdtemp(prefix="podtrain-replica-bench-cfg-")) / "config.json"
    path.write_text(json.dumps({"model_type": "llama", "hidden_size": 384, "intermediate_size": 1024,
                                "num_hidden_layers": 6, "num_attention_heads": 6, "num_key_value_heads": 6,
                                "vocab_size": 8192, "max_position_embeddings": 512}))
    return str(path)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="mid",
                    help="a podtrain preset, a config.json, or 'mid' (a 17M-parameter llama: ~200 MB "
                         "of checkpoint, whose replication takes longer than a step here)")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--step-s", type=float, default=0.3, help="simulated training step length")
    ap.add_argument("--step-kind", choices=("device", "cpu"), default="device",
                    help="device: the step is a wait, as a GPU step is for the host (default); cpu: "
                         "matmuls on the host's cores, which the copies then compete for")
    ap.add_argument("--local-every", default="1,4",
                    help="local-save cadences to measure, comma-separated (each with --steps saves)")
    ap.add_argument("--dir", default=None, help="where the local directories go (default: temp)")
    args = ap.parse_args()
    if args.preset == "mid":
        args.preset = _mid_config()
    verdicts = []
    for every in (int(e) for e in args.local_every.split(",")):
        verdicts.append(_cadence(args, every))
    for line in verdicts:
        print(line)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
