"""The collective record: this rank's last collectives, for the hang watchdog's dumps.

``CollectiveRecorder`` is a small ring buffer every ``DistContext`` owns; podtrain's own
collectives (``DistContext`` helpers, the stop-signal agreement) record themselves in it, and
``recording_allreduce_hook``, a DDP comm hook, records each gradient bucket's AllReduce and
measures how long the rank waited for the others (the signal ``train.stragglers`` uses to find a
slow rank). ``watchdog.Watchdog`` dumps the record when a rank hangs.
"""

from __future__ import annotations

import collections
import os
import sys
import time
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook


def _caller(depth: int) -> str:
    """``file:line in function`` of the frame ``depth`` levels above the caller of this."""
    try:
        frame = sys._getframe(depth + 1)
    except ValueError:
        return "?"
    code = frame.f_code
    return f"{os.path.basename(code.co_filename)}:{frame.f_lineno} in {code.co_name}"


class _Pending:
    """One recorded collective; a context manager that marks it done on exit."""

    __slots__ = ("entry", "_recorder")

    def __init__(self, recorder: "CollectiveRecorder", entry: dict[str, Any]):
        self._recorder = recorder
        self.entry = entry

    def __enter__(self) -> "_Pending":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self._recorder.finish(self.entry, error=exc_type is not None)


class CollectiveRecorder:
    """A small ring buffer of this rank's last collectives (time, op, sizes, dtype, caller).

    Appending is a deque append under the GIL: no lock, so recording costs about a microsecond.
    The watchdog thread only copies the deque. One recorder per ``DistContext`` (no global state).
    """

    def __init__(self, capacity: int = 64):
        self._entries: collections.deque[dict[str, Any]] = collections.deque(maxlen=capacity)
        self._seq = 0
        # For the DDP hook: when the last bucket was launched and when the last one finished.
        self._sync_launch = 0.0
        self._sync_finish = 0.0
        self._sync_pending = False

    def begin(self, op: str, tensor: torch.Tensor | None = None, *, group_size: int | None = None,
              caller: str | None = None, skip: int = 1) -> _Pending:
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
        if group_size is not None:
            entry["group_size"] = group_size
        self._entries.append(entry)
        return _Pending(self, entry)

    def finish(self, entry: dict[str, Any], error: bool = False) -> None:
        """Mark a recorded collective as completed (or failed)."""
        entry["end"] = time.time()
        if error:
            entry["error"] = True

    def snapshot(self) -> list[dict[str, Any]]:
        """A copy of the recorded collectives, oldest first, with a ``state`` for each."""
        for _ in range(5):
            try:
                entries = [dict(e) for e in list(self._entries)]
                break
            except RuntimeError:  # the deque changed under us; try again
                continue
        else:
            entries = []
        now = time.time()
        for e in entries:
            e["state"] = "in_flight" if e["end"] is None else "done"
            e["age_s"] = round(now - e["start"], 3)
        return entries

    # --- DDP comm hook bookkeeping -------------------------------------------------------------
    def _bucket_launched(self) -> None:
        self._sync_launch = time.perf_counter()
        self._sync_pending = True

    def _bucket_finished(self) -> None:
        self._sync_finish = time.perf_counter()

    def pop_sync_wait(self) -> float:
        """Seconds the last gradient sync kept this rank waiting after its backward finished.

        Measured by ``recording_allreduce_hook`` as the time from the last bucket's launch (the
        end of backward) to the last bucket's completion; 0.0 when no sync happened since the
        last call. A fast rank waits for the slow one, so the straggler is the rank that waits
        least. Reads two floats: no host sync. On CUDA the hook's future completes when the work
        is enqueued, so this reads ~0 there.
        """
        if not self._sync_pending:
            return 0.0
        self._sync_pending = False
        return max(0.0, self._sync_finish - self._sync_launch)


def recording_allreduce_hook(state, bucket):  # DDP rejects annotations it cannot match
    """DDP comm hook: record the bucket's AllReduce, then run DDP's default AllReduce.

    ``state`` is a ``HookState``, ``bucket`` a ``dist.GradBucket``; returns the
    ``Future[Tensor]`` DDP waits on. Register with ``register_recording_hook``; the gradients are
    identical to DDP's default.
    """
    recorder = state.recorder
    pending = recorder.begin("all_reduce", bucket.buffer(), group_size=state.group_size,
                             caller=f"DDP gradient bucket {bucket.index()}")
    recorder._bucket_launched()
    fut = allreduce_hook(state.process_group, bucket)

    def done(f: torch.futures.Future) -> torch.Tensor:
        recorder.finish(pending.entry)
        recorder._bucket_finished()
        return f.value()

    return fut.then(done)


class HookState:
    """State of ``recording_allreduce_hook``: the recorder and the process group (None: default)."""

    def __init__(self, recorder: CollectiveRecorder, process_group: Any = None):
        self.recorder = recorder
        self.process_group = process_group
        self.group_size = dist.get_world_size(process_group) if dist.is_initialized() else 1


def register_recording_hook(ddp_model: Any, recorder: CollectiveRecorder,
                            process_group: Any = None) -> None:
    """Make ``ddp_model``'s gradient AllReduces appear in ``recorder`` (and be timed)."""
    ddp_model.register_comm_hook(HookState(recorder, process_group), recording_allreduce_hook)
