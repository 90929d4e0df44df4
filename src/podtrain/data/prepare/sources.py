"""Input resolution for ``podtrain prepare``: INPUTs (files, directories, globs, ``s3://`` prefixes
or objects, ``builtin``) to an ordered list of source files, each with the name its documents are
hashed by.

A source's name: its path relative to the INPUT directory (or ``s3://`` prefix); a file or object
named directly: its file name; a glob match: the path as matched. Nothing is read beyond ``stat``
(a listing on S3) and the Parquet schema, so every bad INPUT is reported before ``prepare`` writes
anything. ``open_source`` opens a source wherever it lies (S3 through ``podtrain.storage``).
"""

from __future__ import annotations

import functools
import glob
import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

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
    path: Path | str   # str: the object's s3:// url
    kind: str          # text | jsonl | parquet
    size: int
    mtime_ns: int      # 0 on S3, where ``version`` (the ETag) tells a changed object
    version: str = ""

    def where(self) -> str:
        """The path or url, absolute: what identifies the source in run keys and messages."""
        return self.path if isinstance(self.path, str) else os.path.abspath(self.path)


def is_s3(url: str | Path) -> bool:
    """Whether ``url`` names an S3 location."""
    return isinstance(url, str) and url.startswith("s3://")


@functools.lru_cache(maxsize=64)
def _store(url: str) -> Any:
    from podtrain.storage import open_store  # only S3 inputs need it (and its extra)
    return open_store(url)


def open_source(src: Source) -> BinaryIO:
    """A binary, seekable file object of the source (an S3 object through ``podtrain.storage``)."""
    if isinstance(src.path, str):
        parent, _, name = src.path.rpartition("/")
        return _store(parent).open_read(name)
    return open(src.path, "rb")


def _s3_sources(inp: str) -> list[Source]:
    """The objects under an ``s3://`` prefix (text, JSONL, Parquet by suffix), or the one object named."""
    root = inp.rstrip("/")
    found = [(e.name, e) for e in _store(root).list()
             if not any(part.startswith(".") for part in e.name.split("/"))]
    out = [Source(inp, name, f"{root}/{name}", kind, e.size, 0, str(e.version))
           for name, e in sorted(found, key=lambda t: t[0])
           if (kind := _kind_of(Path(name), explicit=False)) is not None]
    if out:
        return out
    parent, _, base = root.rpartition("/")
    if base and parent.count("/") >= 2:  # s3://bucket/KEY: perhaps the object itself
        from podtrain.storage import NotFound
        try:
            e = _store(parent).stat(base)
        except NotFound:
            pass
        else:
            return [Source(inp, base, root, _kind_of(Path(base), explicit=True) or "text", e.size, 0,
                           str(e.version))]
    if found:
        raise UserError(f"{inp}: holds no text, .jsonl or .parquet objects")
    raise UserError(f"{inp}: no such S3 object or prefix (nothing listed there)")


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
    if is_s3(inp):
        return _s3_sources(inp)
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
    seen: set[Any] = set()
    sources: list[Source] = []
    for inp in inputs:
        for src in _expand(inp, builtin_bytes):
            st = None if isinstance(src.path, str) else os.stat(src.path)
            ident = src.path if st is None else (st.st_dev, st.st_ino)
            if ident not in seen:  # the same file named twice is read once
                seen.add(ident)
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
        with open_source(src) as fh:
            schema = pa.parquet.ParquetFile(fh).schema_arrow
    except (OSError, pa.ArrowException) as exc:
        raise UserError(f"{src.path}: not a readable Parquet file ({str(exc).splitlines()[0]})") from None
    if text_field not in schema.names:
        raise UserError(f"{src.path}: no column {text_field!r} (has {', '.join(schema.names)}; "
                        "pass --text-field)")
    typ = schema.field(text_field).type
    if not (pa.types.is_string(typ) or pa.types.is_large_string(typ)
            or pa.types.is_binary(typ) or pa.types.is_large_binary(typ)):
        raise UserError(f"{src.path}: column {text_field!r} has type {typ}, expected a string column")
