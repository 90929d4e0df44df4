"""Fewer, larger reads: the block-aligned chunks a rank needs, merged per file (pure, no I/O).

A resume needs many small ranges (a 100M-parameter model's share is ~100 pieces); on object
storage each read is a request with its own latency, so one ranged GET per piece is several times
slower than streaming the object. Chunks of the same file that touch or lie within ``gap`` bytes
of each other are read as one, up to ``cap`` bytes (one staging slab); every chunk keeps its own
place in the read, so its blocks are verified and copied out of the same buffer.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable

GAP_BYTES = 64 << 10
"""Largest hole merged over (read and thrown away): far less than a request's latency costs."""


@dataclass(frozen=True)
class Chunk:
    """One range a reader needs: ``length`` bytes of ``file`` at ``offset``; ``payload`` says
    what to do with them (opaque here)."""

    file: str
    offset: int
    length: int
    payload: Any = None


@dataclass
class Read:
    """One request: ``length`` bytes of ``file`` at ``offset``, holding ``chunks`` (each at
    ``chunk.offset - offset`` in the buffer)."""

    file: str
    offset: int
    length: int
    chunks: list[Chunk] = field(default_factory=list)


def split(file: str, offset: int, length: int, cap: int, payload_of) -> list[Chunk]:
    """``length`` bytes at ``offset`` as chunks of at most ``cap`` bytes (``cap`` a multiple of
    the checksum block, so every chunk but the last is whole blocks); ``payload_of(pos, n)`` gives
    each chunk's payload from its position in the range."""
    return [Chunk(file, offset + pos, min(cap, length - pos), payload_of(pos, min(cap, length - pos)))
            for pos in range(0, length, cap)]


def coalesce(chunks: Iterable[Chunk], cap: int, gap: int = GAP_BYTES) -> list[Read]:
    """Merge chunks of the same file whose ranges overlap, touch or are at most ``gap`` bytes
    apart into reads of at most ``cap`` bytes (a chunk longer than ``cap`` stays alone). Reads
    come file by file, by offset."""
    out: list[Read] = []
    for c in sorted(chunks, key=lambda c: (c.file, c.offset, c.length)):
        last = out[-1] if out else None
        end = max(last.offset + last.length, c.offset + c.length) if last else 0
        if last is not None and last.file == c.file and c.offset <= last.offset + last.length + gap \
                and end - last.offset <= cap:
            last.length = end - last.offset
            last.chunks.append(c)
        else:
            out.append(Read(c.file, c.offset, c.length, [c]))
    return out
