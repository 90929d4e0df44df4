"""Hang detection: no silent waits.

A ``Watchdog`` thread on every rank expects ``beat(step)`` after each completed step. When none
comes within the timeout (a longer one before the first beat: start-up, data loading, the first
compile and collectives), the rank writes what it was doing into ``RUN_DIR/debug/`` and exits
with ``HANG_EXIT_CODE``, so the launcher (torchrun, srun, the PyTorchJob controller) ends the whole
job instead of letting it wait out a 30-minute collective timeout:

* ``stacks_rank{R}.txt``: every Python thread's stack (faulthandler), which names the function the
  rank is blocked in (``all_reduce``, ``barrier``, a data loader...);
* ``collectives_rank{R}.json``: this rank's last collectives from its ``CollectiveRecorder`` (op,
  sizes, dtype, caller, in flight or done), the record podtrain keeps on every backend;
* ``fr_trace_rank{R}.json``: torch's flight recorder (NCCL on GPU, and gloo on torch >= 2.8) when
  the launcher enabled it with ``flight_recorder_env``; PyTorch's own NCCL watchdog also dumps it
  on a collective timeout through ``TORCH_NCCL_DUMP_ON_TIMEOUT``.

Comparing the ranks' files shows who skipped or is stuck in which collective: the ranks waiting
in ``all_reduce`` at sequence N against the one in ``barrier`` at N.

The recorder is also the state of ``recording_allreduce_hook``, a DDP comm hook that logs each
gradient bucket's AllReduce and measures how long the rank waited for the others (the signal
``podtrain.train.stragglers.StragglerMonitor`` uses to find a slow rank).
"""

from __future__ import annotations

import collections
import faulthandler
import json
import logging
import os
import socket
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable

import torch

log = logging.getLogger(__name__)

# The exit code of a rank the watchdog ended: the code coreutils `timeout` uses, so a job's
# exit status reads as "timed out" and is told apart from a crash (1) or a user error (2).
HANG_EXIT_CODE = 124

DEFAULT_STEP_TIMEOUT_S = 600.0
DEFAULT_STARTUP_TIMEOUT_S = 1800.0


def flight_recorder_env(debug_dir: str | os.PathLike, buffer_size: int = 2000) -> dict[str, str]:
    """Environment variables that turn on torch's collective flight recorder, dumping into
    ``debug_dir``.

    They are read when the process group is created, so a launcher puts them into the workers'
    environment (torchrun's, srun's, the pod spec's) rather than the training process setting
    them late. ``TORCH_FR_*`` are the current names (torch >= 2.6, also recording gloo from 2.8).
    Files are named
    ``nccl_trace_rank_<R>`` (the rank is appended by torch).
    """
    prefix = str(Path(debug_dir) / "nccl_trace_rank_")
    size = str(int(buffer_size))
    # Only the current names: torch 2.13 warns on every rank for the old TORCH_NCCL_* aliases.
    return {
        "TORCH_FR_BUFFER_SIZE": size,
        "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
        "TORCH_FR_DUMP_TEMP_FILE": prefix,
    }


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
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

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
        import torch.distributed as dist

        self.recorder = recorder
        self.process_group = process_group
        self.group_size = dist.get_world_size(process_group) if dist.is_initialized() else 1


def register_recording_hook(ddp_model: Any, recorder: CollectiveRecorder,
                            process_group: Any = None) -> None:
    """Make ``ddp_model``'s gradient AllReduces appear in ``recorder`` (and be timed)."""
    ddp_model.register_comm_hook(HookState(recorder, process_group), recording_allreduce_hook)


