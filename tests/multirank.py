"""Run a function on N real ranks: forked processes joined by a gloo process group.

Forking after ``import torch`` costs ~0.2 s for 2 ranks (a torchrun subprocess ~10 s), so unit-level
distributed tests use this and only the few end-to-end tests start torchrun. Nothing here mocks
torch.distributed: the ranks are separate processes talking over loopback TCP.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import traceback
from typing import Any, Callable

import torch

from podtrain.launch.local import free_port


def _rank_main(fn, rank, world, port, args, queue, env):
    try:
        os.environ.update(env)
        os.environ.update({
            "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world),
            "LOCAL_WORLD_SIZE": str(world), "GROUP_RANK": "0",
            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
        })
        torch.set_num_threads(1)
        import datetime

        import torch.distributed as dist

        if world > 1:
            dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                    world_size=world, timeout=datetime.timedelta(seconds=60))
        try:
            result = fn(rank, world, *args)
        finally:
            if world > 1:
                import gc

                gc.collect()
                dist.destroy_process_group()
        # Plain pickle: torch's queue reductions pass tensors as shared-memory handles that die
        # with this process; bytes survive it.
        queue.put((rank, "ok", pickle.dumps(result)))
    except BaseException:  # report every failure to the parent, which re-raises it
        queue.put((rank, "error", traceback.format_exc()))


def run_ranks(fn: Callable[..., Any], world: int, *args: Any, timeout: float = 120.0,
              env: dict[str, str] | None = None) -> list[Any]:
    """Call ``fn(rank, world, *args)`` on ``world`` forked ranks; return results in rank order.

    The default process group (gloo) is initialised before ``fn`` runs and destroyed after, so
    ``fn`` may use ``torch.distributed`` and podtrain's ``DistContext`` directly. ``fn`` and its
    results must be picklable only for the results (fork shares the function).
    """
    ctx = mp.get_context("fork")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_rank_main, args=(fn, r, world, port, args, queue, env or {}),
                         daemon=False) for r in range(world)]  # ranks may start loader workers
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    errors = []
    try:
        for _ in range(world):
            rank, status, payload = queue.get(timeout=timeout)
            if status == "ok":
                results[rank] = pickle.loads(payload)
            else:
                errors.append(f"rank {rank} failed:\n{payload}")
                break
    except Exception as exc:  # queue.Empty: a rank hung or died without reporting
        errors.append(f"ranks did not finish within {timeout}s ({type(exc).__name__}); "
                      f"exit codes {[p.exitcode for p in procs]}")
    finally:
        for p in procs:
            p.join(timeout=5 if not errors else 0.5)
            if p.is_alive():
                p.kill()
                p.join()
    if errors:
        raise AssertionError("\n".join(errors))
    return [results[r] for r in range(world)]


def gloo_context():
    """The DistContext of this forked rank (gloo, CPU), as run_ranks started it."""
    import torch
    from podtrain.distributed.env import ClusterEnv
    from podtrain.distributed.group import DistContext

    env = ClusterEnv.detect()
    return DistContext(env=env, backend="gloo", device=torch.device("cpu"), initialized=env.world_size > 1)
