"""Goodput: where a run's wall time went, over every attempt (restarts and resumes included).

Categories (seconds): ``productive`` steps; ``startup`` (from ``train()`` to the first step);
``restarts`` (from the last line an earlier attempt wrote to metrics.jsonl to this attempt's
start: the time a killed attempt lost after its last log line, the scheduler's requeue, the new
start's imports); ``redone`` steps (a resumed attempt training steps an earlier attempt had already
logged); ``save_stall`` (the step loop's time in checkpoint saves); ``eval``; ``skipped`` (steps
the guard did not apply, and steps trained again after a guard rollback). Goodput is productive /
all of them.

Each train line of metrics.jsonl carries the attempt's cumulative seconds (``goodput_s``, earlier
attempts included) and ``goodput_pct``; a new attempt reads the file to learn the earlier
attempts' totals and the highest step they logged. Host clocks only: no device sync.
"""

from __future__ import annotations

import json
import time
import uuid
from pathlib import Path
from typing import Any

CATEGORIES = ("productive", "startup", "restarts", "redone", "save_stall", "eval", "skipped")


class GoodputClock:
    """One attempt's accounting (every rank keeps one; rank 0's is written)."""

    def __init__(self, started: float):
        """``started``: ``time.time()`` when this attempt's ``train()`` began."""
        self.started = started
        self.attempt = uuid.uuid4().hex[:8]
        self.seconds = dict.fromkeys(CATEGORIES, 0.0)
        self.prior = dict.fromkeys(CATEGORIES, 0.0)
        self.done_before = 0
        """Highest step an earlier attempt logged: steps up to it are redone."""
        self.redo_after_rollback = 0
        """Steps up to this one are trained again after a guard rollback (skipped)."""
        self.redone_steps: list[int] = []
        self._mark: float | None = None
        self._recent: dict[int, tuple[str, float]] = {}

    def load_history(self, metrics_path: Path) -> None:
        """Earlier attempts' totals (each one's last ``goodput_s``) and the restart gap."""
        if not metrics_path.is_file():
            return
        last_by_attempt: dict[str, dict[str, float]] = {}
        last_time = None
        for line in metrics_path.read_text().splitlines():
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue  # a line cut by a kill
            last_time = record.get("time", last_time)
            if record.get("kind") == "train":
                self.done_before = max(self.done_before, int(record.get("step", 0)))
            if isinstance(record.get("goodput_attempt_s"), dict):
                last_by_attempt[record.get("attempt")] = record["goodput_attempt_s"]
        for seconds in last_by_attempt.values():
            for key in CATEGORIES:
                self.prior[key] += float(seconds.get(key, 0.0))
        if last_time is not None:
            self.seconds["restarts"] += max(0.0, self.started - float(last_time))

    def start_steps(self) -> None:
        """The loop is about to take its first step: start-up ends here."""
        now = time.time()
        self.seconds["startup"] += now - self.started
        self._mark = now

    def add(self, category: str, seconds: float) -> float:
        """Book ``seconds`` of a non-step activity (eval, save_stall...); returns them."""
        self.seconds[category] += seconds
        if self._mark is not None:
            self._mark += seconds  # not a step's time
        return seconds

    def step_done(self, step: int) -> None:
        """Book the wall time since the previous step (data wait included) to ``step``."""
        now = time.time()
        seconds, self._mark = now - (self._mark or now), now
        if step <= self.redo_after_rollback:
            category = "skipped"
        elif step <= self.done_before:
            category = "redone"
            self.redone_steps.append(step)
        else:
            category = "productive"
        self.seconds[category] += seconds
        self._recent[step] = (category, seconds)
        if len(self._recent) > 10_000:
            del self._recent[min(self._recent)]

    def step_seconds(self) -> float:
        """Mean wall seconds per step of this attempt so far (0 before the first)."""
        steps = len(self._recent)
        booked = sum(seconds for _, seconds in self._recent.values())
        return booked / steps if steps else 0.0

    def skipped(self, steps: list[int]) -> None:
        """The guard did not apply ``steps``: their time was not productive."""
        for step in steps:
            category, seconds = self._recent.pop(step, ("skipped", 0.0))
            self.seconds[category] -= seconds
            self.seconds["skipped"] += seconds

    def totals(self) -> dict[str, float]:
        """Seconds per category over every attempt so far."""
        return {k: self.prior[k] + self.seconds[k] for k in CATEGORIES}

    def percent(self) -> float:
        """Productive share of all booked time, in percent."""
        totals = self.totals()
        whole = sum(totals.values())
        return 100.0 * totals["productive"] / whole if whole > 0 else 0.0

    def record(self) -> dict[str, Any]:
        """Fields for a metrics.jsonl line."""
        return {"goodput_s": {k: round(v, 4) for k, v in self.totals().items()},
                "goodput_attempt_s": {k: round(v, 4) for k, v in self.seconds.items()},
                "goodput_pct": round(self.percent(), 2), "attempt": self.attempt}

    def summary_line(self) -> str:
        """One line for the closing summary."""
        t = self.totals()
        redone = f" ({len(self.redone_steps)} steps)" if self.redone_steps else ""
        return (f"goodput {self.percent():.1f}%: productive {t['productive']:.1f} s, start-up "
                f"{t['startup']:.1f} s, restarts {t['restarts']:.1f} s, redone {t['redone']:.1f} s"
                f"{redone}, save stalls {t['save_stall']:.1f} s, evaluation {t['eval']:.1f} s, "
                f"skipped {t['skipped']:.1f} s")
