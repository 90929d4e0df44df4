"""Input resolution for ``podtrain prepare``: INPUTs (files, directories, globs, ``s3://`` prefixes
or objects, ``builtin``) to an ordered list of source files, each with the name its documents are
hashed by.

A source's name (what its documents' splits are hashed from): inside an INPUT directory (or
``s3://`` prefix), its path relative to that directory; a file named on the command line or matched
by a glob: its path relative to the deepest folder holding every such file of the command (so
``prepare DOCS/*/notes.txt``, quoted or expanded by the shell, names ``a/notes.txt`` as ``prepare
DOCS`` does, and one file, or files of one folder, keep their bare names); an object named
directly: its name. Nothing is read beyond ``stat`` (a listing on S3), the Parquet schema and the
first bytes of a text candidate, so every bad INPUT is reported before ``prepare`` writes anything.
``open_source`` opens a source wherever it lies (S3 through ``podtrain.storage``); ``open_text``
also decompresses it (``compression``: ``.gz``, ``.bz2``, ``.xz``, ``.zst``).

What is read as what: ``.jsonl``/``.ndjson`` and ``.parquet`` (the first also compressed) by their
suffix; inside a folder, a suffix of ``BINARY_SUFFIXES`` (images, archives, PDFs, ...) and a
compressed Parquet file are skipped unread. Every other file is a text candidate, decided by its
first ``SNIFF_BYTES`` (decompressed, for a compressed file): a NUL byte there makes it binary,
whatever its suffix; and where the suffix says nothing (no suffix, as ``README``, or one not in
``TEXT_SUFFIXES``, as ``changelog.Debian.gz``) they must also be valid UTF-8. A file named on the
command line counts as one whose suffix says text (the user asked for it: bad bytes meet
``--errors``). Files not read are counted per reason with a few names (``Inputs.skipped_line``),
so the summary says what was left out and why; hidden files and folders (``.git``) are not corpus
and not counted. The same file reached twice (the same device and inode: a folder symlinked into
another and matched by a glob, or two INPUTs that overlap) is read once, as the first in corpus
order; the others are counted and named too (``Inputs.duplicates_line``).
"""

from __future__ import annotations

import codecs
import contextlib
import contextvars
import glob
import io
import os
from collections.abc import Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
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
# Suffixes that say "not text" (inside a folder: skipped without reading its head).
BINARY_SUFFIXES = frozenset({
    ".png", ".jpg", ".jpeg", ".gif", ".bmp", ".ico", ".webp", ".tif", ".tiff", ".pdf", ".zip", ".tar",
    ".tgz", ".7z", ".rar", ".jar", ".whl", ".so", ".o", ".a", ".dll", ".exe", ".dylib", ".class",
    ".pyc", ".mp3", ".mp4", ".wav", ".ogg", ".flac", ".avi", ".mov", ".mkv", ".woff", ".woff2",
    ".ttf", ".otf", ".doc", ".docx", ".xls", ".xlsx", ".ppt", ".pptx", ".odt", ".sqlite", ".db",
    ".npy", ".npz", ".pt", ".pth", ".safetensors", ".onnx", ".pkl", ".deb", ".rpm", ".iso",
})
SNIFF_BYTES = 8192          # what decides text or binary: as git's and grep's own checks, the head
SNIFF_RAW_BYTES = 64 << 10  # compressed bytes fetched from S3 to decompress SNIFF_BYTES of text
SNIFF_THREADS = 16          # heads read at once (a listing of S3 objects: one GET each)
SHOWN_EXAMPLES = 3          # names of skipped files the summary shows per reason

# Why a file is not read (the summary's words).
BINARY_BY_SUFFIX = "binary (by suffix)"
BINARY = "binary (NUL bytes)"
NOT_UTF8 = "not UTF-8 text"
COMPRESSED_PARQUET = "compressed Parquet"

# How a text candidate is checked: only for NUL bytes (its suffix says text, or it was named), or
# also for UTF-8 (its suffix says nothing).
SNIFF_NUL = "nul"
SNIFF_UTF8 = "utf8"


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


