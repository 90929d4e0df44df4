"""Stop signals: checkpoint and exit at the next step boundary, at the same step on every rank.

Schedulers announce the end of a job with a signal some time before SIGKILL: Slurm sends SIGTERM
on preemption or at the time limit (``KillWait``, 30 s by default) and, with
``#SBATCH --signal=B:USR1@120``, SIGUSR1 120 s early; torchrun's agent relays a SIGTERM it receives
to every worker and SIGKILLs them 30 s later; Kubernetes sends SIGTERM and SIGKILLs after
``terminationGracePeriodSeconds``; Ctrl-C sends SIGINT. ``StopSignal`` turns the configured signals (``ckpt.signals``)
into a flag. The handler only sets that flag (nothing that takes a lock or allocates), and the
ranks agree with one small all_reduce (max), so they all save the same step even though the signal
reached them at different moments.

The agreement is off the critical path: at step boundary k every rank *starts* an async
all_reduce of its flag (on a CPU gloo group, so no GPU stream is involved) and reads the one it
started at boundary k-1, which has long finished (the gradient sync of step k already made every
rank reach boundary k-1). Every rank reads the same sequence of agreed values, so every rank stops
at the same boundary; the price is one step of latency between the signal and the save, small
against any grace period. A blocking all_reduce per step would instead stall the host's run-ahead
of kernel launches at every step on a GPU, with a latency that grows with the job.

``REQUEUE_EXIT_CODE`` (143 = 128 + SIGTERM) is the status a rank exits with after that save:

* Kubernetes / Kubeflow PyTorchJob with ``restartPolicy: ExitCode``: codes 128-255 are retryable,
  1-127 permanent, so 143 restarts the pod and the job resumes from the checkpoint.
* Slurm: an exit code alone does not requeue; put ``RequeueExit=143`` in slurm.conf, or have the
  batch script run ``scontrol requeue $SLURM_JOB_ID`` when the step ends with 143 (``--requeue``
  lets a preempted job be requeued at all). HyperPod's ``srun --auto-resume=1`` restarts on node
  faults; the run then resumes from the newest checkpoint either way.
* torchrun: a worker that exits non-zero fails the worker group; with ``--max-restarts`` left the
  agent restarts every worker and they resume. When the agent itself got the SIGTERM it stops
  instead and exits non-zero, and the outer scheduler decides.
* Shells report a process killed by SIGTERM as 143 too: "stopped by SIGTERM" either way.
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from typing import Any, Sequence

import torch
import torch.distributed as dist

from podtrain.config import signal_from_name
from podtrain.distributed.group import DistContext
from podtrain.distributed.side_group import new_side_group

log = logging.getLogger(__name__)

REQUEUE_EXIT_CODE = 143
"""Exit status after a signal-triggered checkpoint: 128 + SIGTERM, retryable (see module doc)."""

INTERRUPT_EXIT_CODE = 130
"""Exit status after a Ctrl-C (SIGINT) save: 128 + SIGINT."""

_UNCATCHABLE = {signal.SIGKILL, signal.SIGSTOP}


def parse_signal(name: str) -> signal.Signals:
    """``"SIGTERM"``, ``"TERM"``, ``"sigusr1"`` or a number -> the signal; else a UserError."""
    return signal_from_name(name, "ckpt.signals")


# The agreed flag's bits (MAX over ranks keeps the save failure, the stronger reason).
_SIGNALLED, _SAVE_FAILED = 1, 2
_LEASE_LOST = 4  # above 1 | 2, so the agreed maximum says whether any rank (rank 0) lost the lease


class StopSignal:
    """Handlers that set a stop flag; ``should_stop`` makes the ranks agree on it."""

    def __init__(self, signal_names: Sequence[str] = ("SIGTERM", "SIGINT", "SIGUSR1")) -> None:
        """Install handlers for ``signal_names`` (main thread only; elsewhere, a warning)."""
        self.signals = [parse_signal(n) for n in signal_names]
        self.received: int | None = None
        """Number of the first signal received on this rank, or None."""
        self.received_at: float | None = None
        self._previous: dict[signal.Signals, object] = {}
        self._flag = torch.zeros(1, dtype=torch.int32)
        self._group = None
        self._group_ready = False
        # The agreement started at the previous boundary: (work, its recorded entry), or None.
        self._pending: tuple[Any, Any] | None = None
        self._stop_agreed = False
        self.save_failed_agreed = False
        self.lease_lost_agreed = False
        """Some rank (rank 0, the lease holder) found the run's lease taken by another job."""
        """True once the ranks agreed that a background checkpoint failed (they stop with its error)."""
        if threading.current_thread() is not threading.main_thread():
            log.warning("stop signals not installed: only the main thread may set signal handlers")
            return
        for sig in self.signals:
            self._previous[sig] = signal.signal(sig, self._handle)

    def _handle(self, signum: int, frame: object) -> None:
        # A flag and a timestamp only: a handler may run between any two bytecodes of the loop.
        if self.received is None:
            self.received = signum
            self.received_at = time.monotonic()

    @property
    def requested(self) -> bool:
        """True once one of the signals reached this rank."""
        return self.received is not None

    @property
    def exit_code(self) -> int:
        """The status to exit with after the save: 130 after Ctrl-C (SIGINT, as shells report
        it), else ``REQUEUE_EXIT_CODE``; both are retryable for Kubeflow (128-255)."""
        return INTERRUPT_EXIT_CODE if self.received == signal.SIGINT else REQUEUE_EXIT_CODE

    @property
    def ending(self) -> str:
        """How the attempt ended, for goodput's closing line: ``interrupted`` after Ctrl-C (the
        wait until the user runs it again is idle), else ``stopped`` (a scheduler's stop: the wait
        for the requeue is lost time). See ``train/goodput.py``."""
        return "interrupted" if self.received == signal.SIGINT else "stopped"

    def saved_line(self, step: int, waited_s: float, grace_s: float) -> str:
        """The line after the stop's checkpoint (rank 0 prints it, once for the job): when the
        save finished against the grace period and what the exit code means. A Ctrl-C is not
        requeued by anyone: it says how to resume instead."""
        since = self.seconds_since_signal()
        timing = (f"{since:.1f} s after the signal ({waited_s:.1f} s waiting for the write) of a "
                  f"{grace_s:.0f} s grace period" if since is not None else
                  f"({waited_s:.1f} s waiting for the write; the signal reached another rank)")
        if self.exit_code == INTERRUPT_EXIT_CODE:
            then = f"exiting with {self.exit_code}; run the same command to resume"
        else:
            then = (f"exiting with {self.exit_code}, which a scheduler that retries on 128-255 "
                    "requeues; run the same command to resume")
        return f"stop signal: step {step} saved {timing}; {then}"

    def seconds_since_signal(self) -> float | None:
        """Seconds since this rank received its signal (to log a save against the grace period)."""
        return None if self.received_at is None else time.monotonic() - self.received_at

    def should_stop(self, ctx: DistContext, save_failed: bool = False, lease_lost: bool = False) -> bool:
        """Every rank, at every step boundary: True on all ranks when any rank got a signal, or
        reported ``save_failed`` (its background checkpoint failed: then ``save_failed_agreed``).

        With a process group the answer is the one agreed at the previous boundary (one step of
        latency, see the module doc): it reads the async all_reduce started then and starts the
        next one. One int32 on a CPU (gloo) group; no blocking collective, no GPU synchronisation
        per step. Without a group the local flag answers at once.
        """
        if self._stop_agreed:
            return True  # agreed once: every later boundary stops too, without a collective
        if not ctx.initialized:
            code = self._local_code(save_failed, lease_lost)
        else:
            code = self._agreed()
            if not code:
                self._start_agreement(ctx, save_failed, lease_lost)
        self._stop_agreed = code > 0
        self.save_failed_agreed = bool(code & _SAVE_FAILED)
        self.lease_lost_agreed = code >= _LEASE_LOST
        if code == _SIGNALLED and ctx.is_main:
            name = signal.Signals(self.received).name if self.received else "a signal on another rank"
            log.warning("stop requested (%s): checkpointing and exiting at this step boundary", name)
        return self._stop_agreed

    def _local_code(self, save_failed: bool, lease_lost: bool = False) -> int:
        return ((_SIGNALLED if self.received is not None else 0) | (_SAVE_FAILED if save_failed else 0)
                | (_LEASE_LOST if lease_lost else 0))

    def _agreed(self) -> int:
        """The value the ranks agreed on at the previous boundary (0 at the first)."""
        if self._pending is None:
            return 0
        work, entry = self._pending
        self._pending = None
        work.wait()  # finished already: every rank passed the previous boundary's gradient sync
        entry.done()
        return int(self._flag[0])

    def _start_agreement(self, ctx: DistContext, save_failed: bool = False, lease_lost: bool = False) -> None:
        self._flag[0] = self._local_code(save_failed, lease_lost)
        # Recorded with its work object: the watchdog sees an agreement no peer ever joined.
        entry = ctx.recorder.begin("all_reduce", self._flag, caller="StopSignal.should_stop")
        work = dist.all_reduce(self._flag, op=dist.ReduceOp.MAX, group=self._cpu_group(ctx),
                               async_op=True)
        entry.track(work)
        self._pending = (work, entry)

    def drain(self) -> None:
        """Finish the agreement still in flight (every rank, when the loop ends without a stop),
        so no collective outlives the loop."""
        if self._pending is not None:
            self._agreed()

    def _cpu_group(self, ctx: DistContext):
        """The default group under gloo; under another backend, a gloo group made on first use."""
        if not self._group_ready:
            if ctx.backend != "gloo":
                self._group = new_side_group()  # all ranks reach here at step one
            self._group_ready = True
        return self._group

    def restore(self) -> None:
        """Put the previous handlers back (tests run several trainings in one process)."""
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)  # type: ignore[arg-type]
        self._previous.clear()

    def __enter__(self) -> "StopSignal":
        return self

    def __exit__(self, *exc: object) -> None:
        self.restore()
