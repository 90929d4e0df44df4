"""The collective record: this rank's last collectives, for the hang watchdog's dumps.

``CollectiveRecorder`` is a small ring buffer every ``DistContext`` owns; podtrain's own
collectives (``DistContext`` helpers, the stop-signal agreement) record themselves in it, and the
``Stepper`` records each step's DDP gradient sync as one entry (not one per bucket: DDP keeps its
native C++ AllReduce, no Python comm hook runs on the hot path). ``watchdog.Watchdog`` dumps the
record when a rank hangs.

An entry is done when its ``with`` block ends, or, for asynchronous work, when its *probe* says
so: a ``dist.Work`` (``is_completed()``) or a CUDA event recorded after the work
(``query()``). That is what makes the record true on NCCL, where a collective call returns once
the work is queued: the entry stays ``in_flight`` until the GPU has really finished it, and the
watchdog fires on a tracked entry that stays unfinished past its deadline (``stuck``).
"""

from __future__ import annotations

import collections
import os
import sys
import time
from typing import Any

import torch


def _caller(depth: int) -> str:
    """``file:line in function`` of the frame ``depth`` levels above the caller of this."""
    try:
        frame = sys._getframe(depth + 1)
    except ValueError:
        return "?"
    code = frame.f_code
    return f"{os.path.basename(code.co_filename)}:{frame.f_lineno} in {code.co_name}"


class _Pending:
    """One recorded collective; a context manager that marks it done on exit, or ``done()`` /
    ``track(probe)`` for work that finishes later."""

    __slots__ = ("entry", "_recorder")

    def __init__(self, recorder: "CollectiveRecorder", entry: dict[str, Any]):
        self._recorder = recorder
        self.entry = entry

    def __enter__(self) -> "_Pending":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None and "probe" in self.entry:
            return  # queued, not finished (NCCL): the probe tells when it is
        self._recorder.finish(self.entry, error=exc_type is not None)

    def done(self) -> None:
        """The collective finished now (seen by the host)."""
        self._recorder.finish(self.entry)

    def track(self, probe: Any) -> None:
        """The collective was queued; ``probe`` (a ``dist.Work`` or a ``torch.cuda.Event``
        recorded after it) tells when it really finished. One attribute store: no sync."""
        self.entry["probe"] = probe


def _probe_done(probe: Any) -> bool:
    """Whether asynchronous work finished: ``dist.Work.is_completed`` or ``Event.query``."""
    try:
        check = getattr(probe, "is_completed", None) or probe.query
        return bool(check())
    except Exception:  # a failed work object is finished, with an error the rank will raise
        return True


class CollectiveRecorder:
    """A small ring buffer of this rank's last collectives (time, op, sizes, dtype, caller).

    Appending is a deque append under the GIL: no lock, so recording costs about a microsecond.
    The watchdog thread only copies the deque. One recorder per ``DistContext`` (no global state).
    """

    def __init__(self, capacity: int = 64):
        self._entries: collections.deque[dict[str, Any]] = collections.deque(maxlen=capacity)
        self._seq = 0

    def begin(self, op: str, tensor: torch.Tensor | None = None, *, group_size: int | None = None,
              caller: str | None = None, skip: int = 1, nbytes: int | None = None) -> _Pending:
        """Record that ``op`` starts now; use as ``with recorder.begin("all_reduce", t): ...``.

        ``skip`` is how many frames above the caller of ``begin`` name the real caller (1 skips
        a helper such as ``DistContext.all_reduce_sum``, so the record names its user).
        """
        self._seq += 1
        entry: dict[str, Any] = {
            "seq": self._seq, "op": op, "start": time.time(), "end": None,
            "caller": caller if caller is not None else _caller(skip + 1),
        }
        if tensor is not None:
            entry["shape"] = list(tensor.shape)
            entry["dtype"] = str(tensor.dtype).removeprefix("torch.")
            entry["bytes"] = tensor.numel() * tensor.element_size()
        elif nbytes is not None:
            entry["bytes"] = nbytes
        if group_size is not None:
            entry["group_size"] = group_size
        self._entries.append(entry)
        return _Pending(self, entry)

    def finish(self, entry: dict[str, Any], error: bool = False) -> None:
        """Mark a recorded collective as completed (or failed)."""
        entry["end"] = time.time()
        if error:
            entry["error"] = True

    def _entries_now(self) -> list[dict[str, Any]]:
        for _ in range(5):
            try:
                return list(self._entries)
            except RuntimeError:  # the deque changed under us; try again
                continue
        return []

    def snapshot(self) -> list[dict[str, Any]]:
        """A copy of the recorded collectives, oldest first, with a ``state`` for each."""
        now = time.time()
        out = []
        for entry in self._entries_now():
            e = dict(entry)
            probe = e.pop("probe", None)
            if e["end"] is None and probe is not None and _probe_done(probe):
                e["state"] = "done"  # finished on the device/backend; the host never waited
            else:
                e["state"] = "in_flight" if e["end"] is None else "done"
            e["age_s"] = round(now - e["start"], 3)
            out.append(e)
        return out

    def stuck(self, older_than_s: float) -> dict[str, Any] | None:
        """The oldest tracked (asynchronous) collective still unfinished ``older_than_s`` after
        it started, or None: how the watchdog sees a hung NCCL collective while the host, which
        only queued it, keeps running. Polls the probes; called by the watchdog thread only."""
        limit = time.time() - older_than_s
        for entry in self._entries_now():
            probe = entry.get("probe")
            if (probe is not None and entry["end"] is None and entry["start"] < limit
                    and not _probe_done(probe)):
                return {k: v for k, v in entry.items() if k != "probe"}
        return None
