"""Checkpoints on S3 (a local moto server, started here; needs the `test` extra) against what a
user would otherwise run: s3torchconnector's DCP path, side by side, paired by round:

    .venv/bin/python bench/checkpoint_s3.py [--preset gpt2-124m] [--ranks 1,2] [--rounds 3]

At each rank count the ranks are real processes (forked, gloo over loopback), each holding the
preset's weights and AdamW state (a replicated model, as under DDP), and each round runs both
systems, in alternating order:

* podtrain: ``Checkpointer`` with ``ckpt.dir=s3://...`` at its DEFAULTS (async save, keep_last 3),
  inside ``shared_s3_clients()`` as ``podtrain train`` runs it, one per rank for every round as a
  run keeps one (the warm-up round is the run's first save): ``save`` (the step loop is blocked
  until it returns: host copy), ``wait`` (pieces uploaded, CRCs, manifest committed: durable) and
  its ``restore`` (ranged reads, CRCs checked, copied in: a rollback's path);
* DCP: ``get_state_dict`` then ``torch.distributed.checkpoint.async_save`` with s3torchconnector's
  ``S3StorageWriter`` (the step loop is blocked until it returns: staging), its future's
  ``result()`` (``.metadata`` written: durable), and ``dcp.load`` with ``S3StorageReader`` +
  ``set_state_dict``; the connector at its defaults (``thread_count=1``; ``--dcp-threads``).
  Needs ``tenacity`` (s3torchconnector's ``dcp`` extra).

Stall: from the save call until it returns, the slowest rank. Durable: from the save call until
the checkpoint is visible (every rank's upload and the commit; a barrier after), rank 0's clock.
Load: from the call until every rank has the state back (barrier after). Every figure is a ratio
DCP / podtrain of the same round (>= 1.0: podtrain as fast or faster); the table shows the
median of the rounds after the warm-up round and each round's. The moto server (Python, in the
parent process) is the bottleneck and the machine may be shared: the ratios are the instrument,
the seconds are not.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "tests"))  # the loopback S3 server and the forked ranks the tests use

FIGURES = ("stall", "durable", "load")
TARGET = 1.0


def _state(preset: str):
    """The preset's model and an AdamW that has stepped once (its moments exist, as in training)."""
    from podtrain.model import build_model, preset_config

    model = build_model(preset_config(preset), seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    opt.step()
    for p in model.parameters():
        p.grad = None
    return model, opt


def _barrier(world: int) -> None:
    if world > 1:
        torch.distributed.barrier()


def _slowest(world: int, seconds: float) -> float:
    """The largest of every rank's ``seconds``."""
    if world == 1:
        return seconds
    t = torch.tensor([seconds], dtype=torch.float64)
    torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
    return float(t.item())


def _s3_client():
    """A connector client on the test server (the DCP classes build theirs without an endpoint)."""
    from s3torchconnector import S3ClientConfig
    from s3torchconnector._s3client import S3Client

    return S3Client(os.environ["AWS_REGION"], endpoint=os.environ["AWS_ENDPOINT_URL"],
                    s3client_config=S3ClientConfig(force_path_style=True))


def _podtrain(rank, world, model, opt, bucket, run_dir, step) -> dict:
    """One podtrain save (stall, durable) and restore; seconds."""
    from podtrain.storage import shared_s3_clients

    with shared_s3_clients():  # as `podtrain train` runs: one set of S3 clients for every store
        return _podtrain_rounds(rank, world, model, opt, bucket, run_dir, step)


_RUNS: dict[int, object] = {}
"""This forked rank's Checkpointer, one for every round as a training run keeps one: its later
saves reuse what the first built (buffers, the layout, the config JSON), as a run's do."""


def _podtrain_rounds(rank, world, model, opt, bucket, run_dir, step) -> dict:
    from multirank import gloo_context

    from podtrain.ckpt.checkpointer import Checkpointer
    from podtrain.config_sections import CkptSection

    ck = _RUNS.get(world)
    if ck is None:
        ck = _RUNS[world] = Checkpointer(Path(run_dir), CkptSection(dir=f"s3://{bucket}/podtrain-w{world}"),
                                         gloo_context())
    _barrier(world)
    t0 = time.perf_counter()
    ck.save(step, model, opt, None, {"step": step})
    stall = _slowest(world, time.perf_counter() - t0)
    ck.wait()
    _barrier(world)
    durable = time.perf_counter() - t0
    _barrier(world)
    t0 = time.perf_counter()
    state = ck.restore(model, opt, None)  # the run's own restore (a rollback's path): reads the newest save
    _barrier(world)
    load = time.perf_counter() - t0
    assert state is not None and state.step == step, f"rank {rank}: podtrain restored {state}"
    return {"stall": stall, "durable": durable, "load": load}


def _close_runs() -> None:
    """Close this rank's Checkpointer (after the last round)."""
    for ck in _RUNS.values():
        ck.close()
    _RUNS.clear()


def _dcp(rank, world, model, opt, bucket, step, threads) -> dict:
    """One DCP async save (stall, durable) and load through s3torchconnector; seconds."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from s3torchconnector.dcp import S3StorageReader, S3StorageWriter

    path = f"s3://{bucket}/dcp-w{world}/step_{step:06d}"
    region = os.environ["AWS_REGION"]
    writer = S3StorageWriter(region, path, thread_count=threads)
    writer.fs._client = _s3_client()
    _barrier(world)
    t0 = time.perf_counter()
    msd, osd = get_state_dict(model, opt)  # in the loop: the optimizer's state by name, as DCP wants it
    future = dcp.async_save({"model": msd, "optim": osd}, storage_writer=writer)
    stall = _slowest(world, time.perf_counter() - t0)
    future.result()
    _barrier(world)
    durable = time.perf_counter() - t0
    del msd, osd
    reader = S3StorageReader(region, path)
    reader.fs._client = _s3_client()
    _barrier(world)
    t0 = time.perf_counter()
    msd, osd = get_state_dict(model, opt)
    state = {"model": msd, "optim": osd}
    dcp.load(state, storage_reader=reader)
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    _barrier(world)
    load = time.perf_counter() - t0
    return {"stall": stall, "durable": durable, "load": load}


def bench_rank(rank: int, world: int, preset: str, bucket: str, run_dir: str, rounds: int, threads: int) -> list:
    """On a forked rank: ``rounds`` + 1 rounds of both systems, alternating which goes first."""
    torch.set_num_threads(1)
    model, opt = _state(preset)
    nbytes = sum(t.numel() * t.element_size() for t in model.state_dict().values()) + sum(
        v.numel() * v.element_size() for s in opt.state.values() for v in s.values()
        if isinstance(v, torch.Tensor) and v.dim())
    rows = []
    for rnd in range(rounds + 1):
        step = rnd + 1
        order = ("podtrain", "dcp") if rnd % 2 == 0 else ("dcp", "podtrain")
        row = {"bytes": nbytes, "first": order[0]}
        for name in order:
            row[name] = (_podtrain(rank, world, model, opt, bucket, run_dir, step) if name == "podtrain"
                         else _dcp(rank, world, model, opt, bucket, step, threads))
        if rank == 0:
            print(f"  w{world} round {rnd}{' (warm-up)' if rnd == 0 else ''}: " + "; ".join(
                f"{f} podtrain {row['podtrain'][f]:.2f} s DCP {row['dcp'][f]:.2f} s" for f in FIGURES),
                file=sys.stderr, flush=True)
        rows.append(row)
    from podtrain.storage import shared_s3_clients

    with shared_s3_clients():
        _close_runs()
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="gpt2-124m")
    ap.add_argument("--ranks", default="1,2", help="rank counts (forked processes, gloo)")
    ap.add_argument("--rounds", type=int, default=3, help="measured rounds (after one warm-up round)")
    ap.add_argument("--dcp-threads", type=int, default=1, help="S3StorageWriter thread_count (its default: 1)")
    args = ap.parse_args()
    from multirank import run_ranks
    from s3_server import restore_env, start_with_env

    import torch.distributed.checkpoint  # noqa: F401 - imported once here, not in each forked rank
    import s3torchconnector.dcp  # noqa: F401

    worlds = [int(w) for w in args.ranks.split(",")]
    server, saved = start_with_env()
    results = {}
    try:
        for world in worlds:
            bucket = server.new_bucket()
            with tempfile.TemporaryDirectory(prefix="ckpt-s3-bench-") as run_dir:
                results[world] = run_ranks(bench_rank, world, args.preset, bucket, run_dir, args.rounds,
                                           args.dcp_threads, timeout=7200)[0]
    finally:
        server.stop()
        restore_env(saved)
    mb = results[worlds[0]][0]["bytes"] / 1e6
    print(f"\n{args.preset} weights + AdamW ({mb:,.0f} MB per rank, replicated), moto on loopback; "
          f"ratio = DCP (s3torchconnector S3StorageWriter/Reader, async_save, thread_count={args.dcp_threads}) "
          f"/ podtrain (defaults), same round; median of {args.rounds} rounds after a warm-up")
    print(f"{'ranks':>5} {'figure':>8} | {'podtrain s':>10} {'DCP s':>8} | {'ratio':>6} | per round")
    verdicts = []
    for world in worlds:
        rows = results[world][1:] or results[world]
        for f in FIGURES:
            ratios = [r["dcp"][f] / max(r["podtrain"][f], 1e-9) for r in rows]
            med = statistics.median(ratios)
            print(f"{world:>5} {f:>8} | {statistics.median(r['podtrain'][f] for r in rows):>10.2f} "
                  f"{statistics.median(r['dcp'][f] for r in rows):>8.2f} | {med:>5.2f}x | "
                  + " ".join(f"{x:.2f}" for x in ratios))
            verdicts.append(f"{'PASS' if med >= TARGET else 'MISS'}  {world} rank{'s' if world > 1 else ''} "
                            f"{f}: podtrain {med:.2f}x DCP's speed (target >= {TARGET:.1f}x)")
    print("\n" + "\n".join(verdicts))
    return 0


if __name__ == "__main__":
    sys.exit(main())
