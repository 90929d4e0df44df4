"""Host staging memory for checkpoints: a per-rank budget and a pool of reused slabs within it.

A save streams what this rank writes through ``StagingPool`` (``podtrain.ckpt.staging``): the
step loop copies tensor bytes into free slabs, the background writer writes each filled slab and
hands it back. A resume on a GPU reads file bytes into slabs and copies them to the device. Host
memory for checkpoint data is therefore at most the budget, never a copy of the whole state.

The default budget is a quarter of the node's memory (the smaller of ``MemTotal`` and the cgroup
limit, so a Kubernetes pod's limit counts) divided by the node's ranks (``LOCAL_WORLD_SIZE``):
the node's ranks together never stage more than a quarter of it.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from podtrain.errors import UserError

NODE_MEMORY_FRACTION = 0.25
"""Share of a node's memory its ranks may use together for checkpoint staging by default."""
MIN_STAGING_MB = 1.0
MIB = 1 << 20
# A slab this large copies and writes at full speed; more, smaller slabs let the copy of one
# overlap the write of another.
MAX_SLAB_BYTES = 64 * MIB
# CPU sources are copied by a few threads in pieces of this size (numpy's memcpy drops the GIL).
_CPU_PIECE = 8 * MIB
def node_memory_bytes() -> int:
    """This node's memory as its processes see it: ``MemTotal``, capped by a cgroup limit."""
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    for limit_file in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            text = Path(limit_file).read_text().strip()
        except OSError:
            continue
        if text.isdigit():
            total = min(total, int(text))
    return total


def staging_budget_bytes(host_staging_mb: float | None, local_world_size: int, host: str = "") -> int:
    """Bytes of host staging memory for one rank (``ckpt.host_staging_mb``; None: the default).

    Raises ``UserError`` for a budget below 1 MB or above this node's memory shared by its ranks.
    """
    ranks = max(1, local_world_size)
    node = node_memory_bytes()
    if host_staging_mb is None:
        return max(int(MIN_STAGING_MB * MIB), int(node * NODE_MEMORY_FRACTION / ranks))
    if not host_staging_mb >= MIN_STAGING_MB:  # also refuses NaN
        raise UserError(f"config key 'ckpt.host_staging_mb' must be at least {MIN_STAGING_MB:g} (MB), "
                        f"got {host_staging_mb}")
    budget = int(host_staging_mb * MIB)
    if budget * ranks > node:
        raise UserError(f"config key 'ckpt.host_staging_mb' ({host_staging_mb:g} MB per rank x {ranks} "
                        f"rank(s)) exceeds the memory of host {host or os.uname().nodename} "
                        f"({node // MIB} MB)")
    return budget


