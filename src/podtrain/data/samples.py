"""Samples and their order in one prepared dataset: the windows cut from its token stream and the
exactly-once permutation of each epoch, a keyed bijection computed on demand (the model is
described in ``data/loader.py``)."""

from __future__ import annotations

import math

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


ORDER = "feistel-1"
"""The order a new run takes (``KeyedOrder``), recorded in the loader's state as ``order``."""

SHUFFLE_ORDER = "pcg64-shuffle"
"""The order of checkpoints written before the order was recorded (``ShuffledOrder``): such a run
resumes in it, never re-ordered."""

_M64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15
_ROUNDS = 8  # Luby-Rackoff needs 4 for a pseudo-random permutation; 8 leave no visible structure
_U = np.uint64


def _mix64(z: int) -> int:
    """splitmix64's finaliser on a Python int (the round keys)."""
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _M64
    return z ^ (z >> 31)


def round_keys(seed: int, epoch: int) -> list[int]:
    """The Feistel round keys of epoch ``epoch``: a pure function of (seed, epoch), written out here
    (not numpy's seeding) so that the order cannot change with a library's version."""
    state = _mix64(_mix64((seed & _M64) ^ _GOLDEN) ^ (epoch & _M64))
    return [_mix64((state + (r + 1) * _GOLDEN) & _M64) for r in range(_ROUNDS)]


def _round_function(half: np.ndarray, key: int) -> np.ndarray:
    """A keyed 64-bit hash of each element (splitmix64 of ``half * golden + key``; one new array)."""
    z = half * _U(_GOLDEN)
    z += _U(key)
    z ^= z >> _U(30)
    z *= _U(0xBF58476D1CE4E5B9)
    z ^= z >> _U(27)
    z *= _U(0x94D049BB133111EB)
    z ^= z >> _U(31)
    return z


