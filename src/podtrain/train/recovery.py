"""Putting a checkpoint back into the running training: at start-up (resume) and after the guard
asks for a rollback. Both check the checkpoint's config against this run's, re-apply the current
optimizer hyperparameters and verify that every rank then holds the same weights; the restore
returns a ``ResumeState`` whose loop part ``saving.apply_resume`` applies.

The functions take the typed training state (``podtrain.train.state``): at start-up the parts
that exist by then, in the loop the whole ``TrainState``."""

from __future__ import annotations

import logging
from typing import Any

from torch import nn

from podtrain.ckpt.checkpointer import Checkpointer
from podtrain.ckpt.restore import ResumeState
from podtrain.ckpt.state import capture_rng, restore_rng
from podtrain.config import RunConfig
from podtrain.data.manifest import tokenizer_identity
from podtrain.distributed.group import DistContext
from podtrain.errors import UserError
from podtrain.model import build_model, unwrap
from podtrain.train.guard import Rollback
from podtrain.train.replicas import check_replicas
from podtrain.train.resume import check_resume, reapply_optimizer_hyperparameters
from podtrain.train.saving import apply_resume
from podtrain.train.state import Learner, TrainState
from podtrain.train.strategy import copy_weights

log = logging.getLogger("podtrain")


def restore_checkpoint(cfg: RunConfig, ctx: DistContext, learner: Learner, checkpointer: Checkpointer,
                       tokenizer: str | None, resume: str | None = None) -> ResumeState | None:
    """Load the checkpoint ``resume`` (default ``ckpt.resume``) designates into the learner's
    model, optimizer and scaler (every rank) and return the loop's part; None: nothing to load.
    ``tokenizer``: this run's data's tokenizer identity (a checkpoint of another is refused). The
    replica check runs after the load, whatever it loaded."""

    def check(saved: dict[str, Any], step: int, path: str) -> None:
        check_resume(saved, cfg, tokenizer, step, path)

    def fresh() -> None:
        reinitialise(learner.model, ctx, learner.strategy.sharded, cfg.run.seed, cfg.model.attn_implementation)

    state = checkpointer.restore(learner.model, learner.optimizer, learner.scaler, check=check, resume=resume,
                                 fresh=fresh)
    if state is not None:
        reapply_optimizer_hyperparameters(learner.optimizer, cfg.optim)
    check_replicas(learner.model, ctx, before_ddp=False)
    return state


def reinitialise(model: nn.Module, ctx: DistContext, sharded: bool, seed: int, attn_implementation: str) -> None:
    """Every rank: the weights a fresh start has (``build_for_strategy`` from ``seed``, then the
    strategy's fill), copied into the live ``model`` in place, after a failed load left part of a
    checkpoint in them. The RNG states are kept: building the model reseeds them. Memory: one
    whole fp32 CPU copy of the model, on every rank when not ``sharded`` (ddp), on rank 0 alone
    under fsdp/hsdp (as at start-up)."""
    rng = capture_rng(ctx.device)
    reference = None
    if not sharded or ctx.is_main:
        reference = build_model(unwrap(model).config, attn_implementation, seed=seed)
    copy_weights(unwrap(model), reference, sharded)
    restore_rng(rng, ctx.device)


def roll_back(state: TrainState, plan: Rollback) -> None:
    """The guard's rollback: the newest checkpoint back in, the bad data window skipped."""
    detected_at = state.progress.step
    loader, guard = state.loader, state.guard
    # The newest save first, as long as the step loop may wait for one (ckpt.save_wait_s): one
    # still retrying through an outage is cancelled, and the rollback takes the newest committed;
    # every rank agrees that no save is in flight before any restores (quiesce).
    state.checkpointer.quiesce(state.cfg.ckpt.save_wait_s)
    resumed = restore_checkpoint(state.cfg, state.ctx, state.learner, state.checkpointer,
                                 tokenizer_identity(loader.manifest.tokenizer), resume="auto")
    if resumed is None:
        raise UserError(guard.describe(plan, loader.order, "and there is no checkpoint to roll back to"))
    apply_resume(resumed, state.progress, loader, state.ctx.device)
    state.learner.judge.reset()
    guard.rolled_back(plan, state.progress.step, loader.consumed, loader.order)
    state.goodput.redo_after_rollback = detected_at


def skipped_steps(state: TrainState) -> list[int]:
    """After ``StepStats.read``: the steps of the interval the guard skipped (their time is
    booked as skipped)."""
    flags = state.learner.stepper.stats.skipped
    first = state.progress.step - len(flags) + 1
    steps = [first + i for i, bad in enumerate(flags) if bad]
    state.goodput.skipped(steps)
    return steps


def review_skipped_steps(state: TrainState, skipped: list[int]) -> None:
    """Let the guard judge the interval; roll back when it asks (it raises when it may not)."""
    plan = state.guard.review(skipped, state.progress.step, state.loader.order)
    if plan is not None:
        roll_back(state, plan)
