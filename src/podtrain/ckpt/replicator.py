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
line up on every rank without any message from the step loop. While this rank's step loop copies
a save to host memory, and while its local writer writes one, the copies pause between chunks
(``pause``/``resume``; ``held`` is set while they wait): the host copy, which is the step loop's
stall, and the next save, which the step loop may be waiting for, get the cores, memory bandwidth
and disk alone (measured on 2 shared cores: the host copy took 1.6x as long with the copies running).

Housekeeping never stops training, and a failed round never stops the replicator: a copy that
fails (a full disk, files retention already took) is agreed on in the round and its partial
replicas removed; a round whose collective fails (a timeout, a peer that closed its connections)
leaves the group unusable, so this rank logs it, gives the step up and destroys the group (its
peers' operations on it then fail too, at once or at the group's timeout). The new group is not
made by this thread: creating a group is collective over the default group's store, and one made
from a background thread could interleave with the main thread's collectives and group creations.
The step loop makes it (``mend``), at the next local save's gate, a point every rank reaches in
the same order, once every rank's replicator has given up its broken group (agreed there by one
MAX all_reduce); the steps committed meanwhile are given up (not replicated), and the next round
runs on the new group. Retention of the local tier keeps only the steps the round
in flight may still copy (``protected``), never more, so it never stops even when the copies do.
Every wait has a deadline: the copies' pause (half the group's timeout), ``wait_idle`` and
``close`` (the caller's, else the group's timeout).
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


