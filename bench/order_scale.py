"""The data order against corpus size: loader start time and memory, old order vs new, and ids/s.

    .venv/bin/python bench/order_scale.py [--sizes 1e5,1e6,1e7,1e8,1e9] [--old-max-gb 1]

For each corpus size (a sparse data directory: shards truncated to size, no byte written, so 1e9
samples take no disk), a fresh process starts a real ``ShardedLoader`` (rank 0 of 8, global batch
1024, micro-batch 8, seq 16) and takes its first batch, in the order a new run gets
(``feistel-1``, computed on demand) and, where its epoch array fits in ``--old-max-gb``, in the
order podtrain used before (``pcg64-shuffle``: an int32 array of the epoch, shuffled at start and
at every epoch; reached the way a resume from such a checkpoint reaches it). Printed: seconds to
the first batch and how far resident memory peaked above the process's before it (VmHWM), side by
side, with the exponent of each fitted against corpus size (log-log least squares; ~0 is flat,
~1 linear). "ready" ends when the loader knows its first batch's ids; reading that batch is
shown apart: it touches one page per window whatever the order (and on a device with a large
read-ahead, sparse or not, each touch reads that much around it). Then ids/s of each order per
batch (positions of one step), the old one once its epoch is built.
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

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))
sys.path.insert(0, str(REPO / "tests"))  # the sparse data directories the tests use

from loader_scale import make_sparse_data_dir, peak_rss_growth  # noqa: E402

SEQ, GLOBAL, MICRO, WORLD, SEED = 16, 1024, 8, 8, 1234
ORDERS = ("pcg64-shuffle", "feistel-1")


def count_shard_ops(data: str) -> dict[str, int]:
    """Count, from now on in this process, the metadata operations on ``data``'s shard files
    (``*.bin``): ``stat`` (os.stat/lstat, which pathlib calls too) and ``open`` (os.open and the
    builtin open, which numpy's memmap calls). On Lustre/FSx each is a metadata-server request."""
    import builtins

    root = os.path.abspath(data)
    counts = {"stat": 0, "open": 0}

    def is_shard(path) -> bool:
        try:
            p = os.fspath(path)
        except TypeError:  # a file descriptor
            return False
        p = p.decode() if isinstance(p, bytes) else p
        return p.endswith(".bin") and os.path.abspath(p).startswith(root)  # abspath: no stat of its own

    def counted(kind, real):
        def call(path, *args, **kw):
            if is_shard(path):
                counts[kind] += 1
            return real(path, *args, **kw)
        return call

    os.stat, os.lstat = counted("stat", os.stat), counted("stat", os.lstat)
    os.open, builtins.open = counted("open", os.open), counted("open", builtins.open)
    return counts


def child(data: str, order: str, world: int = WORLD) -> None:
    """In a fresh process: start a loader in ``order`` (rank 0 of ``world``) until its first
    batch's ids are known ("ready": the old order builds its epoch there), then read that batch;
    print JSON, with the shard files' metadata operations of both (``shard_ops``)."""
    from podtrain.data.loader import ShardedLoader, rank_slice
    from podtrain.data.samples import SHUFFLE_ORDER

    loader = {}
    ops = count_shard_ops(data)

    def ready():
        ld = loader["ld"] = ShardedLoader(data, SEQ, GLOBAL, MICRO, 0, world, seed=SEED, prefetch=1)
        if order == SHUFFLE_ORDER:  # a checkpoint from before the order was named: its own order
            ld.load_state_dict({"consumed": 0, "samples_per_epoch": ld.samples_per_epoch, "seed": SEED})
        assert ld.order_name == order
        mine = rank_slice(GLOBAL, world, 0)
        ld.order.ids(mine.start, mine.stop - mine.start)

    def first_batch():
        loader["ld"].next()
        loader["ld"].close()

    ready_s, ready_grew = peak_rss_growth(ready)
    batch_s, batch_grew = peak_rss_growth(first_batch)
    print(json.dumps({"ready_s": ready_s, "ready_rss": ready_grew, "batch_s": batch_s,
                      "start_rss": ready_grew + batch_grew, "shard_stats": ops["stat"], "shard_opens": ops["open"],
                      "shard_ops": ops["stat"] + ops["open"]}))


def measure(data: Path, order: str, world: int = WORLD) -> dict:
    """One ``child`` run (rank 0 of ``world``), in its own process (a clean resident-memory mark)."""
    out = subprocess.run([sys.executable, __file__, "--child", str(data), order, str(world)], capture_output=True,
                         text=True, check=False, env=dict(os.environ, OMP_NUM_THREADS="1"))
    if out.returncode:
        sys.exit(f"{order} at {data}: {out.stderr.strip().splitlines()[-1] if out.stderr.strip() else out.returncode}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def exponent(sizes: list[int], values: list[float]) -> float:
    """The slope of log(value) against log(size) (values floored at 1e-9)."""
    if len(sizes) < 2:
        return float("nan")
    return float(np.polyfit(np.log(sizes), np.log(np.maximum(values, 1e-9)), 1)[0])


def ids_per_second(order, count: int, calls: int = 200) -> float:
    """Ids/s of ``order.ids`` over batches of ``count`` consecutive positions spread over the epoch:
    the median call of ``calls`` (the machine is shared; one slow call says little)."""
    starts = np.random.default_rng(0).integers(0, order.num_samples, size=calls)
    times = []
    for start in starts:
        t0 = time.perf_counter()
        order.ids(int(start), count)
        times.append(time.perf_counter() - t0)
    return count / float(np.median(times))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="1e5,1e6,1e7,1e8,1e9", help="corpus sizes in samples")
    ap.add_argument("--old-max-gb", type=float, default=1.0,
                    help="run the old order only where its epoch array (4 bytes a sample) fits in this")
    ap.add_argument("--child", nargs=3, metavar=("DATA", "ORDER", "WORLD"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        return child(args.child[0], args.child[1], int(args.child[2]))
    sizes = [int(float(s)) for s in args.sizes.split(",")]
    rows: dict[str, dict[int, dict]] = {o: {} for o in ORDERS}
    with tempfile.TemporaryDirectory() as tmp:
        for n in sizes:
            data = make_sparse_data_dir(Path(tmp) / f"n{n}", n, SEQ)
            for order in ORDERS:
                if order == "pcg64-shuffle" and 4 * n > args.old_max_gb * 1e9:
                    continue
                rows[order][n] = measure(data, order)
    print(f"loader start, rank 0 of {WORLD}, global batch {GLOBAL}, a fresh process each. ready: constructed "
          "and its first batch's ids known; MB: resident memory peak above the process's before it")
    print(f"{'samples':>14} | {'old ready s':>11} {'old MB':>7} | {'new ready s':>11} {'new MB':>7} | "
          f"{'first batch read s':>18} {'+ its MB':>8}")
    for n in sizes:
        old, new = rows["pcg64-shuffle"].get(n), rows["feistel-1"][n]
        old_cells = f"{old['ready_s']:>11.3f} {old['ready_rss'] / 2**20:>7.1f}" if old else f"{'-':>11} {'-':>7}"
        print(f"{n:>14,} | {old_cells} | {new['ready_s']:>11.3f} {new['ready_rss'] / 2**20:>7.1f} | "
              f"{new['batch_s']:>18.3f} {(new['start_rss'] - new['ready_rss']) / 2**20:>8.1f}")
    for order in ORDERS:
        measured = sorted(rows[order])
        if not measured:
            continue
        t = exponent(measured, [rows[order][n]["ready_s"] for n in measured])
        m = exponent(measured, [max(rows[order][n]["ready_rss"], 4096) for n in measured])
        print(f"fitted exponent vs corpus size, {order} ({measured[0]:.0e}..{measured[-1]:.0e}): "
              f"ready time {t:+.2f}, peak memory {m:+.2f}")
    new, lo, hi = rows["feistel-1"], sizes[0], sizes[-1]
    print(f"new order, {hi:.0e} vs {lo:.0e} samples: ready {new[hi]['ready_s'] - new[lo]['ready_s']:+.3f} s, "
          f"{(new[hi]['ready_rss'] - new[lo]['ready_rss']) / 2**20:+.1f} MB; with the first batch read "
          f"{new[hi]['ready_s'] + new[hi]['batch_s'] - new[lo]['ready_s'] - new[lo]['batch_s']:+.3f} s, "
          f"{(new[hi]['start_rss'] - new[lo]['start_rss']) / 2**20:+.1f} MB (the pages its windows touch)")
    old_n = max(rows["pcg64-shuffle"], default=None)
    if old_n:
        per = rows["pcg64-shuffle"][old_n]["ready_s"] / old_n
        print(f"old order at 1e9 samples, from {old_n:.0e}: ~{per * 1e9:.0f} s to start and at every epoch, "
              f"{4e9 / 2**30:.1f} GiB per rank (int32; int64 past 2**31 samples)")

    from podtrain.data.samples import KeyedOrder, ShuffledOrder

    n = 10**7
    old_order, new_order, big = ShuffledOrder(n, SEED), KeyedOrder(n, SEED), KeyedOrder(10**9, SEED)
    t0 = time.perf_counter()
    old_order.ids(0, 1)  # builds the epoch
    build = time.perf_counter() - t0
    print(f"\nids/s per batch (positions of one step; the old order after building its epoch of {n:.0e} "
          f"in {build:.2f} s)")
    print(f"{'batch':>9} | {'old 1e7':>12} | {'new 1e7':>12} | {'new 1e9':>12} | {'new / old':>9}")
    for count in (128, 1024, 65536):
        o, k, b = (ids_per_second(x, count, 200 if count < 65536 else 20)
                   for x in (old_order, new_order, big))
        print(f"{count:>9,} | {o:>12,.0f} | {k:>12,.0f} | {b:>12,.0f} | {k / o:>9.3f}")
    per_step = 1024 / ids_per_second(big, 1024)
    print(f"new order: {per_step * 1e3:.2f} ms per 1024 ids on one core, in the loader's thread")


if __name__ == "__main__":
    main()
