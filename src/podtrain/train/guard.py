"""Spike and non-finite guard: a bad step is not applied; repeated bad steps roll back.

Per step, on the device (no host sync): a step is bad when its global gradient norm is
non-finite or exceeds ``guard.spike_factor`` x the median of the last ``guard.history`` accepted
norms. The norm is global after DDP's AllReduce, so every rank reaches the same verdict without a
collective; a rank whose own loss is non-finite multiplies its last backward by NaN
(``poison``), so its gradients, and through the AllReduce everyone's norm, say so too. The verdict
skips the optimizer update on the device (``podtrain.train.skip``: with fp16 through the scaler's
public non-finite check, with fused AdamW through ``found_inf``, a contract probed at start-up).
Only ``optim.implementation=foreach`` without a scaler reads it on the host, once per step.

At each log interval the loop reads the verdicts with the losses (the same host sync) and hands
them to ``review``: after ``guard.max_skips`` bad steps within ``guard.window`` steps it asks for a
rollback to the last checkpoint, after which the data from the first bad step to the last one
seen is skipped (``RUN_DIR/skipped.jsonl``: steps, stream positions, sample ids). When the run has
already rolled back ``guard.max_rollbacks`` times, ``review`` stops it with one line naming the
steps and samples.
"""

from __future__ import annotations

import json
import logging
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from podtrain.config_sections import GuardSection
from podtrain.distributed.group import DistContext
from podtrain.errors import UserError

log = logging.getLogger("podtrain")

SKIPPED_FILE = "skipped.jsonl"


class StepJudge:
    """The device half: judges each step's gradient norm; keeps the recent accepted norms."""

    def __init__(self, cfg: GuardSection, device: torch.device):
        self.factor = cfg.spike_factor
        self.history = torch.full((cfg.history,), float("nan"), dtype=torch.float32, device=device)
        self._slot = 0
        self._nan = torch.tensor(float("nan"), device=device)
        self._one = torch.tensor(1.0, device=device)

    def poison(self, step_loss: torch.Tensor) -> torch.Tensor:
        """1 when this rank's loss so far is finite, else NaN: the factor of the last backward."""
        return torch.where(torch.isfinite(step_loss), self._one, self._nan)

    def judge(self, norm: torch.Tensor) -> torch.Tensor:
        """A device bool: skip this step. Accepted norms join the history."""
        norm = norm.detach().float()
        bad = ~torch.isfinite(norm)
        if self.factor > 0:
            full = ~torch.isnan(self.history).any()  # no spike verdict before the history is full
            bad = bad | (full & (norm > self.factor * self.history.nanmedian()))
        slot = self._slot % self.history.numel()
        self.history[slot] = torch.where(bad, self.history[slot], norm)
        self._slot += 1
        return bad

    def state_dict(self) -> dict:
        """The history and its write position, for the checkpoint (one small device-to-host copy,
        at save steps only): a resumed run judges its next steps as the uninterrupted one would."""
        return {"history": self.history.cpu().tolist(), "slot": self._slot}

    def load_state_dict(self, state: dict) -> None:
        """Put a checkpoint's history back; one saved with another ``guard.history`` keeps the
        newest norms that fit (the spike verdict waits until the history is full again)."""
        saved = torch.tensor(state.get("history") or [], dtype=torch.float32)
        slot = int(state.get("slot", 0))
        self.reset()
        if saved.numel() == 0:
            return
        # Oldest first, as they were written (slot points at the oldest once the ring wrapped).
        order = torch.cat([saved[slot % saved.numel():], saved[:slot % saved.numel()]]) if slot >= saved.numel() else saved[:slot]
        order = order[~torch.isnan(order)][-self.history.numel():]
        self.history[: order.numel()] = order.to(self.history.device)
        self._slot = order.numel()

    def reset(self) -> None:
        """Forget the history (after a rollback the weights are older than the norms)."""
        self.history.fill_(float("nan"))
        self._slot = 0


@dataclass
class Rollback:
    """What the loop must do: restore the last checkpoint; ``steps`` were bad."""

    steps: list[int]
    start: int
    """Stream position of the first bad step's batch."""
    end: int
    """Stream position after the last step seen: the data to skip is [start, end)."""


