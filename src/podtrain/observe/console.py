"""Rank 0's console: the progress bar or plain log lines, the record summary, logging setup."""

from __future__ import annotations

import collections
import logging
import sys
import time
from typing import Any

log = logging.getLogger("podtrain")


# Log intervals whose rate predicts the ETA: recent enough to follow a change of speed.
ETA_WINDOW = 5


class Progress:
    """Rank 0's console: a rich progress bar in a terminal, plain log lines otherwise.

    A plain line reads ``step 20/200 loss 5.1234 | ... | tokens 163,840 | ETA 2m05s``; the ETA
    comes from the rate of the last few log intervals. ``rich`` needs a terminal: where stdout is
    not one (``launch local``, whose torchrun tees each rank's output through a pipe, Slurm,
    Kubernetes) it falls back to plain lines with a one-line note.
    """

    def __init__(self, mode: str, total_steps: int, start_step: int, enabled: bool):
        if mode == "auto":
            mode = "rich" if sys.stdout.isatty() else "plain"
        elif mode == "rich" and enabled and not sys.stdout.isatty():
            log.info("log.progress=rich needs a terminal, and this rank's output is a pipe "
                     "(torchrun --tee, a scheduler's log): plain lines instead")
            mode = "plain"
        self.mode = mode if enabled else "off"
        self.total = total_steps
        self._recent: collections.deque[tuple[float, int]] = collections.deque(
            [(time.time(), start_step)], maxlen=ETA_WINDOW + 1)
        self._bar = None
        if self.mode == "rich":
            from rich.progress import BarColumn, MofNCompleteColumn, Progress as RichProgress
            from rich.progress import TextColumn, TimeRemainingColumn

            self._bar = RichProgress(TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(),
                                     TextColumn("{task.fields[info]}"), TimeRemainingColumn())
            self._task = self._bar.add_task("train", total=total_steps, completed=start_step, info="")
            self._bar.start()

    def update(self, record: dict[str, Any]) -> None:
        """Show one interval's record."""
        self._recent.append((record.get("time", time.time()), record["step"]))
        text = format_record(record)
        if self.mode == "rich":
            self._bar.update(self._task, completed=record["step"], info=text)
        elif self.mode == "plain":
            log.info("step %d/%d %s | tokens %s | ETA %s", record["step"], self.total, text,
                     f"{record.get('tokens_seen', 0):,}", format_duration(self.eta_s(record["step"])))

    def eta_s(self, step: int) -> float | None:
        """Seconds to ``total`` at the rate of the recent intervals (None before any rate)."""
        (t0, s0), (t1, s1) = self._recent[0], self._recent[-1]
        if s1 <= s0 or t1 <= t0:
            return None
        return (self.total - step) * (t1 - t0) / (s1 - s0)

    def note(self, message: str) -> None:
        """A line printed above the bar (evaluation results, checkpoints)."""
        if self.mode == "rich":
            self._bar.console.print(message)
        elif self.mode == "plain":
            log.info("%s", message)

    def close(self) -> None:
        """Stop the bar."""
        if self._bar is not None:
            self._bar.stop()
            self._bar = None


def format_record(r: dict[str, Any]) -> str:
    """The one-line human summary of a metrics record."""
    mfu = f"{100 * r['mfu']:.1f}%" if r.get("mfu") is not None else "n/a"
    return (f"loss {r['loss']:.4f} | lr {r['lr']:.2e} | grad {r['grad_norm']:.3f} | "
            f"{r['tokens_per_s']:,.0f} tok/s | mfu {mfu} | step {1000 * r['step_time_s']:.0f} ms | "
            f"data wait {1000 * r['data_wait_s']:.1f} ms")


def format_duration(seconds: float | None) -> str:
    """``3h04m``, ``2m05s``, ``9s``; ``n/a`` for None."""
    if seconds is None:
        return "n/a"
    whole = int(round(seconds))
    hours, rest = divmod(whole, 3600)
    minutes, secs = divmod(rest, 60)
    if hours:
        return f"{hours}h{minutes:02d}m"
    return f"{minutes}m{secs:02d}s" if minutes else f"{secs}s"


class _CurrentStreamHandler(logging.StreamHandler):
    """A handler writing to whatever ``sys.<name>`` is when a record is emitted.

    A plain StreamHandler keeps the stream object it was given: once that stream is replaced and
    closed (a caller redirecting output, pytest's capture between tests), every later record from
    any podtrain command in the process becomes a "Logging error" traceback.
    """

    def __init__(self, name: str):
        self._stream_name = name
        super().__init__()

    @property
    def stream(self):  # type: ignore[override]
        return getattr(sys, self._stream_name)

    @stream.setter
    def stream(self, value) -> None:  # StreamHandler.__init__ assigns it; the name decides
        pass


def setup_logging(rank: int) -> None:
    """INFO from global rank 0; WARNING and above from the others, prefixed with their rank."""
    prefix = "podtrain" if rank == 0 else f"podtrain rank {rank}"
    handler = _CurrentStreamHandler("stdout" if rank == 0 else "stderr")
    handler.setFormatter(logging.Formatter(f"[{prefix}] %(levelname)s %(message)s"
                                           if rank else f"[{prefix}] %(message)s"))
    root = logging.getLogger("podtrain")
    root.handlers[:] = [handler]
    root.setLevel(logging.INFO if rank == 0 else logging.WARNING)
    root.propagate = False
    # transformers' and torch's chatter stays out of the run's log unless it is a real problem.
    logging.getLogger("transformers").setLevel(logging.ERROR)
