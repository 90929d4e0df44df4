"""Checks that the replicas DDP keeps are what they should be: every parameter takes part in
the loss (else DDP's reducer fails or hangs later), and every rank holds the same weights."""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist

from podtrain.distributed.group import DistContext
from podtrain.errors import UserError
from podtrain.model import is_sharded, parameter_fingerprint
from podtrain.train.precision import resolve_precision
from podtrain.train.loss import micro_batch_loss_sum

log = logging.getLogger("podtrain")


def check_all_parameters_used(model: torch.nn.Module, seq_len: int, device: torch.device) -> None:
    """One local forward/backward on a dummy batch: name parameters that get no gradient.

    DDP without find_unused_parameters would otherwise fail later with a hard-to-read
    reduction error (or hang on some versions). No collective is involved.
    """
    rows = torch.zeros(1, min(seq_len, 16) + 1, dtype=torch.long, device=device)
    micro_batch_loss_sum(model, rows, resolve_precision("fp32", device)).backward()
    unused = [name for name, p in model.named_parameters() if p.requires_grad and p.grad is None]
    model.zero_grad(set_to_none=True)
    if unused:
        shown = ", ".join(unused[:5]) + (f" and {len(unused) - 5} more" if len(unused) > 5 else "")
        raise UserError(f"parameters receive no gradient: {shown}; set dist.find_unused_parameters=true "
                        "(slower) or freeze them (requires_grad=False)")


def ranks_differing(ctx: DistContext, fingerprint: torch.Tensor, caller: str) -> list[tuple[int, str]]:
    """``(rank, host)`` of the ranks whose ``fingerprint`` differs from rank 0's (all ranks call
    this; the same list on every rank). Rank 0's is broadcast and each rank compares its own, then
    one all_reduce MAX of a flag says whether any differs: the bytes each rank receives are the
    fingerprint's and 8 more, whatever the world size (gathering every rank's fingerprint was the
    world size times that). Only when some rank differs are the (flag, host) pairs gathered, to
    name them."""
    mine = fingerprint.detach().to(ctx.device, torch.float64).contiguous()
    rank0 = mine.clone()
    with ctx.recorder.begin("broadcast", rank0, caller=caller):
        dist.broadcast(rank0, src=0)
    differs = not torch.equal(mine.cpu(), rank0.cpu())
    if not ctx.all_reduce_max([float(differs)])[0]:
        return []
    return [(r, host) for r, (d, host) in enumerate(ctx.all_gather_object((differs, ctx.env.hostname))) if d]


def check_replicas(model: torch.nn.Module, ctx: DistContext, before_ddp: bool) -> None:
    """Every rank must hold the same weights: compare per-parameter sums with rank 0's
    (``ranks_differing``: a broadcast and a one-number all_reduce; all ranks call this). Before
    DDP's broadcast a difference is only a warning; after it and the checkpoint restore (every
    rank reads the checkpoint itself), an error naming the ranks. FSDP/HSDP shards differ by
    design: nothing to compare (their wrap broadcasts rank 0's weights before sharding, and every
    rank reads its shards from the same checkpoint)."""
    if not ctx.initialized or is_sharded(model):
        return
    differ = ranks_differing(ctx, parameter_fingerprint(model), "check_replicas")
    if not differ:
        return
    if before_ddp:
        log.warning("ranks %s initialised different weights from rank 0; DDP broadcasts rank 0's",
                    [r for r, _ in differ])
    else:
        where = ", ".join(f"rank {r} on {host}" for r, host in differ)
        raise RuntimeError(f"replicas differ from rank 0's after DDP's broadcast and the checkpoint "
                           f"restore: {where}")


def buffers_changed_by_forward(model: torch.nn.Module, seq_len: int, device: torch.device) -> list[str]:
    """Names of the buffers one training-mode forward of a full-length dummy sequence changes
    (BatchNorm's running statistics, a rotary cache that a long sequence rescales). No collective."""
    before = {name: b.detach().clone() for name, b in model.named_buffers()}
    if not before:
        return []
    rows = torch.zeros(1, seq_len + 1, dtype=torch.long, device=device)
    was_training = model.training
    model.train()
    with torch.no_grad():
        micro_batch_loss_sum(model, rows, resolve_precision("fp32", device))
    model.train(was_training)
    return [name for name, b in model.named_buffers() if not torch.equal(before[name], b)]


def buffers_need_forward_sync(model: torch.nn.Module, ctx: DistContext, seq_len: int) -> bool:
    """Whether DDP must broadcast rank 0's buffers before every forward (all ranks call this).

    Not when the buffers are constant: every rank built the same ones from the config (rotary
    ``inv_freq``: compared across ranks here) and a forward leaves them unchanged (checked on a
    dummy batch). Then the broadcast at DDP's construction is all they ever need, and the
    per-forward broadcast would only cost a collective per micro-batch.
    """
    buffers = [b for _, b in model.named_buffers()]
    if not buffers or not ctx.initialized:
        return False
    changed = buffers_changed_by_forward(model, seq_len, ctx.device)
    with torch.no_grad():
        mine = torch.stack([b.detach().double().sum() for b in buffers]).cpu()
    differ = [r for r, _ in ranks_differing(ctx, mine, "buffers_need_forward_sync")]
    if changed or differ:
        log.info("DDP broadcasts buffers before every forward: %s", "; ".join(filter(None, [
            f"a forward changes {', '.join(changed[:3])}" if changed else "",
            f"ranks {differ} built buffers different from rank 0's" if differ else ""])))
        return True
    return False


def ddp_buffer_arguments(sync: bool) -> dict[str, bool]:
    """DDP's keyword for per-forward buffer syncing: ``forward_sync_buffers`` where torch has it
    (2.13: buffers are still broadcast once at construction), else ``broadcast_buffers``."""
    import inspect

    from torch.nn.parallel import DistributedDataParallel

    if "forward_sync_buffers" in inspect.signature(DistributedDataParallel.__init__).parameters:
        return {"forward_sync_buffers": sync}
    return {"broadcast_buffers": sync}
