"""Samples and their order in one prepared dataset: the windows cut from its token stream and the
exactly-once permutation of each epoch (the model is described in ``data/loader.py``)."""

from __future__ import annotations

import numpy as np

from podtrain.data.manifest import Manifest
from podtrain.data.tokens import SplitTokens
from podtrain.errors import UserError


class SampleIndex:
    """The samples of one split: sample ``i`` is the window of tokens ``[i * seq_len, i * seq_len +
    seq_len + 1)`` of the split's continuous stream (``data/tokens.py``): consecutive windows
    overlap by one token, so every token is a target once, and a window may cross a shard edge."""

    WINDOWS = "stream"
    """The windowing recorded in the loader's state (checkpoints from before it windowed each shard)."""

    def __init__(self, manifest: Manifest, split: str, seq_len: int):
        self.seq_len = seq_len
        self.tokens = SplitTokens(manifest, split)
        self.shards = self.tokens.shards
        self.vocab_limit: int | None = None  # set by DataSources.check_vocab: ids must be below it
        self.num_samples = max(0, (self.tokens.total - 1) // seq_len)
        if self.num_samples == 0:
            raise UserError(f"{manifest.root}: split {split!r} has {self.tokens.total} tokens, too few for one "
                            f"sample of data.seq_len + 1 = {seq_len + 1} tokens")

    def gather(self, ids: np.ndarray) -> np.ndarray:
        """Rows of ``seq_len + 1`` token ids (int64) for the given sample ids."""
        out = self.tokens.windows(np.asarray(ids, dtype=np.int64) * self.seq_len, self.seq_len + 1)
        if self.vocab_limit is not None and len(out):
            self._check_ids(out, ids)
        return out

    def warm(self, ids: np.ndarray) -> None:
        """Start reading these samples' data ahead (S3; nothing to do for memory-mapped shards)."""
        self.tokens.warm(np.asarray(ids, dtype=np.int64) * self.seq_len, self.seq_len + 1)

    def _check_ids(self, rows: np.ndarray, ids: np.ndarray) -> None:
        """One line instead of an embedding's IndexError on every rank: a shard changed after
        prepare (its manifest's ``max_token_id`` checked at start says otherwise) holds an id the
        model has no row for. One max over the batch, in the loader's thread."""
        row_max = rows.max(axis=1)
        bad = np.flatnonzero(row_max >= self.vocab_limit)
        if bad.size:
            row = int(bad[0])
            at = int(ids[row]) * self.seq_len + int(np.argmax(rows[row] >= self.vocab_limit))
            shard = self.shards[self.tokens.shard_at(at)]
            recorded = (f"its manifest says at most {shard.max_token_id}: the shard changed after prepare"
                        if shard.max_token_id is not None else "its manifest records no max_token_id")
            raise UserError(f"shard {shard.path} holds token id {int(row_max[row])}, at or above the model's "
                            f"vocabulary size {self.vocab_limit}; {recorded} (data.verify=true checks the "
                            "shards at start); prepare the data again")


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
