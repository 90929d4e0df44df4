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
  the launcher enabled it (``launch/torchrun.py``: ``flight_recorder_env``); PyTorch's own NCCL watchdog also dumps it
  on a collective timeout through ``TORCH_NCCL_DUMP_ON_TIMEOUT``.

On NCCL a hung collective does not block the host at once: the call returned when the work was
queued, and the host keeps queueing steps until something waits for the GPU. So the watchdog also
polls the record's tracked entries (``CollectiveRecorder.stuck``: the work object or a CUDA event
recorded after the collective) and fires when one stays unfinished past the same timeout, naming
it, even while the host still beats.

Comparing the ranks' files shows who skipped or is stuck in which collective: the ranks waiting
in ``all_reduce`` at sequence N against the one in ``barrier`` at N.
"""

from __future__ import annotations

import contextlib
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

from podtrain.distributed.health import write_verdict
from podtrain.distributed.recorder import CollectiveRecorder
from podtrain.errors import HANG_EXIT_CODE

log = logging.getLogger(__name__)

DEFAULT_STEP_TIMEOUT_S = 600.0
DEFAULT_STARTUP_TIMEOUT_S = 1800.0


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
        run_dir: when given, a firing also writes a ``hang`` verdict (with the last completed
            step) to ``RUN_DIR/health/`` for the scheduler (``podtrain.distributed.health``).
    """

    def __init__(self, debug_dir: str | os.PathLike, rank: int,
                 startup_timeout_s: float = DEFAULT_STARTUP_TIMEOUT_S,
                 step_timeout_s: float = DEFAULT_STEP_TIMEOUT_S,
                 recorder: CollectiveRecorder | None = None, host: str | None = None,
                 exit_grace_s: float | None = None,
                 exit_fn: Callable[[int], None] = os._exit, run_dir: str | os.PathLike | None = None):
        self.debug_dir = Path(debug_dir)
        self.rank = rank
        self.startup_timeout_s = float(startup_timeout_s)
        self.step_timeout_s = float(step_timeout_s)
        self.recorder = recorder
        self.host = host or socket.gethostname()
        self._exit = exit_fn
        self.run_dir = run_dir
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
            stuck = self.recorder.stuck(timeout) if self.recorder is not None else None
            if stuck is not None and not self._stop.is_set():
                self._fire(phase, timeout, stuck)
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

    def _fire(self, phase: str, timeout: float, stuck: dict[str, Any] | None = None) -> None:
        self.fired = True
        what = "the first step" if phase == "start-up" else f"step {(self._last_step or 0) + 1}"
        reason = (f"no step completed within the {phase} timeout of {timeout:g} s "
                  f"(waiting for {what})")
        if stuck is not None:
            reason = (f"collective #{stuck['seq']} {stuck['op']} ({stuck['caller']}) unfinished "
                      f"{time.time() - stuck['start']:.0f} s after it was queued, beyond the "
                      f"{phase} timeout of {timeout:g} s")
        try:
            files = self.dump(reason)
            where = ", ".join(str(f) for f in files)
        except Exception as exc:  # the exit matters more than the dump: never hang here
            where = f"(dump failed: {exc})"
        if self.run_dir is not None:
            with contextlib.suppress(Exception):
                write_verdict(self.run_dir, "hang", self.host, self.rank,
                              {"last_step": self._last_step, "reason": reason, "dumps": where})
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
    """torch's flight recorder as JSON, when enabled and this torch has it; else None.

    ``_dump_fr_trace_json`` holds every backend's entries (NCCL's included) on current torch;
    CUDA builds that predate it name the NCCL one ``_dump_nccl_trace_json``."""
    import torch._C._distributed_c10d as c10d

    _dump_fr_trace_json = (getattr(c10d, "_dump_fr_trace_json", None)
                           or getattr(c10d, "_dump_nccl_trace_json", None))
    if _dump_fr_trace_json is None:
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
