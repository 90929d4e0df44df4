"""Putting a checkpoint back into a running Trainer: at start-up (resume) and after the guard
asks for a rollback. Both check the checkpoint's config against this run's, re-apply the current
optimizer hyperparameters and verify that every rank then holds the same weights; the restore
returns a ``ResumeState`` that the trainer applies (``Trainer.apply_resume``).

``trainer`` is a ``podtrain.train.loop.Trainer`` (not imported: the loop imports this module)."""

from __future__ import annotations

import logging
from typing import Any

from podtrain.ckpt.restore import ResumeState
from podtrain.ckpt.state import capture_rng, restore_rng
from podtrain.data.manifest import tokenizer_identity
from podtrain.errors import UserError
from podtrain.model import build_model, unwrap
from podtrain.train.guard import Rollback
from podtrain.train.replicas import check_replicas
from podtrain.train.resume import check_resume, reapply_optimizer_hyperparameters
from podtrain.train.strategy import copy_weights

log = logging.getLogger("podtrain")


def restore_checkpoint(trainer: Any, resume: str | None = None) -> ResumeState | None:
    """Load the checkpoint ``resume`` (default ``ckpt.resume``) designates into the model,
    optimizer and scaler (every rank) and return the loop's part; None: nothing to load. The
    replica check runs after the load, whatever it loaded."""
    cfg = trainer.cfg
    tokenizer = tokenizer_identity(trainer.loader.manifest.tokenizer)

    def check(saved: dict[str, Any], step: int, path: str) -> None:
        check_resume(saved, cfg, tokenizer, step, path)

    state = trainer.checkpointer.restore(trainer.model, trainer.optimizer, trainer.stepper.scaler,
                                         check=check, resume=resume, fresh=lambda: reinitialise(trainer))
    if state is not None:
        reapply_optimizer_hyperparameters(trainer.optimizer, cfg.optim)
    check_replicas(trainer.model, trainer.ctx, before_ddp=False)
    return state


def reinitialise(trainer: Any) -> None:
    """Every rank: the weights a fresh start has (``build_for_strategy`` from ``run.seed``, then
    the strategy's fill), copied into the live model in place, after a failed load left part of
    a checkpoint in them. The RNG states are kept: building the model reseeds them. Memory: one
    whole fp32 CPU copy of the model, on every rank under ddp, on rank 0 alone under fsdp/hsdp
    (as at start-up)."""
    cfg, ctx = trainer.cfg, trainer.ctx
    sharded = trainer.strategy.sharded
    rng = capture_rng(ctx.device)
    reference = None
    if not sharded or ctx.is_main:
        reference = build_model(unwrap(trainer.model).config, cfg.model.attn_implementation, seed=cfg.run.seed)
    copy_weights(unwrap(trainer.model), reference, sharded)
    restore_rng(rng, ctx.device)


def roll_back(trainer: Any, plan: Rollback) -> None:
    """The guard's rollback: the newest checkpoint back in, the bad data window skipped."""
    detected_at = trainer.step
    trainer.checkpointer.wait()
    state = restore_checkpoint(trainer, resume="auto")
    if state is None:
        raise UserError(trainer.guard.describe(plan, trainer.loader.order,
                                               "and there is no checkpoint to roll back to"))
    trainer.apply_resume(state)
    trainer.stepper.judge.reset()
    trainer.guard.rolled_back(plan, trainer.step, trainer.loader.consumed, trainer.loader.order)
    trainer.goodput.redo_after_rollback = detected_at


def skipped_steps(trainer: Any) -> list[int]:
    """After ``StepStats.read``: the steps of the interval the guard skipped (their time is
    booked as skipped)."""
    flags = trainer.stepper.stats.skipped
    first = trainer.step - len(flags) + 1
    steps = [first + i for i, bad in enumerate(flags) if bad]
    trainer.goodput.skipped(steps)
    return steps


def review_skipped_steps(trainer: Any, skipped: list[int]) -> None:
    """Let the guard judge the interval; roll back when it asks (it raises when it may not)."""
    plan = trainer.guard.review(skipped, trainer.step, trainer.loader.order)
    if plan is not None:
        roll_back(trainer, plan)