class Watchdog:
    """A daemon thread that ends this rank, with stack and collective dumps, when steps stop.

    Call ``start()`` once, ``beat(step)`` after every completed step, ``stop()`` at the end (or use
    it as a context manager). Before the first beat the start-up timeout applies; after it, the
    step timeout. Keep both below the process group's collective timeout so the dumps are
    written before torch's own timeout error, and the step timeout above the longest step
    (evaluation and checkpoint included, as the beat follows them).

    Args:
        debug_dir: where the dumps go (``RUN_DIR/debug``).
        rank: global rank, in the file names and the log line.
        startup_timeout_s: seconds allowed before the first beat.
        step_timeout_s: seconds allowed between beats.
        recorder: the rank's ``CollectiveRecorder`` (``ctx.recorder``), dumped as JSON.
        host: this host's name for the messages (default: the socket's).
        exit_grace_s: seconds between the dump and the exit (default: a tenth of the shorter
            timeout, between 1 and 30 s). The other ranks are usually stuck too and fire within
            a poll interval; were this rank to exit at once, their collectives would fail on the
            closed connection before their own dumps. A rank that errors that way during the
            grace has its dump already; it exits with its own error, the others with
            ``HANG_EXIT_CODE``.
        exit_fn: how to end the process (``os._exit``; tests pass a recorder of calls).
    """

    def __init__(self, debug_dir: str | os.PathLike, rank: int,
                 startup_timeout_s: float = DEFAULT_STARTUP_TIMEOUT_S,
                 step_timeout_s: float = DEFAULT_STEP_TIMEOUT_S,
                 recorder: CollectiveRecorder | None = None, host: str | None = None,
                 exit_grace_s: float | None = None,
                 exit_fn: Callable[[int], None] = os._exit):
        self.debug_dir = Path(debug_dir)
        self.rank = rank
        self.startup_timeout_s = float(startup_timeout_s)
        self.step_timeout_s = float(step_timeout_s)
        self.recorder = recorder
        self.host = host or socket.gethostname()
        self._exit = exit_fn
        shorter = min(self.startup_timeout_s, self.step_timeout_s)
        self.exit_grace_s = (min(30.0, max(1.0, 0.1 * shorter)) if exit_grace_s is None
                             else float(exit_grace_s))
        self.fired = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._started_at = 0.0
        # Written by beat() on the training thread, read by the watchdog thread: plain attribute
        # stores are atomic under the GIL, so no lock is needed.
        self._last_beat: float | None = None
        self._last_step: int | None = None

    def start(self) -> "Watchdog":
        """Start watching; the start-up timeout runs from now."""
        self._started_at = time.monotonic()
        self._thread = threading.Thread(target=self._watch, name=f"podtrain-watchdog-{self.rank}",
                                        daemon=True)
        self._thread.start()
        return self

    def beat(self, step: int) -> None:
        """Report that ``step`` completed: two attribute stores, no lock, no sync."""
        self._last_step = step
        self._last_beat = time.monotonic()

    def stop(self) -> None:
        """Stop watching (idempotent)."""
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5)
        self._thread = None

    def __enter__(self) -> "Watchdog":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    def _deadline(self) -> tuple[float, str, float]:
        last = self._last_beat
        if last is None:
            return self._started_at + self.startup_timeout_s, "start-up", self.startup_timeout_s
        return last + self.step_timeout_s, "step", self.step_timeout_s

    def _watch(self) -> None:
        # Poll often enough to fire within ~5% of the timeout, but at most once a second.
        poll = max(0.05, min(1.0, min(self.startup_timeout_s, self.step_timeout_s) / 20))
        while not self._stop.wait(poll):
            deadline, phase, timeout = self._deadline()
            if time.monotonic() >= deadline and not self._stop.is_set():
                self._fire(phase, timeout)
                return

    def dump(self, reason: str) -> list[Path]:
        """Write the stack, collective and flight-recorder dumps now; return the files written."""
        self.debug_dir.mkdir(parents=True, exist_ok=True)
        header = (f"podtrain watchdog: rank {self.rank} on host {self.host}: {reason}\n"
                  f"last completed step: {self._last_step}\n\n")
        stacks = self.debug_dir / f"stacks_rank{self.rank}.txt"
        with open(stacks, "w") as fh:
            fh.write(header)
            fh.flush()  # faulthandler writes to the file descriptor, below Python's buffer
            faulthandler.dump_traceback(file=fh, all_threads=True)
        written = [stacks]
        colls = self.debug_dir / f"collectives_rank{self.rank}.json"
        record = {"rank": self.rank, "host": self.host, "reason": reason,
                  "last_step": self._last_step,
                  "collectives": self.recorder.snapshot() if self.recorder else []}
        colls.write_text(json.dumps(record, indent=1))
        written.append(colls)
        fr = _flight_recorder_json()
        if fr:
            path = self.debug_dir / f"fr_trace_rank{self.rank}.json"
            path.write_bytes(fr)
            written.append(path)
        return written

    def _fire(self, phase: str, timeout: float) -> None:
        self.fired = True
        what = "the first step" if phase == "start-up" else f"step {(self._last_step or 0) + 1}"
        reason = (f"no step completed within the {phase} timeout of {timeout:g} s "
                  f"(waiting for {what})")
        try:
            files = self.dump(reason)
            where = ", ".join(str(f) for f in files)
        except Exception as exc:  # the exit matters more than the dump: never hang here
            where = f"(dump failed: {exc})"
        log.error("rank %d on host %s: %s; stacks and last collectives in %s; exiting with code "
                  "%d in %g s", self.rank, self.host, reason, where, HANG_EXIT_CODE,
                  self.exit_grace_s)
        for handler in logging.getLogger().handlers + log.handlers:
            try:
                handler.flush()
            except Exception:
                pass
        sys.stderr.flush()
        sys.stdout.flush()
        time.sleep(self.exit_grace_s)  # let the peers stuck with us dump too (see __init__)
        self._exit(HANG_EXIT_CODE)


def _flight_recorder_json() -> bytes | None:
    """torch's flight recorder as JSON, when enabled and this torch has it; else None."""
    try:
        from torch._C._distributed_c10d import _dump_fr_trace_json
    except ImportError:
        return None
    try:
        data = _dump_fr_trace_json()
    except Exception:  # not enabled, or no process group: the own record still stands
        return None
    try:
        if not json.loads(data).get("entries"):
            return None
    except ValueError:
        pass
    return data
