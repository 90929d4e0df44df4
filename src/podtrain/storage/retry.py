"""The one retry policy of every store operation: capped exponential backoff with full jitter, within
a time budget per operation, that a stop signal can cut short.

    policy = RetryPolicy(budget_s=60)          # or the store's own: store.retry
    value = policy.run(url, op, classify)      # op() until it succeeds, fails for good, or time is up
    policy.abandon()                           # from any thread: sleeping retries end now, no new one starts

What is transient (worth another try) is the backend's call: ``classify`` turns its exceptions into
``StorageError``s, and a ``Transient`` one is retried; anything else is raised at once. When the
budget (or ``max_attempts``) is spent, or after ``abandon()``, the last failure is raised as a
``Transient`` saying so, which exits the process with ``STORAGE_OUTAGE_EXIT_CODE`` (203, a code
schedulers retry).

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
from dataclasses import dataclass, field
from typing import Callable, TypeVar

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

    failing_since: float | None = field(default=None, compare=False)
    """When (monotonic) this store's operations began failing transiently, until one succeeds
    (None: the last operation succeeded): how long an outage has lasted, for the checkpointer."""

    def __post_init__(self):
        if self.base_s <= 0 or self.cap_s < self.base_s or self.budget_s < 0:
            raise ValueError(f"RetryPolicy needs 0 < base_s <= cap_s and budget_s >= 0, not {self}")
        if self.max_attempts is not None and self.max_attempts < 1:
            raise ValueError(f"RetryPolicy.max_attempts must be at least 1, not {self.max_attempts}")
        self._rng = random.Random(self.seed)
        self._rng_lock = threading.Lock()

    def __getstate__(self):  # a store crosses into DataLoader workers: locks and events do not pickle
        state = {k: v for k, v in self.__dict__.items() if k not in ("_abandoned", "_local", "_rng", "_rng_lock")}
        state["_was_abandoned"] = self._abandoned.is_set()
        return state

    def __setstate__(self, state):
        abandoned = state.pop("_was_abandoned", False)
        self.__dict__.update(state)
        self._abandoned, self._local = threading.Event(), threading.local()
        if abandoned:
            self._abandoned.set()
        self.__post_init__()

    # -- stopping ------------------------------------------------------------------------------
    def abandon(self) -> None:
        """Stop retrying, from any thread (e.g. a SIGTERM handler's): an operation sleeping between
        tries wakes now and raises ``Transient(url, "abandoned ...")``, and no operation of this
        policy starts another try. Final: a policy once abandoned stays so."""
        self._abandoned.set()

    @property
    def abandoned(self) -> bool:
        """Whether ``abandon()`` was called."""
        return self._abandoned.is_set()

    def check(self, url: str) -> None:
        """Raise ``Transient(url, "abandoned ...")`` if ``abandon()`` was called (long writes call
        this between slices, so a stop signal does not wait for the whole upload)."""
        if self._abandoned.is_set():
            raise Transient(url, "abandoned: the storage operation was stopped (a stop signal) before it finished")

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
                self._wait(url, err, tries, start)
        finally:
            self._local.depth = 0

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
        if self._abandoned.wait(pause):
            raise Transient(err.url, f"{err.cause} (abandoned after {tries} tries: the storage operation "
                                     "was stopped by a stop signal)") from None
