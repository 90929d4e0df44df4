"""One log interval of the training loop: its timing and the metrics.jsonl record it becomes.

Evaluation and checkpoint time are excluded, so tokens/s and MFU measure training alone; the sync
wait comes from the step clock's running total (on a GPU, the steps whose events completed).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any


@dataclass
class LogInterval:
    """Timing of one log interval, excluding evaluation and checkpoint time."""

    start: float
    steps: int = 0
    wait: float = 0.0
    sync_start: float = 0.0
    excluded: float = 0.0

    def add(self, wait_s: float) -> None:
        """One step done, after ``wait_s`` seconds waiting for its batch."""
        self.steps += 1
        self.wait += wait_s

    def exclude(self, seconds: float) -> None:
        """Leave ``seconds`` (evaluation, a save, a trace write) out of the interval's time."""
        self.excluded += seconds

    def elapsed(self, now: float) -> float:
        """Training seconds since the interval began."""
        return now - self.start - self.excluded

    def record(self, *, step: int, loss: float, grad_norm: float, lr: float, tokens_per_step: int,
               flops_per_token: float, world_size: int, peak: float | None, sync_total_s: float,
               max_mem_bytes: int, tokens_seen: int, epoch: int, run_id: str) -> dict[str, Any]:
        """The interval's ``kind=train`` record: rates per step, tokens/s, MFU per device."""
        elapsed = self.elapsed(time.perf_counter())
        steps = max(1, self.steps)
        tokens_per_s = self.steps * tokens_per_step / elapsed if elapsed > 0 else 0.0
        per_device_flops = tokens_per_s * flops_per_token / world_size
        return {
            "kind": "train", "step": step, "loss": loss, "lr": lr, "grad_norm": grad_norm,
            "tokens_per_s": tokens_per_s, "mfu": per_device_flops / peak if peak else None,
            "step_time_s": elapsed / steps, "data_wait_s": self.wait / steps,
            "sync_wait_s": (sync_total_s - self.sync_start) / steps,
            "max_mem_bytes": max_mem_bytes, "world_size": world_size, "tokens_seen": tokens_seen,
            "epoch": epoch, "run_id": run_id, "time": time.time(),
        }
