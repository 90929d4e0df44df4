"""The ``Store`` interface every backend implements, and what the backends share.

Names are relative to the store's root, "/"-separated (``store.join("step_10", "rank_0.safetensors")``);
the same name means the same file on a POSIX path and under an ``s3://bucket/prefix``.
"""

from __future__ import annotations

import abc
import io
import pathlib
from dataclasses import dataclass
from typing import BinaryIO, Callable, Iterator, TypeVar

from podtrain.storage.errors import NotFound, StorageError
from podtrain.storage.retry import RetryPolicy

T = TypeVar("T")


@dataclass(frozen=True)
class Entry:
    """One file of a listing."""

    name: str
    """Relative to the store's root, "/"-separated."""
    size: int
    """Bytes."""
    version: str
    """Changes whenever the file is rewritten: the mtime in ns on POSIX, the ETag on S3."""


class Writer(abc.ABC):
    """A file being written; visible under its name only after ``commit`` (the ``with`` block's clean exit).

    An exception inside the ``with`` block, ``abort()``, or a writer dropped without ``commit`` leaves
    nothing visible (POSIX: the temporary file is removed; S3: the multipart upload is aborted).
    """

    name: str

    @abc.abstractmethod
    def write(self, data) -> int:
        """Append ``data`` (any bytes-like object: bytes, memoryview, numpy array); returns its length."""

    @abc.abstractmethod
    def tell(self) -> int:
        """Bytes written so far."""

    @abc.abstractmethod
    def commit(self) -> None:
        """Make the whole file visible under its name, atomically; the writer is then closed."""

    @abc.abstractmethod
    def abort(self) -> None:
        """Discard everything written; nothing becomes visible. Safe to call twice or after commit (no-op)."""

    def sync(self) -> None:
        """Push what was written so far to the device, still invisible (POSIX: fdatasync of the
        temporary file; elsewhere nothing): a long background write that calls it as it goes
        leaves little dirty data for another writer's fsync to wait for."""

    def __enter__(self) -> "Writer":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.commit()
        else:
            self.abort()

    def __del__(self) -> None:
        # a writer dropped without commit (its thread died, a caller forgot) must not publish anything
        try:
            self.abort()
        except Exception:  # noqa: BLE001 - nothing can be raised from a finaliser
            pass


