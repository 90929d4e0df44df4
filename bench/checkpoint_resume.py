"""Resume time and bytes read per rank at 1, 2 and 4 ranks (gloo, CPU), side by side in one run:

    .venv/bin/python bench/checkpoint_resume.py [--preset gpt2-124m] [--worlds 1,2,4] [--dir DIR]

One save of a training state (weights + AdamW) by 2 ranks at podtrain's defaults, then
``Checkpointer.restore`` at each world size (every rank reads and verifies only its share, the
ranks exchange the rest). Per world: the slowest rank's restore time, the most tensor bytes any
rank read, and both against the 1-rank resume (bytes should fall ~1/N; time falls with it where
storage, not the exchange or the CPU, is the limit: on 2 shared cores expect less).
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import shutil
import socket
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank(rank: int, world: int, port: int, args, mode: str, out) -> None:
    import datetime

    import torch.distributed as dist

    from podtrain.ckpt.checkpointer import Checkpointer
    from podtrain.config_sections import CkptSection
    from podtrain.distributed.env import ClusterEnv
    from podtrain.distributed.group import DistContext
    from podtrain.model import build_model, preset_config

    os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank),
                       "LOCAL_WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
    torch.set_num_threads(1)
    if world > 1:
        dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=1800))
    ctx = DistContext(env=ClusterEnv.detect(), backend="gloo", device=torch.device("cpu"), initialized=world > 1)
    model = build_model(preset_config(args.preset), seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    for p in model.parameters():  # AdamW state exists: the checkpoint holds weights + two moments
        p.grad = torch.zeros_like(p)
    opt.step()
    ck = Checkpointer(Path(args.dir), CkptSection(), ctx)
    if mode == "save":
        ck.save(1, model, opt, None, {"step": 1})
        ck.wait()
        result = None
    else:
        if world > 1:
            dist.barrier()
        t0 = time.perf_counter()
        state = ck.restore(model, opt, None)
        result = (time.perf_counter() - t0, ck.restored.bytes_read, state.step)
    ck.close()
    if world > 1:
        dist.destroy_process_group()
    out.put((rank, result))


def _run(world: int, args, mode: str) -> list:
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_rank, args=(r, world, port, args, mode, out)) for r in range(world)]
    for p in procs:
        p.start()
    results = dict(out.get(timeout=3600) for _ in procs)
    for p in procs:
        p.join()
    return [results[r] for r in range(world)]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="gpt2-124m")
    ap.add_argument("--worlds", default="1,2,4")
    ap.add_argument("--dir", default=None, help="run directory (default: a temporary one)")
    args = ap.parse_args()
    tmp = None
    if args.dir is None:
        tmp = args.dir = tempfile.mkdtemp(prefix="ckpt-resume-")
    try:
        _run(2, args, "save")
        ckpt = Path(args.dir) / "ckpt" / "step_000001"
        total = sum(p.stat().st_size for p in ckpt.glob("rank_*.safetensors"))
        print(f"checkpoint: {args.preset} weights + AdamW, {total / 1e6:.1f} MB of pieces (2 ranks wrote)")
        base = None
        for world in map(int, args.worlds.split(",")):
            rows = _run(world, args, "restore")
            secs, nbytes = max(r[0] for r in rows), max(r[1] for r in rows)
            base = base or (secs, nbytes)
            print(f"  {world} rank(s): restore {secs:6.2f} s (x{secs / base[0]:.2f} of 1 rank)  "
                  f"max read per rank {nbytes / 1e6:8.1f} MB = {nbytes / total:.3f} of the checkpoint "
                  f"(x{nbytes / base[1]:.2f} of 1 rank; ideal {1 / world:.2f})")
    finally:
        if tmp:
            shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
