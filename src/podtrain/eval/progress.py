"""A progress line while lm-eval's requests are scored: an evaluation of thousands of requests
takes minutes, and a silent one cannot be told from a hung one.

Every ``every_s`` seconds (and not more often) while a request type is scored, the main rank logs
what it has done of its share, the rate and the time left at that rate:

    [podtrain] eval: loglikelihood 1200/4000 on this rank, 38.5/s, about 1 min 13 s left

Each rank scores about an equal share (lm-eval deals the documents out in turn), so the main
rank's share stands for the job's.
"""

from __future__ import annotations

import logging
import time
from typing import Callable

log = logging.getLogger("podtrain")

EVERY_S = 30.0
"""Seconds between progress lines."""


def duration(seconds: float) -> str:
    """``1 min 13 s``, ``42 s``, ``2 h 5 min``."""
    seconds = int(round(seconds))
    if seconds < 60:
        return f"{seconds} s"
    if seconds < 3600:
        return f"{seconds // 60} min {seconds % 60} s"
    return f"{seconds // 3600} h {seconds % 3600 // 60} min"


class Progress:
    """Counts the work of one request type at a time and logs a line when one is due."""

    def __init__(self, enabled: bool, every_s: float = EVERY_S, clock: Callable[[], float] = time.monotonic):
        """``enabled``: this rank logs (the main rank); ``clock``: seconds (monotonic)."""
        self.enabled, self.every_s, self.clock = enabled, every_s, clock
        self.kind, self.total, self.done = "", 0, 0
        self._start = self._last = 0.0

    def start(self, kind: str, total: int) -> None:
        """A request type begins: ``total`` units of work on this rank."""
        self.kind, self.total, self.done = kind, total, 0
        self._start = self._last = self.clock()

    def advance(self, units: int) -> None:
        """``units`` more are done; log a line when ``every_s`` has passed since the last one."""
        self.done += units
        now = self.clock()
        if not self.enabled or now - self._last < self.every_s:
            return
        self._last = now
        rate = self.done / max(now - self._start, 1e-9)
        left = max(self.total - self.done, 0)
        log.info("eval: %s %d/%d on this rank, %.1f/s, about %s left", self.kind, self.done, self.total,
                 rate, duration(left / rate) if rate > 0 else "?")
