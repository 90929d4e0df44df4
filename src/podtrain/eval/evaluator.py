"""One evaluation of lm-eval tasks on a model, on every rank: what ``podtrain eval`` and the loop's
``eval.tasks`` both call.

``TaskEvaluator`` is built once (lm-eval present, the shipped tasks written from the data's
validation split, the task names checked: a mistake surfaces at start, not after hours of
training) and ``run`` many times. Under FSDP/HSDP each rank first assembles a whole copy of the
weights (one all-gather per tensor) and scores its share of the requests on that copy: scoring
then needs no collective per forward, so ranks with different request lengths never wait for
each other, and the result does not depend on the sharding. The copy costs one model's weights
of memory per rank for the duration of the evaluation; DDP and one-process runs score the
model itself.
"""

from __future__ import annotations

import contextlib
import time
from pathlib import Path
from typing import Any, Callable

from torch import nn

from podtrain.distributed.group import DistContext
from podtrain.eval.harness import TaskSet, require_lm_eval, run_tasks
from podtrain.eval.tasks import shipped_task_dirs


class TaskEvaluator:
    """lm-eval tasks ready to run on a model (see the module docstring)."""

    def __init__(self, names: list[str], include: list[Path], limit: int | None, manifest: Any,
                 tokenizer: Any, batch_size: int, what: str = "podtrain eval"):
        """``names``: task names; ``include``: the user's task folders; ``limit``: documents per
        task (None: all); ``manifest``: the data whose validation split makes the shipped tasks."""
        require_lm_eval(what)
        self.tokenizer = tokenizer
        self.limit = limit
        self.batch_size = batch_size
        self.tasks = TaskSet(names, shipped_task_dirs(names, manifest, tokenizer) + list(include))

    def run(self, model: nn.Module, ctx: DistContext,
            autocast: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
            on_progress: Callable[[], None] | None = None) -> tuple[dict[str, Any] | None, dict[str, float]]:
        """lm-eval's results (rank 0; None elsewhere) and ``{requests, seconds}`` of this rank."""
        from podtrain.eval.adapter import PodtrainLM

        t0 = time.perf_counter()
        lm = PodtrainLM(whole_model(model, ctx), self.tokenizer, ctx, self.batch_size,
                        autocast=autocast, on_progress=on_progress)
        results = run_tasks(lm, self.tasks, self.limit)
        return results, {"requests": lm.requests_done, "seconds": time.perf_counter() - t0}


def whole_model(model: nn.Module, ctx: DistContext) -> nn.Module:
    """``model`` itself, or under FSDP/HSDP a plain copy with the whole weights on this rank's
    device (every rank calls this: the gather is collective)."""
    from podtrain.model import is_sharded, unwrap

    model = unwrap(model)
    if not is_sharded(model):
        return model
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from transformers import AutoModelForCausalLM

    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    dtype = next(iter(state.values())).dtype
    import torch

    with torch.device(ctx.device):
        copy = AutoModelForCausalLM.from_config(model.config, dtype=dtype)
    copy.load_state_dict(state, strict=False)  # tied weights appear once in the state
    return copy.eval()
