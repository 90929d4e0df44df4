"""The loop's side of checkpoints: what it saves, when a save's stall is booked, applying a resume.

``Trainer`` (``podtrain.train.loop``) calls these with itself (not imported: the loop imports
this module), so the loop stays one screen.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from podtrain.ckpt.restore import ResumeState
from podtrain.ckpt.state import restore_rng
from podtrain.config import to_dict
from podtrain.errors import UserError
from podtrain.train.guard import weights_finite
from podtrain.train.resume import tokenizer_identity

log = logging.getLogger("podtrain")


def train_state(trainer: Any) -> dict[str, Any]:
    """What a checkpoint needs beyond weights and optimizer to continue exactly."""
    return {"step": trainer.step, "tokens_seen": trainer.tokens_seen, "loader": trainer.loader.state_dict(),
            "run_id": trainer.run_id, "config": to_dict(trainer.cfg),
            "tokenizer_sha256": trainer.loader.manifest.raw["tokenizer"].get("sha256"),
            "tokenizer": tokenizer_identity(trainer.loader.manifest.tokenizer),
            "guard": guard_state(trainer)}


def guard_state(trainer: Any) -> dict[str, Any] | None:
    """The guard's memory (the judge's recent norms, the window of bad steps): part of the
    checkpoint, so that a resumed run skips exactly the steps the uninterrupted one would."""
    judge = trainer.stepper.judge
    if judge is None:
        return None
    return {"judge": judge.state_dict(), "window": trainer.guard.state_dict()}


def restore_guard(trainer: Any, state: dict[str, Any] | None) -> None:
    """At start-up, after a resume: the guard's memory as saved (none in older checkpoints)."""
    if state and trainer.stepper.judge is not None:
        trainer.stepper.judge.load_state_dict(state.get("judge") or {})
        trainer.guard.load_state_dict(state.get("window") or {})


def due(trainer: Any, total: int) -> str | None:
    """Which tier this step saves to: "durable" (``ckpt.every``, the last step), "local"
    (``ckpt.local_every``), or None."""
    if trainer.saves.should_save(trainer.step, total):
        return "durable"
    return "local" if trainer.checkpointer.local_due(trainer.step) else None


def save(trainer: Any, tier: str = "durable", must: bool = False) -> float | None:
    """Checkpoint this step (every rank) to ``tier``; returns the step loop's stall in seconds,
    or None when the save was skipped (the previous one still being written: ``ckpt.save_wait_s``).
    ``must``: the last step, which waits for the previous save rather than skip.

    The stall is the host time of ``Checkpointer.save`` plus, on a GPU, the time the optimizer
    step after the previous save waited on the device for that save's copies (CUDA events, known
    by now): goodput books it, and ``ckpt.every=auto`` plans with it.
    """
    if trainer.cfg.guard.enabled and not weights_finite(trainer.model, trainer.ctx):
        raise UserError(f"the weights are non-finite at step {trainer.step}: not saved (the last "
                        "checkpoint stays the newest); lower optim.lr")
    device_wait = trainer.checkpointer.device_stall_s()
    t0 = time.perf_counter()
    saved = trainer.checkpointer.save(trainer.step, trainer.model, trainer.optimizer, trainer.stepper.scaler,
                                      train_state(trainer), local=tier == "local", must=must)
    host = time.perf_counter() - t0
    stall = trainer.goodput.add("save_stall", host + device_wait)
    trainer.metrics.write({"kind": "save", "step": trainer.step, "save_s": stall, "tier": tier,
                           "skipped": not saved, "time": time.time()})
    if not saved:
        return None
    if trainer.saves.auto and tier == "durable":  # rank 0's measurements, so that every rank plans the same steps
        trainer.saves.saved(trainer.step, *trainer.ctx.broadcast_object((stall, trainer.goodput.step_seconds())))
    return host


STOP_SAVE_SHARE = 0.8
"""The share of ``ckpt.grace_s`` a stop signal's save may take before it is abandoned."""


def save_for_stop(trainer: Any) -> bool:
    """Every rank, after a stop signal: checkpoint this step within the grace period, whatever
    the storage does (past it the scheduler's SIGKILL would cut the write anyway, so an unfinished
    save is abandoned and nothing of it commits); rank 0 says how it went. True when saved."""
    cfg = trainer.cfg.ckpt
    saved = save(trainer) is not None
    since = trainer.stop_signal.seconds_since_signal() or 0.0
    budget = max(1.0, STOP_SAVE_SHARE * cfg.grace_s - since)
    waited = trainer.checkpointer.wait(timeout=budget,
                                       abandon_wait_s=max(1.0, (1 - STOP_SAVE_SHARE) / 2 * cfg.grace_s))
    saved = saved and trainer.checkpointer.last_save.get("step") == trainer.step
    if trainer.ctx.is_main:  # one line for the job, not one per rank
        if saved:
            log.warning("%s", trainer.stop_signal.saved_line(trainer.step, waited, cfg.grace_s))
        else:
            log.warning("stop signal: step %d could not be saved within the grace period (storage slow "
                        "or unreachable); exiting with %d, the run resumes from its newest checkpoint",
                        trainer.step, trainer.stop_signal.exit_code)
    return saved


def should_stop(trainer: Any) -> bool:
    """At a step boundary, on every rank: a stop signal, or a failed background save, agreed by
    all ranks. A failed save raises its one-line ``SaveFailed`` here, on every rank alike."""
    stop = trainer.stop_signal.should_stop(trainer.ctx, trainer.checkpointer.failed,
                                           trainer.checkpointer.lease_lost is not None)
    if stop and trainer.stop_signal.lease_lost_agreed:
        trainer.checkpointer.discard()
        raise UserError(f"another job took over this run at step {trainer.step} ("
                        f"{trainer.checkpointer.lease_lost or 'see rank 0'}): this job stops without "
                        "saving, so that two jobs never write one run")
    if stop and trainer.stop_signal.save_failed_agreed:
        trainer.checkpointer.wait()  # raises the failure (every rank's writer learned the same)
    return stop


def apply_resume(trainer: Any, state: ResumeState) -> None:
    """Put a restored checkpoint's loop state (step, tokens, data position, RNG) into ``trainer``."""
    trainer.step, trainer.tokens_seen = state.step, state.tokens_seen
    if state.loader is not None:  # None: a branch that starts its data anew (ckpt.resume_from_reset)
        trainer.loader.load_state_dict(state.loader)
    if state.rng is not None:
        restore_rng(state.rng, trainer.ctx.device)
    log.info("resumed from step %d (epoch %d, %d samples consumed)", trainer.step,
             trainer.loader.epoch, trainer.loader.consumed)