@dataclass
class Guard:
    """The host half: which steps were skipped, when to roll back, which data to skip.

    Every rank holds one and feeds it the same values, so every rank decides the same.
    """

    cfg: GuardSection
    run_dir: Path
    is_main: bool
    skipped_total: int = 0
    rollbacks: int = 0
    _positions: dict[int, tuple[int, int]] = field(default_factory=dict)
    _recent_bad: deque = field(default_factory=deque)
    _pending: list[tuple[int, int]] = field(default_factory=list)

    def __post_init__(self) -> None:
        for record in self.records():
            self.rollbacks += 1
            self._pending.append((record["start"], record["end"]))
        self._pending.sort()

    def state_dict(self) -> dict:
        """What a resumed run needs to decide as the uninterrupted one: the recent bad steps
        (``guard.window``), the stream positions of recent steps and the skipped count."""
        return {"recent_bad": list(self._recent_bad), "skipped_total": self.skipped_total,
                "positions": [[step, *pos] for step, pos in sorted(self._positions.items())]}

    def load_state_dict(self, state: dict) -> None:
        """Continue from a checkpoint's ``state_dict`` (at start-up; rollbacks keep their own)."""
        self._recent_bad = deque(int(s) for s in state.get("recent_bad", []))
        self.skipped_total = int(state.get("skipped_total", 0))
        self._positions = {int(step): (int(a), int(b)) for step, a, b in state.get("positions", [])}

    def records(self) -> list[dict]:
        """The run's rollbacks so far (``RUN_DIR/skipped.jsonl``)."""
        path = self.run_dir / SKIPPED_FILE
        if not path.is_file():
            return []
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]

    def note(self, step: int, start: int, end: int) -> None:
        """The loop took stream positions [start, end) for ``step`` (host integers only)."""
        self._positions[step] = (start, end)
        if len(self._positions) > 4 * self.cfg.window:
            del self._positions[min(self._positions)]

    def skip_data(self, loader) -> None:
        """Before a batch: jump over a recorded bad data window when the loader reaches it."""
        while self._pending and self._pending[0][1] <= loader.consumed:
            self._pending.pop(0)
        if self._pending and self._pending[0][0] <= loader.consumed:
            start, end = self._pending.pop(0)
            log.warning("skipping stream positions %d..%d (data of skipped steps, see %s)", start, end,
                        self.run_dir / SKIPPED_FILE)
            loader.load_state_dict({"consumed": end})

    def review(self, bad_steps: list[int], last: int, order) -> Rollback | None:
        """After a log interval ending at step ``last``, whose ``bad_steps`` were skipped. Returns
        a rollback to make, None, or raises ``UserError`` when the run may not roll back again."""
        self.skipped_total += len(bad_steps)
        if bad_steps:
            log.warning("skipped step(s) %s: non-finite or spiking gradient norm (not applied)",
                        ", ".join(map(str, bad_steps)))
        self._recent_bad.extend(bad_steps)
        while self._recent_bad and self._recent_bad[0] <= last - self.cfg.window:
            self._recent_bad.popleft()
        if len(self._recent_bad) < self.cfg.max_skips:
            return None
        first = self._recent_bad[0]
        start = self._positions.get(first, (0, 0))[0]
        end = self._positions.get(last, (0, 0))[1]
        plan = Rollback(steps=list(self._recent_bad), start=start, end=end)
        if self.rollbacks >= self.cfg.max_rollbacks:
            raise UserError(self.describe(plan, order, f"after {self.rollbacks} rollback(s) "
                                          f"(guard.max_rollbacks={self.cfg.max_rollbacks})"))
        return plan

    def describe(self, plan: Rollback, order, why: str) -> str:
        """One line naming the bad steps and their samples (for a stop)."""
        ids = order.ids(plan.start, plan.end - plan.start) if plan.end > plan.start else np.zeros(0, np.int64)
        shown = ", ".join(map(str, ids[:8].tolist())) + (" ..." if ids.size > 8 else "")
        return (f"steps {', '.join(map(str, plan.steps))} had non-finite or spiking gradients {why}; "
                f"their samples: {shown} ({ids.size} in all): lower optim.lr, check those samples, "
                "or raise guard.spike_factor")

    def rolled_back(self, plan: Rollback, restored_step: int, restored_consumed: int, order) -> None:
        """After the restore: record the window to skip and arrange to skip it."""
        start = max(plan.start, restored_consumed)
        self.rollbacks += 1
        self._recent_bad.clear()
        if plan.end > start:
            self._pending.append((start, plan.end))
            self._pending.sort()
        if self.is_main:
            ids = order.ids(start, plan.end - start) if plan.end > start else np.zeros(0, dtype=np.int64)
            record = {"steps": plan.steps, "rolled_back_to": restored_step, "start": start,
                      "end": plan.end, "sample_ids": ids.tolist()}
            with open(self.run_dir / SKIPPED_FILE, "a") as fh:
                fh.write(json.dumps(record) + "\n")
        log.warning("rolled back to step %d after skipped steps %s; the data of stream positions "
                    "%d..%d will be skipped (%s)", restored_step, ", ".join(map(str, plan.steps)),
                    start, plan.end, self.run_dir / SKIPPED_FILE)


def weights_finite(model: torch.nn.Module, ctx: DistContext) -> bool:
    """True when every parameter is finite (one reduction and one host read: for saves only).

    FSDP/HSDP shards (DTensors) are checked locally and the verdict summed over ``ctx``'s ranks,
    so every rank reaches the same one; replicated parameters need no collective."""
    from torch.distributed.tensor import DTensor

    params = list(model.parameters())
    sharded = any(isinstance(p, DTensor) for p in params)
    with torch.no_grad():
        local = [p.to_local() if isinstance(p, DTensor) else p for p in params]
        bad = torch.stack([~torch.isfinite(t).all() for t in local]).sum().double()
    if sharded:
        ctx.all_reduce_sum(bad)
    return not bool(bad)
