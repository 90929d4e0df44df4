"""Profiling on demand: ``profile.steps=10:13`` traces those training steps on every rank.

Each rank writes ``RUN_DIR/profile/rank<R>_steps<A>-<B>.trace.json``, a torch.profiler Chrome
trace (open it in https://ui.perfetto.dev or TensorBoard's profiler plugin) in which every step is
a ``ProfilerStep#N`` range; on a GPU the trace holds the CUDA kernels too, and
``rank<R>_steps<A>-<B>.memory.pickle`` is a CUDA memory snapshot of the same steps (drop it on
https://pytorch.org/memory_viz). Outside the range the profiler costs nothing: ``around`` is an
empty context manager.
"""

from __future__ import annotations

import contextlib
import logging
import time
from pathlib import Path
from typing import TYPE_CHECKING, Iterator

from podtrain.errors import UserError

if TYPE_CHECKING:  # torch is imported where a profile runs: config validation stays light
    import torch

log = logging.getLogger("podtrain")

# CUDA allocator events kept for the memory snapshot (the PyTorch docs' suggestion; ~100 MB host).
MEMORY_HISTORY_ENTRIES = 100_000


def parse_steps(spec: str, key: str = "profile.steps") -> tuple[int, int] | None:
    """``"10:13"`` -> (10, 13), both traced; ``"12"`` -> (12, 12); ``""`` -> None (off).
    Anything else is a UserError naming ``key``."""
    text = spec.strip()
    if not text:
        return None
    first, sep, last = text.partition(":")
    try:
        start, end = int(first), int(last if sep else first)
    except ValueError:
        start = end = -1
    if start < 1 or end < start:
        raise UserError(f"config key {key!r} must be FIRST:LAST step numbers with 1 <= FIRST <= LAST "
                        f"(e.g. 10:13), got {spec!r}")
    return start, end


class StepProfiler:
    """Profiles the steps ``first..last`` (1-based, as in the log lines) of one rank."""

    def __init__(self, steps: tuple[int, int] | None, out_dir: Path, rank: int, device: torch.device,
                 cuda_memory: bool = True):
        self.steps = steps
        self.out_dir, self.rank, self.device = out_dir, rank, device
        self.cuda_memory = cuda_memory and device.type == "cuda"
        self._profiler: "torch.profiler.profile | None" = None
        self.trace_path: Path | None = None
        self._write_s = 0.0

    @contextlib.contextmanager
    def around(self, step: int) -> Iterator[None]:
        """Wrap the work of step number ``step``: starts the profiler at the first step of the
        range, marks the step, and writes the files after the last."""
        if self.steps is None or not self.steps[0] <= step <= self.steps[1]:
            yield
            return
        import torch

        if self._profiler is None:
            self._start()
        with torch.profiler.record_function(f"ProfilerStep#{step}"):
            yield
        if step == self.steps[1]:
            self.finish()

    def _start(self) -> None:
        import torch

        activities = [torch.profiler.ProfilerActivity.CPU]
        if self.device.type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        if self.cuda_memory:
            torch.cuda.memory._record_memory_history(max_entries=MEMORY_HISTORY_ENTRIES)
        self._profiler = torch.profiler.profile(activities=activities, record_shapes=True,
                                                profile_memory=True)
        self._profiler.start()

    def finish(self) -> None:
        """Stop and write the trace (and memory snapshot); also called when the run ends inside
        the range (a stop signal), so the steps taken are not lost. Idempotent."""
        if self._profiler is None:
            return
        import torch

        start = time.perf_counter()
        profiler, self._profiler = self._profiler, None
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # the kernels of the last step belong in the trace
        profiler.stop()
        first, last = self.steps
        self.out_dir.mkdir(parents=True, exist_ok=True)
        stem = self.out_dir / f"rank{self.rank}_steps{first}-{last}"
        tmp = stem.with_name(stem.name + ".trace.json.tmp")
        profiler.export_chrome_trace(str(tmp))
        self.trace_path = stem.with_name(stem.name + ".trace.json")
        tmp.replace(self.trace_path)  # readers never see a half-written trace
        if self.cuda_memory:
            snapshot = stem.with_name(stem.name + ".memory.pickle")
            torch.cuda.memory._dump_snapshot(str(snapshot))
            torch.cuda.memory._record_memory_history(enabled=None)
        self._write_s += time.perf_counter() - start
        if self.rank == 0:
            log.info("profile of steps %d-%d written to %s (one file per rank)", first, last, self.out_dir)

    def take_write_s(self) -> float:
        """Seconds spent writing the files since the last call: the loop leaves them out of its
        throughput, as it does evaluation and checkpoint time."""
        seconds, self._write_s = self._write_s, 0.0
        return seconds