def read_error(src: Source, exc: BaseException) -> UserError:
    """The one line for an error met reading ``src`` (``OSError`` or ``compression.errors()``)."""
    if isinstance(exc, OSError) and (exc.errno is not None or not src.codec):
        return UserError(f"{src.path}: cannot read ({exc.strerror or exc})")
    # gzip and bzip2 raise OSError without an errno for bad data, the others their own errors
    return UserError(f"{src.path}: not a readable {src.codec} file ({exc or type(exc).__name__})")


@dataclass
class Skipped:
    """The files skipped for one reason: how many, and the first few names."""

    count: int = 0
    examples: list[str] = field(default_factory=list)


@dataclass
class Inputs:
    """Resolved INPUTs: the sources in corpus order, and the files skipped, by reason."""

    sources: list[Source]
    skipped: dict[str, Skipped] = field(default_factory=dict)
    duplicates: Skipped = field(default_factory=Skipped)  # the same file as an earlier source

    def duplicate(self, name: str) -> None:
        """Count ``name`` as dropped: the same file (device and inode) as an earlier source."""
        self.duplicates.count += 1
        if len(self.duplicates.examples) < SHOWN_EXAMPLES:
            self.duplicates.examples.append(name)

    def duplicates_line(self) -> str:
        """``skipped 120 duplicates (the same file as another input: a, b, c, ...)``, or empty."""
        n = self.duplicates.count
        if not n:
            return ""
        names = ", ".join(self.duplicates.examples) + (", ..." if n > len(self.duplicates.examples) else "")
        return f"skipped {n:,} duplicate{'s' if n != 1 else ''} (the same file as another input: {names})"

    def left_out_line(self) -> str:
        """What the summary says was left out: ``skipped_line`` and ``duplicates_line``, joined."""
        return "; ".join(line for line in (self.skipped_line(), self.duplicates_line()) if line)

    def skip(self, reason: str, name: str) -> None:
        """Count the file ``name`` as skipped for ``reason``."""
        entry = self.skipped.setdefault(reason, Skipped())
        entry.count += 1
        if len(entry.examples) < SHOWN_EXAMPLES:
            entry.examples.append(name)

    def add(self, other: Inputs) -> None:
        """Append ``other``'s sources and skipped files to this one's."""
        self.sources.extend(other.sources)
        for reason, entry in other.skipped.items():
            mine = self.skipped.setdefault(reason, Skipped())
            mine.count += entry.count
            mine.examples.extend(entry.examples[:SHOWN_EXAMPLES - len(mine.examples)])

    def skipped_count(self) -> int:
        """Files skipped, all reasons."""
        return sum(e.count for e in self.skipped.values())

    def skipped_line(self) -> str:
        """``skipped 3 files: 2 binary (NUL bytes: logo.png, zeros.txt), 1 not UTF-8 text (old)``,
        the most frequent reason first, at most ``SHOWN_EXAMPLES`` names each (empty when nothing
        was skipped)."""
        if not self.skipped:
            return ""
        total = self.skipped_count()
        ranked = sorted(self.skipped.items(), key=lambda kv: (-kv[1].count, kv[0]))
        parts = []
        for reason, entry in ranked:
            names = ", ".join(entry.examples) + (", ..." if entry.count > len(entry.examples) else "")
            if reason.endswith(")"):  # "binary (NUL bytes)" -> "binary (NUL bytes: a, b)"
                parts.append(f"{entry.count:,} {reason[:-1]}: {names})")
            else:
                parts.append(f"{entry.count:,} {reason} ({names})")
        return f"skipped {total:,} file{'s' if total != 1 else ''}: {', '.join(parts)}"


@dataclass
class _Candidate:
    """A file an INPUT yields, before its head is read: the source and how to check it."""

    source: Source
    sniff: str = ""    # "" (JSONL, Parquet, builtin: not checked), SNIFF_NUL or SNIFF_UTF8


@dataclass
class _Named:
    """A file named on the command line (or matched by a glob): named once all are known."""

    inp: str
    path: Path


