"""One evaluation of lm-eval tasks on a model, on every rank: what ``podtrain eval`` and the loop's
``eval.tasks`` both call.

``TaskEvaluator`` is built once (lm-eval present, the shipped tasks written from the data's
validation split, the task names checked: a mistake surfaces at start, not after hours of
training) and ``run`` many times. Every rank scores its share of the requests with the model
itself: under DDP or in one process a whole model, under FSDP/HSDP the sharded model, its
forwards kept in step over the ranks (``eval/lockstep.py``, which says why no whole copy is
made), so task evaluation needs no weights beyond training's and the results do not depend on
the sharding.
"""

from __future__ import annotations

import contextlib
import time
from pathlib import Path
from typing import Any, Callable

from torch import nn

from podtrain.distributed.group import DistContext
from podtrain.eval.harness import TaskSet, require_lm_eval, run_tasks
from podtrain.eval.lockstep import Lockstep
from podtrain.eval.tasks import shipped_task_dirs


class TaskEvaluator:
    """lm-eval tasks ready to run on a model (see the module docstring)."""

    def __init__(self, names: list[str], include: list[Path], limit: int | None, manifest: Any,
                 tokenizer: Any, batch_size: int, what: str = "podtrain eval", max_length: int | None = None,
                 max_tokens: int | None = None):
        """``names``: task names; ``include``: the user's task folders; ``limit``: documents per
        task (None: all); ``manifest``: the data whose validation split makes the shipped tasks;
        ``max_length``: tokens per scored window (None: the model's position limit);
        ``max_tokens``: tokens per forward (None: ``batch_size`` requests whatever their length)."""
        require_lm_eval(what)
        self.tokenizer = tokenizer
        self.limit = limit
        self.batch_size = batch_size
        self.max_length, self.max_tokens = max_length, max_tokens
        self.tasks = TaskSet(names, shipped_task_dirs(names, manifest, tokenizer) + list(include))

    def run(self, model: nn.Module, ctx: DistContext,
            autocast: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
            on_progress: Callable[[], None] | None = None) -> tuple[dict[str, Any] | None, dict[str, float]]:
        """lm-eval's results (rank 0; None elsewhere) and ``{requests, seconds}`` of this rank."""
        from podtrain.eval.adapter import PodtrainLM
        from podtrain.model import is_sharded, unwrap

        t0 = time.perf_counter()
        model = unwrap(model)  # DDP's forward would sync buffers: scoring needs no wrapper
        lockstep = Lockstep(model, ctx, self.tokenizer.eos_id) if is_sharded(model) else None
        try:
            lm = PodtrainLM(model, self.tokenizer, ctx, self.batch_size, self.max_length, autocast,
                            on_progress, self.max_tokens, lockstep)
            results = run_tasks(lm, self.tasks, self.limit)
        finally:
            if lockstep is not None:
                lockstep.close()
        mine = {"requests": lm.requests_done, "seconds": time.perf_counter() - t0}
        if lockstep is not None:
            mine.update(forwards=lockstep.forwards, padding_forwards=lockstep.padding)
        return results, mine