def split_sides(num_samples: int) -> tuple[int, int]:
    """The Feistel domain ``[0, a * b)`` for ``num_samples``: ``a = ceil(sqrt(n))``, ``b = ceil(n / a)``,
    so ``a * b - n < a``: fewer than one position in ``sqrt(n)`` falls outside ``[0, n)`` and needs a
    second pass (a power-of-two domain would send up to half of them round again)."""
    a = math.isqrt(num_samples - 1) + 1
    return a, -(-num_samples // a)


def _feistel(x: np.ndarray, a: int, b: int, keys: list[int]) -> np.ndarray:
    """A keyed bijection of ``[0, a * b)`` (uint64 in, uint64 out): an alternating-radix Feistel
    network (as NIST's FF1), ``x = left * b + right``; each round maps ``(left, right)`` with
    ``left < A`` to ``(right, (left + F(right)) mod A)``, which swaps the two radices, so after an
    even number of rounds ``left < a`` and ``right < b`` again. Invertible round by round."""
    left, right = x // _U(b), x % _U(b)
    for r, key in enumerate(keys):
        radix = _U(a if r % 2 == 0 else b)
        mixed = _round_function(right, key)
        mixed %= radix
        mixed += left
        mixed %= radix
        left, right = right, mixed
    return left * _U(b) + right


def permute(positions: np.ndarray, num_samples: int, seed: int, epoch: int) -> np.ndarray:
    """The sample ids (int64) at ``positions`` (within ``[0, num_samples)``) of epoch ``epoch``'s order.

    A keyed bijection of ``[0, n)`` computed per position: the Feistel network of ``split_sides``,
    cycle-walked (a value that lands in ``[n, a * b)`` goes through the network again until it is
    below ``n``; that stays a bijection of ``[0, n)``). O(1) memory and O(1) expected time per id,
    vectorised over the positions; the same ids whichever positions are asked for together.
    """
    keys = round_keys(seed, epoch)
    a, b = split_sides(num_samples)
    out = _feistel(np.asarray(positions, dtype=np.uint64), a, b, keys)
    walk = np.flatnonzero(out >= _U(num_samples))
    while walk.size:
        out[walk] = _feistel(out[walk], a, b, keys)
        walk = walk[out[walk] >= _U(num_samples)]
    return out.astype(np.int64)


class _EpochOrder:
    """Stream position -> sample id of one source of ``num_samples``: position ``p`` is place
    ``p % n`` of epoch ``p // n``'s permutation (``_epoch_ids``)."""

    name = ""

    def __init__(self, num_samples: int, seed: int):
        self.num_samples = num_samples
        self.seed = seed

    def _epoch_ids(self, epoch: int, offset: int, take: int) -> np.ndarray:
        """Places ``offset .. offset + take`` of epoch ``epoch``'s permutation."""
        raise NotImplementedError

    def ids(self, start: int, count: int) -> np.ndarray:
        """Sample ids at stream positions ``start .. start + count`` (may straddle epochs)."""
        out = np.empty(count, dtype=np.int64)
        done = 0
        while done < count:
            epoch, offset = divmod(start + done, self.num_samples)
            take = min(count - done, self.num_samples - offset)
            out[done:done + take] = self._epoch_ids(epoch, offset, take)
            done += take
        return out


class KeyedOrder(_EpochOrder):
    """The order ``ORDER``: epoch ``e`` is the keyed permutation ``permute(., n, seed, e)``,
    computed for the positions asked, nothing held."""

    name = ORDER

    def _epoch_ids(self, epoch: int, offset: int, take: int) -> np.ndarray:
        return permute(np.arange(offset, offset + take, dtype=np.uint64), self.num_samples, self.seed, epoch)


def shuffled_permutation(num_samples: int, seed: int, epoch: int) -> np.ndarray:
    """Epoch ``epoch`` of the order ``SHUFFLE_ORDER`` (podtrain's order before ``ORDER``): an
    in-place shuffle of an int32 range (int64 from 2**31 samples), held for the epoch: 4 bytes per
    sample on every rank, shuffled on one thread at every epoch. Kept only to resume such runs."""
    rng = np.random.Generator(np.random.PCG64([seed, epoch]))
    order = np.arange(num_samples, dtype=np.int32 if num_samples < 2**31 else np.int64)
    rng.shuffle(order)
    return order


class ShuffledOrder(_EpochOrder):
    """The order ``SHUFFLE_ORDER``, caching the permutation of the epoch in use."""

    name = SHUFFLE_ORDER

    def __init__(self, num_samples: int, seed: int):
        super().__init__(num_samples, seed)
        self._cache: dict[int, np.ndarray] = {}

    def _epoch_ids(self, epoch: int, offset: int, take: int) -> np.ndarray:
        # The producer thread and the loop (guard reports) both call this: read the entry once.
        perm = self._cache.get(epoch)
        if perm is None:
            perm = shuffled_permutation(self.num_samples, self.seed, epoch)
            if len(self._cache) >= 2:  # at most two epochs are live (a batch straddles a boundary)
                self._cache.pop(min(self._cache), None)
            self._cache[epoch] = perm
        return perm[offset:offset + take]


ORDERS = {ORDER: KeyedOrder, SHUFFLE_ORDER: ShuffledOrder}
"""Every order this podtrain can continue, by the name a loader state records."""


def source_orders(name: str, sizes: list[int], seed: int) -> list[_EpochOrder]:
    """One order ``name`` (a key of ``ORDERS``) per source of ``sizes`` samples, all with ``seed``."""
    return [ORDERS[name](n, seed) for n in sizes]


def validation_ids(num_samples: int, rank: int, world_size: int, limit: int | None) -> np.ndarray:
    """This rank's validation samples: every ``world_size``-th one from ``rank``, in order.

    Disjoint across ranks, no padding duplicates: ranks may get one sample fewer, which is fine
    because the loss is combined by summing losses and token counts. ``limit`` caps the
    samples per rank so evaluation stays cheap.
    """
    stop = num_samples if limit is None else min(num_samples, rank + limit * world_size)
    return np.arange(rank, stop, world_size, dtype=np.int64)  # O(limit), not O(samples)
