"""One split of a prepared dataset as ONE continuous stream of tokens, local or on S3.

A split is the concatenation of its shards in manifest order, so a window may cross a shard
boundary: that makes the samples a function of the token stream alone, not of where prepare cut
the shards (a ``prepare --num-parts N`` + ``merge`` dataset holds the same stream as a one-shot
prepare with other cuts, and must give the same batches). Local shards are memory-mapped; shards
under ``s3://`` are read in blocks through ``data/cache.py``.

Nothing of a shard is touched until a window first reaches it: the stream's layout (where each
shard begins) comes from the manifest's token counts alone, so a rank stats, opens and maps only
the shards its own samples fall in (512 ranks x 20,000 shards would otherwise be 10 million
metadata operations on a shared file system at every start). A local shard's size is checked
against the manifest when it is opened; at most ``MAX_OPEN_SHARDS`` stay mapped (an LRU: each map
holds a file descriptor and a kernel map entry, and a corpus of 20,000 shards would exhaust both).
"""

from __future__ import annotations

import hashlib
import os
import threading
from collections import OrderedDict

import numpy as np

from podtrain.data.cache import BlockCache, CacheSpec, Key, Wanted
from podtrain.data.manifest import MANIFEST_NAME, Manifest, shard_sizes
from podtrain.errors import UserError

MAX_OPEN_SHARDS = 128
"""Local shards a split keeps memory-mapped at once (least recently used closed first): a rank's
windows of a step fall in at most a batch's worth of shards, so the bound costs no re-opening in
the common case, and it keeps the file descriptors and maps far below ``ulimit -n`` (often 1,024)
and ``vm.max_map_count`` (65,530) with any number of shards."""


class SplitTokens:
    """The tokens of ``split``: ``windows(starts, length)`` reads rows of consecutive tokens."""

    def __init__(self, manifest: Manifest, split: str):
        self.shards = manifest.shards(split)
        self.dtype = manifest.dtype
        self.remote = manifest.is_remote
        self.url = str(manifest.root)
        self._listed_in = manifest.root / MANIFEST_NAME
        if self.remote:  # the sizes the manifest was listed with: no request, no stat
            sizes = shard_sizes(manifest, self.shards)
            for shard in self.shards:
                self._check_size(shard, sizes.get(shard.name))
        self.bounds = np.concatenate([[0], np.cumsum([s.tokens for s in self.shards], dtype=np.int64)])
        self.total = int(self.bounds[-1])
        # a block's cache name: the shard's content hash (or, without one, its place and size)
        self._keys = [s.sha256 or hashlib.sha256(f"{self.url}/{s.name}:{s.tokens}".encode()).hexdigest()
                      for s in self.shards]
        # Local shards mapped so far, by index, least recently used first; opened lazily, by the
        # process that reads (memmaps do not survive fork well).
        self._open: OrderedDict[int, np.memmap] = OrderedDict()
        self.max_open = MAX_OPEN_SHARDS
        self._lock = threading.Lock()
        self.cache: BlockCache | None = None
        """S3 shards: the block cache they are read through (``DataSources.use_cache``); None: a
        cache of this split's own, of no budget, made at the first read."""

    def __getstate__(self):  # workers and forks reopen their own memmaps
        state = self.__dict__.copy()
        state["_open"] = OrderedDict()
        state["_lock"] = None
        return state

    def __setstate__(self, state):
        self.__dict__.update(state)
        self._lock = threading.Lock()

    def _check_size(self, shard, size: int | None) -> None:
        """A shard missing or of another length than the manifest says: one line naming it."""
        if size is None:
            raise UserError(f"shard {shard.path} listed in {self._listed_in} is missing")
        if size // self.dtype.itemsize != shard.tokens:
            raise UserError(f"shard {shard.path} holds {size // self.dtype.itemsize} tokens, the manifest "
                            f"says {shard.tokens}")

    def _array(self, k: int) -> np.memmap:
        """Local shard ``k``, memory-mapped at its first use (its size checked then), kept among
        the ``max_open`` most recently used."""
        with self._lock:  # the loader's producer and a caller (a test, a report) may read at once
            array = self._open.get(k)
            if array is not None:
                self._open.move_to_end(k)
                return array
            shard = self.shards[k]
            try:
                fh = open(shard.path, "rb")
            except OSError:
                self._check_size(shard, None)
            with fh:  # one open; the size from its descriptor (no separate stat); mmap keeps its own
                self._check_size(shard, os.fstat(fh.fileno()).st_size)
                array = _random_access(np.memmap(fh, dtype=self.dtype, mode="r"))
            self._open[k] = array
            while len(self._open) > self.max_open:
                self._open.popitem(last=False)  # its rows were copied out: dropping it unmaps it
            return array

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
            for row, parts in enumerate(pieces):
                for k, first, count, at in parts:
                    out[row, at:at + count] = self._array(k)[first:first + count]
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