@dataclass
class _Expanded:
    """What one INPUT yields: candidates, files skipped by name, and whether it is a folder (a
    directory, prefix or glob, which must hold something readable) or files named."""

    inp: str
    candidates: list[_Candidate | _Named]   # _Named: a file named, its name given later
    skipped: Inputs = field(default_factory=lambda: Inputs([]))
    folder: str = ""   # "directory" | "prefix" | "" (files named, a glob of files: none must be text)


def _kind_of(name: str, explicit: bool) -> tuple[str | None, str, str]:
    """``(kind, codec, sniff)`` of a file by its name (or path); kind None: not read, and ``sniff``
    says why (inside a folder only: a compressed Parquet file, a binary suffix). ``explicit``: named
    on the command line."""
    inner, codec = compression.split_suffix(name)
    suffix = os.path.splitext(inner)[1].lower()
    if suffix in PARQUET_SUFFIXES:
        if codec:
            if explicit:
                raise UserError(f"{name}: a compressed Parquet file cannot be read (Parquet compresses its "
                                "own columns): decompress it first")
            return None, codec, COMPRESSED_PARQUET
        return "parquet", "", ""
    if suffix in BINARY_SUFFIXES and not explicit:
        return None, codec, BINARY_BY_SUFFIX
    if suffix in JSONL_SUFFIXES:
        return "jsonl", codec, ""
    # A file named on the command line is text unless it holds NUL bytes: the user asked for it.
    return "text", codec, SNIFF_NUL if suffix in TEXT_SUFFIXES or explicit else SNIFF_UTF8


def _read_head(fh: BinaryIO, n: int, truncated: bool) -> tuple[bytes, bool]:
    """Up to ``n`` bytes of ``fh`` and whether the stream ended there. ``truncated``: ``fh``
    decompresses only the first bytes of a file, so running out of input ends the head instead of
    being an error."""
    out = bytearray()
    try:
        while len(out) < n:
            piece = fh.read(n - len(out))
            if not piece:
                return bytes(out), not truncated
            out += piece
    except (OSError, *compression.errors()):
        if not truncated:
            raise
        return bytes(out), False  # the end of the bytes fetched, not of the file
    return bytes(out), False


def _head(src: Source) -> tuple[bytes, bool]:
    """The first ``SNIFF_BYTES`` of the source's text (decompressed) and whether that is all of it.
    On S3 one ranged GET (the reader's own buffer would fetch megabytes)."""
    try:
        if not isinstance(src.path, str):
            with open_text(src) as fh:
                return _read_head(fh, SNIFF_BYTES, False)
        parent, _, name = src.path.rpartition("/")
        want = min(src.size, SNIFF_RAW_BYTES if src.codec else SNIFF_BYTES)
        raw = _store(parent).read_range(name, 0, want) if want else b""
        if not src.codec:
            return raw, want == src.size
        with compression.decompressing(io.BytesIO(raw), src.codec) as fh:
            return _read_head(fh, SNIFF_BYTES, want < src.size)
    except (OSError, *compression.errors()) as exc:
        raise read_error(src, exc) from None


def _sniff(cand: _Candidate) -> str | None:
    """Why the candidate is not text (``BINARY``, ``NOT_UTF8``), or None: read it."""
    head, whole = _head(cand.source)
    if b"\0" in head:
        return BINARY
    if cand.sniff == SNIFF_UTF8:
        try:  # a character cut at the head's end is not an error (final only when whole)
            codecs.getincrementaldecoder("utf-8")().decode(head, final=whole)
        except UnicodeDecodeError:
            return NOT_UTF8
    return None


def _sniff_all(cands: list[_Candidate]) -> list[str | None]:
    """``_sniff`` of every candidate that needs it (None for the others), in order; the heads are
    read by a few threads at once (each in a copy of this context: the command's S3 clients)."""
    verdicts: list[str | None] = [None] * len(cands)
    todo = [i for i, c in enumerate(cands) if c.sniff]
    if not todo:
        return verdicts
    with ThreadPoolExecutor(min(SNIFF_THREADS, len(todo))) as pool:
        for start in range(0, len(todo), 4096):  # bounded: a million files are not a million futures
            batch = todo[start:start + 4096]
            futures = [pool.submit(contextvars.copy_context().run, _sniff, cands[i]) for i in batch]
            for i, fut in zip(batch, futures, strict=True):
                verdicts[i] = fut.result()  # the first unreadable file in corpus order raises
    return verdicts


