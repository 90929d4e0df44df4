"""Skipping a judged-bad optimizer step without a host sync, through contracts checked at start-up.

The guard's verdict (``podtrain.train.guard``) is a device bool; reading it on the host every step
would stall the CPU until the GPU caught up. Two ways skip on the device instead:

* fp16 (a ``GradScaler``): public API only. The verdict is written into the gradients
  (``poison_gradients``: one small gradient times NaN when bad) before ``scaler.step``, whose own
  non-finite check then skips the step and backs the scale off, as for an overflow.
* fp32/bf16 with fused AdamW: ``optimizer.found_inf``, the attribute through which torch's own
  ``GradScaler`` hands its verdict to fused optimizers. It is not public API, so
  ``require_found_inf_skip`` proves at start-up that this torch's optimizer honours it (one
  step on a 4-element parameter) and stops the run in one line if not: never a bad step
  silently applied after a torch upgrade.

foreach AdamW without a scaler reads the verdict on the host (one read per step, public).
"""

from __future__ import annotations

import functools

import torch

from podtrain.errors import UserError


def poison_gradients(params: list[torch.Tensor], bad: torch.Tensor) -> None:
    """Multiply the first gradient of ``params`` (smallest first, for the least work) by NaN when
    ``bad``, so that ``GradScaler.step``'s non-finite check skips the step; no host sync."""
    grad = next(p.grad for p in params if p.grad is not None)
    grad.mul_(torch.where(bad, float("nan"), 1.0).to(grad.dtype))


def fused_step(optimizer: torch.optim.Optimizer, bad: torch.Tensor) -> None:
    """One step of a fused optimizer that leaves parameters and state untouched when ``bad``
    (checked by ``require_found_inf_skip``)."""
    optimizer.found_inf = bad.float()
    try:
        optimizer.step()
    finally:
        vars(optimizer).pop("found_inf", None)  # an optimizer that dropped it too


def require_found_inf_skip(optimizer: torch.optim.Optimizer, device: torch.device) -> None:
    """Raise ``UserError`` unless ``type(optimizer)`` with ``fused=True`` skips a step given
    ``found_inf`` and takes it without (probed once per optimizer class and device)."""
    if not _honours_found_inf(type(optimizer), str(device)):
        raise UserError(
            f"torch {torch.__version__}'s fused {type(optimizer).__name__} no longer skips a step given "
            "found_inf (how podtrain's guard skips a bad step without a host sync): set "
            "optim.implementation=foreach (one host read per step) or guard.enabled=false")


@functools.lru_cache(maxsize=None)
def _honours_found_inf(cls: type, device: str) -> bool:
    param = torch.nn.Parameter(torch.ones(4, device=device))
    optimizer = cls([param], lr=0.1, fused=True)
    outcome = []
    for found in (1.0, 0.0):
        param.grad = torch.ones(4, device=device)
        before = param.detach().clone()
        fused_step(optimizer, torch.tensor(found, device=device))
        outcome.append(torch.equal(before, param.detach()))
    steps = float(optimizer.state[param]["step"])  # bias correction: the skipped step not counted
    return outcome == [True, False] and steps == 1.0  # skipped with found_inf=1, applied with 0
