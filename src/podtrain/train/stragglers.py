"""Stragglers: which rank makes every step slow, and is it compute or input?

In synchronous DDP every rank finishes a step at the same moment, because the gradient
AllReduce waits for the slowest rank: the whole-step times of all ranks are nearly equal, and the
*fast* ranks spend the difference waiting in the sync. So the monitor compares each rank's own
work per step, ``busy = step_time - sync_wait``, where ``sync_wait`` is how long the rank waited
for the others after its backward. In training both come from the ``Stepper``'s step clock
(``distributed/timing.py``: CUDA events on a GPU, read lazily; host clocks on the CPU), taken once
per report; callers without a clock feed host times through ``observe``. Without a sync wait
(0.0) it compares whole-step times, which is right when the caller measures a rank's time before
the sync.

``observe_wait`` (with a clock) or ``observe`` is called every step on every rank and only adds
floats: no collective, no host sync.
``maybe_report`` is called every step on every rank too; every ``every`` steps it issues ONE small
all_gather (3 floats per rank) and returns a dict for metrics.jsonl; rank 0 logs a WARNING
naming the rank and host when the slowest rank's busy time exceeds the median by more than
``threshold``.

What grows with the world size, and why it stays: the report is the per-rank table (its median
names the straggler, and metrics.jsonl keeps the per-rank means), so each rank receives
``24 x world`` bytes per report: 12 KB at 512 ranks, every ``every`` (default 100) steps, about
0.1 KB per step (tests/test_collective_bytes.py measures it at 2, 4 and 8 ranks). The host
names are not gathered: the straggler's own rank broadcasts its host when one is found (one
name, not one per rank).
"""

from __future__ import annotations

import logging
import statistics
from typing import Any

import torch
import torch.distributed as dist

from podtrain.distributed.group import DistContext
from podtrain.distributed.timing import HostStepClock

log = logging.getLogger(__name__)


def find_straggler(busy_by_rank: list[float], threshold: float) -> tuple[int | None, float]:
    """``(rank, excess)``: the slowest rank and its excess over the median, ``(busy - median) /
    median``; the rank is None when the excess is not above ``threshold``."""
    if not busy_by_rank:
        return None, 0.0
    median = statistics.median(busy_by_rank)
    slowest = max(range(len(busy_by_rank)), key=busy_by_rank.__getitem__)
    excess = (busy_by_rank[slowest] - median) / median if median > 0 else 0.0
    return (slowest if excess > threshold else None), excess


class StragglerMonitor:
    """Per-rank step and data-wait times, compared across ranks every ``every`` steps.

    Construct it on every rank (no collective: a straggler's host is asked when one is found).
    ``clock`` (a ``distributed.timing`` step clock) supplies step and sync-wait times; without
    one, ``observe`` does.
    """

    def __init__(self, ctx: DistContext, every: int = 100, threshold: float = 0.10,
                 clock: HostStepClock | None = None):
        if every < 1:
            raise ValueError(f"every must be >= 1, got {every}")
        self.ctx = ctx
        self.every = every
        self.threshold = threshold
        self.clock = clock
        self._hosts: dict[int, str] = {}
        self._reset()

    def _reset(self) -> None:
        self._steps = 0
        self._step_time = 0.0
        self._data_wait = 0.0
        self._sync_wait = 0.0

    def observe(self, step_time_s: float, data_wait_s: float, sync_wait_s: float = 0.0) -> None:
        """Add one step's times (host-side floats the loop already has): no collective, no sync.

        ``step_time_s`` is the whole step including ``data_wait_s`` (waiting for the batch) and
        ``sync_wait_s`` (waiting for the other ranks in the gradient sync).
        """
        self._steps += 1
        self._step_time += step_time_s
        self._data_wait += data_wait_s
        self._sync_wait += sync_wait_s

    def observe_wait(self, data_wait_s: float) -> None:
        """With a clock: add one step's data wait (the clock has its step and sync times)."""
        self._steps += 1
        self._data_wait += data_wait_s

    def maybe_report(self, step: int) -> dict[str, Any] | None:
        """Every ``every`` steps, compare the ranks (one all_gather, on every rank); else None.

        Returns ``straggler_rank``/``straggler_host`` (None when nobody exceeds the threshold),
        ``straggler_excess`` and per-rank means over the window: ``step_time_by_rank``,
        ``data_wait_by_rank``, ``sync_wait_by_rank``, ``busy_by_rank`` (step time less sync wait).
        """
        if step % self.every != 0:
            return None
        n = max(1, self._steps)
        mine = [self._step_time / n, self._data_wait / n, self._sync_wait / n]
        if self.clock is not None:
            # The completed steps' device (or host) times; the data wait is waited before the
            # clock starts, so it is added to make the step time the whole step's.
            times = self.clock.take()
            m = max(1, times.steps)
            mine[0] = times.step_s / m + mine[1]
            mine[2] = times.sync_wait_s / m
        self._reset()
        table = self._gather(mine)
        step_t, data_w, sync_w = ([row[i] for row in table] for i in range(3))
        busy = [s - w for s, w in zip(step_t, sync_w)]
        rank, excess = find_straggler(busy, self.threshold)
        report = {
            "straggler_rank": rank,
            "straggler_host": self.host(rank) if rank is not None else None,
            "straggler_excess": round(excess, 4),
            "step_time_by_rank": _round(step_t), "data_wait_by_rank": _round(data_w),
            "sync_wait_by_rank": _round(sync_w), "busy_by_rank": _round(busy),
        }
        if rank is not None and self.ctx.is_main:
            self._warn(step, rank, excess, busy, data_w)
        return report

    def host(self, rank: int) -> str:
        """The host of ``rank``, broadcast by that rank the first time it is asked (every rank
        asks together: ``maybe_report`` finds the same straggler on every rank)."""
        if rank not in self._hosts:
            mine = self.ctx.env.hostname if self.ctx.rank == rank else None
            self._hosts[rank] = self.ctx.broadcast_object(mine, src=rank) if self.ctx.initialized else mine
        return self._hosts[rank]

    def _gather(self, mine: list[float]) -> list[list[float]]:
        if not self.ctx.initialized:
            return [mine]
        local = torch.tensor(mine, dtype=torch.float64, device=self.ctx.device)
        out = [torch.empty_like(local) for _ in range(self.ctx.world_size)]
        with self.ctx.recorder.begin("all_gather", local, caller="StragglerMonitor.maybe_report"):
            dist.all_gather(out, local)
        return torch.stack(out).tolist()  # one device-to-host copy per report, not per step

    def _warn(self, step: int, rank: int, excess: float, busy: list[float],
              data_wait: list[float]) -> None:
        med_busy = statistics.median(busy)
        med_wait = statistics.median(data_wait)
        # Input-bound when the extra data wait explains most of the extra time.
        extra_wait = data_wait[rank] - med_wait
        cause = "waiting for data" if extra_wait > 0.5 * (busy[rank] - med_busy) else "compute"
        log.warning(
            "straggler at step %d: rank %d on host %s takes %.3f s per step against a median "
            "of %.3f s (+%.0f%%), data wait %.3f s against %.3f s: likely %s",
            step, rank, self.host(rank), busy[rank], med_busy, 100 * excess,
            data_wait[rank], med_wait, cause)


def _round(values: list[float]) -> list[float]:
    return [round(v, 6) for v in values]
