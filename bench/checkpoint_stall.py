"""Checkpoint cost for a ~100M-parameter model on CPU: step-loop stall async vs sync, and save
throughput against the disk's raw sequential write speed measured in the same run.

    .venv/bin/python bench/checkpoint_stall.py [--preset gpt2-124m] [--rounds 2] [--dir DIR]

Each round, in this order: a raw write of as many bytes as one checkpoint (64 MiB chunks from
memory, one fsync: what the disk can do), a synchronous save (the step loop waits for all of it),
and an asynchronous save (the step loop waits only for the host copy; the write runs behind a
loop of simulated training steps, whose slowdown is reported too). Printed ratios:
  async stall / sync save time      target <= 0.10
  save throughput / raw write speed target >= 0.5   (checkpoint bytes / sync save time)
The first async save also allocates the reused host buffers; steady-state figures use the others.
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

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from podtrain.ckpt.checkpointer import Checkpointer  # noqa: E402
from podtrain.config_sections import CkptSection  # noqa: E402
from podtrain.distributed.env import ClusterEnv  # noqa: E402
from podtrain.distributed.group import DistContext  # noqa: E402
from podtrain.model import build_model, preset_config  # noqa: E402


def raw_write(folder: Path, nbytes: int, chunk: int = 64 << 20) -> float:
    """Seconds to write ``nbytes`` sequentially and fsync them (the disk's own speed)."""
    buf = memoryview(os.urandom(chunk))
    path = folder / "raw.bin"
    t0 = time.perf_counter()
    with open(path, "wb") as fh:
        left = nbytes
        while left > 0:
            n = min(chunk, left)
            fh.write(buf[:n])
            left -= n
        fh.flush()
        os.fsync(fh.fileno())
    took = time.perf_counter() - t0
    path.unlink()
    return took


def fake_step(x: torch.Tensor, w: torch.Tensor, seconds: float) -> float:
    """Matmuls for about ``seconds`` (calibrated once): a stand-in for a training step."""
    t0 = time.perf_counter()
    n = max(1, int(seconds / fake_step.unit))
    for _ in range(n):
        x = torch.tanh(x @ w)
    return time.perf_counter() - t0


def calibrate(x: torch.Tensor, w: torch.Tensor) -> None:
    t0 = time.perf_counter()
    for _ in range(20):
        torch.tanh(x @ w)
    fake_step.unit = (time.perf_counter() - t0) / 20


def checkpoint_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="gpt2-124m")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--dir", default=None, help="where to write (default: the system temp dir)")
    ap.add_argument("--step-s", type=float, default=0.2, help="simulated training step length")
    args = ap.parse_args()

    ctx = DistContext(env=ClusterEnv.detect({}), backend="gloo", device=torch.device("cpu"), initialized=False)
    model = build_model(preset_config(args.preset), seed=0)
    params = sum(p.numel() for p in model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    for p in model.parameters():  # AdamW state without paying for a forward/backward
        p.grad = torch.randn_like(p) * 1e-3
    opt.step()
    x, w = torch.randn(256, 1024), torch.randn(1024, 1024) / 1024 ** 0.5  # ~0.5 GFLOP per op
    calibrate(x, w)
    state = {"step": 0, "tokens_seen": 0, "loader": {"epoch": 0, "consumed": 0}, "run_id": "bench", "config": {}}
    print(f"model {args.preset}: {params / 1e6:.1f}M parameters, torch threads {torch.get_num_threads()}")

    base = Path(tempfile.mkdtemp(prefix="podtrain-ckpt-bench-", dir=args.dir))
    raws, syncs, stalls, first_stall, writes, slowdowns, nbytes = [], [], [], None, [], [], 0
    try:
        sync_ck = Checkpointer(base / "sync", CkptSection(async_save=False, keep_last=1), ctx)
        async_ck = Checkpointer(base / "async", CkptSection(async_save=True, keep_last=1), ctx)
        t0 = time.perf_counter()
        async_ck.save(1, model, opt, None, state)  # allocates the reused host buffers
        first_stall = time.perf_counter() - t0
        async_ck.wait()
        nbytes = checkpoint_bytes(base / "async" / "ckpt" / "step_000001")
        sync_ck.save(1, model, opt, None, state)  # same for the sync checkpointer's buffers
        for r in range(args.rounds):
            step = 2 + r
            raws.append(raw_write(base, nbytes))
            t0 = time.perf_counter()
            sync_ck.save(step, model, opt, None, state)
            syncs.append(time.perf_counter() - t0)
            quiet = [fake_step(x, w, args.step_s) for _ in range(3)]
            t0 = time.perf_counter()
            async_ck.save(step, model, opt, None, state)
            stalls.append(time.perf_counter() - t0)
            busy = []
            while async_ck._pending is not None and not async_ck._pending.done.is_set():
                busy.append(fake_step(x, w, args.step_s))
            async_ck.wait()
            writes.append(async_ck.last_save["write_s"])
            if busy:
                slowdowns.append(statistics.mean(busy) / statistics.mean(quiet))
            print(f"round {r + 1}: raw write {nbytes / raws[-1] / 1e6:.0f} MB/s | sync save {syncs[-1]:.2f} s | "
                  f"async stall {stalls[-1] * 1e3:.0f} ms, background write {writes[-1]:.2f} s, "
                  f"{len(busy)} steps ran meanwhile")
        sync_ck.close()
        async_ck.close()
    finally:
        shutil.rmtree(base, ignore_errors=True)

    raw_bps = nbytes / statistics.mean(raws)
    save_bps = nbytes / statistics.mean(syncs)
    stall, sync_s = statistics.mean(stalls), statistics.mean(syncs)
    print(f"\ncheckpoint: {nbytes / 1e9:.2f} GB (weights + AdamW state + RNG + JSON)")
    print(f"raw sequential write     {raw_bps / 1e6:8.0f} MB/s")
    print(f"save throughput (sync)   {save_bps / 1e6:8.0f} MB/s   ratio {save_bps / raw_bps:.2f}  (target >= 0.5)")
    print(f"sync save (= stall)      {sync_s:8.2f} s")
    print(f"async stall              {stall:8.3f} s   ratio {stall / sync_s:.3f} (target <= 0.10)")
    print(f"async stall, first save  {first_stall:8.3f} s   (allocates the reused host buffers)")
    print(f"async background write   {statistics.mean(writes):8.2f} s")
    if slowdowns:
        print(f"steps during the write   {statistics.mean(slowdowns):8.2f}x their normal length "
              "(the writer's hashing and copies share the CPU)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
