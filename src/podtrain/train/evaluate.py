"""Validation loss on the held-out split: each rank its own samples, combined by token counts;
per source for a ``data.mix`` run, with the mixture's loss weighted as the training mix is."""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from podtrain.data.doc_mask import DocumentMasker, document_loss_sum
from podtrain.data.samples import SampleIndex, validation_ids
from podtrain.distributed.group import DistContext
from podtrain.model import is_sharded
from podtrain.train.precision import Precision
from podtrain.train.loss import micro_batch_loss_sum


@torch.no_grad()
def evaluate(model: nn.Module, index: SampleIndex, ctx: DistContext, micro_batch_size: int,
             max_batches: int, precision: Precision) -> float:
    """Mean next-token loss over up to ``max_batches`` micro-batches per rank, all ranks combined.

    ``model`` is the unwrapped module: evaluation needs no gradient sync, so DDP's forward hooks
    are skipped. Every rank calls this (one all_reduce at the end), even one with no samples.
    Under FSDP/HSDP every forward all-gathers weights with the other ranks, so a rank with fewer
    samples runs as many forwards as rank 0 (the most), the extra ones on a sample it discards.
    """
    return evaluate_sources(model, {"": index}, {"": 1.0}, ctx, micro_batch_size, max_batches, precision)[0]


@torch.no_grad()
def evaluate_sources(model: nn.Module, indexes: dict[str, SampleIndex], weights: dict[str, float],
                     ctx: DistContext, micro_batch_size: int, max_batches: int,
                     precision: Precision, masker: DocumentMasker | None = None) -> tuple[float, dict[str, float]]:
    """``evaluate`` on each source's validation split (``max_batches`` each, one all_reduce for
    all): the mixture's loss (the sources' losses weighted by ``weights``, renormalised over the
    sources that have a split) and ``{source: loss}``. ``masker``: the training loader's
    (data.document_masking), so a sample is scored as the model was trained, each document
    attending only to itself; without it, validation would score attention across documents the
    model never saw and report a loss above the one it reached."""
    was_training = model.training
    model.eval()
    totals = torch.zeros(len(indexes), 2, dtype=torch.float64, device=ctx.device)
    for row, index in enumerate(indexes.values()):
        totals[row] = _local_totals(model, index, ctx, micro_batch_size, max_batches, precision, masker)
    model.train(was_training)
    if is_sharded(model):  # a forward without backward leaves FSDP's weights gathered
        from torch.distributed.fsdp import FSDPModule

        for module in model.modules():  # reshard() is not recursive
            if isinstance(module, FSDPModule):
                module.reshard()
    ctx.all_reduce_sum(totals)
    losses = {name: (loss_sum / tokens if tokens else float("nan"))
              for name, (loss_sum, tokens) in zip(indexes, totals.tolist())}
    weight = sum(weights[name] for name in losses)
    return sum(weights[name] * loss for name, loss in losses.items()) / weight, losses


def _local_totals(model: nn.Module, index: SampleIndex, ctx: DistContext, micro_batch_size: int,
                  max_batches: int, precision: Precision, masker: DocumentMasker | None) -> torch.Tensor:
    """(loss sum, target tokens) of this rank's validation samples of ``index``."""
    limit = max_batches * micro_batch_size
    ids = validation_ids(index.num_samples, ctx.rank, ctx.world_size, limit)
    batches = -(-len(ids) // micro_batch_size)
    if is_sharded(model):
        most = len(validation_ids(index.num_samples, 0, ctx.world_size, limit))
        batches = -(-most // micro_batch_size)
    totals = torch.zeros(2, dtype=torch.float64, device=ctx.device)
    for b in range(batches):
        mine = ids[b * micro_batch_size:(b + 1) * micro_batch_size]
        rows = torch.from_numpy(index.gather(mine if len(mine) else np.zeros(1, np.int64)))
        if masker is not None:  # data.document_masking: positions and mask as in training
            loss_sum = document_loss_sum(model, masker(rows).to(ctx.device), precision).double()
        else:
            rows = rows.to(ctx.device)
            loss_sum = micro_batch_loss_sum(model, rows, precision).double()
        if len(mine):  # an extra forward (FSDP lockstep) counts for nothing
            totals[0] += loss_sum
            totals[1] += rows.shape[0] * (rows.shape[1] - 1)
    return totals
