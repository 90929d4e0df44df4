"""Input resolution for ``podtrain prepare``: INPUTs (files, directories, globs, ``s3://`` prefixes
or objects, ``builtin``) to an ordered list of source files, each with the name its documents are
hashed by.

A source's name: its path relative to the INPUT directory (or ``s3://`` prefix); a file or object
named directly: its file name; a glob match: the path as matched. Nothing is read beyond ``stat``
(a listing on S3) and the Parquet schema, so every bad INPUT is reported before ``prepare`` writes
anything. ``open_source`` opens a source wherever it lies (S3 through ``podtrain.storage``);
``open_text`` also decompresses it (``compression``: ``.gz``, ``.bz2``, ``.xz``, ``.zst``).

Inside a directory (or under a prefix) a file is read by its suffix: text, JSONL, Parquet, or text
and JSONL compressed. Every other file is skipped and counted by its suffix (``Inputs.skipped``),
so the summary says what was left out; hidden files and folders (``.git``) are not corpus and not
counted. A file named on the command line is read as text whatever its suffix: the user asked for
it.
"""

from __future__ import annotations

import contextlib
import glob
import os
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

from podtrain.data.prepare import builtin as builtin_corpus
from podtrain.data.prepare import compression
from podtrain.errors import UserError

TEXT_SUFFIXES = frozenset({
    ".txt", ".text", ".md", ".markdown", ".rst", ".tex", ".py", ".pyi", ".c", ".h", ".cc", ".cpp",
    ".hpp", ".cu", ".js", ".ts", ".java", ".go", ".rs", ".rb", ".sh", ".html", ".css", ".xml",
    ".toml", ".yaml", ".yml", ".ini", ".cfg", ".csv", ".tsv",
})
JSONL_SUFFIXES = frozenset({".jsonl", ".ndjson"})
PARQUET_SUFFIXES = frozenset({".parquet"})
SHOWN_KINDS = 8  # kinds of skipped files named in the summary line; the rest are summed


@dataclass(frozen=True)
class Source:
    """One input file: its kind, the name its documents are hashed by, where it lies."""

    input: str
    name: str
    path: Path | str   # str: the object's s3:// url
    kind: str          # text | jsonl | parquet
    size: int          # bytes of the file as it lies (compressed when ``codec``)
    mtime_ns: int      # 0 on S3, where ``version`` (the ETag) tells a changed object
    version: str = ""
    codec: str = ""    # gzip | bzip2 | xz | zstd: decompressed while read (``open_text``)

    def where(self) -> str:
        """The path or url, absolute: what identifies the source in run keys and messages."""
        return self.path if isinstance(self.path, str) else os.path.abspath(self.path)


def is_s3(url: str | Path) -> bool:
    """Whether ``url`` names an S3 location."""
    return isinstance(url, str) and url.startswith("s3://")


def _store(url: str) -> Any:
    """The store of an S3 input's folder (its CRT client is the command's: ``shared_s3_clients``)."""
    from podtrain.storage import open_store  # only S3 inputs need it (and its extra)
    return open_store(url)


def open_source(src: Source) -> BinaryIO:
    """A binary, seekable file object of the source as it lies (an S3 object through
    ``podtrain.storage``; still compressed: ``open_text`` decompresses)."""
    if isinstance(src.path, str):
        parent, _, name = src.path.rpartition("/")
        return _store(parent).open_read(name)
    return open(src.path, "rb")


@contextlib.contextmanager
def open_text(src: Source) -> Iterator[BinaryIO]:
    """The source's bytes as a stream, decompressed while read when it is compressed (text and
    JSONL sources; Parquet is read through ``open_source``)."""
    with open_source(src) as raw:
        if not src.codec:
            yield raw
            return
        with compression.decompressing(raw, src.codec) as fh:
            yield fh


@dataclass
class Inputs:
    """Resolved INPUTs: the sources in corpus order, and the files skipped, by suffix."""

    sources: list[Source]
    skipped: Counter[str] = field(default_factory=Counter)

    def skipped_line(self) -> str:
        """``skipped 12 files: .pdf 9, .png 3`` (empty when nothing was skipped)."""
        if not self.skipped:
            return ""
        total = sum(self.skipped.values())
        ranked = sorted(self.skipped.items(), key=lambda kv: (-kv[1], kv[0]))
        kinds = [f"{k} {n:,}" for k, n in ranked[:SHOWN_KINDS]]
        if len(ranked) > SHOWN_KINDS:  # a real tree's long tail stays one readable line
            rest = ranked[SHOWN_KINDS:]
            kinds.append(f"others {sum(n for _, n in rest):,} ({len(rest):,} kinds)")
        return f"skipped {total:,} file{'s' if total != 1 else ''}: {', '.join(kinds)}"


def _s3_sources(inp: str, skipped: Counter[str]) -> list[Source]:
    """The objects under an ``s3://`` prefix (text, JSONL, Parquet by suffix), or the one object named."""
    root = inp.rstrip("/")
    found = [(e.name, e) for e in _store(root).list()
             if not any(part.startswith(".") for part in e.name.split("/"))]
    out = []
    for name, e in sorted(found, key=lambda t: t[0]):
        kind, codec = _kind_of(name, explicit=False)
        if kind is None:
            skipped[skipped_kind(name)] += 1
        else:
            out.append(Source(inp, name, f"{root}/{name}", kind, e.size, 0, str(e.version), codec))
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
            kind, codec = _kind_of(root, explicit=True)
            return [Source(inp, base, root, kind or "text", e.size, 0, str(e.version), codec)]
    if found:
        raise UserError(f"{inp}: holds no text, .jsonl or .parquet objects{_none_read(skipped)}")
    raise UserError(f"{inp}: no such S3 object or prefix (nothing listed there)")


