"""The POSIX backend: a directory on a local disk, NVMe, /dev/shm, FSx for Lustre or NFS.

Writes are atomic through ``fsutil`` (a hidden temporary name in the same directory, fsync, rename,
fsync of the directory), so a reader sees the old file or the whole new one. Reads go straight into
the caller's buffer (``readinto``: no intermediate copy), and ``local_path`` hands out the real path
for ``np.memmap``. A network file system's passing failures (ETIMEDOUT, ESTALE, a reset: see
``errors.from_os_error``) are retried under the store's ``RetryPolicy``; a full, read-only or
forbidden location is not.
"""

from __future__ import annotations

import functools
import os
import stat
from pathlib import Path
from typing import BinaryIO

from podtrain.fsutil import open_temp, publish_temp
from podtrain.storage.base import Entry, Store, Writer
from podtrain.storage.buffers import byte_view, writable_view
from podtrain.storage.errors import NotFound, StorageError, from_os_error
from podtrain.storage.retry import RetryPolicy


def is_temp_name(base: str) -> bool:
    """Whether ``base`` is an in-flight temporary file of ``fsutil.open_temp`` ('.NAME.XXXX.tmp')."""
    return base.startswith(".") and base.endswith(".tmp")


def _retried(method):
    """``method(self, name, ...)`` under the store's retry policy (its errors name ``where(name)``)."""
    @functools.wraps(method)
    def run(self: "PosixStore", name: str = "", *args):
        return self.retry.run(self.where(name), lambda: method(self, name, *args))
    return run


class PosixWriter(Writer):
    """Streams into a temporary file beside the target; ``commit`` fsyncs and renames it into place."""

    def __init__(self, store: "PosixStore", name: str):
        self.name, self._url = name, store.where(name)
        self._path = store.root / name
        self._fh = None
        try:
            self._path.parent.mkdir(parents=True, exist_ok=True)
            self._fh, self._tmp = open_temp(self._path)
        except OSError as exc:
            raise from_os_error(self._url, exc) from None
        self._written = 0

    def write(self, data) -> int:
        """Append ``data`` (any bytes-like object); returns its length."""
        if self._fh is None:
            raise ValueError(f"{self._url}: write to a closed writer")
        view = byte_view(data)
        try:
            self._fh.write(view)
        except OSError as exc:
            self.abort()
            raise from_os_error(self._url, exc) from None
        self._written += len(view)
        return len(view)

    def tell(self) -> int:
        """Bytes written so far."""
        return self._written

    def sync(self) -> None:
        """fdatasync what was written so far (the file stays hidden until ``commit``)."""
        if self._fh is None:
            return
        try:
            self._fh.flush()
            os.fdatasync(self._fh.fileno())
        except OSError as exc:
            self.abort()
            raise from_os_error(self._url, exc) from None

    def commit(self) -> None:
        """fsync, rename over the target, fsync the directory: the file is now visible and durable."""
        if self._fh is None:
            raise ValueError(f"{self._url}: commit of a closed writer")
        fh, self._fh = self._fh, None
        try:
            publish_temp(fh, self._tmp, self._path)
        except OSError as exc:
            fh.close()
            self._tmp.unlink(missing_ok=True)
            raise from_os_error(self._url, exc) from None

    def abort(self) -> None:
        """Close and remove the temporary file; the target is untouched."""
        fh, self._fh = self._fh, None
        if fh is not None:
            fh.close()
            self._tmp.unlink(missing_ok=True)


