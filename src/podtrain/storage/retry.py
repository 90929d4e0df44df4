"""The one retry policy of every store operation: capped exponential backoff with full jitter, within
a time budget per operation, that a stop signal can cut short.

    policy = RetryPolicy(budget_s=60)          # or the store's own: store.retry
    value = policy.run(url, op, classify)      # op() until it succeeds, fails for good, or time is up
    policy.abandon()                           # from any thread: sleeping retries end now, no new one starts

    token = Cancel()                           # one job's own stop (a save superseded by a newer one)
    with cancellation(token):                  # this thread's operations, under any policy, heed it
        store.write_bytes(...)
    token.cancel()                             # from any thread: that job's retries end, the store's others go on

What is transient (worth another try) is the backend's call: ``classify`` turns its exceptions into
``StorageError``s, and a ``Transient`` one is retried; anything else is raised at once. When the
budget (or ``max_attempts``) is spent, or after ``abandon()``, the last failure is raised as a
``Transient`` saying so, which exits the process with ``STORAGE_OUTAGE_EXIT_CODE`` (203, a code
schedulers retry).

Why a token as well as ``abandon``: ``abandon`` is for good (the process is stopping), but a
checkpoint save stuck in an outage must be given up when the next save is due, and that next save
runs on the same store and policy (the newest state wins, ``docs/checkpoints.md``). A ``Cancel``
token belongs to one job: the operations of the thread running it (``cancellation``, a context
variable, so other threads and later jobs never see it) stop retrying once it is cancelled, and
the store's policy stays usable. A thread the job starts (a pool of deletes) does not inherit it.

Why full jitter: after an outage every rank of every job retries at once; spreading each wait
uniformly over [0, min(cap, base * 2**n)] spreads the herd (AWS's backoff study). Why a time
budget rather than a number of tries: what a caller can afford is time (a save has until the next
one; a data read holds the step), and a try may itself take long (the CRT client retries each
HTTP request a few times inside it, ``s3_client.CRT_MAX_ATTEMPTS``).
"""

from __future__ import annotations

import random
import threading
import time
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Callable, Iterator, TypeVar

from podtrain.storage.errors import StorageError, Transient

T = TypeVar("T")

BASE_S = 0.2
"""First backoff ceiling (the wait is uniform in [0, ceiling]); it doubles with every try."""
CAP_S = 20.0
"""Largest backoff ceiling: during an outage a store tries about every 10 s on average."""
BUDGET_S = 240.0
"""Time one operation may spend retrying: long enough to ride out an S3 SlowDown storm or a few
minutes of 503s (a 150 s outage is survived), short enough that a dead endpoint ends the job with
203 (requeued) rather than holding the GPUs."""


class Cancel:
    """One job's cancellation (a save, say): ``cancel()`` from any thread makes every storage
    operation run under ``cancellation(token)`` stop retrying, whatever its store's policy:
    one sleeping between tries wakes now, none starts another try, a long write stops at its next
    slice (``RetryPolicy.check``); each raises ``Transient(url, "cancelled ...")``. A try in
    flight is not interrupted. Final, like ``abandon``, but only for this job."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._wakers: set[threading.Event] = set()
        self.reason: str | None = None
        """Why it was cancelled (None: not cancelled)."""

    def cancel(self, reason: str = "a newer save replaced it") -> None:
        """Stop this job's retries (the first reason stays)."""
        with self._lock:
            if self.reason is None:
                self.reason = reason
            wakers = list(self._wakers)
        for wake in wakers:
            wake.set()

    @property
    def cancelled(self) -> bool:
        """Whether ``cancel()`` was called."""
        return self.reason is not None

    def _watch(self, wake: threading.Event, on: bool) -> None:
        with self._lock:
            (self._wakers.add if on else self._wakers.discard)(wake)
            if on and self.reason is not None:
                wake.set()


_token: ContextVar[Cancel | None] = ContextVar("podtrain_retry_cancel", default=None)
"""The ``Cancel`` of the job this thread (context) runs now, or None: see ``cancellation``."""


@contextmanager
def cancellation(token: Cancel | None) -> Iterator[Cancel | None]:
    """Within the block, this thread's storage operations heed ``token`` (None: none). A context
    variable rather than a policy attribute: the store and its policy are shared by the job that
    is cancelled and the one that replaces it, on different threads or one after the other."""
    reset = _token.set(token)
    try:
        yield token
    finally:
        _token.reset(reset)


