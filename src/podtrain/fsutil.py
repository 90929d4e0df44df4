"""Atomic file writes: a temporary name in the same directory, fsync, rename, fsync the directory.

A reader (another rank, a resumed run) therefore sees either the old file or the whole new one,
never half of it, even when the writer is killed mid-write.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import tempfile
import time
from pathlib import Path
from typing import BinaryIO, Iterator

from podtrain.errors import UserError

FILE_MODE = 0o644
"""Mode of published files when the umask cannot be read (what open() gives under umask 022)."""


def file_mode() -> int:
    """The mode a plain ``open()`` would give a new file: 0666 minus this process's umask.

    Read from /proc because ``os.umask`` can only be read by setting it, which races with other
    threads creating files; ``FILE_MODE`` where /proc does not say.
    """
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return 0o666 & ~int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    return FILE_MODE


@contextlib.contextmanager
def naming(path: str | os.PathLike) -> Iterator[None]:
    """Around writes to ``path``: an ``OSError`` that does not name its file (a buffered write, a
    flush, an fsync on an open file: the OS only gives the errno) gets ``path`` as its filename,
    so the one line ``errors.storage_error`` makes of a full or read-only disk says where."""
    try:
        yield
    except OSError as exc:
        if not exc.filename:
            exc.filename = str(path)
        raise


def writable_dir(path: str | os.PathLike) -> Path:
    """Create ``path`` (and its parents) and prove a file can be created in it; returns it.

    Called before work that would write there much later (a run's first checkpoint), so that a
    read-only or full disk, or a file where the folder should be, fails at once: the ``OSError``
    names the path, and ``errors.storage_error`` makes it one line.
    """
    path = Path(path)
    try:
        path.mkdir(parents=True, exist_ok=True)
    except FileNotFoundError as exc:
        # ENOENT from mkdir with parents: a parent that cannot hold folders (a pseudo file system
        # such as /proc, a mount gone meanwhile). The user's path to fix, where another ENOENT is
        # more likely a bug (``errors.STORAGE_ERRNOS`` leaves it out for that reason).
        raise UserError(f"cannot create {path}: {exc.filename} cannot hold folders "
                        "(a pseudo file system, or a mount that is gone); choose another location") from None
    try:
        fd, probe = tempfile.mkstemp(prefix=".podtrain-probe-", dir=path)
        try:
            os.write(fd, b"\0")
        finally:
            os.close(fd)
            os.unlink(probe)
    except OSError as exc:
        # The error names the probe's made-up file (or nothing): the user's folder is what to fix.
        exc.filename = str(path)
        raise
    return path


def fsync_path(path: Path) -> None:
    """Make ``path`` durable: a file's bytes, or a folder's entries (a rename or creation inside it)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def open_temp(path: Path) -> tuple[BinaryIO, Path]:
    """A new temporary file beside ``path`` to stream into, open for writing, and its name.

    Named ``.NAME.XXXXXXXX.tmp``: hidden, and findable by a cleanup after a killed run.
    """
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    return os.fdopen(fd, "wb"), Path(tmp)


def publish_temp(fh: BinaryIO, tmp: Path, path: Path) -> None:
    """Turn the finished temporary file ``tmp`` (open as ``fh``, which is closed) into ``path``.

    mkstemp creates 0600, but run and data directories on shared storage are read by other
    users' tools, so the file gets the mode a plain open() would have given; then its data is
    made durable before the rename, and the rename after it.
    """
    with naming(path):
        os.fchmod(fh.fileno(), file_mode())
        fh.flush()
        os.fsync(fh.fileno())
        fh.close()
        os.replace(tmp, path)
        fsync_path(Path(path).parent)


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` atomically."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fh, tmp = open_temp(path)
    try:
        with naming(path), fh:
            fh.write(data)
            publish_temp(fh, tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def atomic_write_text(path: Path, text: str) -> None:
    """Write ``text`` (UTF-8) to ``path`` atomically."""
    atomic_write_bytes(path, text.encode("utf-8"))


def sha256_file(path: Path, chunk: int = 1 << 22) -> str:
    """Hex SHA-256 of a file, read in 4 MiB chunks."""
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        while block := fh.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def flock_within(fd: int, timeout_s: float, poll_s: float = 0.05) -> bool:
    """Take an exclusive ``flock`` on ``fd``, waiting at most ``timeout_s``: True once held, False
    when another holder kept it that long. An ``OSError`` other than contention (a mount without
    flock support) propagates: each caller decides whether to go on unlocked."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            if time.monotonic() > deadline:
                return False
            time.sleep(poll_s)