class PosixStore(Store):
    """A ``Store`` on a directory (created on the first write)."""

    is_local = True

    def __init__(self, url: str, retry: RetryPolicy | None = None):
        self.url = str(url)
        self.root = Path(url)
        self.retry = retry if retry is not None else RetryPolicy()

    def _path(self, name: str) -> Path:
        return self.root / self.check_name(name)

    def local_path(self, name: str) -> Path:
        """The real path of ``name`` (whether or not it exists yet)."""
        return self._path(name)

    @_retried
    def stat(self, name: str) -> Entry:
        """Size and mtime (ns) of ``name``."""
        try:
            st = os.stat(self._path(name))
        except OSError as exc:
            raise from_os_error(self.where(name), exc) from None
        if not stat.S_ISREG(st.st_mode):
            raise NotFound(self.where(name), "not a file")
        return Entry(name, st.st_size, str(st.st_mtime_ns))

    def exists(self, name: str) -> bool:
        """Whether the file ``name`` exists."""
        return self._path(name).is_file()

    @_retried
    def read_into(self, name: str, offset: int, buf) -> None:
        """Fill ``buf`` from ``offset`` with ``readinto`` (no intermediate copy)."""
        view = writable_view(buf)
        try:
            with open(self._path(name), "rb", buffering=0) as fh:
                fh.seek(offset)
                got = 0
                while got < len(view):
                    n = fh.readinto(view[got:])
                    if not n:
                        break
                    got += n
        except OSError as exc:
            raise from_os_error(self.where(name), exc) from None
        if got != len(view):
            raise StorageError(self.where(name), f"short read: wanted {len(view)} bytes at offset {offset}, "
                                                 f"the file ends after {offset + got}")

    @_retried
    def open_read(self, name: str) -> BinaryIO:
        """The file itself, opened for buffered binary reading."""
        try:
            return open(self._path(name), "rb")
        except OSError as exc:
            raise from_os_error(self.where(name), exc) from None

    def open_write(self, name: str) -> PosixWriter:
        """A writer to a temporary file beside ``name``, renamed into place on commit."""
        return PosixWriter(self, self.check_name(name))

    def _walk(self, prefix: str, dirs: list | None = None):
        """(relative name, DirEntry) of every file under the directory part of ``prefix``, temporaries
        included; the directories whose names start with ``prefix`` are appended to ``dirs``."""
        top = prefix.rsplit("/", 1)[0] if "/" in prefix else ""
        stack = [top]
        while stack:
            rel = stack.pop()
            try:
                entries = list(os.scandir(self.root / rel if rel else self.root))
            except FileNotFoundError:
                continue
            except OSError as exc:
                raise from_os_error(self.where(rel), exc) from None
            for ent in entries:
                child = f"{rel}/{ent.name}" if rel else ent.name
                if ent.is_dir(follow_symlinks=False):
                    if child.startswith(prefix) or prefix.startswith(child + "/"):
                        stack.append(child)
                    if dirs is not None and child.startswith(prefix):
                        dirs.append(child)
                elif child.startswith(prefix):
                    yield child, ent

    @_retried
    def list(self, prefix: str = "") -> list[Entry]:
        """Every committed file whose name starts with ``prefix``, sorted by name."""
        out = []
        for name, ent in self._walk(prefix):
            if is_temp_name(ent.name):
                continue
            try:
                st = ent.stat(follow_symlinks=True)
            except FileNotFoundError:  # deleted while listing
                continue
            out.append(Entry(name, st.st_size, str(st.st_mtime_ns)))
        return sorted(out, key=lambda e: e.name)

    @_retried
    def list_dirs(self, prefix: str = "") -> list[str]:
        """The immediate subdirectories of the directory ``prefix`` (empty ones included)."""
        prefix = prefix.strip("/")
        try:
            entries = list(os.scandir(self.root / prefix if prefix else self.root))
        except (FileNotFoundError, NotADirectoryError):
            return []
        except OSError as exc:
            raise from_os_error(self.where(prefix), exc) from None
        return sorted(self.join(prefix, e.name) for e in entries if e.is_dir(follow_symlinks=False))

    @_retried
    def delete(self, name: str) -> None:
        """Remove ``name`` if it exists."""
        try:
            self._path(name).unlink(missing_ok=True)
        except OSError as exc:
            raise from_os_error(self.where(name), exc) from None

    @_retried
    def delete_prefix(self, prefix: str) -> None:
        """Remove every file (temporaries too) whose name starts with ``prefix``, then the emptied directories."""
        if not prefix:
            raise ValueError("delete_prefix needs a non-empty prefix (it would empty the whole store)")
        dirs: list[str] = []
        try:
            for name, _ in list(self._walk(prefix, dirs)):
                (self.root / name).unlink(missing_ok=True)
            top = prefix.rstrip("/")
            if prefix.endswith("/") and (self.root / top).is_dir():
                dirs.append(top)
            for d in sorted(set(dirs), key=len, reverse=True):
                try:
                    (self.root / d).rmdir()
                except OSError:  # not empty (a file appeared, or not ours to remove): keep it
                    pass
        except OSError as exc:
            raise from_os_error(self.where(prefix), exc) from None
