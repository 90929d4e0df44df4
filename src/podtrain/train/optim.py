"""AdamW with decay on matrices only, and the learning-rate schedule as a pure function of the step."""

from __future__ import annotations

import math

import torch
from torch import nn

from podtrain.config_sections import OptimSection


def lr_at(step: int, lr: float, min_lr: float, warmup_steps: int, total_steps: int,
          schedule: str = "cosine", decay_fraction: float = 0.2) -> float:
    """Learning rate for optimizer step ``step`` (0-based) of ``total_steps``.

    Convention: the linear warmup reaches ``lr`` exactly at its last step (``warmup_steps - 1``)
    and only there; the decay then ends exactly at ``min_lr`` on the last step
    (``total_steps - 1``). ``cosine`` decays over everything after the warmup; ``wsd``
    (warmup-stable-decay) holds ``lr`` and decays linearly over the last ``decay_fraction`` of
    the steps, so steps before the decay do not depend on ``total_steps`` (a run can be extended
    by raising it); ``constant`` holds ``lr`` after the warmup.

    Pure, so a resumed run recomputes the same value from the step alone (no scheduler state).
    """
    if warmup_steps > 0 and step < warmup_steps:
        return lr * (step + 1) / warmup_steps
    if schedule == "constant":
        return lr
    peak = max(warmup_steps - 1, 0)  # the step that used lr (step 0 without warmup)
    last = total_steps - 1
    if schedule == "wsd":
        decay_steps = max(1, round(decay_fraction * total_steps))
        decay_start = max(peak, last - decay_steps)  # the last step at lr
        progress = min(1.0, max(0.0, (step - decay_start) / max(1, last - decay_start)))
        return min_lr + (lr - min_lr) * (1.0 - progress)
    progress = min(1.0, (step - peak) / max(1, last - peak))
    return min_lr + 0.5 * (lr - min_lr) * (1.0 + math.cos(math.pi * progress))


def schedule_lr(cfg: OptimSection, step: int, total_steps: int) -> float:
    """``lr_at`` with the schedule ``cfg`` describes."""
    return lr_at(step, cfg.lr, cfg.min_lr, cfg.warmup_steps, total_steps, cfg.schedule,
                 cfg.decay_fraction)


def parameter_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Two AdamW groups: decay for weight matrices; none for norms, biases and embeddings.

    Embeddings are found by module type (``nn.Embedding``), so a tied LM head (the same tensor)
    is not decayed either. Shared tensors are listed once.
    """
    embedding_ids = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    decay, no_decay, seen = [], [], set()
    for param in model.parameters():
        if not param.requires_grad or id(param) in seen:
            continue
        seen.add(id(param))
        (no_decay if param.ndim < 2 or id(param) in embedding_ids else decay).append(param)
    return [{"params": decay, "weight_decay": weight_decay},
            {"params": no_decay, "weight_decay": 0.0}]


def build_optimizer(model: nn.Module, cfg: OptimSection, device: torch.device) -> torch.optim.AdamW:
    """AdamW over ``parameter_groups``: fused kernels where this torch supports them, else foreach."""
    impl = cfg.implementation
    if impl == "auto":
        impl = "fused" if fused_supported(device) else "foreach"
    kwargs = {"fused": True} if impl == "fused" else {"foreach": True}
    return torch.optim.AdamW(parameter_groups(model, cfg.weight_decay), lr=cfg.lr,
                             betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, **kwargs)


def fused_supported(device: torch.device) -> bool:
    """Fused AdamW exists for CUDA and, since torch 2.4, CPU; probe instead of guessing."""
    try:
        p = nn.Parameter(torch.zeros(2, device=device))
        torch.optim.AdamW([p], fused=True)
        return True
    except (RuntimeError, TypeError):
        return False


def set_lr(optimizer: torch.optim.Optimizer, value: float) -> None:
    """Set every group's learning rate for the coming step."""
    for group in optimizer.param_groups:
        group["lr"] = value
