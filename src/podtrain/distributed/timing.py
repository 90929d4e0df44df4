"""Step timing without a host sync: host clocks on the CPU, CUDA events on a GPU.

A straggler is found by comparing the ranks' own work per step, ``compute = step - sync_wait``,
where ``sync_wait`` is how long the rank waited for the others in the gradient sync after its own
backward finished (in synchronous DDP the fast ranks wait for the slow one). On a GPU, host clocks
measure when kernels were *queued*: the host runs ahead, a step's host time is the launch time,
and the wait for a NCCL AllReduce happens on the device, so host-side sync waits read ~0 and every
rank looks alike. ``CudaStepClock`` therefore records CUDA events at the same four points and reads
them lazily: each step folds in the steps whose last event has completed (``Event.query``, no
sync), so nothing ever blocks the host. ``HostStepClock`` is the same interface on the CPU, where
work is synchronous and ``time.perf_counter`` is the truth. ``step_clock(device)`` picks one.

The four points of a step: ``start_step``; ``backward_done`` (the rank's own backward produced its
last gradient: a post-accumulate-grad hook on the first parameter, whose gradient autograd
computes last, one Python call per micro-batch and none per gradient bucket); ``synced`` (the
backward, gradient sync included, returned); ``end_step`` (after the optimizer step).
"""

from __future__ import annotations

import collections
import time
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn


@dataclass
class StepTimes:
    """Sums over the steps folded since the last ``take``: divide by ``steps`` for means."""

    steps: int = 0
    step_s: float = 0.0
    """Whole steps, forward to optimizer step (data wait excluded: the loader measures that)."""
    sync_wait_s: float = 0.0
    """Waiting for the other ranks in the gradient sync after this rank's own backward."""

    @property
    def compute_s(self) -> float:
        """The rank's own work: step time less the sync wait."""
        return self.step_s - self.sync_wait_s


class HostStepClock:
    """The step's four points on the host clock: right where work is synchronous (CPU, gloo)."""

    def __init__(self) -> None:
        self.total_sync_wait_s = 0.0
        """Sync wait of every completed step since the start (metrics read differences of it)."""
        self._start = self._backward = self._synced = 0.0
        self._times = StepTimes()

    def start_step(self) -> None:
        """A step begins (before its first forward)."""
        self._start = self._backward = self._synced = time.perf_counter()

    def backward_done(self) -> None:
        """This rank's backward produced its last gradient (called from the autograd hook)."""
        self._backward = time.perf_counter()

    def synced(self) -> Any:
        """The last backward, gradient sync included, returned. Returns a probe of the sync's
        completion for the collective record, or None when it is complete (here: always)."""
        self._synced = time.perf_counter()
        return None

    def end_step(self) -> None:
        """The step (optimizer included) is done: add it to the sums."""
        end = time.perf_counter()
        times = self._times
        times.steps += 1
        times.step_s += end - self._start
        # A step without a sync (one process) or without the hook reads 0, not a negative span.
        sync = max(0.0, self._synced - self._backward)
        times.sync_wait_s += sync
        self.total_sync_wait_s += sync

    def take(self) -> StepTimes:
        """The sums since the last call, and start new ones (no sync)."""
        times, self._times = self._times, StepTimes()
        return times

    def watch_backward(self, model: nn.Module) -> Any:
        """Call ``backward_done`` whenever autograd accumulates the gradient of ``model``'s first
        trainable parameter (the embedding: its gradient is the last one backward computes).
        Returns the hook handle, or None when the model has no trainable parameter."""
        first = next((p for p in model.parameters() if p.requires_grad), None)
        if first is None:
            return None
        clock = self
        return first.register_post_accumulate_grad_hook(lambda _param: clock.backward_done())


class _CudaStep:
    """The four events of one step, recorded on the current stream."""

    __slots__ = ("start", "backward", "synced", "end")

    def __init__(self) -> None:
        self.start = torch.cuda.Event(enable_timing=True)
        self.backward: torch.cuda.Event | None = None
        self.synced: torch.cuda.Event | None = None
        self.end = torch.cuda.Event(enable_timing=True)


class CudaStepClock(HostStepClock):
    """The same four points as CUDA events, read lazily: never a host sync.

    Each step gets fresh events (a few microseconds to record); a step is folded into the sums
    once its ``end`` event has completed, checked with ``Event.query`` at the next ``end_step``
    and at ``take``. A step whose events are not complete yet is counted at a later ``take``.
    """

    def __init__(self) -> None:
        super().__init__()
        self._current: _CudaStep | None = None
        self._pending: collections.deque[_CudaStep] = collections.deque()

    @staticmethod
    def _record() -> torch.cuda.Event:
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def start_step(self) -> None:
        """A step begins: an event on the current stream."""
        self._current = _CudaStep()
        self._current.start.record()

    def backward_done(self) -> None:
        """The last gradient's kernels are queued: an event after them (autograd's stream)."""
        if self._current is not None:
            self._current.backward = self._record()

    def synced(self) -> Any:
        """After the backward: DDP made the current stream wait for the AllReduce, so this event
        completes when the gradient sync has finished on the GPU. It is the collective record's
        probe of the sync (in flight until then)."""
        if self._current is None:
            return None
        self._current.synced = self._record()
        return self._current.synced

    def end_step(self) -> None:
        """The step's last event; fold the steps that have completed meanwhile."""
        if self._current is None:
            return
        self._current.end.record()
        self._pending.append(self._current)
        self._current = None
        self._fold()

    def _fold(self) -> None:
        times = self._times
        while self._pending and self._pending[0].end.query():
            step = self._pending.popleft()
            times.steps += 1
            times.step_s += step.start.elapsed_time(step.end) / 1000.0
            if step.backward is not None and step.synced is not None:
                sync = max(0.0, step.backward.elapsed_time(step.synced) / 1000.0)
                times.sync_wait_s += sync
                self.total_sync_wait_s += sync

    def take(self) -> StepTimes:
        """The completed steps' sums since the last call (no sync: unfinished steps wait)."""
        self._fold()
        return super().take()


def step_clock(device: torch.device) -> HostStepClock:
    """CUDA events on a GPU, host clocks elsewhere."""
    return CudaStepClock() if device.type == "cuda" else HostStepClock()
