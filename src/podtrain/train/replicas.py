"""Checks that the replicas DDP keeps are what they should be: every parameter takes part in
the loss (else DDP's reducer fails or hangs later), and every rank holds the same weights."""

from __future__ import annotations

import logging

import torch

from podtrain.distributed.group import DistContext
from podtrain.errors import UserError
from podtrain.model import parameter_fingerprint
from podtrain.train.precision import resolve_precision
from podtrain.train.step import micro_batch_loss_sum

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


def check_replicas(model: torch.nn.Module, ctx: DistContext, before_ddp: bool) -> None:
    """Every rank must hold the same weights: compare per-parameter sums across ranks (all
    ranks call this). Before DDP's broadcast a difference is only a warning; after it and the
    checkpoint restore (every rank reads the checkpoint itself), an error naming the ranks."""
    if not ctx.initialized:
        return
    gathered = ctx.all_gather_object((parameter_fingerprint(model).cpu(), ctx.env.hostname))
    differ = [r for r, (f, _) in enumerate(gathered) if not torch.equal(f, gathered[0][0])]
    if not differ:
        return
    if before_ddp:
        log.warning("ranks %s initialised different weights from rank 0; DDP broadcasts rank 0's", differ)
    else:
        where = ", ".join(f"rank {r} on {gathered[r][1]}" for r in differ)
        raise RuntimeError(f"replicas differ from rank 0's after DDP's broadcast and the checkpoint "
                           f"restore: {where}")
