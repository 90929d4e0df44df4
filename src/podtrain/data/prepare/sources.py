"""Input resolution for ``podtrain prepare``: INPUTs (files, directories, globs, ``builtin``) to
an ordered list of source files, each with the name its documents are hashed by.

A source's name: its path relative to the INPUT directory; a file named directly: its file name;
a glob match: the path as matched. Nothing is read beyond ``stat`` and the Parquet schema, so
every bad INPUT is reported before ``prepare`` writes anything.
"""

from __future__ import annotations

import glob
import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from podtrain.data.prepare import builtin as builtin_corpus
from podtrain.errors import UserError

TEXT_SUFFIXES = frozenset({
    ".txt", ".text", ".md", ".markdown", ".rst", ".tex", ".py", ".pyi", ".c", ".h", ".cc", ".cpp",
    ".hpp", ".cu", ".js", ".ts", ".java", ".go", ".rs", ".rb", ".sh", ".html", ".css", ".xml",
    ".toml", ".yaml", ".yml", ".ini", ".cfg", ".csv", ".tsv",
})
JSONL_SUFFIXES = frozenset({".jsonl", ".ndjson"})
PARQUET_SUFFIXES = frozenset({".parquet"})


@dataclass(frozen=True)
class Source:
    """One input file: its kind, the name its documents are hashed by, where it lies."""

    input: str
    name: str
    path: Path
    kind: str          # text | jsonl | parquet
    size: int
    mtime_ns: int


def _kind_of(path: Path, explicit: bool) -> str | None:
    suffix = path.suffix.lower()
    if suffix in JSONL_SUFFIXES:
        return "jsonl"
    if suffix in PARQUET_SUFFIXES:
        return "parquet"
    if suffix in TEXT_SUFFIXES or explicit:
        # A file named on the command line is text whatever its suffix: the user asked for it.
        return "text"
    return None


def _source(inp: str, name: str, path: Path, kind: str) -> Source:
    try:
        st = path.stat()
    except OSError as exc:
        raise UserError(f"{path}: cannot read ({exc.strerror})") from None
    return Source(inp, name, path, kind, st.st_size, st.st_mtime_ns)


def _walk_dir(inp: str, root: Path) -> list[Source]:
    found: list[tuple[str, Path, str]] = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if not d.startswith(".")]  # .git, .prepare, ...
        for fname in filenames:
            path = Path(dirpath) / fname
            kind = None if fname.startswith(".") else _kind_of(path, explicit=False)
            if kind is not None:
                found.append((path.relative_to(root).as_posix(), path, kind))
    found.sort()
    if not found:
        raise UserError(f"{inp}: directory holds no text, .jsonl or .parquet files")
    return [_source(inp, name, path, kind) for name, path, kind in found]


def _expand(inp: str, builtin_bytes: int) -> list[Source]:
    if inp == "builtin":
        return [Source("builtin", f.name, f.path, "text", f.size, f.path.stat().st_mtime_ns)
                for f in builtin_corpus.builtin_files(builtin_bytes)]
    path = Path(inp)
    if path.is_dir():
        return _walk_dir(inp, path)
    if path.is_file():
        return [_source(inp, path.name, path, _kind_of(path, explicit=True) or "text")]
    if glob.has_magic(inp):
        matches = sorted(glob.glob(inp, recursive=True))
        if not matches:
            raise UserError(f"{inp}: no file matches this pattern")
        out: list[Source] = []
        for m in matches:
            mp = Path(m)
            if mp.is_dir():
                out.extend(_walk_dir(m, mp))
            elif mp.is_file() and (kind := _kind_of(mp, explicit=True)):
                out.append(_source(inp, mp.as_posix(), mp, kind))
        return out
    raise UserError(f"{inp}: no such file or directory")


def resolve_inputs(inputs: Iterable[str], builtin_bytes: int = builtin_corpus.DEFAULT_BUILTIN_BYTES,
                   text_field: str = "text") -> list[Source]:
    """Expand INPUTs (files, directories, globs, ``builtin``) into sources, in a deterministic order.

    A path that does not exist, a glob with no match, or a Parquet file without ``text_field`` is
    a one-line user error; nothing is written before this succeeds.
    """
    seen: set[tuple[int, int]] = set()
    sources: list[Source] = []
    for inp in inputs:
        for src in _expand(inp, builtin_bytes):
            st = os.stat(src.path)
            if (st.st_dev, st.st_ino) not in seen:  # the same file named twice is read once
                seen.add((st.st_dev, st.st_ino))
                sources.append(src)
    for src in sources:
        if src.kind == "parquet":
            _check_parquet(src, text_field)
    return sources


def load_pyarrow() -> Any:
    """The ``pyarrow`` module with its Parquet reader; a user error saying how to install it.

    Imported on first use: pyarrow is an optional extra, and heavy for corpora without Parquet.
    """
    try:
        import pyarrow
        import pyarrow.parquet  # noqa: F401
    except ImportError:
        raise UserError("reading Parquet needs pyarrow: pip install 'podtrain[parquet]'") from None
    return pyarrow


def _check_parquet(src: Source, text_field: str) -> None:
    pa = load_pyarrow()
    try:
        schema = pa.parquet.ParquetFile(src.path).schema_arrow
    except (OSError, pa.ArrowException) as exc:
        raise UserError(f"{src.path}: not a readable Parquet file ({str(exc).splitlines()[0]})") from None
    if text_field not in schema.names:
        raise UserError(f"{src.path}: no column {text_field!r} (has {', '.join(schema.names)}; "
                        "pass --text-field)")
    typ = schema.field(text_field).type
    if not (pa.types.is_string(typ) or pa.types.is_large_string(typ)
            or pa.types.is_binary(typ) or pa.types.is_large_binary(typ)):
        raise UserError(f"{src.path}: column {text_field!r} has type {typ}, expected a string column")