def _all_reduce_max(values: list[float]) -> list[float]:
    """The elementwise maximum of ``values`` over the ranks, on the default group (a gloo one)."""
    tensor = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return tensor.tolist()


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
        """Every rank constructs one when any rank's ring has targets (agreed: the ring comes from
        host names gathered once; creating the group is collective), also a rank whose own ring is
        empty (uneven nodes): it still votes in every round. ``on_failure(step_name)``: remove
        that step's partial replicas here after any rank's copy failed. ``timeout_s``: each
        collective's, and the default bound of ``wait_idle`` and ``close``."""
        self.store, self.ring, self.rank, self.host, self.is_main = store, ring, rank, host, is_main
        self.on_failure = on_failure
        self.timeout_s = timeout_s
        self.group = new_side_group(timeout_s)
        self._cond = threading.Condition()
        self._newest: int | None = None  # the newest local step this rank has committed
        self._done: int | None = None  # the last step replicated (or given up on)
        self._voted: int | None = None  # this rank's vote in the round being agreed
        self._copying: int | None = None  # the step the round in flight copies
        self._closing = False
        self._dead = False  # no new group could be made: the copies have stopped for the run
        self._thread: threading.Thread | None = None
        self._holds = 0  # saves that have paused the copies (``pause``) and not yet resumed them
        self._go = threading.Event()  # set while no save holds the copies back
        self._go.set()
        self.held = threading.Event()
        """Set while the copies wait, between two messages, for the saves holding them (``pause``)."""
        self.replicated = 0
        """Local steps replicated by this run so far."""
        self.failed_rounds = 0
        """Rounds that failed (their step given up; the next round ran)."""
        self.groups_made = 1
        """Groups this replicator has made: one, plus one per broken group replaced (``mend``)."""
        self.last: dict[str, float] = {}
        """The last finished replication: step, bytes received by this rank, seconds."""

    def protected(self) -> range:
        """The local steps retention must keep (whatever ``ckpt.local_keep`` says) because the
        round in flight may copy them: the step it copies, or while its step is being agreed the
        steps after the last one done up to this rank's vote (a peer's vote may be older). Empty
        while no round runs: retention never waits for the copies."""
        with self._cond:
            if self._copying is not None:
                return range(self._copying, self._copying + 1)
            if self._voted is not None:
                return range((self._done if self._done is not None else -1) + 1, self._voted + 1)
            return range(0)

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
            self._cond.notify_all()  # (wait_idle's callers wait on the same condition)
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="podtrain-replicas", daemon=True)
            self._thread.start()

    def wait_idle(self, timeout: float | None = None) -> bool:
        """Wait until the newest committed step is replicated (or given up on), at most ``timeout``
        seconds (None: the group's timeout): for callers that wait for a local save and want its
        replicas too. False when the copies are still running then."""
        deadline = time.monotonic() + (self.timeout_s if timeout is None else timeout)
        with self._cond:
            while self._thread is not None and self._thread.is_alive() and self._newest != self._done:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(min(left, 0.1))
        return True

    def close(self, timeout: float | None = None) -> bool:
        """Copy the newest committed step if not yet done, stop the thread, release the group
        (every rank, after its local writer's thread has finished: no commit comes later), within
        ``timeout`` seconds (None: the group's timeout). A thread still copying then is left to end
        with the process (a daemon) and its group is not destroyed under it; False then."""
        with self._cond:
            self._closing = True
            self._holds = 0  # no save comes after close: a hold never resumed must not keep the copies waiting
            self._go.set()
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(self.timeout_s if timeout is None else max(0.0, timeout))
            if self._thread.is_alive():
                log.warning("peer replicas on rank %d are still copying at close: left to end with the "
                            "process", self.rank)
                return False
            self._thread = None
        release_side_group(self.group, "replica")
        self.group = None
        return True

    def _pace(self) -> None:
        """Before each message: wait while a save holds the copies, for at most half the group's
        timeout (the peer of the pair waits for this message meanwhile; a save that held the
        copies longer is a bug, and the copies then go on)."""
        if self._go.is_set():
            return
        self.held.set()
        try:
            self._go.wait(self.timeout_s / 2)
        finally:
            self.held.clear()

    def mend(self, agree: Callable[[list[float]], list[float]] | None = None) -> bool:
        """The step loop (main thread), every rank, at a point all reach in the same order (the
        local save's gate): when every rank's copies have given up a broken group (agreed with one
        MAX ``agree``: ``DistContext.all_reduce_max``; None: a CPU all_reduce on the default
        group), make the new one here, so that group creation never runs on a background thread.
        True when a group was made now."""
        with self._cond:
            waiting = self.group is None and not self._dead and not self._closing
        unmended = (agree or _all_reduce_max)([0.0 if waiting else 1.0])[0]
        if unmended > 0:  # some rank's copies still use (or have not yet left) the broken group
            return False
        try:
            group = new_side_group(self.timeout_s)
        except Exception as exc:  # no group, no copies (never the default group: the step loop's)
            log.warning("peer replicas on rank %d stop: no new group could be made (%s); local "
                        "checkpoints are kept by their own nodes only", self.rank, exc)
            with self._cond:
                self._dead = True
                self._cond.notify_all()
            return False
        with self._cond:
            self.group = group
            self.groups_made += 1
            self._cond.notify_all()
        return True

    def _loop(self) -> None:
        _lower_priority()
        while True:
            with self._cond:
                while self.group is None and not self._closing and not self._dead:
                    # no group until the step loop makes one (``mend``): what commits meanwhile is
                    # given up, so that neither ``wait_idle`` nor retention waits for it
                    self._done = self._newest
                    self._cond.notify_all()
                    self._cond.wait()
                if self.group is None:  # closing, or no group could be made anew: nothing more to copy
                    break
                while not self._closing and self._newest == self._done:
                    self._cond.wait()
                vote = self._newest if self._newest != self._done else CLOSING
                self._voted = None if vote == CLOSING else vote
            agreed, broken = torch.tensor([vote], dtype=torch.int64), None
            try:
                dist.all_reduce(agreed, op=dist.ReduceOp.MIN, group=self.group)
            except Exception as exc:  # the group is broken: a new one (``mend``), then the next round
                broken = f"agreeing on the step to copy: {type(exc).__name__}: {exc}"
            if broken is not None:  # (outside the handler: nothing of the failed call is still referenced)
                self._break(broken)
                with self._cond:
                    self._voted = None
                    if self._closing:  # no new round at close: what was copied stays
                        break
                continue
            step = int(agreed[0])
            if step == CLOSING:  # some rank has nothing newer and is closing: so has every rank
                break
            if self._done is None or step > self._done:
                with self._cond:
                    self._copying, self._voted = step, None
                try:
                    self._replicate(step)
                finally:
                    with self._cond:
                        self._copying = None
            with self._cond:
                self._voted = None
                self._done = max(step, self._done if self._done is not None else step)
                self._cond.notify_all()
        with self._cond:
            self._voted, self._copying = None, None
            self._done = self._newest
            self._cond.notify_all()

    def _replicate(self, step: int) -> None:
        """One round: copy ``step`` to the ring and agree on how it went. A failed copy is agreed
        (its partial replicas removed everywhere); a failed collective breaks the group (``_remake``)."""
        name = layout.step_name(step)
        t0 = time.perf_counter()
        got, problem, broken = 0, None, None
        try:
            got = replicas.replicate(self.store, name, self.rank, self.ring, self.group, self._pace)
        except replicas.CopyFailed as exc:  # the protocol ran to its end: the group is fine
            problem = f"rank {self.rank} on {self.host}: {exc}"
        except Exception as exc:  # a message could not be sent or received: the group is not
            broken = f"rank {self.rank} on {self.host}: {type(exc).__name__}: {exc}"
        failed = torch.tensor([1 if problem else 0], dtype=torch.uint8)
        if broken is None:
            try:
                dist.all_reduce(failed, op=dist.ReduceOp.MAX, group=self.group)
            except Exception as exc:  # a peer is gone or timed out: what arrived here whole stays
                broken = f"the other ranks could not be asked how their copies went: {exc}"
        if broken is not None:  # (outside the handlers: nothing of the failed calls is still referenced)
            self._give_up(step, broken)
            return
        took = time.perf_counter() - t0
        if failed[0]:
            self.failed_rounds += 1
            self.on_failure(name)
            if problem or self.is_main:
                log.warning("peer replicas of local step %d failed (%s): the step is held by its own "
                            "nodes only; the next local step is copied as usual", step, problem or "on another rank")
            return
        self.replicated += 1
        self.last = {"step": step, "bytes": got, "seconds": took}
        if self.is_main:
            log.info("local step %d replicated to %d peer node(s): %.1f MB received by rank 0 in %.2f s",
                     step, len(self.ring.targets), got / 1e6, took)

    def _give_up(self, step: int, why: str) -> None:
        """A collective of the round for ``step`` failed: the step is given up (replicas of it that
        arrived whole here stay: each file was committed, the marker last, and restore checks them
        again), and the group is given up (``_break``)."""
        self.failed_rounds += 1
        try:
            self.on_failure(layout.step_name(step))
        except Exception as exc:  # housekeeping: the next round must run regardless
            log.warning("removing the partial replicas of local step %d on rank %d failed: %s", step, self.rank, exc)
        self._break(f"copying local step {step}: {why}")

    def _break(self, why: str) -> None:
        """This rank's group is unusable after a failed collective (its peers' messages may be
        half delivered): destroy it, so that the peers' operations on it fail as well and they
        give up theirs too (each rank once per broken group, so the new groups match), and wait
        for the step loop to make a new one (``mend``). Said on every rank (each saw its own failure)."""
        log.warning("peer replicas on rank %d (%s): %s; their group is made anew at the next local save "
                    "and the next round runs on it", self.rank, self.host, why)
        release_side_group(self.group, "replica")
        with self._cond:
            self.group = None
            self._cond.notify_all()
