"""Who writes and who reads which bytes of a checkpoint: pure functions, no I/O, no collectives.

Every tensor of a checkpoint (weights ``model/<name>``, optimizer state ``optim/<name>.<key>``)
is stored as *pieces*: a flat element range ``[start, start + count)`` of the tensor in row-major
order, held in one rank's file at a byte ``offset``. Each piece carries a CRC-32 per block of
``BLOCK_BYTES`` (counted from the piece's first byte), so a reader verifies exactly the blocks it
reads, in the same pass, whatever part of a piece it needs.

Writing: a tensor that every rank holds whole (DDP; the few plain tensors of an FSDP run) is split
by ``split_even``: the tensors, concatenated in a fixed order, cut into ``world`` contiguous
byte-balanced ranges, so the ranks write ~1/N each, in parallel. A DTensor shard (FSDP/HSDP) is
written by the rank holding it (``shard_range``: FSDP2 shards dim 0, so a shard is one flat range).

Reading: a rank reads what its own targets need; for tensors every rank holds whole, the readers
split the work the same way (``split_even`` over this run's ranks) and broadcast the rest.
"""

from __future__ import annotations

import base64
import math
import struct
import zlib
from dataclasses import dataclass
from typing import Iterable, Sequence

BLOCK_BYTES = 256 << 10
"""Checksum granularity: a reader of any part of a piece reads (and verifies) whole blocks, so a
rank reads at most two extra blocks per tensor range it needs; the manifest holds 4 bytes per block."""


@dataclass(frozen=True)
class Piece:
    """One stored flat range of a tensor."""

    tensor: str
    start: int
    """First element (row-major) of the range."""
    count: int
    """Elements in the range."""
    file: str
    offset: int
    """Byte offset of the range in ``file``."""
    crcs: tuple[int, ...]
    """CRC-32 of each ``BLOCK_BYTES`` block of the range's bytes."""

    def to_json(self) -> list:
        """Compact manifest form: ``[tensor, start, count, offset, base64 of the CRCs]``."""
        raw = struct.pack(f"<{len(self.crcs)}I", *self.crcs)
        return [self.tensor, self.start, self.count, self.offset, base64.b64encode(raw).decode()]

    @staticmethod
    def from_json(file: str, item: Sequence) -> "Piece":
        """Inverse of ``to_json`` for a piece of ``file``."""
        tensor, start, count, offset, crcs = item
        raw = base64.b64decode(crcs)
        return Piece(str(tensor), int(start), int(count), file, int(offset),
                     struct.unpack(f"<{len(raw) // 4}I", raw))


def split_even(items: Sequence[tuple[str, int, int]], world: int) -> list[list[tuple[str, int, int]]]:
    """Cut tensors ``(name, numel, element_size)``, concatenated in the given order, into ``world``
    contiguous ranges of ~equal bytes (cut at element boundaries). Returns, for each rank, its
    ``(name, start, count)`` element ranges, in order. Every rank computes the same from the same input."""
    total = sum(n * e for _, n, e in items)
    bounds = [total * r // world for r in range(world + 1)]
    out: list[list[tuple[str, int, int]]] = [[] for _ in range(world)]
    pos = 0  # byte position of the current tensor's first element in the concatenation
    rank = 0
    for name, numel, esize in items:
        nbytes = numel * esize
        start = 0
        while start < numel:
            while rank < world - 1 and bounds[rank + 1] <= pos + start * esize:
                rank += 1
            end_byte = bounds[rank + 1] - pos if rank < world - 1 else nbytes
            end = min(numel, max(start + 1, -(-end_byte // esize)))  # round up to an element
            out[rank].append((name, start, end - start))
            start = end
        pos += nbytes
    return out


def shard_range(shape: Sequence[int], shard_index: int, num_shards: int) -> tuple[int, int]:
    """``(start, count)`` in elements of shard ``shard_index`` of ``num_shards`` along dim 0, as
    ``torch.chunk`` (and so FSDP2's ``Shard(0)``) cuts it: ``ceil(rows / n)`` rows per shard, the
    last shards shorter or empty."""
    rows, per_row, chunk = _rows(shape, num_shards)
    first = min(rows, shard_index * chunk)
    last = min(rows, first + chunk)
    return first * per_row, (last - first) * per_row


def block_crcs(data: memoryview | bytes, block: int = BLOCK_BYTES) -> list[int]:
    """CRC-32 of each ``block``-byte block of ``data`` (the last one may be shorter)."""
    view = memoryview(data).cast("B")
    return [zlib.crc32(view[i:i + block]) for i in range(0, len(view), block)] or [zlib.crc32(b"")]


@dataclass(frozen=True)
class Span:
    """What a reader fetches to get elements of one piece: whole blocks, verified on arrival."""

    piece: Piece
    first_block: int
    last_block: int
    """Inclusive."""
    want_start: int
    """First wanted element of the tensor (inside this piece)."""
    want_count: int

    def byte_range(self, esize: int, block: int = BLOCK_BYTES) -> tuple[int, int]:
        """``(file offset, length)`` of the blocks to read."""
        begin = self.first_block * block
        end = min((self.last_block + 1) * block, self.piece.count * esize)
        return self.piece.offset + begin, end - begin


def spans(pieces: Iterable[Piece], start: int, count: int, esize: int, block: int = BLOCK_BYTES) -> list[Span]:
    """The block spans of ``pieces`` (one tensor's) covering elements ``[start, start + count)``.
    Raises ``ValueError`` when the pieces do not cover the range (a checkpoint missing data)."""
    out: list[Span] = []
    covered = 0
    for p in pieces:
        lo, hi = max(start, p.start), min(start + count, p.start + p.count)
        if lo >= hi:
            continue
        first = (lo - p.start) * esize // block
        last = ((hi - p.start) * esize - 1) // block
        out.append(Span(p, first, last, lo, hi - lo))
        covered += hi - lo
    if covered != count:
        raise ValueError(f"elements {start}..{start + count} are not all stored ({covered} found)")
    return out


def assign_replicas(items: Sequence[tuple[str, int]], replicas: int) -> dict[str, int]:
    """Which replica group writes (and, at resume, reads) each sharded tensor ``(name, bytes)``:
    byte-balanced (largest first, to the least loaded group; ties by name and group index), so
    each of ``replicas`` groups moves ~1/R of the checkpoint. Every rank computes the same."""
    load = [0] * max(1, replicas)
    out: dict[str, int] = {}
    for name, nbytes in sorted(items, key=lambda item: (-item[1], item[0])):
        group = min(range(len(load)), key=lambda g: (load[g], g))
        out[name] = group
        load[group] += nbytes
    return out


def shards_overlapping(shape: Sequence[int], num_shards: int, start: int, count: int) -> range:
    """The indices of the ``shard_range`` shards (of ``num_shards``) holding any of elements
    ``[start, start + count)``: O(1), whatever the number of shards."""
    if count <= 0:
        return range(0)
    _, per_row, chunk = _rows(shape, num_shards)
    chunk = max(1, chunk)
    first, last = start // per_row // chunk, (start + count - 1) // per_row // chunk
    return range(min(first, num_shards - 1), min(last, num_shards - 1) + 1)


def _rows(shape: Sequence[int], num_shards: int) -> tuple[int, int, int]:
    """``(rows, elements per row, rows per shard)`` of a tensor cut along dim 0 as ``torch.chunk`` cuts it."""
    rows = shape[0] if shape else 1
    return rows, math.prod(shape[1:]), -(-rows // num_shards)
