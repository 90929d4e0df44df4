"""The validation split's fallback document: a small corpus still gets one (issue 19, point 16).

A document is in the validation split when the hash of its name falls below ``val_fraction``
(``encode.is_val``). With few documents none may: 48 files at the default 3% have a 23% chance.
Then, when the corpus has at least two documents, the one whose hash is lowest (the one closest
to being drawn) is held out as well. The choice depends only on the documents' names, so it is the
same in every run, for every worker count and in every part of a ``--num-parts`` prepare (each
part computes it over the whole corpus).

Finding out reads document names in corpus order and stops at the first one that hashes into the
validation split: a real corpus stops within its first ~1/val_fraction documents; only a corpus
with no such document is read to the end (a small one, by construction, or a tiny fraction).
"""

from __future__ import annotations

import json
from collections.abc import Iterator

from podtrain.data.prepare import compression
from podtrain.data.prepare.encode import doc_hash, is_val
from podtrain.data.prepare.readers import JsonlItem, RowsItem, plan_tasks
from podtrain.data.prepare.sources import Source, open_text

SCAN_CHUNK_BYTES = 1 << 20


def document_names(sources: list[Source], text_field: str) -> Iterator[str]:
    """The names of the corpus's non-empty documents, in corpus order (what ``is_val`` hashes).

    Cheap approximations where reading would cost: a non-empty text file is one document (a
    compressed one when its first byte decompresses), and a JSONL line counts when its field is a
    non-empty string (malformed lines are left to the real pass, which names them).
    """
    for src in sources:
        if src.kind == "text":  # not read: a huge file would be read whole for its one name
            if src.size and (not src.codec or _decompresses_to_something(src)):
                yield src.name
            continue
        for task, _ in plan_tasks([src], SCAN_CHUNK_BYTES, text_field):
            for item in task:
                if isinstance(item, RowsItem):
                    yield from (f"{item.name}#{item.first_row + i}" for i, r in enumerate(item.rows) if r)
                elif isinstance(item, JsonlItem):
                    yield from (f"{item.name}:{item.first_line + i}"
                                for i, raw in enumerate(item.data.split(b"\n")) if _has_text(raw, text_field))


def _decompresses_to_something(src: Source) -> bool:
    """Whether a compressed file holds at least one byte (a corrupt one: left to the real pass)."""
    try:
        with open_text(src) as fh:
            return bool(fh.read(1))
    except (OSError, *compression.errors()):
        return True


def _has_text(raw: bytes, text_field: str) -> bool:
    if not raw.strip():
        return False
    try:
        obj = json.loads(raw)
    except ValueError:
        return False
    return isinstance(obj, dict) and isinstance(obj.get(text_field), str) and bool(obj[text_field])


def fallback_val_document(sources: list[Source], val_fraction: float, text_field: str) -> str | None:
    """The document to hold out for validation when no document's hash puts one there, else None.

    ``None`` too when ``val_fraction`` is 0 or the corpus has fewer than two documents (a single
    document cannot be both trained on and held out).
    """
    if val_fraction <= 0.0:
        return None
    best: tuple[int, str] | None = None
    count = 0
    for name in document_names(sources, text_field):
        if is_val(name, val_fraction):
            return None
        count += 1
        h = doc_hash(name)
        if best is None or h < best[0]:
            best = (h, name)
    return best[1] if best is not None and count >= 2 else None
