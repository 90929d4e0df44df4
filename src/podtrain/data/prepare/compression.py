"""Compressed inputs of ``podtrain prepare``: ``.gz``, ``.bz2``, ``.xz`` and ``.zst`` text and JSONL,
decompressed as they are read (streaming: memory stays at one read buffer, whatever the file size).

The kind of a compressed file is the kind of the name under the compression suffix
(``web.jsonl.zst`` is JSONL). gzip, bzip2 and xz come with Python; zstd needs the standard library's
``compression.zstd`` (Python 3.14) or the ``zstandard`` package (``pip install 'podtrain[zstd]'``),
asked for only when a ``.zst`` file is met. Parquet compresses its own columns: a compressed
``.parquet`` file is not read.
"""

from __future__ import annotations

import bz2
import gzip
import lzma
from typing import Any, BinaryIO

from podtrain.errors import UserError

CODECS = {".gz": "gzip", ".bz2": "bzip2", ".xz": "xz", ".zst": "zstd"}
"""Compression suffix -> codec name."""
ZSTD_EXTRA = "pip install 'podtrain[zstd]'"


def split_suffix(name: str) -> tuple[str, str]:
    """``("web.jsonl", "zstd")`` for ``web.jsonl.zst``; ``(name, "")`` when not compressed."""
    for suffix, codec in CODECS.items():
        if name.lower().endswith(suffix) and len(name) > len(suffix):
            return name[: -len(suffix)], codec
    return name, ""


def _zstd() -> Any:
    """The zstd module there is: ``compression.zstd`` (Python 3.14+), else ``zstandard``, else None."""
    try:
        from compression import zstd  # type: ignore[import-not-found]  # Python 3.14+
        return zstd
    except ImportError:
        pass
    try:
        import zstandard
    except ImportError:
        return None
    return zstandard


def check_available(codec: str, where: str) -> None:
    """A one-line UserError naming ``where`` and the extra when ``codec`` cannot be read here."""
    if codec == "zstd" and _zstd() is None:
        raise UserError(f"{where}: reading .zst files needs the zstandard package: {ZSTD_EXTRA}")


def decompressing(raw: BinaryIO, codec: str) -> BinaryIO:
    """A binary stream of ``raw``'s decompressed bytes; concatenated members (frames) are read as
    one stream. Closing it may leave ``raw`` open: the caller closes ``raw``."""
    if codec == "gzip":
        return gzip.GzipFile(fileobj=raw, mode="rb")
    if codec == "bzip2":
        return bz2.BZ2File(raw, mode="rb")
    if codec == "xz":
        return lzma.LZMAFile(raw, mode="rb")
    zstd = _zstd()
    if zstd is None:  # resolve_inputs checked; a direct caller still gets the one line
        raise UserError(f"reading .zst files needs the zstandard package: {ZSTD_EXTRA}")
    if hasattr(zstd, "ZstdFile"):  # compression.zstd
        return zstd.ZstdFile(raw, mode="rb")
    # read_across_frames: files written by pzstd or in appended pieces are several frames.
    return zstd.ZstdDecompressor().stream_reader(raw, read_across_frames=True)


def errors() -> tuple[type[BaseException], ...]:
    """The exceptions a corrupt or truncated compressed file raises while being read (besides
    ``OSError``, which gzip and bzip2 raise for bad data)."""
    found: list[type[BaseException]] = [EOFError, lzma.LZMAError]
    zstd = _zstd()
    if zstd is not None:
        found.append(getattr(zstd, "ZstdError", EOFError))
    return tuple(found)
