"""Rank 0's console: the progress bar or plain log lines, the record summary, logging setup."""

from __future__ import annotations

import logging
import sys
from typing import Any

log = logging.getLogger("podtrain")


class Progress:
    """Rank 0's console: a rich progress bar in a terminal, plain log lines otherwise."""

    def __init__(self, mode: str, total_steps: int, start_step: int, enabled: bool):
        if mode == "auto":
            mode = "rich" if sys.stdout.isatty() else "plain"
        self.mode = mode if enabled else "off"
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
        text = format_record(record)
        if self.mode == "rich":
            self._bar.update(self._task, completed=record["step"], info=text)
        elif self.mode == "plain":
            log.info("step %d %s", record["step"], text)

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


def setup_logging(rank: int) -> None:
    """INFO from global rank 0; WARNING and above from the others, prefixed with their rank."""
    prefix = "podtrain" if rank == 0 else f"podtrain rank {rank}"
    handler = logging.StreamHandler(sys.stdout if rank == 0 else sys.stderr)
    handler.setFormatter(logging.Formatter(f"[{prefix}] %(levelname)s %(message)s"
                                           if rank else f"[{prefix}] %(message)s"))
    root = logging.getLogger("podtrain")
    root.handlers[:] = [handler]
    root.setLevel(logging.INFO if rank == 0 else logging.WARNING)
    root.propagate = False
    # transformers' and torch's chatter stays out of the run's log unless it is a real problem.
    logging.getLogger("transformers").setLevel(logging.ERROR)
