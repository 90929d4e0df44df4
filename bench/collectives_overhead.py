"""podtrain's all_reduce busbw against a bare ``torch.distributed.all_reduce`` loop, and against
this machine's memory-copy bandwidth, all measured in the same run.

    .venv/bin/python bench/collectives_overhead.py [--sizes 1M,16M,64M] [--rounds 5] [--iters 20]

Two ranks (forked, gloo over loopback, one thread each). For each size, ``--rounds`` rounds
alternate which goes first: podtrain's ``run_benchmark`` (its checked case, then the timed loop)
and a bare loop (warm-up, barrier, ``dist.all_reduce`` ``--iters`` times, time averaged across
ranks, the same as the tool's). tool/bare is given for the medians over rounds and for the
best round of each (the best is the steadier figure on a machine shared with other work);
target >= 0.95, i.e. tool overhead <= 5%. The memcpy figure is one thread's ``dst.copy_(src)``
of a 256 MiB buffer (bytes copied per second, best of 5), measured before the ranks start, so a
loopback busbw can be read against a physical limit: gloo over loopback moves every byte through
the kernel's socket buffers several times, so busbw is expected to be a small fraction of memcpy.
"""

from __future__ import annotations

import argparse
import datetime
import multiprocessing as mp
import os
import socket
import statistics
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402


def memcpy_gbps(nbytes: int = 256 << 20, repeats: int = 5) -> float:
    """One thread's copy bandwidth: bytes copied per second (GB/s), best of ``repeats``."""
    src = torch.ones(nbytes // 4)
    dst = torch.empty_like(src)
    dst.copy_(src)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - start)
    return nbytes / best / 1e9


def bare_seconds(nbytes: int, iters: int, warmup: int) -> float:
    """Seconds per call of a bare all_reduce loop, averaged across ranks."""
    x = torch.ones(nbytes // 4)
    for _ in range(warmup):
        dist.all_reduce(x)
    dist.barrier()
    start = time.perf_counter()
    for _ in range(iters):
        dist.all_reduce(x)
    t = torch.tensor([(time.perf_counter() - start) / iters], dtype=torch.float64)
    dist.all_reduce(t)
    return t.item() / dist.get_world_size()


def tool_seconds(ctx, nbytes: int, iters: int, warmup: int) -> float:
    """Seconds per call as ``podtrain bench collectives`` measures them (averaged across ranks)."""
    from podtrain.diagnostics.collectives import BenchOptions, run_benchmark

    opts = BenchOptions(ops=["all_reduce"], sizes=[nbytes], iters=iters, warmup=warmup)
    rec = run_benchmark(ctx, opts)[0]
    assert rec["wrong"] == 0, rec
    return rec["time_s"]


def rank_main(rank, world, port, args, queue):
    os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank),
                       "LOCAL_WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1",
                       "MASTER_PORT": str(port)})
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=300))
    from podtrain.distributed.env import ClusterEnv
    from podtrain.distributed.group import process_group

    results = {}
    with process_group(ClusterEnv.detect(), "gloo") as ctx:
        for size in args.sizes:
            tool, bare = [], []
            for r in range(args.rounds):
                order = (("tool", "bare") if r % 2 == 0 else ("bare", "tool"))
                for kind in order:
                    if kind == "tool":
                        tool.append(tool_seconds(ctx, size, args.iters, args.warmup))
                    else:
                        bare.append(bare_seconds(size, args.iters, args.warmup))
            results[size] = (tool, bare)
    dist.destroy_process_group()
    queue.put((rank, results))


def parse_sizes(text: str) -> list[int]:
    from podtrain.diagnostics.busbw import parse_size

    return [parse_size(s) for s in text.split(",")]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", type=parse_sizes, default=parse_sizes("1M,16M,64M"))
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5)
    args = p.parse_args()
    torch.set_num_threads(1)
    copy = memcpy_gbps()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("fork")
    queue = ctx.Queue()
    procs = [ctx.Process(target=rank_main, args=(r, 2, port, args, queue)) for r in range(2)]
    for proc in procs:
        proc.start()
    results = dict(queue.get(timeout=1800) for _ in procs)[0]
    for proc in procs:
        proc.join()

    from podtrain.diagnostics.busbw import busbw_gbps, format_size

    print(f"2 ranks, gloo over loopback, float32, {args.rounds} alternating rounds of "
          f"{args.iters} iterations; torch {torch.__version__}; load average "
          f"{os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")
    print(f"memcpy (1 thread, 256M copy_): {copy:.2f} GB/s")
    print(f"{'size':>6} {'stat':>6}  {'tool busbw':>11}  {'bare busbw':>11}  {'tool/bare':>9}  "
          f"{'tool/memcpy':>11}")
    for size, (tool_ts, bare_ts) in results.items():
        for stat, pick in (("median", statistics.median), ("best", min)):
            tool_bw = busbw_gbps("all_reduce", size, pick(tool_ts), 2)
            bare_bw = busbw_gbps("all_reduce", size, pick(bare_ts), 2)
            print(f"{format_size(size):>6} {stat:>6}  {tool_bw:>8.3f} GB/s  {bare_bw:>8.3f} GB/s  "
                  f"{tool_bw / bare_bw:>9.3f}  {tool_bw / copy:>11.3f}")


if __name__ == "__main__":
    main()