@dataclass
class RetryPolicy:
    """How a store retries transient failures. One per store (``store.retry``); thread-safe.

    Waits are uniform in ``[0, min(cap_s, base_s * 2**n)]`` before try ``n + 2``. An operation
    stops retrying when the next wait would end past ``budget_s`` after its first try, after
    ``max_attempts`` tries (None: the budget alone bounds it), or once ``abandon()`` was called.
    A try in flight is not interrupted: an operation can end up to one try's duration after that.
    """

    # The defaults are the module's constants as they are when a policy is made.
    base_s: float = field(default_factory=lambda: BASE_S)
    """First backoff ceiling, seconds (default ``BASE_S``)."""
    cap_s: float = field(default_factory=lambda: CAP_S)
    """Largest backoff ceiling, seconds (default ``CAP_S``)."""
    budget_s: float = field(default_factory=lambda: BUDGET_S)
    """Seconds one operation may spend from its first try to the start of its last (default ``BUDGET_S``)."""
    max_attempts: int | None = None
    """Most tries of one operation (None: only ``budget_s`` bounds them)."""
    seed: int | None = None
    """Seed of the jitter (None: from the OS); tests pin it."""
    _abandoned: threading.Event = field(default_factory=threading.Event, init=False, repr=False)
    _local: threading.local = field(default_factory=threading.local, init=False, repr=False)
    _wakers: set = field(default_factory=set, init=False, repr=False, compare=False)
    """Events of the operations sleeping between tries now (``abandon`` sets them)."""

    failing_since: float | None = field(default=None, compare=False)
    """When (monotonic) this store's operations began failing transiently, until one succeeds
    (None: the last operation succeeded): how long an outage has lasted, for the checkpointer.
    It outlives the operation that set it (one given up or cancelled), so it does not say whether
    anything is retrying now: ``retrying`` does."""

    def __post_init__(self):
        if self.base_s <= 0 or self.cap_s < self.base_s or self.budget_s < 0:
            raise ValueError(f"RetryPolicy needs 0 < base_s <= cap_s and budget_s >= 0, not {self}")
        if self.max_attempts is not None and self.max_attempts < 1:
            raise ValueError(f"RetryPolicy.max_attempts must be at least 1, not {self.max_attempts}")
        self._rng = random.Random(self.seed)
        self._rng_lock = threading.Lock()
        self._wakers_lock = threading.Lock()
        self._retrying = 0  # operations now between a failed try and their end (under _wakers_lock)

    def __getstate__(self):  # a store crosses into DataLoader workers: locks and events do not pickle
        state = {k: v for k, v in self.__dict__.items()
                 if k not in ("_abandoned", "_local", "_rng", "_rng_lock", "_wakers", "_wakers_lock", "_retrying")}
        state["_was_abandoned"] = self._abandoned.is_set()
        return state

    def __setstate__(self, state):
        abandoned = state.pop("_was_abandoned", False)
        self.__dict__.update(state)
        self._abandoned, self._local, self._wakers = threading.Event(), threading.local(), set()
        if abandoned:
            self._abandoned.set()
        self.__post_init__()

    # -- stopping ------------------------------------------------------------------------------
    def abandon(self) -> None:
        """Stop retrying, from any thread (e.g. a SIGTERM handler's): an operation sleeping between
        tries wakes now and raises ``Transient(url, "abandoned ...")``, and no operation of this
        policy starts another try. Final: a policy once abandoned stays so."""
        self._abandoned.set()
        with self._wakers_lock:
            wakers = list(self._wakers)
        for wake in wakers:
            wake.set()

    @property
    def retrying(self) -> bool:
        """Whether an operation of this policy (any thread) has failed a try and has not ended yet:
        it is backing off or trying again now. A save whose storage merely failed earlier (an
        outage's last, cancelled operation) is not retrying."""
        with self._wakers_lock:
            return self._retrying > 0

    @property
    def abandoned(self) -> bool:
        """Whether ``abandon()`` was called."""
        return self._abandoned.is_set()

    def check(self, url: str) -> None:
        """Raise ``Transient(url, "abandoned ...")`` if ``abandon()`` was called, or ``Transient(url,
        "cancelled ...")`` if this thread's job was cancelled (``cancellation``); long writes call
        this between slices, so a stop signal or a newer save does not wait for the whole upload."""
        if self._abandoned.is_set():
            raise Transient(url, "abandoned: the storage operation was stopped (a stop signal) before it finished")
        token = _token.get()
        if token is not None and token.cancelled:
            raise Transient(url, f"cancelled: the storage operation was stopped before it finished ({token.reason})")

    # -- retrying ------------------------------------------------------------------------------
    def delay(self, tries: int) -> float:
        """The (random) wait after ``tries`` failed tries: uniform in [0, min(cap, base * 2**(tries-1))]."""
        ceiling = min(self.cap_s, self.base_s * 2.0 ** min(tries - 1, 60))
        with self._rng_lock:
            return self._rng.uniform(0.0, ceiling)

    def run(self, url: str, op: Callable[[], T],
            classify: Callable[[Exception], StorageError | None] = lambda exc: None) -> T:
        """``op()``, tried again after each ``Transient`` failure until the policy gives up.

        ``classify`` maps the backend's exceptions to a ``StorageError`` (None: not a storage
        failure, re-raised as it is); a ``StorageError`` raised by ``op`` itself counts as is.
        Permanent failures raise at once. Inside another ``run`` of this policy on the same thread
        (an upload's creation within the upload's retry), ``op`` is tried once and the outer
        operation does the retrying, so budgets never multiply.
        """
        if getattr(self._local, "depth", 0):
            return self._once(op, classify)
        self._local.depth = 1
        counted = False  # this operation is in self._retrying
        try:
            start, tries = time.monotonic(), 0
            while True:
                self.check(url)
                tries += 1
                try:
                    result = self._once(op, classify)
                    self.failing_since = None
                    return result
                except Transient as exc:
                    err = exc
                    if self.failing_since is None:
                        self.failing_since = time.monotonic()
                    if not counted:
                        with self._wakers_lock:
                            self._retrying += 1
                            counted = True
                self._wait(url, err, tries, start)
        finally:
            self._local.depth = 0
            if counted:
                with self._wakers_lock:
                    self._retrying -= 1

    @staticmethod
    def _once(op: Callable[[], T], classify: Callable[[Exception], StorageError | None]) -> T:
        try:
            return op()
        except StorageError:
            raise
        except Exception as exc:
            err = classify(exc)
            if err is None:
                raise
        raise err from None

    def _wait(self, url: str, err: Transient, tries: int, start: float) -> None:
        """Sleep before try ``tries + 1``, or raise the final ``Transient`` (spent or abandoned)."""
        elapsed = time.monotonic() - start
        pause = self.delay(tries)
        if (self.max_attempts is not None and tries >= self.max_attempts) or elapsed + pause > self.budget_s:
            raise Transient(err.url, f"{err.cause} (gave up after {tries} tries in {elapsed:.1f} s: "
                                     f"the storage retry budget is {self.budget_s:g} s)") from None
        token = _token.get()
        wake = threading.Event()  # set by abandon() or by the job's cancel(), whichever comes first
        with self._wakers_lock:
            self._wakers.add(wake)
        if token is not None:
            token._watch(wake, True)
        try:
            if not self._abandoned.is_set():
                wake.wait(pause)
        finally:
            with self._wakers_lock:
                self._wakers.discard(wake)
            if token is not None:
                token._watch(wake, False)
        if self._abandoned.is_set():
            raise Transient(err.url, f"{err.cause} (abandoned after {tries} tries: the storage operation "
                                     "was stopped by a stop signal)") from None
        if token is not None and token.cancelled:
            raise Transient(err.url, f"{err.cause} (cancelled after {tries} tries: {token.reason})") from None


@dataclass(frozen=True)
class Deadline:
    """One moment (``time.monotonic``) that a sequence of waits shares: each waits ``remaining()``
    at most, so the sequence as a whole ends by ``at`` however the time is split among them (the
    stop path after a signal: every tier's save, the writers' threads, the replicas, the lease,
    within ``ckpt.grace_s``). What is still running then is left to its daemon thread."""

    at: float

    @classmethod
    def after(cls, seconds: float) -> "Deadline":
        """The deadline ``seconds`` from now."""
        return cls(time.monotonic() + seconds)

    def remaining(self) -> float:
        """Seconds left (0 once it has passed)."""
        return max(0.0, self.at - time.monotonic())

    @property
    def expired(self) -> bool:
        """Whether it has passed."""
        return time.monotonic() >= self.at

    def sooner(self, seconds: float) -> "Deadline":
        """``seconds`` earlier: a part of the sequence that must leave time for what follows it."""
        return Deadline(self.at - seconds)
