"""Validation loss on the held-out split: each rank its own samples, combined by token counts."""

from __future__ import annotations

import torch
from torch import nn

from podtrain.data.loader import SampleIndex, validation_ids
from podtrain.distributed.group import DistContext
from podtrain.train.precision import Precision
from podtrain.train.step import micro_batch_loss_sum


@torch.no_grad()
def evaluate(model: nn.Module, index: SampleIndex, ctx: DistContext, micro_batch_size: int,
             max_batches: int, precision: Precision) -> float:
    """Mean next-token loss over up to ``max_batches`` micro-batches per rank, all ranks combined.

    ``model`` is the unwrapped module: evaluation needs no gradient sync, so DDP's forward hooks
    are skipped. Every rank calls this (one all_reduce at the end), even one with no samples.
    """
    ids = validation_ids(index.num_samples, ctx.rank, ctx.world_size, max_batches * micro_batch_size)
    was_training = model.training
    model.eval()
    totals = torch.zeros(2, dtype=torch.float64, device=ctx.device)
    for start in range(0, len(ids), micro_batch_size):
        rows = torch.from_numpy(index.gather(ids[start:start + micro_batch_size])).to(ctx.device)
        totals[0] += micro_batch_loss_sum(model, rows, precision).double()
        totals[1] += rows.shape[0] * (rows.shape[1] - 1)
    model.train(was_training)
    ctx.all_reduce_sum(totals)
    loss_sum, tokens = totals.tolist()
    return loss_sum / tokens if tokens else float("nan")