class StagingPool:
    """Reused host slabs (page-locked on GPU runs) whose total never exceeds the budget.

    Slabs are allocated on first need and kept: a later save copies into memory that is already
    mapped and pinned (a fresh allocation pays a page fault per 4 KiB, and pinning is slow). At
    least two slabs exist when the budget allows, so one is filled while another is written.
    Slabs are a power of two bytes, at most 64 MiB.
    ``peak_in_use_bytes`` is the pool's own accounting of the most bytes handed out at once.
    """

    def __init__(self, budget_bytes: int, pin: bool, threads: int | None = None) -> None:
        """``budget_bytes``: the cap; ``pin``: page-locked slabs (GPU runs); ``threads``: CPU copiers."""
        self.budget_bytes = int(budget_bytes)
        self.pin = pin
        # A power of two: CUDA's pinned (caching host) allocator rounds every request up to one,
        # so any other size would pin more than the budget says.
        self.slab_bytes = 1 << (max(1, min(MAX_SLAB_BYTES, self.budget_bytes // 2)).bit_length() - 1)
        self.max_slabs = max(1, self.budget_bytes // self.slab_bytes)
        self.threads = threads or max(1, min(4, os.cpu_count() or 1))
        self._free: list[torch.Tensor] = []
        self._allocated = 0
        self._in_use = 0
        self.peak_in_use_bytes = 0
        """Most bytes of slabs handed out at the same time (never above the budget)."""
        self._cond = threading.Condition()
        self._copier = None

    @property
    def allocated_bytes(self) -> int:
        """Host memory the pool holds now (handed out or free)."""
        return self._allocated * self.slab_bytes

    def acquire(self, cancelled: Callable[[], bool] = lambda: False) -> torch.Tensor | None:
        """A free slab (uint8, ``slab_bytes`` long), waiting for one when all are in use.

        Returns None when ``cancelled()`` turns true while waiting (checked on every wake-up:
        whoever cancels calls ``wake``).
        """
        with self._cond:
            while not self._free and self._allocated >= self.max_slabs:
                if cancelled():
                    return None
                self._cond.wait(1.0)
            if cancelled():
                return None
            if self._free:
                slab = self._free.pop()
            else:
                slab = torch.empty(self.slab_bytes, dtype=torch.uint8, pin_memory=self.pin)
                self._allocated += 1
            self._in_use += 1
            self.peak_in_use_bytes = max(self.peak_in_use_bytes, self._in_use * self.slab_bytes)
            return slab

    def available_slabs(self) -> int:
        """Slabs ``acquire`` hands out now without waiting (free, or still to allocate)."""
        with self._cond:
            return self.max_slabs - self._in_use

    def release(self, slab: torch.Tensor) -> None:
        """Give a slab back (its bytes may be overwritten at once)."""
        with self._cond:
            self._in_use -= 1
            self._free.append(slab)
            self._cond.notify_all()

    def wake(self) -> None:
        """Wake every waiter in ``acquire`` so it re-checks its ``cancelled``."""
        with self._cond:
            self._cond.notify_all()

    def copy_cpu(self, pieces: list[tuple[np.ndarray, np.ndarray]]) -> None:
        """``np.copyto(dst, src)`` for each pair, split over a few threads (memcpy drops the GIL).

        The work is cut into at most ``threads`` batches of about equal bytes and the calling
        thread copies one of them: one task per thread, not one per piece (a state of many small
        tensors would otherwise pay a future and two GIL hand-offs per tensor on the step loop).
        Below ``_CPU_PIECE`` bytes in all, the calling thread copies everything itself."""
        work = [(d[i:i + _CPU_PIECE], s[i:i + _CPU_PIECE])
                for d, s in pieces for i in range(0, len(s), _CPU_PIECE)]
        total = sum(len(s) for _, s in work)
        batches = min(self.threads, len(work), max(1, total // _CPU_PIECE))
        if batches <= 1:
            _copy_all(work)
            return
        if self._copier is None:
            from concurrent.futures import ThreadPoolExecutor

            self._copier = ThreadPoolExecutor(self.threads - 1, thread_name_prefix="podtrain-copy")
        groups: list[list] = [[] for _ in range(batches)]
        share, filled, g = -(-total // batches), 0, 0
        for item in work:  # consecutive pieces, cut where a batch reaches its share
            groups[g].append(item)
            filled += len(item[1])
            if filled >= share * (g + 1) and g < batches - 1:
                g += 1
        futures = [self._copier.submit(_copy_all, group) for group in groups[1:] if group]
        _copy_all(groups[0])
        for future in futures:
            future.result()

    def close(self) -> None:
        """Stop the copy threads (the slabs are freed with the pool)."""
        if self._copier is not None:
            self._copier.shutdown(wait=True)
            self._copier = None


def _copy_all(work: list[tuple[np.ndarray, np.ndarray]]) -> None:
    """``np.copyto`` of each ``(dst, src)`` in ``work``, in order."""
    for dst, src in work:
        np.copyto(dst, src)


def byte_array(t: torch.Tensor) -> np.ndarray:
    """A contiguous CPU tensor's memory as a numpy byte array (no copy; any dtype, bf16 too)."""
    flat = t.reshape(-1)
    return (flat if flat.dtype == torch.uint8 else flat.view(torch.uint8)).numpy()


def flat_bytes(t: torch.Tensor) -> torch.Tensor:
    """``t``'s bytes as a 1-D uint8 tensor on its device (a view when ``t`` is contiguous)."""
    flat = t.detach().contiguous().reshape(-1)
    return flat if flat.dtype == torch.uint8 else flat.view(torch.uint8)
