"""Garbage collection on a schedule every rank shares (``train.gc_every``), never a pause of one rank.

Python's automatic collector runs when allocations cross a threshold, at a moment of its choosing
and on each rank at a different one. A full collection walks every tracked object: after set-up a
rank holds ~400k of them (torch, transformers, the model's modules), so one full collection costs
0.2-0.4 s of CPU on the demo model (1.1 s on a loaded host), and it lands within the first tens of
steps. In a data-parallel job the step ends in an AllReduce: a pause of one rank is every rank's
wait there, and at 512 ranks some rank pauses at nearly every step.

So, as torchtitan does (its ``GarbageCollection``), after set-up the trainer collects once,
``gc.freeze()``s what survives (set-up objects live for the whole run: no collection needs to walk
them again), and takes the automatic collector off. Then the collector runs at the step boundary of
every ``train.gc_every``-th step, the same step on every rank (the step counter is agreed), over
the young generations only (generation 1: what the steps since the last one made; 0.02-0.04 ms on
the demo); every ``FULL_EVERY``-th of those, and at a save (an agreed point where the ranks wait
anyway), a full collection (~0.5 ms there, set-up being frozen), so that a cycle that outlived a
young collection is freed too: memory stays bounded with no checkpoints at all.
``train.gc_every=0`` leaves Python's automatic collector as it is.

``close`` puts the collector back as it found it (the frozen objects returned to the collector's
care, automatic collection re-enabled if it was on): several trainings run in one process (tests).
"""

from __future__ import annotations

import gc
import logging
import time

log = logging.getLogger(__name__)

FULL_EVERY = 10
"""Every this-many scheduled collections is a full one (generation 2): cheap once set-up is frozen,
and what frees a cycle that outlived a young collection when no save comes to do it."""


class GcSchedule:
    """The collector at agreed step boundaries (module doc); ``every=0``: Python's own collector."""

    def __init__(self, every: int, full_every: int = FULL_EVERY) -> None:
        """``every``: collect (generation 1) at each step that is a multiple of it; 0 leaves the
        automatic collector alone. ``full_every``: every this-many scheduled collections is full."""
        self.every = every
        self.full_every = full_every
        self.active = False
        """True between ``start`` and ``close`` (with ``every > 0``): automatic collection is off."""
        self.collections = 0
        """Scheduled collections run so far (young and full)."""
        self.seconds = 0.0
        """Time spent in this schedule's collections (set-up's one included), for the closing log."""
        self._was_enabled = True
        self._froze = False

    def start(self) -> None:
        """After set-up, before the first step: one full collection of set-up's garbage, freeze the
        survivors, automatic collection off. A no-op with ``every=0``."""
        if self.every <= 0 or self.active:
            return
        began = time.perf_counter()
        gc.collect()  # set-up's garbage first: what is frozen is never collected
        # Freeze only when nothing else froze objects: unfreeze at close would release theirs too.
        self._froze = gc.get_freeze_count() == 0
        if self._froze:
            gc.freeze()
        self._was_enabled = gc.isenabled()
        gc.disable()
        self.active = True
        self.seconds += time.perf_counter() - began
        log.debug("gc: %d set-up objects frozen, automatic collection off, a collection every %d steps",
                  gc.get_freeze_count(), self.every)

    def after_step(self, step: int, agreed_point: bool = False) -> None:
        """At the boundary after optimizer step ``step`` (the same on every rank): collect when the
        schedule says so (generation 1, every ``full_every``-th one full). ``agreed_point``: a
        point every rank reaches together and waits at anyway (a save): a full collection."""
        if not self.active:
            return
        if agreed_point:
            self._collect(2)
        elif step % self.every == 0:
            self.collections += 1
            self._collect(2 if self.collections % self.full_every == 0 else 1)

    def _collect(self, generation: int) -> None:
        began = time.perf_counter()
        gc.collect(generation)
        self.seconds += time.perf_counter() - began

    def close(self) -> None:
        """Give the collector back as ``start`` found it (every exit path; idempotent)."""
        if not self.active:
            return
        self.active = False
        if self._froze:
            gc.unfreeze()  # set-up's objects back in the oldest generation: collectable again
        if self._was_enabled:
            gc.enable()
        log.debug("gc: %d scheduled collections, %.3f s in all", self.collections, self.seconds)
