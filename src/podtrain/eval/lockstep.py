"""Scoring lm-eval requests with an FSDP/HSDP model itself, each rank its own share.

Under FSDP every forward all-gathers each layer's weight shards from the other ranks of its shard
group, so every rank must run as many forwards as the busiest one, whatever its share of the
requests (their number, lengths, shared contexts and early stops all differ per rank).
``Lockstep`` keeps them in step: before each real forward a rank says so (a one-element
all_reduce of 1); a rank whose requests of a kind are done (``drain``, at the end of each lm-eval
request type on every rank) says 0 and, as long as the sum shows another rank still working, runs
a one-token forward of its own that joins that rank's all-gathers, until every rank says 0.

One scalar all_reduce per forward is negligible beside the forward's all-gathers (and the scorer
already waits for each batch's scores on the host). Why not a whole copy instead: an 8B model is
32 GB in fp32 and a 70B one 280 GB, more than an 80 GB GPU holds beside its training state, and a
copy in one rank's host memory would be scored on the CPU (hours) while every GPU waits. Scored
sharded, task evaluation needs no weights beyond training's own (one layer gathered at a time, or
all of them where training already keeps them gathered: ``accumulate_unsharded``).
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from podtrain.distributed.group import DistContext


class Lockstep:
    """Forwards of the sharded ``model`` (the root FSDP module, which every forward goes through)
    kept in step over the ranks of ``ctx`` (see the module docstring). Build it on every rank;
    ``close`` on every rank when the evaluation ends."""

    def __init__(self, model: nn.Module, ctx: DistContext, pad_token: int = 0):
        """``pad_token``: the id of the one-token forwards a rank with nothing left runs."""
        self.model, self.ctx = model, ctx
        self.forwards = 0
        """Forwards this rank ran for its own requests."""
        self.padding = 0
        """One-token forwards this rank ran to keep in step with busier ranks."""
        self._draining = False
        self._flag = torch.zeros(1, dtype=torch.int64, device=ctx.device)
        self._pad = torch.full((1, 1), pad_token, dtype=torch.long, device=ctx.device)
        # prepend: the announcement must come before FSDP's own pre-forward hook (its all-gather
        # of the root's weights), as the idle ranks' announcement comes before their padding forward
        self._handle = model.register_forward_pre_hook(self._before_forward, prepend=True)

    def _busy_ranks(self, busy: bool) -> int:
        self._flag.fill_(int(busy))
        self.ctx.all_reduce_sum(self._flag)
        return int(self._flag.item())

    def _before_forward(self, module: nn.Module, args: tuple) -> None:
        if not self._draining:
            self._busy_ranks(True)
            self.forwards += 1

    @torch.no_grad()
    def drain(self, on_forward: Callable[[], None] = lambda: None) -> None:
        """Join the other ranks' remaining forwards until every rank is done (every rank calls
        this at the same points: the end of each request type). ``on_forward`` after each: the
        loop's watchdog beat (this rank is working with the others, not hanging)."""
        self._draining = True
        try:
            while self._busy_ranks(False):
                self.model(input_ids=self._pad, use_cache=False)
                self.padding += 1
                on_forward()
        finally:
            self._draining = False

    def close(self) -> None:
        """Stop announcing forwards and reshard every layer (a forward without a backward leaves
        FSDP's root, and layers that keep their weights between micro-batches, gathered)."""
        from torch.distributed.fsdp import FSDPModule

        self._handle.remove()
        for module in self.model.modules():  # reshard() is not recursive
            if isinstance(module, FSDPModule):
                module.reshard()
