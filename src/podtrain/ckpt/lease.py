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
node loss never waits for a human. Simultaneous starts are settled by reading the lease back after
a short pause: the last writer holds it, the other stops.

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

from podtrain.ckpt.store import NotFound, StorageError
from podtrain.errors import UserError

log = logging.getLogger("podtrain.checkpoint")

LEASE_FILE = "lease"
SETTLE_S = 0.5
"""Pause between writing a lease and reading it back (two jobs starting in the same second)."""


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
        """``job J on host H (pid P), last heartbeat Ns ago``."""
        return (f"job {self.job or '?'} on host {self.host} (pid {self.pid}, lineage {self.lineage}), last "
                f"heartbeat {max(0.0, now - self.heartbeat):.0f} s ago")


def read_lease(store) -> LeaseRecord | None:
    """The lease in ``store``, or None (absent, or unreadable: a torn write counts as absent)."""
    try:
        raw = json.loads(store.read_bytes(LEASE_FILE))
        return LeaseRecord(**{k: raw[k] for k in LeaseRecord.__dataclass_fields__})
    except (NotFound, FileNotFoundError):
        return None
    except (ValueError, KeyError, TypeError, UnicodeDecodeError):
        log.warning("%s/%s is damaged: treated as free", store.url, LEASE_FILE)
        return None


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

    def set_lineage(self, lineage: str) -> None:
        """Name the run in the lease (known only after the run directory's lease is held)."""
        self.record.lineage = lineage

    def _take(self, store) -> None:
        now = time.time()
        held = read_lease(store)
        damaged = held is None and store.exists(LEASE_FILE)
        if held is not None and not held.same_holder(self.record):
            age = now - held.heartbeat
            if held.host == self.record.host and not _alive(held.pid):
                log.info("%s/%s: taking the lease over from a process on this host that is gone (%s)",
                         store.url, LEASE_FILE, held.describe(now))
            elif self.record.job and held.job == self.record.job:
                # An earlier attempt of this job (a requeue, a restarted pod) may still be saving
                # on its way out: wait until it stops renewing, never write beside it.
                self._wait_for_lapse(store, held)
            elif age <= self.timeout_s:
                raise UserError(
                    f"{store.url} is in use by {held.describe(now)}: two jobs must not write one run. "
                    f"Stop that job, give this one its own run.dir and ckpt.dir, or, if that job is "
                    f"gone, wait {self.timeout_s - age:.0f} s for its lease to expire "
                    f"(ckpt.lease_timeout_s={self.timeout_s:g})")
            else:
                log.warning("%s/%s: taking over the lease of %s (older than ckpt.lease_timeout_s=%g)",
                            store.url, LEASE_FILE, held.describe(now), self.timeout_s)
        if held is None and not damaged and store.local_path(LEASE_FILE) is not None:
            if self._create_exclusive(store):  # POSIX: atomic, no pause needed
                return
        else:
            self._write(store)
            time.sleep(SETTLE_S)
        back = read_lease(store)
        if back is None or not back.same_holder(self.record):
            raise UserError(f"{store.url} was claimed at the same moment by "
                            f"{back.describe(time.time()) if back else 'another job'}: two jobs must not "
                            "write one run; this one stops")

    def _wait_for_lapse(self, store, held: LeaseRecord) -> None:
        """Wait until an earlier attempt of this job has stopped renewing (1.5 renewals), at most
        the timeout; an attempt still renewing then is another live process of this job: refused."""
        lapse = 1.5 * self.renew_s
        deadline = time.time() + self.timeout_s
        said = False
        while True:
            now = time.time()
            current = read_lease(store)
            if current is None or current.same_holder(self.record) or now - current.heartbeat > lapse:
                log.info("%s/%s: taking the lease over from an earlier attempt of this job (%s)",
                         store.url, LEASE_FILE, held.describe(now))
                return
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
            held = read_lease(store)
            if held is None or not held.same_holder(self.record):
                reason = f"{store.url}: the lease is now held by {held.describe(time.time()) if held else 'nobody'}"
                self.lost = self.lost or reason
                return reason
        return None

    def _create_exclusive(self, store) -> bool:
        """POSIX: create the lease only if no one else has (a hard link to a complete temporary
        file fails when the name exists); False when another job won the race."""
        path = store.local_path(LEASE_FILE)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{LEASE_FILE}.{os.getpid()}.{threading.get_ident()}.tmp")
        self.record.heartbeat = time.time()
        with open(tmp, "w") as fh:  # complete and durable before it gets its name
            fh.write(json.dumps(asdict(self.record)))
            fh.flush()
            os.fsync(fh.fileno())
        try:
            os.link(tmp, path)
            return True
        except FileExistsError:
            return False
        finally:
            tmp.unlink(missing_ok=True)

    def _write(self, store) -> None:
        self.record.heartbeat = time.time()
        store.write_bytes(LEASE_FILE, json.dumps(asdict(self.record)).encode())

    def _renew_loop(self) -> None:
        while not self._stop.wait(self.renew_s):
            for store in self.stores:
                self._renew(store)

    def _renew(self, store) -> None:
        """Renew one lease; a lease now held by another job is lost (said once)."""
        try:
            held = read_lease(store)
            if held is not None and not held.same_holder(self.record):
                if self.lost is None:
                    self.lost = f"{store.url}: the lease was taken over by {held.describe(time.time())}"
                    log.error("%s: this job no longer owns the run and will stop", self.lost)
                return
            self._write(store)
        except (StorageError, OSError) as exc:  # an outage: the next renewal tries again
            log.warning("renewing the lease %s/%s failed: %s", store.url, LEASE_FILE, exc)

    def release(self) -> None:
        """Stop renewing and remove the leases this job still holds."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        for store in self.stores:
            self._drop(store)

    def _drop(self, store) -> None:
        try:
            held = read_lease(store)
            if held is not None and held.same_holder(self.record):
                store.delete(LEASE_FILE)
        except (StorageError, OSError) as exc:
            log.warning("releasing the lease %s/%s failed: %s (it expires by itself)", store.url, LEASE_FILE, exc)


def claim_once(store, name: str, body: dict) -> dict:
    """Write the small JSON object ``name`` unless it exists; returns the one that stands (ours, or
    the first claimant's). POSIX: an exclusive hard link; S3: write, pause, read back (the last
    writer of a simultaneous pair wins, and both read the same winner)."""
    existing = _read_json(store, name)
    if existing is not None:
        return existing
    path = store.local_path(name)
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
        with open(tmp, "w") as fh:
            fh.write(json.dumps(body))
            fh.flush()
            os.fsync(fh.fileno())
        try:
            os.link(tmp, path)
        except FileExistsError:
            pass
        finally:
            tmp.unlink(missing_ok=True)
    else:
        store.write_bytes(name, json.dumps(body).encode())
        time.sleep(SETTLE_S)
    return _read_json(store, name) or body


def _read_json(store, name: str) -> dict | None:
    try:
        data = json.loads(store.read_bytes(name))
    except (NotFound, FileNotFoundError, ValueError, UnicodeDecodeError):
        return None
    return data if isinstance(data, dict) else None