class Store(abc.ABC):
    """One root (a POSIX directory or an ``s3://bucket/prefix``) to read, list and atomically write files."""

    url: str
    """The root as given: a path or ``s3://bucket/prefix`` (never holds a secret)."""
    is_local: bool = False
    """True on POSIX (``local_path`` gives a real path), False on S3."""
    retry: RetryPolicy
    """How this store retries transient failures (its own unless one was given to ``open_store``);
    ``store.retry.abandon()`` stops every retry of it, e.g. when a stop signal arrives."""

    def join(self, *parts: str) -> str:
        """A child name relative to the root: the parts joined by "/" (empty parts dropped)."""
        return "/".join(p.strip("/") for p in parts if p and p.strip("/"))

    def where(self, name: str) -> str:
        """The full url of ``name`` (for messages)."""
        return f"{self.url.rstrip('/')}/{name}" if name else self.url

    def check_name(self, name: str) -> str:
        """``name`` if it is a plain relative name (no "..", no leading "/"), else a ``StorageError``."""
        if not name or name.startswith("/") or ".." in name.split("/") or "\\" in name:
            raise StorageError(self.where(str(name)), "not a relative file name inside the store")
        return name

    # reads ------------------------------------------------------------------------------------
    @abc.abstractmethod
    def stat(self, name: str) -> Entry:
        """Size and version of the file ``name`` (``NotFound`` if it does not exist); the version
        changes whenever the file is rewritten (a cache of it is stale when it differs)."""

    def size(self, name: str) -> int:
        """Bytes in ``name`` (``NotFound`` if it does not exist)."""
        return self.stat(name).size

    def exists(self, name: str) -> bool:
        """Whether the file ``name`` exists."""
        try:
            self.size(name)
        except NotFound:
            return False
        return True

    @abc.abstractmethod
    def read_into(self, name: str, offset: int, buf) -> None:
        """Fill the writable buffer ``buf`` (bytearray, memoryview, numpy or torch uint8) with the bytes
        of ``name`` from ``offset``; a file shorter than ``offset + len(buf)`` is a ``StorageError``."""

    def read_range(self, name: str, offset: int, length: int) -> bytes:
        """``length`` bytes of ``name`` from ``offset`` (a short file is a ``StorageError``)."""
        buf = bytearray(length)
        self.read_into(name, offset, buf)
        return bytes(buf)

    def read_bytes(self, name: str) -> bytes:
        """The whole of ``name``."""
        return self.read_range(name, 0, self.size(name))

    def iter_chunks(self, name: str, chunk_bytes: int = 8 << 20, size: int | None = None) -> Iterator[bytes]:
        """``name`` in consecutive chunks of ``chunk_bytes`` (the last one shorter). ``size``: its
        size when already known (a listing): no request asks for it (S3: no HEAD); a file of
        another size then fails its last read (shorter) or is read only up to ``size``."""
        if chunk_bytes <= 0:
            raise ValueError("chunk_bytes must be positive")
        total = self.size(name) if size is None else size
        for offset in range(0, total, chunk_bytes):
            yield self.read_range(name, offset, min(chunk_bytes, total - offset))

    def open_read(self, name: str) -> BinaryIO:
        """A seekable, buffered binary file reading ``name``."""
        return io.BufferedReader(_RangeFile(self, name, self.size(name)), buffer_size=8 << 20)

    def local_path(self, name: str) -> pathlib.Path | None:
        """The real path of ``name`` (e.g. for ``np.memmap``) on POSIX; None on S3."""
        return None

    # writes -----------------------------------------------------------------------------------
    @abc.abstractmethod
    def open_write(self, name: str) -> Writer:
        """A ``Writer`` for ``name``: ``with store.open_write(name) as f: f.write(b)``; atomic."""

    def write_replayable(self, name: str, fill: Callable[[Writer], T]) -> T:
        """Write ``name`` atomically with ``fill(writer)`` and return what it returns; after a transient
        failure (of a part, of the commit) the partial file is discarded and ``fill`` is called again
        with a new writer, under the store's retry policy. So ``fill`` must write the same bytes each
        time (e.g. from buffers that stay valid until this returns)."""
        def once() -> T:
            with self.open_write(name) as fh:
                return fill(fh)

        return self.retry.run(self.where(name), once)

    def write_bytes(self, name: str, data) -> None:
        """Write ``data`` (bytes-like) to ``name`` atomically (the whole of it again after a transient failure)."""
        self.write_replayable(name, lambda fh: fh.write(data))

    # control files: compare-and-swap ----------------------------------------------------------
    # Small files that several jobs may write at once (a run's owner, its lease) change only through
    # these: each either happens on the version the caller saw or not at all, so two writers can never
    # both believe they won (S3: conditional requests; POSIX: an exclusive link, a lock file).
    # ``data`` must be unique to its writer (a holder's pid, start time, heartbeat): that is how a
    # retried request whose first try had in fact landed is recognised as the caller's own.
    @abc.abstractmethod
    def read_versioned(self, name: str) -> tuple[bytes, str]:
        """The whole of ``name`` and its version tag, read together (``NotFound`` if absent): the
        tag to give ``replace_if`` or ``delete_if`` to change exactly this content."""

    @abc.abstractmethod
    def create_exclusive(self, name: str, data) -> str | None:
        """Create ``name`` holding ``data`` only if no file of that name exists; its version tag,
        or None when one exists (another writer won: nothing was written)."""

    @abc.abstractmethod
    def replace_if(self, name: str, data, tag: str) -> str | None:
        """Replace ``name`` with ``data`` only if it still has version ``tag``; the new tag, or None
        when it was changed or removed since (nothing was written)."""

    @abc.abstractmethod
    def delete_if(self, name: str, tag: str) -> bool:
        """Remove ``name`` only if it still has version ``tag``: True when it is gone (removed now,
        or already absent), False when another version stands (it is left alone)."""

    # listing and deletion ---------------------------------------------------------------------
    @abc.abstractmethod
    def list(self, prefix: str = "") -> list[Entry]:
        """Every file whose name starts with ``prefix`` (a string prefix; end it with "/" to mean a
        directory), recursively, sorted by name. Files being written are not listed."""

    @abc.abstractmethod
    def list_dirs(self, prefix: str = "") -> list[str]:
        """Names (relative to the root, no trailing "/") of the immediate subdirectories of the
        directory ``prefix``, sorted. On S3 a "directory" exists only while it holds a file."""

    @abc.abstractmethod
    def delete(self, name: str) -> None:
        """Remove ``name``; a missing file is not an error."""

    def delete_many(self, names: list[str]) -> None:
        """Remove every file of ``names`` (missing ones are not an error). S3: in batches of up to
        1,000 keys per request (DeleteObjects); here, one ``delete`` each (POSIX: an unlink each)."""
        for name in names:
            self.delete(name)

    @abc.abstractmethod
    def delete_prefix(self, prefix: str) -> None:
        """Remove every file whose name starts with ``prefix`` (which must not be empty): one
        listing of ``prefix`` and its files deleted as ``delete_many`` does (S3: in batches)."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.url!r})"


class _RangeFile(io.RawIOBase):
    """A seekable raw file over ``Store.read_into``: what ``open_read`` buffers on stores without files."""

    def __init__(self, store: Store, name: str, size: int):
        self._store, self._name, self._size, self._pos = store, name, size, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._size}[whence]
        if base + offset < 0:
            raise ValueError(f"negative seek position {base + offset}")
        self._pos = base + offset
        return self._pos

    def readinto(self, buf) -> int:
        view = memoryview(buf).cast("B")
        n = max(0, min(len(view), self._size - self._pos))
        if n:
            self._store.read_into(self._name, self._pos, view[:n])
            self._pos += n
        return n
