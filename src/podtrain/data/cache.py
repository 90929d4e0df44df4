"""Shards on S3, read in fixed blocks through a bounded cache on local disk, fetched ahead.

Why blocks: a sample is a few KB, and an S3 GET costs a request whatever its size; a block
(``block_bytes``: up to 256 KiB) serves every sample that falls in it while it is cached, and a
window that crosses a block or shard edge is stitched from two. Blocks are cached under
``data.cache_dir`` as files named by the shard's SHA-256 (content, not url: data prepared again
under the same prefix never reads stale blocks), and evicted least recently used so the cache
stays within ``data.cache_gb``. Each file is a small header (magic, CRC-32 and length of the
block) and the block, written to a temporary name, fsynced and renamed. A file whose header or
CRC does not match when a process first reads it (a node that crashed may leave a file of the
right size full of zeros: the rename reached the disk, the data did not) is deleted and fetched
again, with one warning; a block is trained on only as it is on S3.

Each process of a node owns one slot folder (``local_I``) and ``cache_gb / local_world_size`` of
the budget, so no two processes account for the same files. Data-parallel ranks read disjoint
samples, so sharing would save little; a restart with the same layout finds its own blocks.

Missing blocks are fetched by a thread pool; ``warm`` starts the fetches of the NEXT batch while
the loader's producer assembles this one (read-ahead on top of the loader's ``data.prefetch``
ready batches). The pool, the store and the S3 client are made lazily in the process that reads
(after ranks and DataLoader workers fork: a CRT client does not survive a fork).
"""

from __future__ import annotations

import logging
import os
import struct
import threading
import zlib
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from podtrain.storage import Store, open_store
from podtrain.storage.s3_client import S3Clients, active_clients

log = logging.getLogger("podtrain")

BLOCK_MAX = 256 << 10
BLOCK_MIN = 4 << 10
BLOCKS_IN_BUDGET = 64
"""A slot's budget holds at least this many blocks (so a tiny cap makes smaller blocks, not thrash)."""
FETCH_THREADS = 16
HEADER = struct.Struct("<4sIQ")
"""Before each cached block: magic, CRC-32 of the block, its length in bytes."""
MAGIC = b"PTB1"


@dataclass(frozen=True)
class CacheSpec:
    """Where S3 blocks are cached and how much may be kept (``data.cache_dir``, ``data.cache_gb``).

    ``slot, slots``: this process's local rank and the processes per node.
    """

    cache_dir: str
    cap_bytes: int
    slot: int = 0
    slots: int = 1

    @property
    def slot_bytes(self) -> int:
        """This process's share of the budget."""
        return self.cap_bytes // max(1, self.slots)

    @property
    def block_bytes(self) -> int:
        """Block size: the largest power of two <= BLOCK_MAX that leaves ``BLOCKS_IN_BUDGET``
        blocks in the slot's budget (at least BLOCK_MIN)."""
        size = BLOCK_MAX
        while size > BLOCK_MIN and size * BLOCKS_IN_BUDGET > self.slot_bytes:
            size //= 2
        return size