def _s3_sources(inp: str) -> _Expanded:
    """The objects under an ``s3://`` prefix (sniffed as a directory's files), or the one object named."""
    root = inp.rstrip("/")
    found = [(e.name, e) for e in _store(root).list()
             if not any(part.startswith(".") for part in e.name.split("/"))]
    exp = _Expanded(inp, [], folder="prefix")
    for name, e in sorted(found, key=lambda t: t[0]):
        kind, codec, sniff = _kind_of(name, explicit=False)
        if kind is None:
            exp.skipped.skip(sniff, name)
        else:
            exp.candidates.append(_Candidate(Source(inp, name, f"{root}/{name}", kind, e.size, 0,
                                                    str(e.version), codec), sniff))
    if exp.candidates:
        return exp
    parent, _, base = root.rpartition("/")
    if base and parent.count("/") >= 2:  # s3://bucket/KEY: perhaps the object itself
        from podtrain.storage import NotFound
        try:
            e = _store(parent).stat(base)
        except NotFound:
            pass
        else:
            kind, codec, sniff = _kind_of(root, explicit=True)
            return _Expanded(inp, [_Candidate(Source(inp, base, root, kind or "text", e.size, 0,
                                                     str(e.version), codec), sniff)])
    if found:
        return exp  # all skipped: resolve_corpus says so, with the reasons
    raise UserError(f"{inp}: no such S3 object or prefix (nothing listed there)")


def _source(inp: str, name: str, path: Path, kind: str, codec: str = "") -> Source:
    try:
        st = path.stat()
    except OSError as exc:
        raise UserError(f"{path}: cannot read ({exc.strerror})") from None
    return Source(inp, name, path, kind, st.st_size, st.st_mtime_ns, "", codec)


def _walk_dir(inp: str, root: Path, exp: _Expanded) -> None:
    """The files under ``root`` into ``exp``, named by their path relative to ``root``."""
    found: list[tuple[str, Path, str, str, str]] = []
    unread: list[tuple[str, str]] = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if not d.startswith(".")]  # .git, .prepare, ...
        for fname in filenames:
            if fname.startswith("."):
                continue
            path = Path(dirpath) / fname
            kind, codec, sniff = _kind_of(fname, explicit=False)
            rel = path.relative_to(root).as_posix()
            if kind is None:
                unread.append((rel, sniff))
            else:
                found.append((rel, path, kind, codec, sniff))
    for rel, why in sorted(unread):  # sorted: the names shown do not depend on the file system
        exp.skipped.skip(why, rel)
    found.sort()
    exp.candidates += [_Candidate(_source(inp, name, path, kind, codec), sniff)
                       for name, path, kind, codec, sniff in found]


def _expand(inp: str, builtin_bytes: int, named: list[_Named]) -> _Expanded:
    """What ``inp`` yields; the files it names are also appended to ``named`` (their names depend
    on every file named: ``_name_files``)."""
    if is_s3(inp):
        return _s3_sources(inp)
    if inp == "builtin":
        return _Expanded(inp, [_Candidate(Source("builtin", f.name, f.path, "text", f.size,
                                                 f.path.stat().st_mtime_ns))
                               for f in builtin_corpus.builtin_files(builtin_bytes)])
    path = Path(inp)
    if path.is_dir():
        exp = _Expanded(inp, [], folder="directory")
        _walk_dir(inp, path, exp)
        return exp
    if path.is_file():
        named.append(_Named(inp, path))
        return _Expanded(inp, [named[-1]])
    if glob.has_magic(inp):
        matches = sorted(glob.glob(inp, recursive=True))
        if not matches:
            raise UserError(f"{inp}: no file matches this pattern")
        exp = _Expanded(inp, [], folder="directory")
        for m in matches:
            mp = Path(m)
            if mp.is_dir():
                _walk_dir(m, mp, exp)
            elif mp.is_file():
                named.append(_Named(inp, mp))
                exp.candidates.append(named[-1])
        if all(isinstance(c, _Named) for c in exp.candidates) and not exp.skipped.skipped:
            exp.folder = ""  # a glob of files only: they are files named, none need be text
        return exp
    raise UserError(f"{inp}: no such file or directory")


