"""Peer replicas off the local save's critical path: a thread and a lazily connected gloo group
of their own that copy committed local steps to the ring targets (``podtrain.ckpt.replicas``).

Why a thread of its own: the local writer finishes a save (piece file, marker, manifest) in a
fraction of a step, but sending the same bytes to K peers and receiving theirs doubles the I/O
and adds the network. Run inside the save job, at ``ckpt.local_every: 1`` the next local save
waited for the previous one's replication, and the step loop with it. Now the save job ends at
its commit, and replication follows behind it.

The replicator always copies the newest local step every rank has committed, skipping older ones
it had no time for (a replica of step 40 is worth nothing once step 41 has one). Agreement: each
round starts with one MIN all_reduce on the replicator's group of the newest step this rank has
committed (commits are collective, so every rank reaches every step); ranks take part in a round
only once their own writer has committed a step newer than the last one replicated, so the rounds
line up on every rank without any message from the step loop. Retention of the local tier never
removes a step newer than the last replicated one (``protect_from``): it may be in flight. While
this rank's step loop copies a save to host memory, and while its local writer writes one, the
copies pause between chunks (``pause``/``resume``): the host copy, which is the step loop's stall,
and the next save, which the step loop may be waiting for, get the cores, memory bandwidth and disk
alone (measured on 2 shared cores: the host copy took 1.6x as long with the copies running).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import Callable

import torch
import torch.distributed as dist

from podtrain.ckpt import layout, replicas
from podtrain.distributed.side_group import new_side_group, release_side_group

log = logging.getLogger("podtrain.checkpoint")

CLOSING = -1
"""A round's vote from a rank that is closing with nothing newer to copy."""


def _lower_priority() -> None:
    """Nice this thread (Linux threads have their own nice value): on a busy host the step loop's
    threads go first, and the copies use what CPU is left."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 10)
    except (AttributeError, OSError):  # not Linux, or not permitted: run at normal priority
        pass


class Replicator:
    """One rank's replica sender/receiver: ``committed`` after each local commit, ``close`` at the end."""

    def __init__(self, store, ring: replicas.Ring, rank: int, host: str, is_main: bool, timeout_s: float,
                 on_failure: Callable[[str], None]) -> None:
        """Every rank constructs one when its ring has targets (creating the group is collective).
        ``on_failure(step_name)``: remove that step's replicas here after any rank's copy failed."""
        self.store, self.ring, self.rank, self.host, self.is_main = store, ring, rank, host, is_main
        self.on_failure = on_failure
        self.group = new_side_group(timeout_s)
        self._cond = threading.Condition()
        self._newest: int | None = None  # the newest local step this rank has committed
        self._done: int | None = None  # the last step replicated (or given up on)
        self._closing = False
        self._thread: threading.Thread | None = None
        self._holds = 0  # saves that have paused the copies (``pause``) and not yet resumed them
        self._go = threading.Event()  # set while no save holds the copies back
        self._go.set()
        self.replicated = 0
        """Local steps replicated by this run so far."""
        self.last: dict[str, float] = {}
        """The last finished replication: step, bytes received by this rank, seconds."""

    @property
    def protect_from(self) -> int | None:
        """Retention keeps every local step above this one (it may be being copied)."""
        return self._done if self._done is not None else -1

    def pause(self) -> None:
        """A save begins on this rank (its host copy, then its local write): the copies stop at the
        next chunk until every ``pause`` is matched by a ``resume`` (a paused peer only makes the
        other side of its pair wait)."""
        with self._cond:
            self._holds += 1
            self._go.clear()

    def resume(self) -> None:
        """The save that called ``pause`` no longer needs the host to itself."""
        with self._cond:
            self._holds = max(0, self._holds - 1)
            if self._holds == 0:
                self._go.set()

    def committed(self, step: int) -> None:
        """The local writer committed ``step`` on every rank: copy it when the replicator is free."""
        with self._cond:
            self._newest = step
            self._cond.notify()
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="podtrain-replicas", daemon=True)
            self._thread.start()

    def wait_idle(self) -> None:
        """Block until the newest committed step is replicated (or given up on): for callers that
        wait for a local save and want its replicas too."""
        with self._cond:
            while self._thread is not None and self._thread.is_alive() and self._newest != self._done:
                self._cond.wait(0.1)

    def close(self) -> None:
        """Copy the newest committed step if not yet done, stop the thread, release the group
        (every rank, after its local writer's thread has finished: no commit comes later)."""
        with self._cond:
            self._closing = True
            self._holds = 0  # no save comes after close: a hold never resumed must not keep the copies waiting
            self._go.set()
            self._cond.notify()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        release_side_group(self.group, "replica")
        self.group = None

    def _loop(self) -> None:
        _lower_priority()
        while True:
            with self._cond:
                while not self._closing and self._newest == self._done:
                    self._cond.wait()
                vote = self._newest if self._newest != self._done else CLOSING
            agreed = torch.tensor([vote], dtype=torch.int64)
            try:
                dist.all_reduce(agreed, op=dist.ReduceOp.MIN, group=self.group)
            except Exception as exc:  # a peer is gone (its node was lost): nothing more to copy
                log.warning("peer replicas stopped on rank %d: %s", self.rank, exc)
                break
            step = int(agreed[0])
            if step == CLOSING:  # some rank has nothing newer and is closing: so has every rank
                break
            if self._done is None or step > self._done:
                self._replicate(step)
            with self._cond:
                self._done = max(step, self._done if self._done is not None else step)
                self._cond.notify_all()
        with self._cond:
            self._done = self._newest
            self._cond.notify_all()

    def _replicate(self, step: int) -> None:
        name = layout.step_name(step)
        t0 = time.perf_counter()
        got, problem = 0, None
        try:
            got = replicas.replicate(self.store, name, self.rank, self.ring, self.group, self._go.wait)
        except Exception as exc:  # the save itself succeeded: a failed copy is a warning
            problem = f"rank {self.rank} on {self.host}: {type(exc).__name__}: {exc}"
        failed = torch.tensor([1 if problem else 0], dtype=torch.uint8)
        try:
            dist.all_reduce(failed, op=dist.ReduceOp.MAX, group=self.group)
        except Exception as exc:  # a peer is gone (its node was lost just now): what arrived here
            # whole stays (each file was committed, the marker last; restore checks it again)
            log.warning("peer replicas of local step %d: the other ranks could not be asked how their "
                        "copies went (%s); the replicas held here are kept", step, exc)
        took = time.perf_counter() - t0
        if failed[0]:
            self.on_failure(name)
            if problem or self.is_main:
                log.warning("peer replicas of local step %d failed (%s): the step is held by its own "
                            "nodes only", step, problem or "on another rank")
            return
        self.replicated += 1
        self.last = {"step": step, "bytes": got, "seconds": took}
        if self.is_main:
            log.info("local step %d replicated to %d peer node(s): %.1f MB received by rank 0 in %.2f s",
                     step, len(self.ring.targets), got / 1e6, took)
