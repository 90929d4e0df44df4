"""Save of a gpt2-124m training state (weights + AdamW) at 2 ranks (gloo, CPU), side by side:

    .venv/bin/python bench/checkpoint_save.py [--preset gpt2-124m] [--ranks 2] [--rounds 3] [--dir DIR]

* podtrain: ``Checkpointer.save`` at its defaults (every rank writes ~1/N, in the background);
* DCP: ``torch.distributed.checkpoint.async_save`` of the same state (``get_state_dict``);
* plain: each rank writes its share of the same bytes (one buffer, one file, fsync).

Each round every rank runs the three in this order, with barriers between; the first round warms
up (host buffers, imports) and the figures are medians of the others. Throughput is the bytes of
the checkpoint (all ranks) over the time from the call to the durable commit, as rank 0 sees it.
The stall is the time the call blocked the caller (the step loop's cost on the CPU). Goals:
podtrain >= 1.0x DCP's throughput, >= 0.8x the plain writes, stall <= DCP's.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import shutil
import socket
import statistics
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


def _dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def _rank(rank: int, world: int, port: int, args, out) -> None:
    import datetime

    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    from podtrain.ckpt.checkpointer import Checkpointer
    from podtrain.config_sections import CkptSection
    from podtrain.distributed.env import ClusterEnv
    from podtrain.distributed.group import DistContext
    from podtrain.model import build_model, preset_config

    os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank),
                       "LOCAL_WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=600))
    ctx = DistContext(env=ClusterEnv.detect(), backend="gloo", device=torch.device("cpu"), initialized=True)
    model = build_model(preset_config(args.preset), seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    for p in model.parameters():  # AdamW state exists: the save holds weights + two moments
        p.grad = torch.zeros_like(p)
    opt.step()
    base = Path(args.dir)
    ck = Checkpointer(base / "podtrain", CkptSection(keep_last=1), ctx)
    share = None
    results = []
    for rnd in range(args.rounds):
        row = {}
        # podtrain
        dist.barrier()
        t0 = time.perf_counter()
        ck.save(rnd + 1, model, opt, None, {"step": rnd + 1})
        stall = time.perf_counter() - t0
        ck.wait()
        dist.barrier()
        total = time.perf_counter() - t0
        folder = base / "podtrain" / "ckpt" / f"step_{rnd + 1:06d}"
        nbytes = _dir_bytes(folder) if rank == 0 else 0
        row["podtrain"] = (stall, total, nbytes)
        # DCP async_save
        model_sd, optim_sd = get_state_dict(model, opt)
        target = base / "dcp" / f"round_{rnd}"
        dist.barrier()
        t0 = time.perf_counter()
        future = dcp.async_save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(target))
        stall = time.perf_counter() - t0
        future.result()
        dist.barrier()
        total = time.perf_counter() - t0
        row["dcp"] = (stall, total, _dir_bytes(target) if rank == 0 else 0)
        # plain writes of this rank's share of the same bytes
        if share is None:
            flat = torch.cat([t.detach().reshape(-1).view(torch.uint8) for t in
                              [*model.state_dict().values(), *[v for s in opt.state.values() for v in s.values()
                                                               if isinstance(v, torch.Tensor)]]])
            n = flat.numel()
            share = flat[n * rank // world:n * (rank + 1) // world].clone()
            del flat
        path = base / "plain" / f"rank_{rank}_{rnd}.bin"
        path.parent.mkdir(parents=True, exist_ok=True)
        dist.barrier()
        t0 = time.perf_counter()
        with open(path, "wb") as fh:
            fh.write(memoryview(share.numpy()))
            fh.flush()
            os.fsync(fh.fileno())
        dist.barrier()
        total = time.perf_counter() - t0
        row["plain"] = (total, total, share.numel() * world)
        results.append(row)
        if rank == 0:
            shutil.rmtree(target, ignore_errors=True)
            for p in (base / "plain").glob("*.bin"):
                p.unlink()
    ck.close()
    dist.barrier()
    dist.destroy_process_group()
    out.put((rank, results))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="gpt2-124m")
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--dir", default=None, help="where to write (default: a temporary directory)")
    args = ap.parse_args()
    tmp = None
    if args.dir is None:
        tmp = args.dir = tempfile.mkdtemp(prefix="ckpt-save-")
    try:
        ctx = mp.get_context("spawn")
        out = ctx.Queue()
        port = _free_port()
        procs = [ctx.Process(target=_rank, args=(r, args.ranks, port, args, out)) for r in range(args.ranks)]
        for p in procs:
            p.start()
        results = dict(out.get(timeout=3600) for _ in procs)
        for p in procs:
            p.join()
    finally:
        if tmp:
            shutil.rmtree(tmp, ignore_errors=True)
    rows = results[0][1:] if args.rounds > 1 else results[0]  # the first round warms up
    fig = {}
    for kind in ("podtrain", "dcp", "plain"):
        stall = statistics.median(r[kind][0] for r in rows)
        total = statistics.median(r[kind][1] for r in rows)
        nbytes = statistics.median(r[kind][2] for r in rows)
        fig[kind] = (stall, total, nbytes / total / 1e6, nbytes)
        print(f"{kind:9s} {nbytes / 1e6:8.1f} MB  {total:6.2f} s  {nbytes / total / 1e6:7.1f} MB/s  "
              f"stall {stall:.3f} s")
    print(f"throughput podtrain / DCP async_save = {fig['podtrain'][2] / fig['dcp'][2]:.2f}x (goal >= 1.0)")
    print(f"throughput podtrain / plain writes   = {fig['podtrain'][2] / fig['plain'][2]:.2f}x (goal >= 0.8)")
    print(f"stall podtrain / DCP async_save      = {fig['podtrain'][0] / max(fig['dcp'][0], 1e-9):.2f}x "
          "(goal <= 1.0)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
