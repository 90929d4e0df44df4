"""One writer per run: a lease file that a live job renews and a second job respects.

A job submitted twice, or a requeue that overlaps the old allocation, would otherwise write the
same checkpoint directory from two jobs at once. Rank 0 takes a lease at start, in the run
directory and in the checkpoint location (POSIX or S3: a small JSON object)::

    {"lineage", "job", "host", "pid", "started", "heartbeat"}

and a background thread renews ``heartbeat`` every ``min(timeout / 4, 30)`` seconds. Another job finding
a lease whose heartbeat is younger than ``ckpt.lease_timeout_s`` stops at start in one line naming
the holder. A holder on this host whose process is gone (kill -9, torchrun's ``--max-restarts``) is
taken over at once; an earlier attempt of the same job (the same Slurm job id, torchrun rendezvous
id or PyTorchJob: a requeue, a re-created pod) once it has stopped renewing (1.5 renewals: it may
still be saving on its way out); a lease whose holder stopped
heartbeating for longer than the timeout is taken over, and the log says so, so a requeue after a
node loss never waits for a human.

The lease changes only by compare-and-swap (``Store.create_exclusive``, ``replace_if``,
``delete_if``; on S3 conditional requests, ``If-None-Match: *`` and ``If-Match: ETag``; on POSIX
an exclusive hard link, and a compare and rename under a lock file): a job takes a free lease only
if it is still absent, takes one over, renews or releases it only if it is still the very version it
read. So of two simultaneous starts exactly one holds the lease and the other stops, however late a
throttled request lands; a renewal after another job took over fails, and the holder learns it lost;
a release never removes another holder's lease.

Wall clocks of different hosts are compared (``heartbeat``): NTP keeps them within far less than
any sensible timeout.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from dataclasses import asdict, dataclass

from podtrain.ckpt.store import NotFound, StorageError, read_json
from podtrain.storage.errors import AccessDenied
from podtrain.errors import UserError

log = logging.getLogger("podtrain.checkpoint")

LEASE_FILE = "lease"
RELEASED = 0.0
"""The heartbeat of a lease its holder released where the storage refuses deletes: free at once."""
CLAIM_TRIES = 5
"""Rounds of ``claim_once`` (each: create, else read the winner): more are needed only while the
object keeps vanishing between the two (someone deleting it)."""


@dataclass
class LeaseRecord:
    """Who holds a lease, and since when it was last renewed (wall-clock seconds)."""

    lineage: str
    job: str
    host: str
    pid: int
    started: float
    heartbeat: float

    def same_holder(self, other: "LeaseRecord") -> bool:
        """The same process wrote both (the record a renewal expects to find)."""
        return (self.job, self.host, self.pid, self.started) == (other.job, other.host, other.pid, other.started)

    def describe(self, now: float) -> str:
        """``job J on host H (pid P, lineage L), last heartbeat Ns ago``; the lineage is left out
        while it is not known yet (a lease taken before the run named itself)."""
        lineage = f", lineage {self.lineage}" if self.lineage else ""
        return (f"job {self.job or '?'} on host {self.host} (pid {self.pid}{lineage}), last "
                f"heartbeat {max(0.0, now - self.heartbeat):.0f} s ago")


def read_lease(store) -> tuple[LeaseRecord | None, str | None]:
    """The lease in ``store`` and its version tag (one read: on S3 one GET): ``(None, None)`` when
    absent, ``(None, tag)`` when damaged (a torn write counts as free, and a compare-and-swap on
    ``tag`` replaces it)."""
    try:
        data, tag = store.read_versioned(LEASE_FILE)
    except (NotFound, FileNotFoundError):
        return None, None
    try:
        raw = read_json(store, LEASE_FILE, data)
        return LeaseRecord(**{k: raw[k] for k in LeaseRecord.__dataclass_fields__}), tag
    except (ValueError, KeyError, TypeError):
        log.warning("%s/%s is damaged: treated as free", store.url, LEASE_FILE)
        return None, tag


def _alive(pid: int) -> bool:
    """Whether process ``pid`` exists on this host."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class Lease:
    """Rank 0's leases on a run's locations: ``acquire`` at start, renewed in the background,
    ``release`` at the end (see the module docstring)."""

    def __init__(self, stores: list, lineage: str, job: str, host: str, timeout_s: float) -> None:
        """``stores``: the locations to hold (the run directory, the checkpoint location)."""
        self.stores = stores
        self.timeout_s = float(timeout_s)
        now = time.time()
        self.record = LeaseRecord(lineage, job, host, os.getpid(), now, now)
        self.lost: str | None = None
        """Set when a renewal found another holder: why (the run should stop)."""
        self._tags: dict[str, str] = {}
        """Per location (its url): the version tag of the lease this job wrote last there."""
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def renew_s(self) -> float:
        """Seconds between renewals: a quarter of the timeout, at most 30 s."""
        return max(min(self.timeout_s / 4, 30.0), 0.05)

    def acquire(self) -> None:
        """Take every lease or raise ``UserError`` naming the live holder (nothing is left taken);
        then renew them in the background."""
        taken = []
        try:
            for store in self.stores:
                self._take(store)
                taken.append(store)
        except BaseException:
            for store in taken:
                self._drop(store)
            raise
        self._thread = threading.Thread(target=self._renew_loop, name="podtrain-lease", daemon=True)
        self._thread.start()

    def extend(self, store) -> None:
        """Take one more location's lease (the checkpoint location, once the run knows it)."""
        self._take(store)
        self.stores = [*self.stores, store]

    def _take(self, store) -> None:
        """Take ``store``'s lease by compare-and-swap on the version just read (or create it where
        there is none); ``UserError`` when a live holder has it or another job won the race."""
        now = time.time()
        held, tag = read_lease(store)
        if held is not None and not held.same_holder(self.record):
            age = now - held.heartbeat
            if held.heartbeat == RELEASED:
                log.info("%s/%s: taking the lease released by %s", store.url, LEASE_FILE, held.describe(now))
            elif held.host == self.record.host and not _alive(held.pid):
                log.info("%s/%s: taking the lease over from a process on this host that is gone (%s)",
                         store.url, LEASE_FILE, held.describe(now))
            elif self.record.job and held.job == self.record.job:
                # An earlier attempt of this job (a requeue, a restarted pod) may still be saving
                # on its way out: wait until it stops renewing, never write beside it.
                tag = self._wait_for_lapse(store, held)
            elif age <= self.timeout_s:
                raise UserError(
                    f"{store.url} is in use by {held.describe(now)}: two jobs must not write one run. "
                    f"Stop that job, give this one its own run.dir and ckpt.dir, or, if that job is "
                    f"gone, wait {self.timeout_s - age:.0f} s for its lease to expire "
                    f"(ckpt.lease_timeout_s={self.timeout_s:g})")
            else:
                log.warning("%s/%s: taking over the lease of %s (older than ckpt.lease_timeout_s=%g)",
                            store.url, LEASE_FILE, held.describe(now), self.timeout_s)
        # Exactly one writer wins each of these: a lease created or changed since the read above
        # (a job starting at the same moment, however late its request lands) makes ours fail.
        new = store.create_exclusive(LEASE_FILE, self._body()) if tag is None else \
            store.replace_if(LEASE_FILE, self._body(), tag)
        if new is None:
            back, _ = read_lease(store)
            raise UserError(f"{store.url} was claimed at the same moment by "
                            f"{back.describe(time.time()) if back else 'another job'}: two jobs must not "
                            "write one run; this one stops")
        self._tags[store.url] = new

    def _wait_for_lapse(self, store, held: LeaseRecord) -> str | None:
        """Wait until an earlier attempt of this job has stopped renewing (1.5 renewals), at most
        the timeout; an attempt still renewing then is another live process of this job: refused.
        Returns the version tag of the lease as last read (None: it is gone), to take it over by."""
        lapse = 1.5 * self.renew_s
        deadline = time.time() + self.timeout_s
        said = False
        while True:
            now = time.time()
            current, tag = read_lease(store)
            if current is None or current.same_holder(self.record) or now - current.heartbeat > lapse:
                log.info("%s/%s: taking the lease over from an earlier attempt of this job (%s)",
                         store.url, LEASE_FILE, held.describe(now))
                return tag
            if now > deadline:
                raise UserError(f"{store.url} is still renewed by {current.describe(now)}, another process "
                                "of this same job: two attempts must not write one run")
            if not said:
                log.info("%s/%s: an earlier attempt of this job renewed the lease %.0f s ago: waiting up "
                         "to %.0f s for it to stop", store.url, LEASE_FILE, now - current.heartbeat, lapse)
                said = True
            time.sleep(min(1.0, lapse / 4))

    def still_held(self) -> str | None:
        """Re-read every lease (rank 0, just before a commit): None while this job holds them all,
        else why not. A job that lost its run must not commit or prune anything in it."""
        for store in self.stores:
            held, _ = read_lease(store)
            if held is None or not held.same_holder(self.record):
                reason = f"{store.url}: the lease is now held by {held.describe(time.time()) if held else 'nobody'}"
                self.lost = self.lost or reason
                return reason
        return None

    def _body(self) -> bytes:
        """The lease record with a new heartbeat, as written (unique to this holder and moment)."""
        self.record.heartbeat = time.time()
        return json.dumps(asdict(self.record)).encode()

    def _renew_loop(self) -> None:
        while not self._stop.wait(self.renew_s):
            for store in self.stores:
                self._renew(store)

    def _renew(self, store) -> None:
        """Renew one lease by compare-and-swap on the version this job wrote last: it fails once
        another job took the lease over (or removed it), and the lease is then lost (said once)."""
        try:
            tag = self._tags.get(store.url)
            new = store.replace_if(LEASE_FILE, self._body(), tag) if tag is not None else None
            if new is None:
                held, current = read_lease(store)
                if held is not None and held.same_holder(self.record):
                    # our own renewal landed although its answer was lost (an outage): adopt it
                    new = store.replace_if(LEASE_FILE, self._body(), current)
                if new is None:
                    if self.lost is None:
                        held, current = read_lease(store)
                        self.lost = (f"{store.url}: the lease was taken over by {held.describe(time.time())}"
                                     if held is not None else
                                     f"{store.url}: the lease was removed by another job" if current is None else
                                     f"{store.url}: the lease was replaced by another job (unreadable)")
                        log.error("%s: this job no longer owns the run and will stop", self.lost)
                    return
            self._tags[store.url] = new
        except (StorageError, OSError) as exc:  # an outage: the next renewal tries again
            log.warning("renewing the lease %s/%s failed: %s", store.url, LEASE_FILE, exc)

    def release(self, deadline_s: float | None = None, drop: bool = True) -> bool:
        """Stop renewing and remove the leases this job still holds. ``deadline_s`` (a stop
        signal's grace period): the most seconds this may take; a renewal or removal still waiting
        on the storage then is left to a daemon thread, and the lease expires by itself. False
        when a thread was left so, True when everything ended. ``drop=False``: stop renewing
        only, leaving the lease to expire (a writer of this job may still be writing)."""
        end = None if deadline_s is None else time.monotonic() + deadline_s

        def left() -> float | None:
            return None if end is None else max(0.0, end - time.monotonic())

        self._stop.set()
        if self._thread is not None:
            self._thread.join(left())
            if self._thread.is_alive():
                log.warning("releasing the lease: a renewal is still waiting on the storage after %.1f s; "
                            "left to expire by itself", deadline_s)
                return False
            self._thread = None
        if not drop:
            log.warning("the lease is left to expire by itself (within %.0f s), not released: a checkpoint "
                        "writer of this job may still be writing", self.timeout_s)
            return True
        dropper = threading.Thread(target=lambda: [self._drop(store) for store in self.stores],
                                   name="podtrain-lease-release", daemon=True)
        dropper.start()
        dropper.join(left())
        if dropper.is_alive():
            log.warning("releasing the lease: the storage did not answer within %.1f s; left to expire by "
                        "itself", deadline_s)
            return False
        return True

    def _drop(self, store) -> None:
        """Remove ``store``'s lease if it is this job's, by compare-and-swap on the version read:
        a lease another job took over meanwhile is never removed."""
        try:
            held, tag = read_lease(store)
            if held is None or not held.same_holder(self.record):
                return
            try:
                removed = store.delete_if(LEASE_FILE, tag)
            except AccessDenied:
                # A bucket that refuses deletes (object lock, no s3:DeleteObject) still takes writes:
                # the lease is marked released (heartbeat 0, as old as can be), so the next job takes
                # it at once instead of waiting ckpt.lease_timeout_s for it to expire.
                removed = store.replace_if(LEASE_FILE, json.dumps({**asdict(self.record), "heartbeat": RELEASED}).encode(),
                                           tag) is not None
                log.info("%s/%s: the storage refuses deletes; the lease is marked released instead",
                         store.url, LEASE_FILE)
            if not removed:
                log.warning("%s/%s changed while it was being released: left to its new holder",
                            store.url, LEASE_FILE)
        except (StorageError, OSError) as exc:
            log.warning("releasing the lease %s/%s failed: %s (it expires by itself)", store.url, LEASE_FILE, exc)


def claim_once(store, name: str, body: dict) -> dict:
    """Create the small JSON object ``name`` unless it exists; returns the one that stands (ours, or
    the first claimant's). A compare-and-swap (``Store.create_exclusive``: a hard link on POSIX,
    ``If-None-Match: *`` on S3): of simultaneous claimants exactly one creates it, however late a
    throttled request lands, and every one of them returns that claim. A damaged object is replaced
    only if it is still the damaged version read (``replace_if``)."""
    data = json.dumps(body).encode()
    for _ in range(CLAIM_TRIES):
        if store.create_exclusive(name, data) is not None:
            return body
        try:
            held, tag = store.read_versioned(name)
        except (NotFound, FileNotFoundError):  # removed between the two: claim again
            continue
        standing = read_json(store, name, held, error=None)
        if standing is not None:
            return standing
        log.warning("%s/%s is damaged: claimed anew", store.url, name)
        if store.replace_if(name, data, tag) is not None:
            return body
    raise StorageError(store.where(name), f"could not be claimed in {CLAIM_TRIES} tries: it keeps changing "
                                          "(another process is creating and removing it)")

