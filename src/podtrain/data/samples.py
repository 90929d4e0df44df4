"""Samples and their order in one prepared dataset: the windows cut from its shards and the
exactly-once permutation of each epoch (the model is described in ``data/loader.py``)."""

from __future__ import annotations

import numpy as np

from podtrain.data.manifest import Manifest
from podtrain.errors import UserError


class SampleIndex:
    """The samples of one split: packed windows of ``seq_len + 1`` tokens over memmapped shards."""

    def __init__(self, manifest: Manifest, split: str, seq_len: int):
        self.seq_len = seq_len
        self.shards = manifest.shards(split)
        self.dtype = manifest.dtype
        self._arrays: list[np.memmap] | None = None  # opened lazily: memmaps do not survive fork well
        self.vocab_limit: int | None = None  # set by DataSources.check_vocab: ids must be below it
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
        if self.vocab_limit is not None and len(out):
            self._check_ids(out, shard_of)
        return out

    def _check_ids(self, rows: np.ndarray, shard_of: np.ndarray) -> None:
        """One line instead of an embedding's IndexError on every rank: a shard changed after
        prepare (its manifest's ``max_token_id`` checked at start says otherwise) holds an id the
        model has no row for. One max over the batch, in the loader's thread."""
        row_max = rows.max(axis=1)
        bad = np.flatnonzero(row_max >= self.vocab_limit)
        if bad.size:
            shard = self.shards[int(shard_of[bad[0]])]
            recorded = (f"its manifest says at most {shard.max_token_id}: the shard changed after prepare"
                        if shard.max_token_id is not None else "its manifest records no max_token_id")
            raise UserError(f"shard {shard.path} holds token id {int(row_max[bad[0]])}, at or above the model's "
                            f"vocabulary size {self.vocab_limit}; {recorded} (data.verify=true checks the "
                            "shards at start); prepare the data again")

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
        # The producer thread and the loop (guard reports) both call this: read the entry once.
        perm = self._cache.get(epoch)
        if perm is None:
            perm = epoch_permutation(self.num_samples, self.seed, epoch)
            if len(self._cache) >= 2:  # at most two epochs are live (a batch straddles a boundary)
                self._cache.pop(min(self._cache), None)
            self._cache[epoch] = perm
        return perm

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


def validation_ids(num_samples: int, rank: int, world_size: int, limit: int | None) -> np.ndarray:
    """This rank's validation samples: every ``world_size``-th one from ``rank``, in order.

    Disjoint across ranks, no padding duplicates: ranks may get one sample fewer, which is fine
    because the loss is combined by summing losses and token counts. ``limit`` caps the
    samples per rank so evaluation stays cheap.
    """
    ids = np.arange(rank, num_samples, world_size, dtype=np.int64)
    return ids if limit is None else ids[:limit]