def default_cache_dir() -> str:
    """``$PODTRAIN_CACHE/data``, else ``$XDG_CACHE_HOME/podtrain/data``, else ``~/.cache/podtrain/data``."""
    root = os.environ.get("PODTRAIN_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "podtrain")
    return os.path.join(root, "data")


Key = tuple[str, str, int]
"""A block: (data directory url, shard name, block index)."""
Wanted = dict[Key, tuple[str, int]]
"""Blocks to read, each with its shard's SHA-256 and the block's length in bytes."""


class BlockCache:
    """Blocks of shards on S3, cached under ``spec``. One per data sources (``DataSources.use_cache``:
    every split and source shares its budget), closed with their loader.

    ``clients``: the S3 clients its stores share; None: those of the enclosing
    ``storage.shared_s3_clients()`` block (taken now: the fetch threads do not see the block),
    else its own, closed with it.
    """

    def __init__(self, spec: CacheSpec, clients: S3Clients | None = None):
        clients = clients if clients is not None else active_clients()
        self._owns_clients = clients is None
        self._clients = S3Clients() if clients is None else clients
        self.spec = spec
        self.block = spec.block_bytes
        self.dir = Path(spec.cache_dir or default_cache_dir()) / f"{self.block >> 10}k" / f"local_{spec.slot}"
        self._pid: int | None = None
        self._lock = threading.Lock()
        self._writable = True

    def __getstate__(self):  # a worker process makes its own pool, stores, clients and index
        state = self.__dict__.copy()
        state["_pid"] = None
        state["_owns_clients"] = True  # ``_clients`` arrives empty: the worker's own
        for key in ("_lock", "_pool", "_stores", "_files", "_inflight", "_checked"):
            state.pop(key, None)
        return state

    def __setstate__(self, state):
        self.__dict__.update(state)
        self._lock = threading.Lock()

    def _ready(self) -> None:
        """Open the store, the pool and the index of cached files in this process (after a fork)."""
        if self._pid == os.getpid():
            return
        with self._lock:
            if self._pid == os.getpid():
                return
            self._stores: dict[str, Store] = {}
            self._pool = ThreadPoolExecutor(FETCH_THREADS, thread_name_prefix="podtrain-s3")
            self._inflight: dict[Key, Future] = {}
            self._files: OrderedDict[str, int] = OrderedDict()  # file name -> bytes, least recent first
            self._checked: set[str] = set()  # files whose CRC this process has verified (or written)
            self._corrupt_seen = False
            try:
                self.dir.mkdir(parents=True, exist_ok=True)
                found = sorted(os.scandir(self.dir), key=lambda e: e.stat().st_mtime_ns)
                for entry in found:
                    if entry.name.startswith("."):
                        os.unlink(entry.path)  # a temporary file a killed process left
                    else:
                        self._files[entry.name] = entry.stat().st_size
            except OSError as exc:
                self._no_disk(exc)
            self._pid = os.getpid()
            self._evict(0)

    @property
    def used_bytes(self) -> int:
        """Bytes of cached blocks this process accounts for (within ``spec.slot_bytes``)."""
        self._ready()
        return sum(self._files.values())

    def _file(self, sha: str, j: int) -> str:
        return f"{sha[:32]}.{j}"

    def _holds(self, file: str, length: int) -> bool:
        """Whether ``file`` is cached with a block of ``length`` bytes (lock held)."""
        return self._files.get(file) == HEADER.size + length

    def _fetch(self, key: Key, sha: str, length: int) -> np.ndarray:
        url, name, j = key
        store = self._stores.get(url)
        if store is None:
            store = self._stores[url] = open_store(url, clients=self._clients)
        buf = np.empty(length, dtype=np.uint8)
        store.read_into(name, j * self.block, buf)
        self._keep(self._file(sha, j), buf)
        return buf

    def _keep(self, file: str, buf: np.ndarray) -> None:
        """Write a fetched block into the cache (header + block, fsync, rename) and evict down to the budget."""
        size = HEADER.size + len(buf)
        if not self._writable or size > self.spec.slot_bytes:
            return
        with self._lock:
            self._evict(size)
        tmp = self.dir / f".{file}.{os.getpid()}.{threading.get_ident()}"
        try:
            with open(tmp, "wb") as fh:
                fh.write(HEADER.pack(MAGIC, zlib.crc32(buf), len(buf)))
                fh.write(memoryview(buf))
                fh.flush()
                os.fsync(fh.fileno())  # the data on disk before the name: never a named file of zeros
            os.replace(tmp, self.dir / file)
        except OSError as exc:
            self._no_disk(exc)
            tmp.unlink(missing_ok=True)
            return
        with self._lock:
            self._files[file] = size
            self._files.move_to_end(file)
            self._checked.add(file)
            self._evict(0)  # fetch threads that made room at once may together have overshot it

    def _evict(self, incoming: int) -> None:
        """Remove least recently used blocks until ``incoming`` more bytes fit (lock held)."""
        total = sum(self._files.values())
        while self._files and total + incoming > self.spec.slot_bytes:
            file, size = self._files.popitem(last=False)
            self._checked.discard(file)
            total -= size
            try:
                os.unlink(self.dir / file)
            except OSError:
                pass

    def _no_disk(self, exc: OSError) -> None:
        if self._writable:
            log.warning("data cache %s: %s; reading S3 blocks without caching them", self.dir, exc)
        self._writable = False

    def _cached(self, sha: str, j: int, length: int) -> np.ndarray | None:
        """The cached block (a read-only mapping), or None when it is not cached or fails its check."""
        file = self._file(sha, j)
        with self._lock:
            known = self._holds(file, length)
            checked = file in self._checked
            if known:
                self._files.move_to_end(file)
        if not known:
            return None
        try:  # a mapping stays valid if the file is evicted meanwhile
            whole = np.memmap(self.dir / file, dtype=np.uint8, mode="r")
        except (OSError, ValueError):
            return None
        block = whole[HEADER.size:]
        if not checked:
            magic, crc, size = HEADER.unpack(whole[:HEADER.size].tobytes())
            if magic != MAGIC or size != length or zlib.crc32(block) != crc:
                self._discard(file, "its checksum does not match (a torn write, e.g. a crash before the data "
                                    "reached the disk)")
                return None
            with self._lock:
                self._checked.add(file)
        return block

    def _discard(self, file: str, why: str) -> None:
        """Delete a bad cached block (it is fetched again); warn the first time."""
        with self._lock:
            self._files.pop(file, None)
            self._checked.discard(file)
            first, self._corrupt_seen = not self._corrupt_seen, True
        try:
            os.unlink(self.dir / file)
        except OSError:
            pass
        (log.warning if first else log.debug)("data cache %s: block %s discarded and fetched again: %s%s",
                                               self.dir, file, why,
                                               " (further ones are logged at debug level)" if first else "")

    def warm(self, wanted: Wanted) -> None:
        """Start fetching the wanted blocks that are neither cached nor in flight (returns at once)."""
        self._ready()
        for key, (sha, length) in wanted.items():
            with self._lock:
                if key in self._inflight or self._holds(self._file(sha, key[2]), length):
                    continue
                self._inflight[key] = self._pool.submit(self._fetch, key, sha, length)

    def wait_fetches(self) -> None:
        """Return once every fetch started so far (``warm``'s read-ahead included) has ended: its
        block is cached, or it failed (the failure is raised by ``blocks``, not here)."""
        self._ready()
        with self._lock:
            pending = list(self._inflight.values())
        for future in pending:
            future.exception()

    def blocks(self, wanted: Wanted) -> dict[Key, np.ndarray]:
        """The bytes of every wanted block: from the cache, an in-flight fetch, or fetched now (in parallel)."""
        self.warm(wanted)
        out = {}
        for key, (sha, length) in wanted.items():
            with self._lock:
                future = self._inflight.pop(key, None)
            got = future.result() if future is not None else self._cached(sha, key[2], length)
            if got is None:  # evicted between warm and now (a tiny budget): fetch it again
                got = self._fetch(key, sha, length)
            out[key] = got
        return out

    def close(self) -> None:
        """Release the fetch threads and the stores (the loader's end): fetches not started are
        cancelled, those running finish (one block each). The cached files stay; a later read
        opens the cache again."""
        with self._lock:
            if self._pid != os.getpid():
                return  # nothing opened in this process
            self._pid = None
            pool, self._stores, self._inflight = self._pool, {}, {}
        pool.shutdown(wait=True, cancel_futures=True)
        if self._owns_clients:
            self._clients.close()