def _kind_of(name: str, explicit: bool) -> tuple[str | None, str]:
    """``(kind, codec)`` of a file by its name (or path); kind None: not read (only when not
    ``explicit``, i.e. named on the command line)."""
    inner, codec = compression.split_suffix(name)
    suffix = os.path.splitext(inner)[1].lower()
    if suffix in PARQUET_SUFFIXES:
        if codec:
            if explicit:
                raise UserError(f"{name}: a compressed Parquet file cannot be read (Parquet compresses its "
                                "own columns): decompress it first")
            return None, codec
        return "parquet", ""
    if suffix in JSONL_SUFFIXES:
        return "jsonl", codec
    if suffix in TEXT_SUFFIXES or explicit:
        # A file named on the command line is text whatever its suffix: the user asked for it.
        return "text", codec
    return None, codec


def skipped_kind(name: str) -> str:
    """How a skipped file is counted: its suffix (``.pdf``; ``.tar.gz`` with a compression's), or
    ``no suffix``."""
    base = os.path.basename(name)
    inner, _ = compression.split_suffix(base)
    return (os.path.splitext(inner)[1] + base[len(inner):]).lower() or "no suffix"


def _none_read(skipped: Counter[str]) -> str:
    return f" ({Inputs([], skipped).skipped_line()})" if skipped else ""


def _source(inp: str, name: str, path: Path, kind: str, codec: str = "") -> Source:
    try:
        st = path.stat()
    except OSError as exc:
        raise UserError(f"{path}: cannot read ({exc.strerror})") from None
    return Source(inp, name, path, kind, st.st_size, st.st_mtime_ns, "", codec)


def _walk_dir(inp: str, root: Path, skipped: Counter[str]) -> list[Source]:
    found: list[tuple[str, Path, str, str]] = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if not d.startswith(".")]  # .git, .prepare, ...
        for fname in filenames:
            if fname.startswith("."):
                continue
            path = Path(dirpath) / fname
            kind, codec = _kind_of(fname, explicit=False)
            if kind is None:
                skipped[skipped_kind(fname)] += 1
            else:
                found.append((path.relative_to(root).as_posix(), path, kind, codec))
    found.sort()
    if not found:
        raise UserError(f"{inp}: directory holds no text, .jsonl or .parquet files{_none_read(skipped)}")
    return [_source(inp, name, path, kind, codec) for name, path, kind, codec in found]


def _expand(inp: str, builtin_bytes: int, skipped: Counter[str]) -> list[Source]:
    if is_s3(inp):
        return _s3_sources(inp, skipped)
    if inp == "builtin":
        return [Source("builtin", f.name, f.path, "text", f.size, f.path.stat().st_mtime_ns)
                for f in builtin_corpus.builtin_files(builtin_bytes)]
    path = Path(inp)
    if path.is_dir():
        return _walk_dir(inp, path, skipped)
    if path.is_file():
        kind, codec = _kind_of(str(path), explicit=True)
        return [_source(inp, path.name, path, kind or "text", codec)]
    if glob.has_magic(inp):
        matches = sorted(glob.glob(inp, recursive=True))
        if not matches:
            raise UserError(f"{inp}: no file matches this pattern")
        out: list[Source] = []
        for m in matches:
            mp = Path(m)
            if mp.is_dir():
                out.extend(_walk_dir(m, mp, skipped))
            elif mp.is_file():
                kind, codec = _kind_of(m, explicit=True)
                out.append(_source(inp, mp.as_posix(), mp, kind or "text", codec))
        return out
    raise UserError(f"{inp}: no such file or directory")


def resolve_corpus(inputs: Iterable[str], builtin_bytes: int = builtin_corpus.DEFAULT_BUILTIN_BYTES,
                   text_field: str = "text") -> Inputs:
    """Expand INPUTs (files, directories, globs, ``builtin``) into sources, in a deterministic
    order, counting the files of a directory (or prefix) that are not read.

    A path that does not exist, a glob with no match, a Parquet file without ``text_field`` or a
    ``.zst`` file without a zstd reader is a one-line user error; nothing is written before this
    succeeds.
    """
    seen: set[Any] = set()
    resolved = Inputs([])
    for inp in inputs:
        for src in _expand(inp, builtin_bytes, resolved.skipped):
            st = None if isinstance(src.path, str) else os.stat(src.path)
            ident = src.path if st is None else (st.st_dev, st.st_ino)
            if ident not in seen:  # the same file named twice is read once
                seen.add(ident)
                resolved.sources.append(src)
    for src in resolved.sources:
        compression.check_available(src.codec, str(src.path))
        if src.kind == "parquet":
            _check_parquet(src, text_field)
    return resolved


def resolve_inputs(inputs: Iterable[str], builtin_bytes: int = builtin_corpus.DEFAULT_BUILTIN_BYTES,
                   text_field: str = "text") -> list[Source]:
    """The sources of ``resolve_corpus`` (without the count of skipped files)."""
    return resolve_corpus(inputs, builtin_bytes, text_field).sources


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
