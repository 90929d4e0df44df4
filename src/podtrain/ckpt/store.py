"""The checkpoint's I/O seam: a directory-like store with atomic writes.

Checkpoints read and write only through these few methods, which are the subset of
``podtrain.storage``'s ``Store`` (``open_store(url)``) that checkpoints need; until that module is
merged, ``PosixStore`` implements them for a local or shared (FSx for Lustre, NFS) directory. The
S3 backend and the node-local tier slot in as other stores with the same methods: every tier is
one store object, and nothing in ``podtrain.ckpt`` touches the file system except through it
(``local_path`` lets POSIX-only niceties, such as renaming a directory aside, be skipped elsewhere).

Names are ``/``-separated and relative to the store's root. ``open_write`` is atomic: the file is
visible under its name only after the block exits cleanly (temporary name, fsync, rename, fsync of
the directory); an exception removes the temporary file.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, Iterator

from podtrain.errors import UserError
from podtrain.fsutil import fsync_dir

TMP_MARK = ".tmp-"
"""Temporary files (``open_write``) carry this in their name until renamed into place."""


class StorageError(UserError):
    """A store operation failed for a reason the user must fix (no space, read-only, missing)."""


@dataclass(frozen=True)
class Entry:
    """One stored file: its name (relative to the root) and size."""

    name: str
    size: int


class PosixStore:
    """A directory as a store (``podtrain.storage`` API subset; see the module docstring)."""

    is_local = True

    def __init__(self, root: str | os.PathLike) -> None:
        """``root``: the directory (created on the first write)."""
        self.root = Path(root)
        self.url = str(root)

    def _path(self, name: str) -> Path:
        return self.root / name if name else self.root

    def join(self, *parts: str) -> str:
        """A child name, ``/``-separated."""
        return "/".join(p.strip("/") for p in parts if p)

    def local_path(self, name: str) -> Path | None:
        """The file's path on this machine (POSIX stores only)."""
        return self._path(name)

    def exists(self, name: str) -> bool:
        """Whether a file or directory ``name`` exists."""
        return self._path(name).exists()

    def size(self, name: str) -> int:
        """Bytes of file ``name``."""
        return self._path(name).stat().st_size

    def read_bytes(self, name: str) -> bytes:
        """The whole file."""
        return self._path(name).read_bytes()

    def read_into(self, name: str, offset: int, buf) -> None:
        """Fill the writable buffer ``buf`` with the file's bytes from ``offset`` (EOFError if short)."""
        view = memoryview(buf).cast("B")
        with open(self._path(name), "rb", buffering=0) as fh:
            fh.seek(offset)
            while len(view):
                n = fh.readinto(view)
                if not n:
                    raise EOFError(f"{self._path(name)}: file ends before byte {offset + len(memoryview(buf).cast('B'))}")
                view = view[n:]

    def read_range(self, name: str, offset: int, length: int) -> bytes:
        """``length`` bytes of the file from ``offset``."""
        buf = bytearray(length)
        self.read_into(name, offset, buf)
        return bytes(buf)

    @contextlib.contextmanager
    def open_write(self, name: str) -> Iterator[BinaryIO]:
        """A file to write, visible as ``name`` only once the block exits cleanly."""
        final = self._path(name)
        tmp = final.parent / f"{TMP_MARK}{final.name}-{uuid.uuid4().hex[:8]}"
        try:
            final.parent.mkdir(parents=True, exist_ok=True)
            with open(tmp, "wb") as fh:
                yield fh
                fh.flush()
                os.fsync(fh.fileno())
            os.replace(tmp, final)
            fsync_dir(final.parent)
        except BaseException as exc:
            tmp.unlink(missing_ok=True)
            if isinstance(exc, OSError) and not isinstance(exc, (FileNotFoundError,)):
                raise StorageError(f"writing {final} failed: {exc.strerror or exc}") from exc
            raise

    def write_bytes(self, name: str, data: bytes) -> None:
        """Write a whole file atomically."""
        with self.open_write(name) as fh:
            fh.write(data)

    def list(self, prefix: str = "") -> list[Entry]:
        """Every file under ``prefix`` (recursive), names relative to the root, sorted."""
        base = self._path(prefix)
        if not base.is_dir():
            return []
        out = []
        for path in sorted(base.rglob("*")):
            if path.is_file():
                with contextlib.suppress(FileNotFoundError):
                    out.append(Entry(path.relative_to(self.root).as_posix(), path.stat().st_size))
        return out

    def list_dirs(self, prefix: str = "") -> list[str]:
        """Names of the immediate child directories of ``prefix``."""
        base = self._path(prefix)
        if not base.is_dir():
            return []
        return sorted(p.name for p in base.iterdir() if p.is_dir())

    def delete(self, name: str) -> None:
        """Remove one file (absent: nothing)."""
        self._path(name).unlink(missing_ok=True)

    def delete_prefix(self, prefix: str) -> None:
        """Remove everything under ``prefix``: renamed aside first so it vanishes at once."""
        path = self._path(prefix)
        if not path.exists():
            return
        trash = path.parent / f"{TMP_MARK}trash-{path.name}-{uuid.uuid4().hex[:8]}"
        try:
            os.rename(path, trash)
        except FileNotFoundError:
            return
        shutil.rmtree(trash, ignore_errors=True)


def open_store(url: str | os.PathLike) -> PosixStore:
    """The store for ``url`` (a directory path; ``s3://`` arrives with ``podtrain.storage``)."""
    if str(url).startswith("s3://"):
        raise UserError(f"ckpt.dir={url}: S3 checkpoints are not available in this build")
    return PosixStore(url)
