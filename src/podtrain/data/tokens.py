"""One split of a prepared dataset as ONE continuous stream of tokens, local or on S3.

A split is the concatenation of its shards in manifest order, so a window may cross a shard
boundary: that makes the samples a function of the token stream alone, not of where prepare cut
the shards (a ``prepare --num-parts N`` + ``merge`` dataset holds the same stream as a one-shot
prepare with other cuts, and must give the same batches). Local shards are memory-mapped; shards
under ``s3://`` are read in blocks through ``data/cache.py``.
"""

from __future__ import annotations

import hashlib

import numpy as np

from podtrain.data.cache import BlockCache, CacheSpec, Key, Wanted
from podtrain.data.manifest import MANIFEST_NAME, Manifest, shard_sizes
from podtrain.errors import UserError


class SplitTokens:
    """The tokens of ``split``: ``windows(starts, length)`` reads rows of consecutive tokens."""

    def __init__(self, manifest: Manifest, split: str):
        self.shards = manifest.shards(split)
        self.dtype = manifest.dtype
        self.remote = manifest.is_remote
        self.url = str(manifest.root)
        sizes = shard_sizes(manifest, self.shards)
        for shard in self.shards:
            size = sizes.get(shard.name)
            if size is None:
                raise UserError(f"shard {shard.path} listed in {manifest.root / MANIFEST_NAME} is missing")
            if size // self.dtype.itemsize != shard.tokens:
                raise UserError(f"shard {shard.path} holds {size // self.dtype.itemsize} tokens, the manifest "
                                f"says {shard.tokens}")
        self.bounds = np.concatenate([[0], np.cumsum([s.tokens for s in self.shards], dtype=np.int64)])
        self.total = int(self.bounds[-1])
        # a block's cache name: the shard's content hash (or, without one, its place and size)
        self._keys = [s.sha256 or hashlib.sha256(f"{self.url}/{s.name}:{s.tokens}".encode()).hexdigest()
                      for s in self.shards]
        self._arrays: list[np.memmap] | None = None  # opened lazily: memmaps do not survive fork well
        self.cache: BlockCache | None = None
        """S3 shards: the block cache they are read through (``DataSources.use_cache``); None: a
        cache of this split's own, of no budget, made at the first read."""

    def __getstate__(self):  # workers and forks reopen their own memmaps
        state = self.__dict__.copy()
        state["_arrays"] = None
        return state

    def shard_at(self, pos: int) -> int:
        """The index of the shard holding stream position ``pos``."""
        return int(np.searchsorted(self.bounds, pos, side="right") - 1)

    def _pieces(self, start: int, length: int):
        """``(shard, first token in it, count, offset in the row)`` covering ``[start, start + length)``."""
        k, done = self.shard_at(start), 0
        while done < length:
            first = start + done - int(self.bounds[k])
            count = min(length - done, self.shards[k].tokens - first)
            if count > 0:
                yield k, first, count, done
                done += count
            k += 1

    def windows(self, starts: np.ndarray, length: int) -> np.ndarray:
        """Rows of ``length`` consecutive tokens (int64) starting at each stream position of ``starts``."""
        out = np.empty((len(starts), length), dtype=np.int64)
        pieces = [list(self._pieces(int(s), length)) for s in starts]
        if not self.remote:
            if self._arrays is None:
                self._arrays = [_random_access(np.memmap(s.path, dtype=self.dtype, mode="r")) for s in self.shards]
            for row, parts in enumerate(pieces):
                for k, first, count, at in parts:
                    out[row, at:at + count] = self._arrays[k][first:first + count]
            return out
        cache = self._block_cache()
        got = cache.blocks(self._wanted(pieces, cache.block))
        item = self.dtype.itemsize
        for row, parts in enumerate(pieces):
            for k, first, count, at in parts:
                lo, hi = first * item, (first + count) * item
                raw = np.concatenate([got[(self.url, self.shards[k].name, j)][max(lo - j * cache.block, 0):
                                                                               hi - j * cache.block]
                                      for j in range(lo // cache.block, (hi - 1) // cache.block + 1)])
                out[row, at:at + count] = raw.view(self.dtype)
        return out

    def _block_cache(self) -> BlockCache:
        if self.cache is None:
            self.cache = BlockCache(CacheSpec("", 0))
        return self.cache

    def _wanted(self, pieces, block: int) -> Wanted:
        """The blocks the pieces touch, each with its shard's content key and length."""
        wanted: Wanted = {}
        item = self.dtype.itemsize
        for parts in pieces:
            for k, first, count, _ in parts:
                size = self.shards[k].tokens * item
                for j in range(first * item // block, ((first + count) * item - 1) // block + 1):
                    key: Key = (self.url, self.shards[k].name, j)
                    wanted[key] = (self._keys[k], min(block, size - j * block))
        return wanted

    def warm(self, starts: np.ndarray, length: int) -> None:
        """S3: start fetching the blocks these windows need (read-ahead; returns at once)."""
        if self.remote:
            cache = self._block_cache()
            cache.warm(self._wanted([list(self._pieces(int(s), length)) for s in starts], cache.block))


def _random_access(array: np.memmap) -> np.memmap:
    """Tell the kernel that ``array`` is read at random places: training reads short windows in a
    shuffled order, and the default read-ahead (often 128 KB to 8 MB per fault) would pull in
    megabytes of disk for each few-hundred-byte window once the corpus outgrows the page cache."""
    import mmap

    raw = getattr(array, "_mmap", None)
    if raw is not None and hasattr(mmap, "MADV_RANDOM"):
        try:
            raw.madvise(mmap.MADV_RANDOM)
        except (OSError, ValueError):  # advice only: an empty shard or an odd file system
            pass
    return array
