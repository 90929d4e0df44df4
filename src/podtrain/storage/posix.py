"""The POSIX backend: a directory on a local disk, NVMe, /dev/shm, FSx for Lustre or NFS.

Writes are atomic through ``fsutil`` (a hidden temporary name in the same directory, fsync, rename,
fsync of the directory), so a reader sees the old file or the whole new one. Reads go straight into
the caller's buffer (``readinto``: no intermediate copy), and ``local_path`` hands out the real path
for ``np.memmap``. A network file system's passing failures (ETIMEDOUT, ESTALE, a reset: see
``errors.from_os_error``) are retried under the store's ``RetryPolicy``; a full, read-only or
forbidden location is not.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import hashlib
import logging
import os
import stat
from pathlib import Path
from typing import BinaryIO

from podtrain.fsutil import file_mode, flock_within, fsync_path, open_temp, publish_temp
from podtrain.storage.base import Entry, Store, Writer
from podtrain.storage.buffers import byte_view, writable_view
from podtrain.storage.errors import NotFound, StorageError, from_os_error
from podtrain.storage.retry import RetryPolicy

log = logging.getLogger("podtrain.storage")

LOCK_WAIT_S = 10.0
"""Longest wait for a control file's lock (it is held for one read and one rename)."""
_NO_LOCKS = (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL)
"""flock failing for want of support (Lustre mounted without ``-o flock``), not for contention."""


def version_tag(data: bytes) -> str:
    """A POSIX control file's version tag: a digest of its bytes. Not the mtime (a coarse clock
    gives two writes in one tick the same one) nor the inode (freed by a rename, soon reused)."""
    return "b2:" + hashlib.blake2b(data, digest_size=16).hexdigest()


def _tag_if_same(path: Path, data) -> str | None:
    """The tag of ``path`` when it holds exactly ``data`` (this writer's own bytes), else None."""
    try:
        held = path.read_bytes()
    except FileNotFoundError:
        return None
    return version_tag(held) if held == bytes(byte_view(data)) else None


def is_temp_name(base: str) -> bool:
    """Whether ``base`` is an in-flight temporary file of ``fsutil.open_temp`` ('.NAME.XXXX.tmp')."""
    return base.startswith(".") and base.endswith(".tmp")


def is_lock_name(base: str) -> bool:
    """Whether ``base`` is a control file's lock file ('.NAME.lock': ``PosixStore.replace_if``)."""
    return base.startswith(".") and base.endswith(".lock")


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
        self._said_no_locks = False

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

    # control files: compare-and-swap (see ``Store``) ------------------------------------------
    @_retried
    def read_versioned(self, name: str) -> tuple[bytes, str]:
        """The bytes of ``name`` and their digest (its version tag)."""
        try:
            data = self._path(name).read_bytes()
        except OSError as exc:
            raise from_os_error(self.where(name), exc) from None
        return data, version_tag(data)

    def _complete_temp(self, path: Path, data) -> Path:
        """A temporary file beside ``path`` holding ``data``, durable, with a plain file's mode."""
        path.parent.mkdir(parents=True, exist_ok=True)
        fh, tmp = open_temp(path)
        try:
            with fh:
                fh.write(byte_view(data))
                os.fchmod(fh.fileno(), file_mode())
                fh.flush()
                os.fsync(fh.fileno())
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        return tmp

    @_retried
    def create_exclusive(self, name: str, data) -> str | None:
        """Hard-link a complete temporary file to ``name``: the link fails when the name exists,
        atomically on every POSIX file system (NFS and Lustre included), so one creator wins."""
        path = self._path(name)
        try:
            tmp = self._complete_temp(path, data)
            try:
                os.link(tmp, path)
            except FileExistsError:
                # ours after all when a retry follows a link that landed before a passing error
                return _tag_if_same(path, data)
            finally:
                tmp.unlink(missing_ok=True)
            fsync_path(path.parent)
        except OSError as exc:
            raise from_os_error(self.where(name), exc) from None
        return version_tag(bytes(byte_view(data)))

    @contextlib.contextmanager
    def _locked(self, name: str):
        """Hold the lock file ``.NAME.lock`` beside ``name`` (flock, waiting at most ``LOCK_WAIT_S``):
        every ``replace_if`` and ``delete_if`` of ``name`` compares and changes it under this lock.
        The lock file stays (removing a lock file others may hold would let two holders in)."""
        path = self._path(name)
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path.with_name(f".{path.name}.lock"), os.O_RDWR | os.O_CREAT, 0o666)
        try:
            try:
                if not flock_within(fd, LOCK_WAIT_S, poll_s=0.01):
                    raise StorageError(self.where(name), f"its lock .{path.name}.lock was held for more "
                                                         f"than {LOCK_WAIT_S:g} s")
            except OSError as exc:
                if exc.errno not in _NO_LOCKS:
                    raise
                # no lock on this mount: compare, then rename, as before the lock existed (two
                # writers landing within that instant are not told apart there)
                if not self._said_no_locks:
                    self._said_no_locks = True
                    log.warning("%s: the file system refuses flock (%s): control files are compared and "
                                "replaced without a lock (mount Lustre with -o flock)", self.url, exc.strerror)
            yield path
        finally:
            os.close(fd)

    @_retried
    def replace_if(self, name: str, data, tag: str) -> str | None:
        """Under ``name``'s lock: rename a complete temporary file over it if its digest is ``tag``."""
        try:
            tmp = self._complete_temp(self._path(name), data)
            try:
                with self._locked(name) as path:
                    try:
                        if version_tag(path.read_bytes()) != tag:
                            return _tag_if_same(path, data)  # a retry after our own rename landed
                    except FileNotFoundError:
                        return None
                    os.replace(tmp, path)
                    fsync_path(path.parent)
            finally:
                tmp.unlink(missing_ok=True)
        except OSError as exc:
            raise from_os_error(self.where(name), exc) from None
        return version_tag(bytes(byte_view(data)))

    @_retried
    def delete_if(self, name: str, tag: str) -> bool:
        """Under ``name``'s lock: remove it if its digest is ``tag``."""
        try:
            with self._locked(name) as path:
                try:
                    if version_tag(path.read_bytes()) != tag:
                        return False
                except FileNotFoundError:
                    return True
                path.unlink()
                fsync_path(path.parent)
        except OSError as exc:
            raise from_os_error(self.where(name), exc) from None
        return True

    @_retried
    def list(self, prefix: str = "") -> list[Entry]:
        """Every committed file whose name starts with ``prefix``, sorted by name (neither
        temporaries nor control files' lock files)."""
        out = []
        for name, ent in self._walk(prefix):
            if is_temp_name(ent.name) or is_lock_name(ent.name):
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
