"""When to save: every ``ckpt.every`` steps, or ``auto`` from the measured cost of a save.

Young/Daly: with a save costing the step loop ``C`` seconds and failures arriving every ``M``
seconds on average, the interval that loses the least expected time is ``sqrt(2 C M)``
(J. W. Young 1974; J. T. Daly 2006, first order). ``auto`` saves once early (step
``FIRST_AUTO_SAVE``) to measure ``C``, then re-plans after every save from that save's stall
(``ckpt.mtbf_h`` gives ``M``) and the measured time per step. After the first save is written, a
save that would not fit ``ckpt.grace_s`` (stall + write: what a stop signal's final save costs)
is warned about once.
"""

from __future__ import annotations

import logging
import math

from podtrain.config_sections import CkptSection

log = logging.getLogger("podtrain.checkpoint")

FIRST_AUTO_SAVE = 10
"""ckpt.every=auto: the step of the first (measuring) save."""


def young_daly_seconds(stall_s: float, mtbf_s: float) -> float:
    """The checkpoint interval (seconds) that minimises expected lost time: sqrt(2 C M)."""
    return math.sqrt(2.0 * max(stall_s, 0.0) * mtbf_s)


class SaveSchedule:
    """Which steps save (every rank computes the same from agreed inputs: see ``saved``)."""

    def __init__(self, cfg: CkptSection, start_step: int):
        self.cfg = cfg
        self.auto = cfg.every == "auto"
        self.every = 0 if self.auto else int(cfg.every)
        self.next_auto = start_step + FIRST_AUTO_SAVE
        self._grace_checked = False

    def should_save(self, step: int, last_step: int) -> bool:
        """True at the planned steps and always at ``last_step``."""
        if step == last_step:
            return True
        if self.auto:
            return step >= self.next_auto
        return self.every > 0 and step % self.every == 0

    def saved(self, step: int, stall_s: float, step_s: float) -> None:
        """After a save at ``step`` that stalled the loop ``stall_s``; ``step_s`` per step.

        Under auto the next save is planned here. The inputs must be the same on every rank (the
        loop passes rank 0's, broadcast), else ranks would save at different steps.
        """
        if not self.auto:
            return
        seconds = young_daly_seconds(stall_s, self.cfg.mtbf_h * 3600.0)
        self.every = max(1, round(seconds / step_s)) if step_s > 0 else FIRST_AUTO_SAVE
        self.next_auto = step + self.every
        log.info("ckpt.every=auto: a save stalls %.3f s, MTBF %.3g h -> save every %.3g s = %d steps "
                 "of %.3f s", stall_s, self.cfg.mtbf_h, seconds, self.every, step_s)

    def check_grace(self, last_save: dict[str, float]) -> None:
        """Once the first save is written: warn when stall + write exceed ``ckpt.grace_s``."""
        if self._grace_checked or not last_save:
            return
        self._grace_checked = True
        needed = last_save.get("stall_s", 0.0) + last_save.get("write_s", 0.0)
        if needed > self.cfg.grace_s:
            log.warning("a checkpoint takes %.1f s (%.2f s stall + %.1f s write) but ckpt.grace_s is "
                        "%.0f s: the save after a stop signal would be killed before it is written; "
                        "raise the scheduler's grace period (and ckpt.grace_s) or write faster storage",
                        needed, last_save.get("stall_s", 0.0), last_save.get("write_s", 0.0),
                        self.cfg.grace_s)
