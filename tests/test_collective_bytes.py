"""The bytes each rank receives from the remaining agreements (issue 37 point 3), measured on
real forked gloo ranks at 2, 4 and 8: the DDP replicas' weight check, the restore's agreements
and the newest local step every rank holds are flat in the world size; the straggler monitor's
report is the per-rank table it returns, 24 bytes a rank every ``every`` steps, and nothing else
(no host names gathered).

Bytes are counted by wrapping ``torch.distributed``'s collectives in each forked rank (the real
collectives run underneath): what a rank receives from the others, by the logical payload
(pickled sizes for the object collectives, plus the 8-byte size each rank sends in an all-gather
of objects)."""

from __future__ import annotations

import pickle

import pytest

from multirank import run_ranks

WORLDS = (2, 4, 8)


def _count_received(rank: int) -> dict:
    """Wrap this process's torch.distributed collectives: received bytes by phase."""
    import torch.distributed as dist

    box = {"phase": None, "bytes": {}}

    def add(n: int) -> None:
        if box["phase"] is not None:
            box["bytes"][box["phase"]] = box["bytes"].get(box["phase"], 0) + int(n)

    real = {name: getattr(dist, name) for name in ("all_reduce", "broadcast", "all_gather", "all_gather_object",
                                                   "broadcast_object_list", "gather_object")}

    def all_reduce(tensor, *a, **k):
        add(tensor.nbytes)
        return real["all_reduce"](tensor, *a, **k)

    def broadcast(tensor, src, *a, **k):
        add(0 if rank == src else tensor.nbytes)
        return real["broadcast"](tensor, src, *a, **k)

    def all_gather(out, tensor, *a, **k):
        add(sum(o.nbytes for o in out) - tensor.nbytes)
        return real["all_gather"](out, tensor, *a, **k)

    def all_gather_object(out, obj, *a, **k):
        result = real["all_gather_object"](out, obj, *a, **k)
        add(sum(len(pickle.dumps(o)) for i, o in enumerate(out) if i != rank) + 8 * len(out))
        return result

    def broadcast_object_list(objs, src=0, *a, **k):
        result = real["broadcast_object_list"](objs, src, *a, **k)
        add(0 if rank == src else sum(len(pickle.dumps(o)) for o in objs))
        return result

    def gather_object(obj, out=None, dst=0, *a, **k):
        result = real["gather_object"](obj, out, dst, *a, **k)
        add(sum(len(pickle.dumps(o)) for i, o in enumerate(out) if i != rank) if rank == dst else 0)
        return result

    for name, fn in (("all_reduce", all_reduce), ("broadcast", broadcast), ("all_gather", all_gather),
                     ("all_gather_object", all_gather_object), ("broadcast_object_list", broadcast_object_list),
                     ("gather_object", gather_object)):
        setattr(dist, name, fn)
    return box


def _measure(rank: int, world: int) -> dict:
    import torch

    from multirank import gloo_context
    from podtrain.ckpt.restore import agreed, newest_held_by_all, reports_if_any
    from podtrain.train.replicas import check_replicas
    from podtrain.train.stragglers import StragglerMonitor

    ctx = gloo_context()
    box = _count_received(rank)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Linear(16, 4))
    out = {}
    box["phase"] = "check_replicas"
    check_replicas(model, ctx, before_ddp=False)
    box["phase"] = "restore_agreements"
    out["agreed"] = agreed(ctx, "here", lambda: rank)
    out["reports"] = reports_if_any(ctx, None)
    box["phase"] = "newest_held_by_all"
    held = [(3, "a"), (4, "b"), (5, "c")] if rank else [(4, "b"), (5, "c"), (6, "d")]
    out["common"] = newest_held_by_all(ctx, held)
    box["phase"] = "straggler_init"
    monitor = StragglerMonitor(ctx, every=2, threshold=0.10)
    box["phase"] = "straggler_report"
    for step in (1, 2):
        monitor.observe(0.1 * (3 if rank == world - 1 and step == 2 else 1), 0.0)
        report = monitor.maybe_report(step)
    out["straggler"] = (report["straggler_rank"], report["straggler_host"])
    box["phase"] = None
    # a replica that differs is still named (the failure path gathers, to name it)
    if rank == 1:
        with torch.no_grad():
            model[0].weight.add_(1.0)
    try:
        check_replicas(model, ctx, before_ddp=False)
        out["differ"] = None
    except RuntimeError as exc:
        out["differ"] = str(exc)
    out["bytes"] = box["bytes"]
    return out


@pytest.mark.slow
def test_bytes_each_rank_receives_from_the_agreements_at_2_4_and_8_ranks():
    import socket

    runs = {world: run_ranks(_measure, world, timeout=180) for world in WORLDS}
    host = socket.gethostname()
    for world, results in runs.items():
        for rank, out in enumerate(results):
            assert out["agreed"] == rank and out["reports"] == []
            assert out["common"] == (5, "c")  # the newest item every rank holds
            assert out["straggler"] == (world - 1, host)
            assert out["differ"] == f"replicas differ from rank 0's after DDP's broadcast and the checkpoint " \
                                    f"restore: rank 1 on {host}", out["differ"]
    by_world = {world: [out["bytes"] for out in results] for world, results in runs.items()}
    # the straggler's table: 3 float64 per rank per report, nothing at construction
    for world, per_rank in by_world.items():
        for rank, got in enumerate(per_rank):
            assert got.get("straggler_init", 0) == 0, (world, rank, got)
            # the table, the straggler's host (broadcast from it: its pickled name) on the others
            host_bytes = 0 if rank == world - 1 else len(pickle.dumps(host))
            assert got["straggler_report"] == 24 * (world - 1) + host_bytes, (world, rank, got)
    # the rest is flat: the same bytes on every rank at 2, 4 and 8 ranks (rank 0 apart: it sends)
    for phase in ("check_replicas", "restore_agreements", "newest_held_by_all"):
        seen = {world: sorted({got.get(phase, 0) for got in per_rank[1:]}) for world, per_rank in by_world.items()}
        assert len({tuple(v) for v in seen.values()}) == 1 and len(seen[2]) == 1, (phase, seen)
