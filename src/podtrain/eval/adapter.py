"""lm-eval's ``LM`` over podtrain's own model and tokenizer, its requests shared out over ranks.

lm-eval's evaluator gives each rank every ``world_size``-th document (``LM.rank``,
``LM.world_size``), pads the ranks to the same request count, and gathers the per-document
metrics on rank 0 through ``all_gather`` / ``gather_object`` / ``barrier``, which this class
implements over podtrain's ``DistContext`` (gloo or NCCL alike). The model is a plain module on
each rank (DDP, one process, ``podtrain eval``: ranks never wait for each other while scoring), or
the FSDP/HSDP model itself with a ``Lockstep`` (``eval/lockstep.py``) that every request type ends
by draining, so every rank runs as many forwards as the busiest.

Tokenization follows lm-eval's ``HFLM``: context and continuation are encoded together and the
continuation's tokens are those past the context's own encoding, with the context's trailing
whitespace moved into the continuation (a BPE merges a space with the word after it); an empty
context is an EOS (a document start, as in training).
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable

import torch
from lm_eval.api.model import LM
from torch import nn

from podtrain.distributed.group import DistContext
from podtrain.eval.lockstep import Lockstep
from podtrain.eval.progress import Progress
from podtrain.eval.scoring import greedy_until, max_length_of, rolling_pairs, score_pairs

DEFAULT_BATCH_SIZE = 32
DEFAULT_MAX_GEN_TOKENS = 256


class PodtrainLM(LM):
    """An lm-eval model: ``loglikelihood`` (batched), ``loglikelihood_rolling``,
    ``generate_until`` (greedy), over ``model`` and a podtrain tokenizer (byte or BPE/HF:
    ``encode``, ``decode``, ``eos_id``)."""

    def __init__(self, model: nn.Module, tokenizer: Any, ctx: DistContext | None = None,
                 batch_size: int = DEFAULT_BATCH_SIZE, max_length: int | None = None,
                 autocast: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
                 on_progress: Callable[[], None] | None = None, max_tokens: int | None = None,
                 lockstep: Lockstep | None = None, progress: Progress | None = None):
        """``ctx``: the job's process group (None: one process); ``autocast``: the forward's
        precision context (the run's); ``max_length``: tokens per window (default: the model's
        limit); ``max_tokens``: tokens per forward at most (None: ``batch_size`` requests whatever
        their length); ``on_progress``: called after each batch (the loop's watchdog: evaluating
        is not hanging); ``lockstep``: a sharded model's (see the module docstring); ``progress``:
        the progress lines (default: every ``EVERY_S`` seconds on the main rank)."""
        super().__init__()
        self.model = model
        self.tok = tokenizer
        self.ctx = ctx
        self._rank = ctx.rank if ctx is not None else 0
        self._world_size = ctx.world_size if ctx is not None else 1
        self._device = next(model.parameters()).device
        self.batch_size = int(batch_size)
        self.max_length = int(max_length or max_length_of(model))
        self.autocast = autocast
        self.on_progress = on_progress or (lambda: None)
        self.max_tokens = max_tokens
        self.lockstep = lockstep
        self.progress = progress or Progress(self._rank == 0)
        self.requests_done = 0
        """Requests answered (lm-eval's padding copies included): the throughput's numerator."""

    # -- what lm-eval's evaluator uses to share the work -----------------------------------------
    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        """Every rank's ``tensor``, concatenated in rank order."""
        if self._world_size == 1:
            return tensor
        import torch.distributed as dist

        parts = [torch.empty_like(tensor) for _ in range(self._world_size)]
        dist.all_gather(parts, tensor.contiguous())
        return torch.stack(parts) if tensor.dim() == 0 else torch.cat(parts)

    def gather_object(self, obj: Any, dst: int = 0) -> list[Any] | None:
        """Every rank's ``obj`` on ``dst`` (None elsewhere); called on every rank."""
        if self._world_size == 1:
            return [obj]
        return self.ctx.gather_object(obj, dst)

    def barrier(self) -> None:
        """Wait for every rank."""
        if self._world_size > 1:
            self.ctx.barrier()

    @property
    def tokenizer_name(self) -> str:
        """The tokenizer's name (lm-eval fingerprints cached requests with it)."""
        return str(getattr(self.tok, "name", "podtrain"))

    # -- requests -------------------------------------------------------------------------------
    def encode_pair(self, context: str, continuation: str) -> tuple[list[int], list[int]]:
        """(context ids, continuation ids) cut as lm-eval's HFLM cuts them (module docstring)."""
        spaces = len(context) - len(context.rstrip())
        if spaces:
            context, continuation = context[:-spaces], context[-spaces:] + continuation
        if not context:
            return [self.tok.eos_id], list(self.tok.encode(continuation))
        whole = list(self.tok.encode(context + continuation))
        ctx_ids = list(self.tok.encode(context))
        return ctx_ids, whole[len(ctx_ids):]

    def loglikelihood(self, requests: list[Any], disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        """``(log p(continuation | context), greedy)`` per ``(context, continuation)`` request."""
        pairs = [self.encode_pair(*req.args) for req in requests]
        out = self._score("loglikelihood", pairs)
        self._in_step()
        self.requests_done += len(requests)
        for req, result in zip(requests, out):
            self.cache_hook.add_partial("loglikelihood", req.args, result)
        return out

    def loglikelihood_rolling(self, requests: list[Any], disable_tqdm: bool = False) -> list[float]:
        """The whole text's log-likelihood (disjoint windows of the model's length, after EOS)."""
        texts = [req.args[0] for req in requests]
        windows = [rolling_pairs(self.tok.encode(t), self.tok.eos_id, self.max_length) for t in texts]
        flat = [pair for w in windows for pair in w]
        scores = iter(self._score("loglikelihood_rolling windows", flat))
        out = [sum(next(scores)[0] for _ in w) for w in windows]
        self._in_step()
        self.requests_done += len(requests)
        for req, result in zip(requests, out):
            self.cache_hook.add_partial("loglikelihood_rolling", req.args, result)
        return out

    def generate_until(self, requests: list[Any], disable_tqdm: bool = False) -> list[str]:
        """Greedy continuation of each context up to its ``until`` strings / ``max_gen_toks``."""
        out = []
        was_training = self.model.training
        self.model.eval()
        self.progress.start("generate_until", len(requests))
        try:
            for req in requests:
                context, kwargs = req.args[0], dict(req.args[1] or {})
                until = kwargs.get("until") or []
                until = [until] if isinstance(until, str) else list(until)
                ids = self.tok.encode(context) if context else [self.tok.eos_id]
                text = greedy_until(self.model, ids, self.tok.decode, until,
                                    int(kwargs.get("max_gen_toks", DEFAULT_MAX_GEN_TOKENS)),
                                    self.tok.eos_id, self.max_length, self.autocast)
                out.append(text)
                self._batch_done(1)
                self.cache_hook.add_partial("generate_until", req.args, text)
        finally:
            self.model.train(was_training)
        self._in_step()
        self.requests_done += len(requests)
        return out

    def _in_step(self) -> None:
        """The end of a request type on every rank: a sharded model's ranks catch up (``Lockstep``)."""
        if self.lockstep is not None:
            self.lockstep.drain(self.on_progress)

    def _batch_done(self, units: int) -> None:
        self.on_progress()
        self.progress.advance(units)

    def _score(self, kind: str, pairs: list[tuple[list[int], list[int]]]) -> list[tuple[float, bool]]:
        was_training = self.model.training
        self.model.eval()
        self.progress.start(kind, len({(tuple(c), tuple(x)) for c, x in pairs}))  # scored once each
        try:
            return score_pairs(self.model, pairs, self.batch_size, self.max_length, self.autocast,
                               self._batch_done, self.max_tokens)
        finally:
            self.model.train(was_training)
