"""Goodput: where a run's wall time went, over every attempt (restarts and resumes included).

Categories (seconds): ``productive`` steps; ``startup`` (from ``train()`` to the first step);
``restarts`` (from the last line an earlier attempt wrote to metrics.jsonl to this attempt's
start: the time a killed attempt lost after its last log line, the scheduler's requeue, the new
start's imports); ``redone`` steps (a resumed attempt training steps an earlier attempt had already
logged); ``save_stall`` (the step loop's time in checkpoint saves); ``eval``; ``skipped`` (steps
the guard did not apply, and steps trained again after a guard rollback). Goodput is productive /
all of them.

Idle time is not lost time. An attempt that ends on purpose writes a closing ``kind=goodput``
line saying how (``ended``): ``finished`` (it reached ``train.steps``), ``interrupted`` (Ctrl-C) or
``stopped`` (a scheduler's stop signal: SIGTERM, SIGUSR1). The gap from a ``finished`` or
``interrupted`` attempt to the next one is nobody's loss (the run was extended or resumed when
its user chose) and is booked nowhere. After a ``stopped`` attempt (preempted, requeued) or one
that wrote no closing line (killed, crashed), the gap until the next attempt is ``restarts``.
An attempt that trains no step (rerun at ``train.steps``: "nothing to do") books nothing at all.

Each train line of metrics.jsonl carries the attempt's cumulative seconds (``goodput_s``, earlier
attempts included) and ``goodput_pct``; the closing line has the attempt's final figures (its
last evaluation and save included), which ``podtrain report`` reads. A new attempt reads the file
to learn the earlier attempts' totals and the highest step they logged. Host clocks only: no
device sync.
"""

from __future__ import annotations

import json
import os
import time
import uuid
from pathlib import Path
from typing import Any

CATEGORIES = ("productive", "startup", "restarts", "redone", "save_stall", "eval", "skipped")

IDLE_AFTER = ("finished", "interrupted")
"""How an attempt ended when the wait for the next one is idle, not lost (see the module doc)."""

LABELS = {"productive": "productive", "startup": "start-up", "restarts": "restarts", "redone": "redone",
          "save_stall": "save stalls", "eval": "evaluation", "skipped": "skipped"}


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
        self._lost_at: float | None = None
        """The lost attempt's last log line (``time.time()``), when this attempt recovers from one."""
        self._restore: dict[str, Any] | None = None
        self._steps_started: float | None = None
        self.recovery: dict[str, Any] | None = None
        """This attempt's recovery budget once its first step is done (see the module doc)."""
        self._recovery_written = False

    def load_history(self, metrics_path: Path) -> None:
        """Earlier attempts' totals (each one's last ``goodput_s``) and the restart gap."""
        if not metrics_path.is_file():
            return
        last_by_attempt: dict[str, dict[str, float]] = {}
        last_time, ended = None, None
        for line in metrics_path.read_text().splitlines():
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue  # a line cut by a kill
            last_time = record.get("time", last_time)
            ended = record.get("ended") if record.get("kind") == "goodput" else None
            if record.get("kind") == "train":
                self.done_before = max(self.done_before, int(record.get("step", 0)))
            if isinstance(record.get("goodput_attempt_s"), dict):
                last_by_attempt[record.get("attempt")] = record["goodput_attempt_s"]
        for seconds in last_by_attempt.values():
            for key in CATEGORIES:
                self.prior[key] += float(seconds.get(key, 0.0))
        if last_time is not None and ended not in IDLE_AFTER:
            self.seconds["restarts"] += max(0.0, self.started - float(last_time))
            self._lost_at = float(last_time)

    def note_restore(self, budget: dict[str, Any] | None) -> None:
        """The restore's seconds and bytes by source (``Checkpointer.restore_budget``)."""
        self._restore = budget

    def nothing_done(self) -> None:
        """This attempt trains no step (the run is already at ``train.steps``): it books nothing,
        neither its start-up nor a restart gap, so rerunning a finished run's command leaves its
        goodput as it was. Its closing line (``ended=finished``) still makes the wait after it idle."""
        self.seconds = dict.fromkeys(CATEGORIES, 0.0)
        self._lost_at = None

    def start_steps(self) -> None:
        """The loop is about to take its first step: start-up ends here."""
        now = time.time()
        self.seconds["startup"] += now - self.started
        self._mark = self._steps_started = now

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
        self._recent.pop(step, None)  # booked again (a rollback's redo): it becomes the newest
        self._recent[step] = (category, seconds)
        if self._lost_at is not None and self.recovery is None:
            self.recovery = recovery_budget(self._lost_at, process_start_time(), self.started,
                                            self._steps_started or self.started, now, self._restore)
        if len(self._recent) > 10_000:
            # The oldest booked, first in the dict's order: O(1). A min() over the window cost
            # every step from the 10,001st on a scan of 10,000 keys (~0.4 ms of host time).
            del self._recent[next(iter(self._recent))]

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
        out = {"goodput_s": {k: round(v, 4) for k, v in self.totals().items()},
               "goodput_attempt_s": {k: round(v, 4) for k, v in self.seconds.items()},
               "goodput_pct": round(self.percent(), 2), "attempt": self.attempt}
        if self.recovery is not None and not self._recovery_written:
            out["recovery"] = self.recovery  # once: the first line after the first step
            self._recovery_written = True
        return out

    def closing_record(self, step: int, ended: str) -> dict[str, Any]:
        """The attempt's last metrics line (``kind=goodput``): its final figures and how it
        ``ended`` (``finished``, ``interrupted`` or ``stopped``: see the module doc)."""
        return {"kind": "goodput", "step": step, **self.record(), "ended": ended, "time": time.time()}

    def summary_line(self) -> str:
        """One line for the closing summary."""
        return goodput_line(self.totals(), len(self.redone_steps))


