"""Reading sources into tasks for ``podtrain prepare``: slices of raw input, in corpus order.

An item is one slice of one source, small enough to hold in memory: a ``TextItem`` (a piece of a
text file), a ``JsonlItem`` (whole lines of a JSONL file) or a ``RowsItem`` (Parquet rows). Each
carries the source's ``name`` (what its documents' splits are hashed from) and ``where`` (the
path error messages name).

A task is a list of items of ~chunk_bytes. Tasks are cut by byte counts alone, so task i is the
same whatever the worker count; that is what makes the shards independent of it. Tasks are
pickled to the worker processes, so items are NamedTuples: as cheap to pickle as plain tuples.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import BinaryIO, NamedTuple, TypeAlias

from podtrain.data.prepare import compression
from podtrain.data.prepare.sources import Source, load_pyarrow, open_source, open_text, read_error
from podtrain.errors import UserError


class TextItem(NamedTuple):
    """A piece of a text file, starting at byte ``offset``; the document ends with it when ``last``."""

    name: str
    where: str
    data: bytes
    offset: int
    last: bool


class JsonlItem(NamedTuple):
    """Whole lines of a JSONL file, the first of them line number ``first_line`` (1-based)."""

    name: str
    where: str
    data: bytes
    first_line: int


class RowsItem(NamedTuple):
    """Parquet rows (raw bytes of the text column; ``None`` for a null), from row ``first_row``."""

    name: str
    where: str
    rows: list[bytes | None]
    first_row: int


Item: TypeAlias = TextItem | JsonlItem | RowsItem
Task: TypeAlias = list[Item]

WHITESPACE = frozenset(b" \t\n\r\x0b\x0c")
PARQUET_BATCH_ROWS = 256


def _cut_text(buf: bytes) -> int:
    """Where to end a piece of a large text file: after a newline that precedes a non-space.

    Cutting there keeps a byte-level BPE's pre-tokenization (which never merges across such a
    boundary) identical to encoding the file whole; failing that, any newline; failing that, a
    UTF-8 character boundary. Never 0: a text piece is always cut, however long its line.
    """
    pos = buf.rfind(b"\n", 0, len(buf) - 1)
    while pos >= 0 and buf[pos + 1] in WHITESPACE:
        pos = buf.rfind(b"\n", 0, pos)
    if pos >= 0:
        return pos + 1
    pos = buf.rfind(b"\n")
    if pos >= 0:
        return pos + 1
    # No newline at all: cut before the last character start (a byte that is not 0b10xxxxxx).
    for cut in range(len(buf) - 1, max(len(buf) - 5, 0), -1):
        if not 0x80 <= buf[cut] < 0xC0:
            return cut
    return len(buf)


def _cut_lines(buf: bytes) -> int:
    """After the last complete line; 0 (read on) while a JSONL line is longer than a chunk."""
    return buf.rfind(b"\n") + 1


def _read_full(fh: BinaryIO, n: int) -> bytes:
    """``n`` bytes, fewer only at the end (a raw stream, e.g. S3's, may return less per call)."""
    data = fh.read(n)
    if len(data) in (0, n):
        return data
    parts = [data]
    got = len(data)
    while got < n and (more := fh.read(n - got)):
        parts.append(more)
        got += len(more)
    return b"".join(parts)


def _pieces(src: Source, chunk: int, cut: Callable[[bytes], int]) -> Iterator[tuple[bytes, int, bool]]:
    """``(piece, offset, last)`` of a file read ``chunk`` bytes at a time (decompressed, for a
    compressed file: offsets count decompressed bytes) and cut where ``cut`` says; ``cut(buf) == 0``
    keeps reading. The last piece, possibly empty, has ``last`` true."""
    try:
        with open_text(src) as fh:
            carry, offset = b"", 0
            while True:
                data = _read_full(fh, chunk)
                buf = carry + data
                if len(data) < chunk:  # a short read is the end (_read_full reads on otherwise)
                    yield buf, offset, True
                    return
                n = cut(buf)
                if n == 0:
                    carry = buf
                    continue
                yield buf[:n], offset, False
                carry, offset = buf[n:], offset + n
    except (OSError, *compression.errors()) as exc:
        raise read_error(src, exc) from None


def _text_items(src: Source, chunk: int) -> Iterator[Item]:
    # The last piece is yielded even when empty: it closes the document of a file cut in pieces.
    for piece, offset, last in _pieces(src, chunk, _cut_text):
        yield TextItem(src.name, str(src.path), piece, offset, last)


def _jsonl_items(src: Source, chunk: int) -> Iterator[Item]:
    line = 1
    for piece, _, _ in _pieces(src, chunk, _cut_lines):
        if piece:
            yield JsonlItem(src.name, str(src.path), piece, line)
        line += piece.count(b"\n")


def _parquet_items(src: Source, text_field: str) -> Iterator[Item]:
    pa = load_pyarrow()
    row = 0
    try:
        with open_source(src) as fh:
            for batch in pa.parquet.ParquetFile(fh).iter_batches(batch_size=PARQUET_BATCH_ROWS,
                                                                 columns=[text_field]):
                col = batch.column(0)
                # Read as bytes so invalid UTF-8 meets the same --errors policy as text files.
                if pa.types.is_string(col.type):
                    col = col.cast(pa.binary())
                elif pa.types.is_large_string(col.type):
                    col = col.cast(pa.large_binary())
                rows = col.to_pylist()
                yield RowsItem(src.name, str(src.path), rows, row)
                row += len(rows)
    except (OSError, pa.ArrowException) as exc:
        raise UserError(f"{src.path}: cannot read Parquet ({str(exc).splitlines()[0]})") from None


def _items(sources: list[Source], chunk: int, text_field: str) -> Iterator[Item]:
    for src in sources:
        if src.kind == "text":
            yield from _text_items(src, chunk)
        elif src.kind == "jsonl":
            yield from _jsonl_items(src, chunk)
        else:
            yield from _parquet_items(src, text_field)


def _item_bytes(item: Item) -> int:
    if isinstance(item, RowsItem):
        return sum(len(r) for r in item.rows if r is not None)
    return len(item.data)


def plan_tasks(sources: list[Source], chunk: int, text_field: str) -> Iterator[tuple[Task, int]]:
    """Yield ``(task, raw_bytes)`` in order; each task holds about ``chunk`` bytes of raw text."""
    task: Task = []
    size = 0
    for item in _items(sources, chunk, text_field):
        task.append(item)
        size += _item_bytes(item)
        if size >= chunk:
            yield task, size
            task, size = [], 0
    if task:
        yield task, size
