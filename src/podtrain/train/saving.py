"""The loop's side of checkpoints: what it saves, when a save's stall is booked, applying a resume.

Each function takes the typed training state (``podtrain.train.state``): the whole
``TrainState`` in the loop, or the few parts that exist during set-up (``restore_guard``,
``apply_resume``).
"""

from __future__ import annotations

import logging
import time
from typing import Any

import torch

from podtrain.ckpt.restore import ResumeState
from podtrain.ckpt.state import restore_rng
from podtrain.config import to_dict
from podtrain.data.loader import ShardedLoader
from podtrain.errors import UserError
from podtrain.storage.retry import Deadline
from podtrain.train.guard import Guard, StepJudge, weights_finite
from podtrain.train.resume import tokenizer_identity
from podtrain.train.state import RunProgress, TrainState

log = logging.getLogger("podtrain")


def train_state(state: TrainState) -> dict[str, Any]:
    """What a checkpoint needs beyond weights and optimizer to continue exactly."""
    loader = state.loader
    return {"step": state.progress.step, "tokens_seen": state.progress.tokens_seen,
            "loader": loader.state_dict(), "run_id": state.run_id, "config": to_dict(state.cfg),
            "tokenizer_sha256": loader.manifest.raw["tokenizer"].get("sha256"),
            "tokenizer": tokenizer_identity(loader.manifest.tokenizer),
            "guard": guard_state(state.learner.judge, state.guard)}


def guard_state(judge: StepJudge | None, guard: Guard) -> dict[str, Any] | None:
    """The guard's memory (the judge's recent norms, the window of bad steps): part of the
    checkpoint, so that a resumed run skips exactly the steps the uninterrupted one would."""
    if judge is None:
        return None
    return {"judge": judge.state_dict(), "window": guard.state_dict()}


def restore_guard(judge: StepJudge | None, guard: Guard, saved: dict[str, Any] | None) -> None:
    """At start-up, after a resume: the guard's memory as saved (none in older checkpoints)."""
    if saved and judge is not None:
        judge.load_state_dict(saved.get("judge") or {})
        guard.load_state_dict(saved.get("window") or {})


def due(state: TrainState, total: int) -> str | None:
    """Which tier this step saves to: "durable" (``ckpt.every``, the last step), "local"
    (``ckpt.local_every``), or None."""
    step = state.progress.step
    if state.saves.should_save(step, total):
        return "durable"
    return "local" if state.checkpointer.local_due(step) else None


def save(state: TrainState, tier: str = "durable", must: bool = False,
         deadline: Deadline | None = None) -> float | None:
    """Checkpoint this step (every rank) to ``tier``; returns the step loop's stall in seconds,
    or None when the save was skipped (the previous one still being written: ``ckpt.save_wait_s``).
    ``must``: the last step, which waits for the previous save rather than skip. ``deadline``: a
    stop's (``Checkpointer.save``: an older save in flight is cancelled and waited for until then).

    The stall is the host time of ``Checkpointer.save`` plus, on a GPU, the time the optimizer
    step after the previous save waited on the device for that save's copies (CUDA events, known
    by now): goodput books it, and ``ckpt.every=auto`` plans with it.
    """
    step, learner, checkpointer = state.progress.step, state.learner, state.checkpointer
    if state.cfg.guard.enabled and not weights_finite(learner.model, state.ctx):
        raise UserError(f"the weights are non-finite at step {step}: not saved (the last "
                        "checkpoint stays the newest); lower optim.lr")
    device_wait = checkpointer.device_stall_s()
    t0 = time.perf_counter()
    saved = checkpointer.save(step, learner.model, learner.optimizer, learner.scaler, train_state(state),
                              local=tier == "local", must=must, deadline=deadline)
    host = time.perf_counter() - t0
    stall = state.goodput.add("save_stall", host + device_wait)
    state.metrics.write({"kind": "save", "step": step, "save_s": stall, "tier": tier,
                         "skipped": not saved, "time": time.time()})
    if not saved:
        return None
    if state.saves.auto and tier == "durable":  # rank 0's measurements, so that every rank plans the same steps
        state.saves.saved(step, *state.ctx.broadcast_object((stall, state.goodput.step_seconds())))
    return host