def goodput_line(totals: dict[str, float], redone_steps: int = 0) -> str:
    """``goodput 90.2%: productive 41.0 s, start-up 3.1 s, ...``: the closing summary's line, and
    ``podtrain report``'s from a metrics record's ``goodput_s``."""
    whole = sum(float(totals.get(k, 0.0)) for k in CATEGORIES)
    pct = 100.0 * float(totals.get("productive", 0.0)) / whole if whole > 0 else 0.0
    parts = [f"{LABELS[k]} {float(totals.get(k, 0.0)):.1f} s"
             + (f" ({redone_steps} steps)" if k == "redone" and redone_steps else "") for k in CATEGORIES]
    return f"goodput {pct:.1f}%: " + ", ".join(parts)


def process_start_time() -> float | None:
    """When this process started (``time.time()`` scale; Linux ``/proc``), or None elsewhere."""
    try:
        ticks = int(open("/proc/self/stat").read().rsplit(")", 1)[1].split()[19])
        boot = next(float(line.split()[1]) for line in open("/proc/stat") if line.startswith("btime "))
        return boot + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, StopIteration):
        return None


def recovery_budget(lost_at: float, process_start: float | None, started: float, steps_started: float,
                    first_step_done: float, restore: dict[str, Any] | None) -> dict[str, Any]:
    """The phases of one recovery, in seconds (pure; see the module doc). ``process_start`` None
    (not Linux): the span up to the training state's creation is one phase."""
    out: dict[str, Any] = {"lost_at": round(lost_at, 3)}
    if process_start is not None and lost_at <= process_start <= started:
        out["lost_to_start_s"] = round(process_start - lost_at, 3)
        out["start_to_group_s"] = round(started - process_start, 3)
    else:
        out["lost_to_group_s"] = round(started - lost_at, 3)
    out["startup_s"] = round(steps_started - started, 3)
    if restore:
        out["restore_s"] = round(float(restore.get("restore_s", 0.0)), 3)
        out["restore_bytes"] = dict(restore.get("bytes", {}))
        out["restore_tier"] = restore.get("tier")
    out["first_step_s"] = round(first_step_done - steps_started, 3)
    out["total_s"] = round(first_step_done - lost_at, 3)
    return out


def recovery_line(budget: dict[str, Any]) -> str:
    """``recovery 12.3 s: lost -> process start 8.1 s, ...``: one restart's budget in a line."""
    labels = (("lost_to_start_s", "lost -> process start (detection, relaunch, rendezvous)"),
              ("start_to_group_s", "imports + process group"), ("lost_to_group_s", "lost -> process group"),
              ("startup_s", "start-up (model build + restore)"), ("restore_s", "of which restore"),
              ("first_step_s", "first step"))
    parts = [f"{label} {budget[key]:.1f} s" for key, label in labels if key in budget]
    nbytes = budget.get("restore_bytes") or {}
    if nbytes:
        parts.append("restore read " + ", ".join(f"{v / 1e6:.1f} MB {k.replace('_', ' ')}" for k, v in nbytes.items()))
    return f"recovery {budget.get('total_s', 0.0):.1f} s: " + ", ".join(parts)