def _name_files(named: list[_Named]) -> list[_Candidate]:
    """The files named on the command line or matched by globs, each named by its path relative
    to the deepest folder holding all of them (a folder's files are named relative to it: named
    one by one, the same files split the same way; the shell's ``DOCS/*/notes.txt`` does not
    make 20 documents of one name, which would all fall into one split)."""
    if not named:
        return []
    root = os.path.commonpath([os.path.dirname(os.path.abspath(n.path)) for n in named])
    out = []
    for n in named:
        kind, codec, sniff = _kind_of(str(n.path), explicit=True)
        name = Path(os.path.relpath(os.path.abspath(n.path), root)).as_posix()
        out.append(_Candidate(_source(n.inp, name, n.path, kind or "text", codec), sniff))
    return out


def resolve_corpus(inputs: Iterable[str], builtin_bytes: int = builtin_corpus.DEFAULT_BUILTIN_BYTES,
                   text_field: str = "text") -> Inputs:
    """Expand INPUTs (files, directories, globs, ``builtin``) into sources, in a deterministic
    order, counting the files that are not read, by reason (see the module docstring).

    A path that does not exist, a glob with no match, a folder with nothing readable, a Parquet
    file without ``text_field``, a ``.zst`` file without a zstd reader or a compressed file that
    does not decompress is a one-line user error; nothing is written before this succeeds.
    """
    named: list[_Named] = []
    expanded = [_expand(inp, builtin_bytes, named) for inp in inputs]
    named_as = dict(zip(map(id, named), _name_files(named), strict=True))
    seen: set[Any] = set()
    cands: list[_Candidate] = []
    owner: list[int] = []
    resolved = Inputs([])
    dups = [0] * len(expanded)
    for k, exp in enumerate(expanded):
        for item in exp.candidates:
            cand = named_as[id(item)] if isinstance(item, _Named) else item
            src = cand.source
            st = None if isinstance(src.path, str) else os.stat(src.path)
            ident = src.path if st is None else (st.st_dev, st.st_ino)
            if ident not in seen:  # the same file named twice is read once
                seen.add(ident)
                cands.append(cand)
                owner.append(k)
            else:  # (a symlinked folder matched by a glob, two INPUTs that overlap): said in the summary
                resolved.duplicate(src.name)
                dups[k] += 1
    for cand in cands:
        compression.check_available(cand.source.codec, str(cand.source.path))
    kept = [0] * len(expanded)
    for cand, k, why in zip(cands, owner, _sniff_all(cands), strict=True):
        if why is None:
            resolved.sources.append(cand.source)
            kept[k] += 1
        else:
            expanded[k].skipped.skip(why, cand.source.name)
    for k, exp in enumerate(expanded):
        if exp.folder and not kept[k] and not dups[k]:  # a folder must hold something readable
            what = "directory holds no text, .jsonl or .parquet files" if exp.folder == "directory" \
                else "holds no text, .jsonl or .parquet objects"
            line = exp.skipped.skipped_line()
            raise UserError(f"{exp.inp}: {what}" + (f" ({line})" if line else ""))
        resolved.add(exp.skipped)
    for src in resolved.sources:
        if src.kind == "parquet":
            _check_parquet(src, text_field)
    return resolved


def resolve_inputs(inputs: Iterable[str], builtin_bytes: int = builtin_corpus.DEFAULT_BUILTIN_BYTES,
                   text_field: str = "text") -> list[Source]:
    """The sources of ``resolve_corpus`` (without the files skipped)."""
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
