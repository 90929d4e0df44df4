"""Token shards -> this rank's micro-batches, with a global order that resumes exactly.

The model of the data (one picture to hold in your head):

* A split's shards are memory-mapped (zero copy). Sample ``i`` is a window of ``seq_len + 1``
  tokens; consecutive windows of a shard overlap by one token, so every token is a target once.
  Documents are packed: EOS separates them and a window may span two documents.
* All epochs form one **stream**: stream position ``p`` holds sample ``perm(seed, e)[p % N]``
  with ``e = p // N``, where ``perm`` is a permutation that is a pure function of (seed, epoch).
* Optimizer step ``s`` consumes the next ``global_batch_size`` stream positions. Rank ``r`` takes
  the ``r``-th contiguous slice of ``global_batch_size / world_size`` of them and cuts it into
  micro-batches. So the loader's whole state is the number of stream positions consumed: it does
  not depend on the world size, and a run resumed on 2 or 3 ranks continues exactly where 4 left
  off (same global batch), repeating and skipping nothing.
* The epoch tail: when ``N`` is not a multiple of the global batch, the last batch of epoch ``e``
  is completed with the first samples of epoch ``e + 1``'s order. Nothing is dropped or padded:
  every sample is seen exactly once per epoch, and the epoch advances by itself.

Batches are built ahead of the step by a background thread (or ``num_workers`` processes through
``torch.utils.data.DataLoader``), and the time the step waits for one is reported as ``wait_s``.
"""

from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import numpy as np
import torch

from podtrain.data.manifest import Manifest, read_manifest
from podtrain.errors import UserError