EXIT_RESERVE_S = 5.0
"""The part of ``ckpt.grace_s`` kept for the process's own exit after the stop path (the process
group's teardown, the interpreter's): at most this, at most a tenth of the grace."""
STOP_SAVE_RESERVE_S = 3.0
"""The part of the stop's deadline the save leaves to ``Checkpointer.close`` (the lease's release,
the writer threads' ends): at most this, at most a fifth of what is left."""


def stop_deadline(state: TrainState) -> Deadline:
    """The one deadline of the whole stop path on this rank: ``ckpt.grace_s`` after the signal
    reached it (after now, when it reached another rank), less the exit's reserve. Every wait
    after the signal (the save of each tier, the writers, the replicas, the lease) takes only what
    is left of it, so the process exits within the grace period whatever the storage does."""
    grace = state.cfg.ckpt.grace_s
    since = state.stop_signal.seconds_since_signal() or 0.0
    return Deadline.after(grace - since - min(EXIT_RESERVE_S, grace / 10))


def save_for_stop(state: TrainState, deadline: Deadline) -> bool:
    """Every rank, after a stop signal: checkpoint this step by ``deadline`` (``stop_deadline``),
    whatever the storage does: an older save still in flight (retrying through an outage, say) is
    cancelled and this step saved instead; an unfinished save at the deadline is cancelled and
    nothing of it commits (past the grace period the scheduler's SIGKILL would cut it anyway).
    Rank 0 says how it went. True when saved."""
    cfg, step, stop_signal, checkpointer = state.cfg.ckpt, state.progress.step, state.stop_signal, state.checkpointer
    save_by = deadline.sooner(min(STOP_SAVE_RESERVE_S, deadline.remaining() / 5))
    saved = save(state, deadline=save_by) is not None
    waited = checkpointer.wait(deadline=save_by)
    saved = saved and checkpointer.last_save.get("step") == step
    if state.ctx.is_main:  # one line for the job, not one per rank
        if saved:
            log.warning("%s", stop_signal.saved_line(step, waited, cfg.grace_s))
        else:
            log.warning("stop signal: step %d could not be saved within the grace period (storage slow "
                        "or unreachable); exiting with %d, the run resumes from its newest checkpoint",
                        step, stop_signal.exit_code)
    return saved


def should_stop(state: TrainState) -> bool:
    """At a step boundary, on every rank: a stop signal, or a failed background save, agreed by
    all ranks. A failed save raises its one-line ``SaveFailed`` here, on every rank alike."""
    stop_signal, checkpointer = state.stop_signal, state.checkpointer
    stop = stop_signal.should_stop(state.ctx, checkpointer.failed, checkpointer.lease_lost is not None)
    if stop and stop_signal.lease_lost_agreed:
        checkpointer.discard()
        raise UserError(f"another job took over this run at step {state.progress.step} ("
                        f"{checkpointer.lease_lost or 'see rank 0'}): this job stops without "
                        "saving, so that two jobs never write one run")
    if stop and stop_signal.save_failed_agreed:  # raises the failure (every rank's writer learned the same);
        checkpointer.wait(deadline=Deadline.after(state.cfg.ckpt.save_wait_s))  # the other tier's save may hang
    return stop


def apply_resume(resumed: ResumeState, progress: RunProgress, loader: ShardedLoader,
                 device: torch.device) -> None:
    """Put a restored checkpoint's loop state into ``progress`` (step, tokens), ``loader`` (the
    data position) and this process's RNGs."""
    progress.step, progress.tokens_seen = resumed.step, resumed.tokens_seen
    if resumed.loader is not None:  # None: a branch that starts its data anew (ckpt.resume_from_reset)
        loader.load_state_dict(resumed.loader)
    if resumed.rng is not None:
        restore_rng(resumed.rng, device)
    log.info("resumed from step %d (epoch %d, %d samples consumed)", progress.step, loader.epoch, loader.consumed)
