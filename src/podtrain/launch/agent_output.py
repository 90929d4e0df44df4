"""The console of ``launch local``: the workers' lines, not torchrun's.

torchrun (``--tee 3``) copies each worker's stdout/stderr to its own, every line prefixed with
``[<role><local_rank>]:``, and adds its own logging: "Sending process ... closing signal", and on
any failure a ``ChildFailedError`` or ``SignalException`` traceback of 20-60 lines that repeats
what the workers said. ``AgentOutput`` reads the agents' pipes and passes the workers' lines
through, except their final ``podtrain: error:`` line (``launch local`` prints the job's one
verdict line itself, once); torchrun's own lines go to ``RUN_DIR/logs/torchrun_<id>.log`` and are
kept in memory for the exit summary (``exit_report.torchrun_exit_codes``).

The log file is a convenience: when it cannot be written (a full or read-only disk) the pumping
goes on without it, so the workers never block on a full pipe and the job still ends with their
verdict; ``log_error`` says why the file is incomplete.
"""

from __future__ import annotations

import re
import subprocess
import sys
import threading
from pathlib import Path
from typing import IO

from podtrain.errors import storage_error

WORKER_LINE = re.compile(r"^\[[A-Za-z_]+\d+\]:")
"""torchrun's prefix on a tee'd worker line, e.g. ``[default0]:``."""

VERDICT_PREFIXES = ("podtrain: error: ", "podtrain: interrupted")
"""A worker's last words that ``launch local`` replaces with its own single line."""

MAX_KEPT_CHARS = 1 << 20
"""torchrun's own output kept in memory for the summary (the file keeps everything)."""


class AgentOutput:
    """Context manager: pump every agent's stdout and stderr until they close (see module doc)."""

    def __init__(self, agents: list[subprocess.Popen], log_path: Path) -> None:
        """Start one reader thread per pipe of ``agents``; torchrun's lines go to ``log_path``."""
        self.log_path = log_path
        self.log_error: str | None = None
        """Why ``log_path`` is incomplete (a storage error's one line), or None."""
        self._log: IO[str] | None = None
        try:
            self._log = open(log_path, "a", encoding="utf-8")
        except OSError as exc:
            self._log_failed(exc)
        self._kept: list[str] = []
        self._kept_chars = 0
        self._lock = threading.Lock()
        self._threads = []
        for agent in agents:
            for pipe, console in ((agent.stdout, sys.stdout), (agent.stderr, sys.stderr)):
                if pipe is None:
                    continue
                thread = threading.Thread(target=self._pump, args=(pipe, console), daemon=True,
                                          name="podtrain-agent-output")
                thread.start()
                self._threads.append(thread)

    @property
    def torchrun_text(self) -> str:
        """torchrun's own lines (not the workers'), as read so far."""
        with self._lock:
            return "".join(self._kept)

    def _pump(self, pipe: IO[str], console: IO[str]) -> None:
        for line in pipe:
            if WORKER_LINE.match(line):
                payload = WORKER_LINE.sub("", line, count=1)
                if not payload.startswith(VERDICT_PREFIXES):
                    console.write(line)
                    console.flush()
                continue
            with self._lock:
                if self._log is not None:
                    try:
                        self._log.write(line)
                    except OSError as exc:
                        self._log_failed(exc)
                if self._kept_chars < MAX_KEPT_CHARS:
                    self._kept.append(line)
                    self._kept_chars += len(line)
        pipe.close()

    def __enter__(self) -> "AgentOutput":
        return self

    def __exit__(self, *exc: object) -> None:
        for thread in self._threads:
            thread.join()
        if self._log is not None:
            try:
                self._log.close()
            except OSError as exc:  # its buffer's last flush
                self._log = None
                self._log_failed(exc)

    def _log_failed(self, exc: OSError) -> None:
        """Stop writing the log (closing what can be closed) and remember why, once."""
        log, self._log = self._log, None
        if log is not None:
            try:
                log.close()
            except OSError:
                pass  # the same failure again: its buffer cannot be flushed either
        if self.log_error is None:
            exc.filename = exc.filename or str(self.log_path)  # a buffered write names no file
            error = storage_error(exc)
            self.log_error = str(error) if error is not None else f"{type(exc).__name__}: {exc}"