class SampleIndex:
    """The samples of one split: packed windows of ``seq_len + 1`` tokens over memmapped shards."""

    def __init__(self, manifest: Manifest, split: str, seq_len: int):
        self.seq_len = seq_len
        self.shards = manifest.shards(split)
        self.dtype = manifest.dtype
        self._arrays: list[np.memmap] | None = None  # opened lazily: memmaps do not survive fork well
        counts = []
        for shard in self.shards:
            if not shard.path.is_file():
                raise UserError(f"shard {shard.path} listed in {manifest.root / 'manifest.json'} is missing")
            tokens = shard.path.stat().st_size // self.dtype.itemsize
            if tokens != shard.tokens:
                raise UserError(f"shard {shard.path} holds {tokens} tokens, the manifest says {shard.tokens}")
            counts.append(max(0, (tokens - 1) // seq_len))
        self.offsets = np.concatenate([[0], np.cumsum(counts, dtype=np.int64)])
        self.num_samples = int(self.offsets[-1])
        if self.num_samples == 0:
            total = sum(s.tokens for s in self.shards)
            raise UserError(f"{manifest.root}: split {split!r} has {total} tokens, too few for one "
                            f"sample of data.seq_len + 1 = {seq_len + 1} tokens")

    def _open(self) -> list[np.memmap]:
        if self._arrays is None:
            self._arrays = [np.memmap(s.path, dtype=self.dtype, mode="r") for s in self.shards]
        return self._arrays

    def gather(self, ids: np.ndarray) -> np.ndarray:
        """Rows of ``seq_len + 1`` token ids (int64) for the given sample ids."""
        arrays = self._open()
        shard_of = np.searchsorted(self.offsets, ids, side="right") - 1
        starts = (ids - self.offsets[shard_of]) * self.seq_len
        out = np.empty((len(ids), self.seq_len + 1), dtype=np.int64)
        for row, (shard, start) in enumerate(zip(shard_of, starts)):
            out[row] = arrays[shard][start:start + self.seq_len + 1]
        return out

    def __getstate__(self):  # workers and forks reopen their own memmaps
        state = self.__dict__.copy()
        state["_arrays"] = None
        return state


def epoch_permutation(num_samples: int, seed: int, epoch: int) -> np.ndarray:
    """The order of epoch ``epoch``: a pure function of (seed, epoch), different every epoch.

    Held in memory for the epoch: 4 bytes per sample below 2**31 samples (an in-place shuffle of
    an int32 range; the same order as ``Generator.permutation``), so 100M samples cost 400 MB.
    """
    rng = np.random.Generator(np.random.PCG64([seed, epoch]))
    order = np.arange(num_samples, dtype=np.int32 if num_samples < 2**31 else np.int64)
    rng.shuffle(order)
    return order


class GlobalOrder:
    """Stream position -> sample id, caching the permutation of the epoch in use."""

    def __init__(self, num_samples: int, seed: int):
        self.num_samples = num_samples
        self.seed = seed
        self._cache: dict[int, np.ndarray] = {}

    def _perm(self, epoch: int) -> np.ndarray:
        if epoch not in self._cache:
            if len(self._cache) >= 2:  # at most two epochs are live (a batch straddles a boundary)
                self._cache.pop(min(self._cache))
            self._cache[epoch] = epoch_permutation(self.num_samples, self.seed, epoch)
        return self._cache[epoch]

    def ids(self, start: int, count: int) -> np.ndarray:
        """Sample ids at stream positions ``start .. start + count`` (may straddle epochs)."""
        out = np.empty(count, dtype=np.int64)
        done = 0
        while done < count:
            pos = start + done
            epoch, offset = divmod(pos, self.num_samples)
            take = min(count - done, self.num_samples - offset)
            out[done:done + take] = self._perm(epoch)[offset:offset + take]
            done += take
        return out


def rank_slice(global_batch: int, world_size: int, rank: int) -> slice:
    """The part of a global batch (stream positions relative to its start) this rank trains on."""
    per_rank = global_batch // world_size
    return slice(rank * per_rank, (rank + 1) * per_rank)


@dataclass
class StepBatch:
    """What one optimizer step receives on one rank.

    Attributes:
        micro_batches: ``accum`` tensors of shape [micro_batch, seq_len + 1]; inputs are
            ``[:, :-1]`` and targets ``[:, 1:]`` (views, no copy).
        sample_ids: the global sample ids in this rank's share (for tests and diagnostics).
        consumed: stream positions consumed once this step is done (the state to save).
        wait_s: seconds the caller waited for this batch (data-loading stall).
    """

    micro_batches: list[torch.Tensor]
    sample_ids: np.ndarray
    consumed: int
    wait_s: float = 0.0


class _StepDataset(torch.utils.data.Dataset):
    """Map-style view used by worker processes: item ``k`` is step ``first_step + k``'s batch."""

    def __init__(self, loader: "ShardedLoader", start: int):
        self.loader, self.start = loader, start

    def __len__(self) -> int:  # effectively infinite; the sampler bounds it
        return 2**62

    def __getitem__(self, k: int):
        batch = self.loader.build(self.start + k * self.loader.global_batch_size, pin=False)
        return batch.micro_batches, batch.sample_ids, batch.consumed


class ShardedLoader:
    """This rank's batches of one split, built ahead of the step.

    Args:
        data_dir: a ``podtrain prepare`` output directory.
        seq_len: tokens per training sequence.
        global_batch_size: sequences per optimizer step across all ranks.
        micro_batch_size: sequences per forward/backward on this rank.
        rank, world_size: this rank's place; ``global_batch_size`` must split evenly.
        seed: data-order seed.
        split: "train" (or "val").
        prefetch: batches kept ready ahead.
        num_workers: 0 builds batches in one background thread; N > 0 uses N worker processes.
        pin_memory: pin host batches so copies to the GPU can overlap compute.
    """

    def __init__(self, data_dir: str | Path, seq_len: int, global_batch_size: int,
                 micro_batch_size: int, rank: int, world_size: int, seed: int,
                 split: str = "train", prefetch: int = 4, num_workers: int = 0,
                 pin_memory: bool = False, manifest: Manifest | None = None):
        if global_batch_size % (micro_batch_size * world_size):
            raise UserError(
                f"train.global_batch_size={global_batch_size} is not divisible by "
                f"train.micro_batch_size x world size = {micro_batch_size} x {world_size}")
        self.manifest = manifest or read_manifest(data_dir)
        self.index = SampleIndex(self.manifest, split, seq_len)
        self.order = GlobalOrder(self.index.num_samples, seed)
        self.global_batch_size = global_batch_size
        self.micro_batch_size = micro_batch_size
        self.rank, self.world_size = rank, world_size
        self.prefetch, self.num_workers, self.pin_memory = prefetch, num_workers, pin_memory
        self.consumed = 0  # stream positions consumed by steps handed to the trainer
        self._stream: Iterator[StepBatch] | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # -- state ---------------------------------------------------------------------------------
    @property
    def samples_per_epoch(self) -> int:
        """N: samples in one pass over the split."""
        return self.index.num_samples

    @property
    def epoch(self) -> int:
        """The epoch the next batch starts in."""
        return self.consumed // self.index.num_samples

    def state_dict(self) -> dict[str, int]:
        """Where the data stands, independent of the world size: (epoch, global samples consumed)."""
        return {"epoch": self.epoch, "consumed": self.consumed,
                "samples_per_epoch": self.index.num_samples, "seed": self.order.seed}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Continue from a saved state (before the first ``next``)."""
        if state.get("samples_per_epoch", self.index.num_samples) != self.index.num_samples:
            raise UserError(
                f"data in {self.manifest.root} has {self.index.num_samples} samples per epoch but the "
                f"checkpoint was made with {state['samples_per_epoch']}: different data or data.seq_len")
        if state.get("seed", self.order.seed) != self.order.seed:
            raise UserError(
                f"run.seed is {self.order.seed} but the checkpoint's data order was made with seed "
                f"{state['seed']}: resuming would repeat and skip samples (keep run.seed)")
        self.close()
        self.consumed = int(state["consumed"])

    # -- building ------------------------------------------------------------------------------
    def build(self, start: int, pin: bool | None = None) -> StepBatch:
        """This rank's batch of the step whose global batch starts at stream position ``start``.

        ``pin`` defaults to ``pin_memory``; worker processes pass False (CUDA cannot be used in a
        forked worker; the DataLoader pins in the parent instead).
        """
        positions = rank_slice(self.global_batch_size, self.world_size, self.rank)
        ids = self.order.ids(start + positions.start, positions.stop - positions.start)
        rows = torch.from_numpy(self.index.gather(ids))
        if self.pin_memory if pin is None else pin:
            rows = rows.pin_memory()
        micro = list(rows.split(self.micro_batch_size))
        return StepBatch(micro, ids, start + self.global_batch_size)

    def _thread_stream(self) -> Iterator[StepBatch]:
        ready: queue.Queue = queue.Queue(maxsize=self.prefetch)
        start = self.consumed

        def produce() -> None:
            pos = start
            try:
                while not self._stop.is_set():
                    batch = self.build(pos)
                    while not self._stop.is_set():
                        try:
                            ready.put(batch, timeout=0.1)
                            break
                        except queue.Full:
                            continue
                    pos += self.global_batch_size
            except BaseException as exc:  # hand the failure to the consumer instead of hanging it
                ready.put(exc)

        self._stop.clear()
        self._thread = threading.Thread(target=produce, name="podtrain-loader", daemon=True)
        self._thread.start()
        while True:
            item = ready.get()
            if isinstance(item, BaseException):
                raise item
            yield item

    def _worker_stream(self) -> Iterator[StepBatch]:
        import itertools

        loader = torch.utils.data.DataLoader(
            _StepDataset(self, self.consumed), batch_size=None, sampler=itertools.count(),
            num_workers=self.num_workers, prefetch_factor=max(1, self.prefetch // self.num_workers),
            pin_memory=self.pin_memory, persistent_workers=False)
        for micro, ids, consumed in loader:
            yield StepBatch(list(micro), np.asarray(ids), int(consumed))

    def next(self) -> StepBatch:
        """The next step's batch; ``wait_s`` is how long this call blocked."""
        if self._stream is None:
            self._stream = self._worker_stream() if self.num_workers else self._thread_stream()
        t0 = time.perf_counter()
        batch = next(self._stream)
        batch.wait_s = time.perf_counter() - t0
        self.consumed = batch.consumed
        return batch

    def close(self) -> None:
        """Stop the background thread or workers (safe to call twice)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None
        if self._stream is not None:
            self._stream.close()
            self._stream = None


def validation_ids(num_samples: int, rank: int, world_size: int, limit: int | None) -> np.ndarray:
    """This rank's validation samples: every ``world_size``-th one from ``rank``, in order.

    Disjoint across ranks, no padding duplicates: ranks may get one sample fewer, which is fine
    because the loss is combined by summing losses and token counts. ``limit`` caps the
    samples per rank so evaluation stays cheap.
    """
    ids = np.arange(rank, num_samples, world_size, dtype=np.int64)
    return ids if limit is None else ids[:limit]


def unigram_entropy(manifest: Manifest, split: str = "train", max_tokens: int = 50_000_000) -> float:
    """Entropy in nats of the split's token frequencies (over its first ``max_tokens`` tokens).

    The loss a model would reach by predicting every token from its frequency alone: a trained
    model must get clearly below it to have learnt anything about context.
    """
    counts = np.zeros(manifest.vocab_size, dtype=np.int64)
    budget = max_tokens
    for shard in manifest.shards(split):
        if budget <= 0:
            break
        tokens = np.memmap(shard.path, dtype=manifest.dtype, mode="r")[:budget]
        counts += np.bincount(tokens, minlength=manifest.vocab_size)[:manifest.vocab_size]
        budget -= len(tokens)
    p = counts[counts > 0] / counts.sum()
    return float(-(p * np.log(p)).sum())
