"""``podtrain prepare``: any corpus -> fixed-size token shards + ``manifest.json``.

The pipeline, in one direction::

    inputs --resolve--> sources --read--> tasks (~chunk_bytes of raw text each, in order)
           --workers: decode, split, tokenize--> per-task token arrays (train, val)
           --main: append in task order--> ShardWriter per split --> shards + done records
           --> manifest.json (last)

Why it is deterministic whatever the worker count: tasks are cut from the input by byte counts
alone, results are consumed strictly in task order, and a document's split is a hash of its name.

Why it is idempotent: every finished shard gets a done record (``DATA_DIR/.prepare/``) keyed by a
fingerprint of the inputs (paths, sizes, mtimes) and the options. A re-run with the same key
verifies the finished shards' checksums, skips them and restarts the token stream where the first
unfinished shard begins; a finished run with a valid manifest is left alone.

A document's name (what its split is hashed from): its path relative to the INPUT directory; a
file named directly: its file name; a glob match: the path as matched; a JSONL line: NAME:LINE; a
Parquet row: NAME#ROW. Moving the corpus therefore keeps every document in its split.

Why nothing is half-written: shards are streamed into a temporary file and renamed when full,
other files go through ``fsutil.atomic_write_*``, the manifest is written last, and a user error
removes everything this run wrote (a Ctrl-C keeps finished shards for the resume).
"""

from __future__ import annotations

import argparse
import fcntl
import glob
import hashlib
import json
import multiprocessing
import os
import queue
import re
import shutil
import sys
import tempfile
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from podtrain.data import builtin as builtin_corpus
from podtrain.data import tokenizer as tokmod
from podtrain.data.manifest import FORMAT, MANIFEST_NAME
from podtrain.errors import UserError
from podtrain.fsutil import atomic_write_bytes, atomic_write_text, fsync_dir, sha256_file

DEFAULT_VAL_FRACTION = 0.03
DEFAULT_SHARD_TOKENS = 1 << 26          # 128 MiB per uint16 shard
DEFAULT_CHUNK_BYTES = 1 << 20           # raw text per worker task (small: load balance)
DEFAULT_BPE_TRAIN_BYTES = 256 << 20     # text a BPE is trained on (the first train documents)
ERROR_POLICIES = ("strict", "replace", "skip")
STATE_DIR = ".prepare"
TOKENIZER_DIR = "tokenizer"
PIPELINE_VERSION = 1                    # bump when the same options would give different shards

TEXT_SUFFIXES = frozenset({
    ".txt", ".text", ".md", ".markdown", ".rst", ".tex", ".py", ".pyi", ".c", ".h", ".cc", ".cpp",
    ".hpp", ".cu", ".js", ".ts", ".java", ".go", ".rs", ".rb", ".sh", ".html", ".css", ".xml",
    ".toml", ".yaml", ".yml", ".ini", ".cfg", ".csv", ".tsv",
})
JSONL_SUFFIXES = frozenset({".jsonl", ".ndjson"})
PARQUET_SUFFIXES = frozenset({".parquet"})
SHARD_RE = re.compile(r"^(train|val)_(\d{5})\.bin$")
WHITESPACE = frozenset(b" \t\n\r\x0b\x0c")
PARQUET_BATCH_ROWS = 256


# --------------------------------------------------------------------------------------- options


@dataclass(frozen=True)
class PrepareOptions:
    """Everything ``prepare`` needs; the CLI flags map one to one."""

    inputs: tuple[str, ...]
    out: Path
    tokenizer: str = "byte"
    val_fraction: float = DEFAULT_VAL_FRACTION
    text_field: str = "text"
    errors: str = "strict"
    shard_tokens: int = DEFAULT_SHARD_TOKENS
    chunk_bytes: int = DEFAULT_CHUNK_BYTES
    workers: int = 0                     # 0: one per available core
    builtin_bytes: int = builtin_corpus.DEFAULT_BUILTIN_BYTES
    bpe_train_bytes: int = DEFAULT_BPE_TRAIN_BYTES
    eos_token: str | None = None
    progress: bool | None = None         # None: a bar when stderr is a terminal

    def key_fields(self) -> dict[str, Any]:
        """The options that change the shards' bytes (worker count and progress do not)."""
        return {"tokenizer": self.tokenizer, "val_fraction": self.val_fraction,
                "text_field": self.text_field, "errors": self.errors,
                "shard_tokens": self.shard_tokens, "chunk_bytes": self.chunk_bytes,
                "builtin_bytes": self.builtin_bytes, "bpe_train_bytes": self.bpe_train_bytes,
                "eos_token": self.eos_token, "pipeline": PIPELINE_VERSION}


@dataclass
class PrepareResult:
    """What a run did: counters the tests and the summary line read."""

    out: Path
    manifest: dict[str, Any]
    shards_written: int = 0
    shards_skipped: int = 0
    tasks_run: int = 0
    tasks_skipped: int = 0
    input_bytes: int = 0
    seconds: float = 0.0
    up_to_date: bool = False


def _validate(opts: PrepareOptions) -> None:
    if not opts.inputs:
        raise UserError("prepare needs at least one INPUT (a file, directory, glob, or `builtin`)")
    if not 0.0 <= opts.val_fraction < 1.0:
        raise UserError(f"--val-fraction {opts.val_fraction}: must be in [0, 1)")
    if opts.errors not in ERROR_POLICIES:
        raise UserError(f"--errors {opts.errors}: must be one of {', '.join(ERROR_POLICIES)}")
    for flag, value in (("--shard-tokens", opts.shard_tokens), ("--chunk-bytes", opts.chunk_bytes),
                        ("--builtin-bytes", opts.builtin_bytes), ("--bpe-train-bytes", opts.bpe_train_bytes)):
        if value <= 0:
            raise UserError(f"{flag} {value}: must be positive")
    if opts.workers < 0:
        raise UserError(f"--workers {opts.workers}: must be >= 0 (0 = one per core)")


def default_workers() -> int:
    """One worker per core this process may run on."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # pragma: no cover - not Linux
        return max(1, os.cpu_count() or 1)


# --------------------------------------------------------------------------------------- sources


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


def _pyarrow() -> Any:
    try:
        import pyarrow
        import pyarrow.parquet  # noqa: F401
    except ImportError:
        raise UserError("reading Parquet needs pyarrow: pip install 'podtrain[parquet]'") from None
    return pyarrow


def _check_parquet(src: Source, text_field: str) -> None:
    pa = _pyarrow()
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


# ----------------------------------------------------------------------------------------- tasks
# An item is one slice of one source, small enough to hold in memory:
#   ("text",  name, where, data: bytes, offset, last)  a piece of a text file (a document ends at last)
#   ("jsonl", name, where, data: bytes, first_line)    whole lines of a JSONL file
#   ("rows",  name, where, rows: list[bytes|None], first_row)  Parquet rows
# A task is a list of items of ~chunk_bytes; task i is the same whatever the worker count.

Item = tuple
Task = list


def _cut_text(buf: bytes) -> int:
    """Where to end a piece of a large text file: after a newline that precedes a non-space.

    Cutting there keeps a byte-level BPE's pre-tokenization (which never merges across such a
    boundary) identical to encoding the file whole; failing that, any newline; failing that, a
    UTF-8 character boundary.
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


def _read_error(path: Path, exc: OSError) -> UserError:
    return UserError(f"{path}: cannot read ({exc.strerror or exc})")


def _text_items(src: Source, chunk: int) -> Iterator[Item]:
    try:
        with open(src.path, "rb") as fh:
            carry, offset = b"", 0
            while True:
                data = fh.read(chunk)
                buf = carry + data
                if len(data) < chunk:  # a short read of a regular file is its end
                    yield ("text", src.name, str(src.path), buf, offset, True)
                    return
                cut = _cut_text(buf)
                yield ("text", src.name, str(src.path), buf[:cut], offset, False)
                carry, offset = buf[cut:], offset + cut
    except OSError as exc:
        raise _read_error(src.path, exc) from None


def _jsonl_items(src: Source, chunk: int) -> Iterator[Item]:
    try:
        with open(src.path, "rb") as fh:
            carry, line = b"", 1
            while True:
                data = fh.read(chunk)
                buf = carry + data
                if len(data) < chunk:
                    if buf:
                        yield ("jsonl", src.name, str(src.path), buf, line)
                    return
                cut = buf.rfind(b"\n") + 1
                if cut == 0:  # one line longer than a chunk: keep reading
                    carry = buf
                    continue
                yield ("jsonl", src.name, str(src.path), buf[:cut], line)
                line += buf.count(b"\n", 0, cut)
                carry = buf[cut:]
    except OSError as exc:
        raise _read_error(src.path, exc) from None


def _parquet_items(src: Source, text_field: str) -> Iterator[Item]:
    pa = _pyarrow()
    row = 0
    try:
        pf = pa.parquet.ParquetFile(src.path)
        for batch in pf.iter_batches(batch_size=PARQUET_BATCH_ROWS, columns=[text_field]):
            col = batch.column(0)
            # Read as bytes so invalid UTF-8 meets the same --errors policy as text files.
            if pa.types.is_string(col.type):
                col = col.cast(pa.binary())
            elif pa.types.is_large_string(col.type):
                col = col.cast(pa.large_binary())
            rows = col.to_pylist()
            yield ("rows", src.name, str(src.path), rows, row)
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
    if item[0] == "rows":
        return sum(len(r) for r in item[3] if r is not None)
    return len(item[3])


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


# ---------------------------------------------------------------------------------- the encoder


def is_val(name: str, val_fraction: float) -> bool:
    """Whether the document called ``name`` belongs to the validation split (a pure hash test)."""
    if val_fraction <= 0.0:
        return False
    digest = hashlib.blake2b(name.encode("utf-8", "surrogatepass"), digest_size=8).digest()
    return int.from_bytes(digest, "big") < val_fraction * 2.0 ** 64


@dataclass(frozen=True)
class EncodeSpec:
    """What a worker needs to rebuild the encoder (picklable; the tokenizer as its JSON text)."""

    kind: str
    tokenizer_json: str | None
    eos_id: int
    dtype: str
    val_fraction: float
    text_field: str
    errors: str

    def build(self) -> Encoder:
        """The encoder this spec describes."""
        if self.kind == "byte":
            tok: Any = tokmod.ByteTokenizer()
        else:
            import tokenizers
            tok = tokmod.HFTokenizer(tokenizers.Tokenizer.from_str(self.tokenizer_json or ""),
                                     self.eos_id, kind=self.kind, name=self.kind)
        return Encoder(self, tok)


@dataclass
class Unit:
    """One stretch of text bound for one split; ``eos`` when a document ends with it."""

    payload: bytes | str       # bytes: valid UTF-8 (byte-level fast path); str: decoded text
    eos: bool
    val: bool


@dataclass
class Counts:
    """Per-task tallies of the --errors policy."""

    replaced: int = 0
    skipped: int = 0

    def add(self, other: Counts) -> None:
        """Accumulate ``other`` into this one."""
        self.replaced += other.replaced
        self.skipped += other.skipped

    def as_dict(self) -> dict[str, int]:
        """The tallies as a plain dict (for records and the manifest)."""
        return {"replaced": self.replaced, "skipped": self.skipped}


class Encoder:
    """Turns a task into token arrays: decode with the --errors policy, split, tokenize, pack."""

    def __init__(self, spec: EncodeSpec, tok: Any) -> None:
        """Bind ``spec`` to a built tokenizer."""
        self.spec = spec
        self.tok = tok
        self.want_bytes = spec.kind == "byte"
        self.dtype = np.dtype(spec.dtype)

    def _decode(self, raw: bytes, where: str, counts: Counts, base: int = 0) -> bytes | str | None:
        """Raw bytes -> payload, applying the policy; ``None`` means skip this unit.

        ``base`` is the offset of ``raw`` in its file, so a strict error names the exact byte.
        """
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            if self.spec.errors == "strict":
                raise UserError(f"{where}: byte {base + exc.start} is not valid UTF-8 "
                                "(pass --errors replace or --errors skip)") from None
            if self.spec.errors == "skip":
                counts.skipped += 1
                return None
            counts.replaced += 1
            text = raw.decode("utf-8", errors="replace")
            return text.encode("utf-8") if self.want_bytes else text
        return raw if self.want_bytes else text

    def _clean_str(self, text: str, where: str, counts: Counts) -> bytes | str | None:
        """A str from JSON may hold lone surrogates, which no tokenizer can encode."""
        try:
            data = text.encode("utf-8")
        except UnicodeEncodeError:
            return self._decode(text.encode("utf-8", "surrogatepass"), where, counts)
        return data if self.want_bytes else text

    def units(self, task: Task, counts: Counts) -> Iterator[Unit]:
        """The task's text, in order, as units tagged with their split."""
        frac = self.spec.val_fraction
        for item in task:
            kind, name, where = item[0], item[1], item[2]
            if kind == "text":
                yield from self._text_units(item, frac, counts)
            elif kind == "jsonl":
                yield from self._jsonl_units(item, frac, counts)
            else:
                for i, raw in enumerate(item[3]):
                    if raw:
                        payload = self._decode(raw, f"{where} row {item[4] + i}", counts)
                        if payload:
                            yield Unit(payload, True, is_val(f"{name}#{item[4] + i}", frac))

    def _text_units(self, item: Item, frac: float, counts: Counts) -> Iterator[Unit]:
        _, name, where, data, offset, last = item
        val = is_val(name, frac)
        empty: bytes | str = b"" if self.want_bytes else ""
        payload = self._decode(data, where, counts, base=offset) if data else empty
        # A skipped piece still closes its document when it was the last one of a larger file.
        payload = empty if payload is None else payload
        if payload or (last and offset):
            yield Unit(payload, last, val)

    def _jsonl_units(self, item: Item, frac: float, counts: Counts) -> Iterator[Unit]:
        _, name, where, data, first_line = item
        field_name = self.spec.text_field
        for i, raw in enumerate(data.split(b"\n")):
            line_no = first_line + i
            if not raw.strip():
                continue
            at = f"{where}:{line_no}"
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError:
                line = self._decode(raw, at, counts)  # strict raises, skip returns None
                if line is None:
                    continue
                line = line.decode("utf-8") if isinstance(line, bytes) else line
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as exc:
                raise UserError(f"{at}: not valid JSON ({exc.msg} at column {exc.colno})") from None
            if not isinstance(obj, dict) or field_name not in obj:
                raise UserError(f"{at}: no {field_name!r} field (pass --text-field)")
            text = obj[field_name]
            if not isinstance(text, str):
                raise UserError(f"{at}: field {field_name!r} is {type(text).__name__}, expected a string")
            if text:
                payload = self._clean_str(text, at, counts)
                if payload:
                    yield Unit(payload, True, is_val(f"{name}:{line_no}", frac))

    def pack(self, units: list[Unit]) -> np.ndarray:
        """Tokenize ``units`` and concatenate them, an EOS after each document's last unit."""
        if not units:
            return np.empty(0, dtype=self.dtype)
        if self.want_bytes:
            seqs: list[Any] = [np.frombuffer(u.payload, dtype=np.uint8) for u in units]  # type: ignore[arg-type]
        else:
            seqs = self.tok.encode_batch([u.payload for u in units])
        total = sum(len(s) for s in seqs) + sum(u.eos for u in units)
        out = np.empty(total, dtype=self.dtype)
        pos = 0
        eos = self.spec.eos_id
        for seq, unit in zip(seqs, units, strict=True):
            n = len(seq)
            out[pos:pos + n] = seq
            pos += n
            if unit.eos:
                out[pos] = eos
                pos += 1
        return out

    def run(self, task: Task) -> tuple[np.ndarray, np.ndarray, dict[str, int]]:
        """Encode one task: (train tokens, val tokens, error tallies)."""
        counts = Counts()
        train: list[Unit] = []
        val: list[Unit] = []
        for unit in self.units(task, counts):
            (val if unit.val else train).append(unit)
        return self.pack(train), self.pack(val), counts.as_dict()


# A pool worker process holds its own encoder, built once by the initializer; the main process
# never reads or writes this (inline runs pass their encoder explicitly).
_worker_encoder: Encoder | None = None


def _init_worker(spec: EncodeSpec) -> None:
    global _worker_encoder
    # One core per worker: the pool is the parallelism, the tokenizer must not add its own threads.
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    _worker_encoder = spec.build()


def _run_in_worker(task: Task) -> tuple[np.ndarray, np.ndarray, dict[str, int]]:
    assert _worker_encoder is not None
    return _worker_encoder.run(task)


class _Inline:
    """The pool interface run in this process (one byte-level worker: no IPC to pay for)."""

    def __init__(self, spec: EncodeSpec) -> None:
        self.encoder = spec.build()

    def submit(self, task: Task) -> Callable[[], Any]:
        return lambda: self.encoder.run(task)

    def close(self) -> None:
        pass


class _Pool:
    """Spawned worker processes with ordered results.

    Spawn, not fork: the main process may hold tokenizer threads (BPE training). And a
    ProcessPoolExecutor, not multiprocessing.Pool: when a worker cannot start, the executor
    raises BrokenProcessPool where Pool would respawn it forever.
    """

    def __init__(self, spec: EncodeSpec, workers: int) -> None:
        self.pool = ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn"),
                                        initializer=_init_worker, initargs=(spec,))

    def submit(self, task: Task) -> Callable[[], Any]:
        future = self.pool.submit(_run_in_worker, task)

        def get() -> Any:
            try:
                return future.result()
            except BrokenProcessPool as exc:
                raise RuntimeError("a prepare worker process died or could not start (when prepare() "
                                   "is called from a script, guard it with `if __name__ == "
                                   "'__main__':`)") from exc
        return get

    def close(self) -> None:
        self.pool.shutdown(wait=True, cancel_futures=True)


# ------------------------------------------------------------------------------- shard writing


def _file_mode() -> int:
    """0666 minus this process's umask (read from /proc: os.umask would change it to read it)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return 0o666 & ~int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    return 0o644


def _publish(path: Path) -> None:
    """Give a file written by fsutil (0600, from mkstemp) the usual permissions."""
    os.chmod(path, _file_mode())


def shard_name(split: str, index: int) -> str:
    """File name of shard ``index`` of ``split``."""
    return f"{split}_{index:05d}.bin"


def _record_path(out: Path, split: str, index: int) -> Path:
    return out / STATE_DIR / f"{split}_{index:05d}.json"


class ShardWriter:
    """Streams one split's tokens into fixed-size shards; each full shard is renamed into place
    and gets a done record saying where in the task stream the next shard begins."""

    def __init__(self, out: Path, split: str, dtype: np.dtype, shard_tokens: int, key: str,
                 done: list[dict[str, Any]], resume_task: int, resume_skip: int, complete: bool) -> None:
        """Continue after the ``done`` shards (their records), skipping stream tokens before
        (``resume_task``, ``resume_skip``)."""
        self.out, self.split, self.dtype = out, split, dtype
        self.shard_tokens, self.key = shard_tokens, key
        self.records = list(done)
        self.resume_task, self.resume_skip, self.complete = resume_task, resume_skip, complete
        self.written = 0
        self._fh: Any = None
        self._tmp: Path | None = None
        self._fill = 0
        self._digest: Any = None
        self._max = 0
        self._eos_count = 0

    def _open(self) -> None:
        fd, tmp = tempfile.mkstemp(prefix=f".{shard_name(self.split, len(self.records))}.",
                                   suffix=".tmp", dir=self.out)
        os.fchmod(fd, _file_mode())  # mkstemp makes 0600; data is meant to be shared like any file
        self._fh, self._tmp = os.fdopen(fd, "wb"), Path(tmp)
        self._fill, self._digest, self._max, self._eos_count = 0, hashlib.sha256(), 0, 0

    def write(self, task_index: int, tokens: np.ndarray, eos_id: int,
              errors_before: dict[str, int]) -> None:
        """Append task ``task_index``'s tokens for this split (tasks arrive in order)."""
        if self.complete or task_index < self.resume_task:
            return
        pos = self.resume_skip if task_index == self.resume_task else 0
        while pos < tokens.size:
            if self._fh is None:
                self._open()
            take = min(self.shard_tokens - self._fill, tokens.size - pos)
            part = tokens[pos:pos + take]
            blob = memoryview(part).cast("B")  # no copy: file and hash read the array's buffer
            self._fh.write(blob)
            self._digest.update(blob)
            self._max = max(self._max, int(part.max()))
            self._eos_count += int(np.count_nonzero(part == eos_id))
            self._fill += take
            pos += take
            if self._fill == self.shard_tokens:
                self._finish(task_index, pos, errors_before, last=False)

    def _finish(self, next_task: int, skip: int, errors_before: dict[str, int], last: bool) -> None:
        fh, tmp = self._fh, self._tmp
        assert fh is not None and tmp is not None
        fh.flush()
        os.fsync(fh.fileno())
        fh.close()
        name = shard_name(self.split, len(self.records))
        os.replace(tmp, self.out / name)
        fsync_dir(self.out)
        self._fh = self._tmp = None
        rec = {"key": self.key, "file": name, "tokens": self._fill, "documents": self._eos_count,
               "sha256": self._digest.hexdigest(), "max_token_id": self._max,
               "next_task": next_task, "skip": skip, "errors_before": dict(errors_before), "last": last}
        atomic_write_text(_record_path(self.out, self.split, len(self.records)), json.dumps(rec))
        self.records.append(rec)
        self.written += 1

    def close(self, n_tasks: int, errors_total: dict[str, int]) -> None:
        """Write the partial last shard and mark the split complete."""
        if self.complete:
            return
        if self._fh is not None:
            self._finish(n_tasks, 0, errors_total, last=True)
        elif self.records and not self.records[-1]["last"]:
            # The stream ended exactly on a shard boundary: re-mark the last full shard as last.
            rec = dict(self.records[-1], last=True, next_task=n_tasks, skip=0, errors_before=errors_total)
            atomic_write_text(_record_path(self.out, self.split, len(self.records) - 1), json.dumps(rec))
            self.records[-1] = rec
        self.complete = True

    def abort(self) -> None:
        """Drop the shard in progress (its temporary file)."""
        if self._fh is not None:
            self._fh.close()
        if self._tmp is not None:
            self._tmp.unlink(missing_ok=True)
        self._fh = self._tmp = None

    def tokens(self) -> int:
        """Tokens in this split's finished shards."""
        return sum(r["tokens"] for r in self.records)


# ------------------------------------------------------------------------- state and cleanup


def run_key(sources: list[Source], opts: PrepareOptions, tokenizer_sha: str | None) -> str:
    """Fingerprint of the inputs (name, path, size, mtime) and the options that shape the shards."""
    desc = {"sources": [[s.input, s.name, os.path.abspath(s.path), s.kind, s.size, s.mtime_ns]
                        for s in sources],
            "options": opts.key_fields(), "tokenizer_file_sha256": tokenizer_sha}
    return hashlib.sha256(json.dumps(desc, sort_keys=True).encode("utf-8")).hexdigest()


def _remove_temp_files(out: Path) -> None:
    """Temporary files left by a killed run (ours all start with '.' and end with '.tmp')."""
    for folder in (out, out / STATE_DIR, out / TOKENIZER_DIR):
        if folder.is_dir():
            for p in folder.glob(".*.tmp"):
                p.unlink(missing_ok=True)


def clean_outputs(out: Path) -> None:
    """Remove every file ``prepare`` writes in ``out`` (manifest first, so the directory never
    looks complete); files that are not ours are left alone."""
    (out / MANIFEST_NAME).unlink(missing_ok=True)
    if out.is_dir():
        for p in out.iterdir():
            if SHARD_RE.match(p.name):
                p.unlink(missing_ok=True)
    for sub in (STATE_DIR, TOKENIZER_DIR):
        if (out / sub).is_dir():
            shutil.rmtree(out / sub)
    _remove_temp_files(out)


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _shard_ok(out: Path, rec: dict[str, Any], itemsize: int) -> bool:
    path = out / rec["file"]
    try:
        if path.stat().st_size != rec["tokens"] * itemsize:
            return False
    except OSError:
        return False
    return sha256_file(path) == rec["sha256"]


@dataclass
class SplitResume:
    """Where a split's stream restarts: after ``done`` shards, at (``task``, ``skip``)."""

    done: list[dict[str, Any]] = field(default_factory=list)
    task: int = 0
    skip: int = 0
    errors_before: dict[str, int] = field(default_factory=lambda: {"replaced": 0, "skipped": 0})
    complete: bool = False


def _resume_split(out: Path, split: str, key: str, itemsize: int) -> SplitResume:
    res = SplitResume()
    index = 0
    while True:
        rec = _read_json(_record_path(out, split, index))
        if rec is None or rec.get("key") != key or rec.get("file") != shard_name(split, index) \
                or not _shard_ok(out, rec, itemsize):
            break
        res.done.append(rec)
        res.task, res.skip, res.errors_before = rec["next_task"], rec["skip"], rec["errors_before"]
        index += 1
        if rec["last"]:
            res.complete = True
            break
    # Anything after the valid prefix is stale: drop it so the directory matches the records.
    for p in list(out.glob(f"{split}_*.bin")) + list((out / STATE_DIR).glob(f"{split}_*.json")):
        m = re.match(rf"^{split}_(\d{{5}})\.(bin|json)$", p.name)
        if m and int(m.group(1)) >= index:
            p.unlink(missing_ok=True)
    return res


# ----------------------------------------------------------------------------------- tokenizer


@dataclass
class TokenizerSetup:
    """The tokenizer chosen for a run: its identity (for the manifest) and the worker spec."""

    identity: dict[str, Any]
    tokenizer_json: str | None
    files: dict[str, bytes]


def _byte_setup() -> TokenizerSetup:
    return TokenizerSetup({"kind": "byte", "name": "byte", "vocab_size": tokmod.BYTE_VOCAB_SIZE,
                           "eos_id": tokmod.BYTE_EOS_ID, "files": [],
                           "sha256": tokmod.BYTE_IDENTITY_SHA256}, None, {})


def _hf_setup(tok: tokmod.HFTokenizer, files: dict[str, bytes]) -> TokenizerSetup:
    main = files[tokmod.TOKENIZER_FILE]
    names = [f"{TOKENIZER_DIR}/{tokmod.TOKENIZER_FILE}"] + \
        [f"{TOKENIZER_DIR}/{n}" for n in sorted(files) if n != tokmod.TOKENIZER_FILE]
    return TokenizerSetup({"kind": tok.kind, "name": tok.name, "vocab_size": tok.vocab_size,
                           "eos_id": tok.eos_id, "files": names,
                           "sha256": hashlib.sha256(main).hexdigest()}, main.decode("utf-8"), files)


def _train_texts(sources: list[Source], opts: PrepareOptions) -> Iterator[str]:
    """Train-split texts, in corpus order, up to ``bpe_train_bytes`` (validation never leaks in)."""
    spec = EncodeSpec("hf", None, 0, "uint32", opts.val_fraction, opts.text_field, opts.errors)
    enc = Encoder(spec, None)
    budget = opts.bpe_train_bytes
    counts = Counts()
    for task, _ in plan_tasks(sources, opts.chunk_bytes, opts.text_field):
        for unit in enc.units(task, counts):
            if not unit.val and unit.payload:
                text = str(unit.payload)
                yield text
                budget -= len(text)
                if budget <= 0:
                    return


def _setup_tokenizer(opts: PrepareOptions, sources: list[Source],
                     hf: tokmod.LoadedHF | None) -> TokenizerSetup:
    if opts.tokenizer == "byte":
        return _byte_setup()
    if hf is not None:
        return _hf_setup(hf.tokenizer, hf.files)
    vocab = tokmod.parse_bpe_vocab(opts.tokenizer)
    # Training has no progress bar of its own: say what the pause is.
    print(f"prepare: training {opts.tokenizer} on up to {opts.bpe_train_bytes / 1e6:.0f} MB of train text",
          file=sys.stderr)
    tok = tokmod.train_bpe(_train_texts(sources, opts), vocab)
    return _hf_setup(tok, {tokmod.TOKENIZER_FILE: tok.tok.to_str().encode("utf-8")})


def _write_tokenizer(out: Path, setup: TokenizerSetup) -> None:
    for name, blob in setup.files.items():
        atomic_write_bytes(out / TOKENIZER_DIR / name, blob)
        _publish(out / TOKENIZER_DIR / name)


def _tokenizer_files_ok(out: Path, identity: dict[str, Any]) -> bytes | None:
    if identity["kind"] == "byte":
        return b""
    path = out / identity["files"][0]
    try:
        blob = path.read_bytes()
    except OSError:
        return None
    return blob if hashlib.sha256(blob).hexdigest() == identity["sha256"] else None


# ------------------------------------------------------------------------------------ progress


class _Progress:
    """A rich progress bar over input bytes on a terminal; silent otherwise."""

    def __init__(self, enabled: bool, total: int) -> None:
        self.bar: Any = None
        if enabled:
            from rich.console import Console
            from rich.progress import (BarColumn, DownloadColumn, Progress, TextColumn,
                                       TimeRemainingColumn, TransferSpeedColumn)
            self.bar = Progress(TextColumn("prepare"), BarColumn(), DownloadColumn(),
                                TransferSpeedColumn(), TimeRemainingColumn(),
                                console=Console(stderr=True), transient=True)
            self.task = self.bar.add_task("prepare", total=total)
            self.bar.start()

    def advance(self, n: int) -> None:
        if self.bar is not None:
            self.bar.advance(self.task, n)

    def stop(self) -> None:
        if self.bar is not None:
            self.bar.stop()


# ------------------------------------------------------------------------------------ pipeline


def _empty_corpus_error(opts: PrepareOptions, what: str) -> UserError:
    return UserError(f"{', '.join(opts.inputs)}: {what}")


def _load_hf_early(opts: PrepareOptions) -> tokmod.LoadedHF | None:
    if opts.tokenizer == "byte":
        return None
    if opts.tokenizer.startswith("bpe:"):
        tokmod.parse_bpe_vocab(opts.tokenizer)  # a bad VOCAB fails before anything is written
        return None
    return tokmod.load_hf(opts.tokenizer, opts.eos_token)


def _manifest_up_to_date(out: Path, key: str, state: dict[str, Any] | None) -> dict[str, Any] | None:
    if state is None or state.get("key") != key:
        return None
    manifest = _read_json(out / MANIFEST_NAME)
    if manifest is None or manifest.get("format") != FORMAT:
        return None
    itemsize = np.dtype(manifest["dtype"]).itemsize
    for split in manifest["splits"].values():
        for shard in split["shards"]:
            if not _shard_ok(out, {"file": shard["file"], "tokens": shard["tokens"],
                                   "sha256": shard["sha256"]}, itemsize):
                return None
    return manifest


def _build_manifest(opts: PrepareOptions, sources: list[Source], identity: dict[str, Any],
                    dtype: str, writers: dict[str, ShardWriter], errors: dict[str, int]) -> dict[str, Any]:
    splits = {}
    for split, w in writers.items():
        shards = [{k: r[k] for k in ("file", "tokens", "documents", "sha256", "max_token_id")}
                  for r in w.records]
        splits[split] = {"tokens": sum(s["tokens"] for s in shards),
                         "documents": sum(s["documents"] for s in shards), "shards": shards}
    per_input: dict[str, dict[str, int]] = {}
    for s in sources:
        entry = per_input.setdefault(s.input, {"files": 0, "bytes": 0})
        if s.input == "builtin":  # the built-in corpus depends on the interpreter: say which
            entry["python"] = sys.version.split()[0]
        entry["files"] += 1
        entry["bytes"] += s.size
    return {"format": FORMAT, "tokenizer": identity, "dtype": dtype, "splits": splits,
            "val_fraction": opts.val_fraction,
            "sources": [{"input": k, **v} for k, v in per_input.items()],
            "errors": {"policy": opts.errors, **errors},
            "text_field": opts.text_field, "shard_tokens": opts.shard_tokens}


class _WriterThread:
    """Runs the shard writers on one thread, in task order, so writing, hashing and fsync overlap
    the tokenizing (file writes, sha256 and numpy copies release the GIL)."""

    def __init__(self, writers: dict[str, ShardWriter], eos_id: int, depth: int) -> None:
        """Start the thread; at most ``depth`` results wait for it (bounded memory)."""
        self.writers, self.eos_id = writers, eos_id
        self.queue: queue.Queue[Any] = queue.Queue(maxsize=depth)
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._loop, name="podtrain-prepare-writer", daemon=True)
        self.thread.start()

    def _loop(self) -> None:
        while (item := self.queue.get()) is not None:
            if self.error is not None:
                continue  # keep draining so a blocked put() in the main thread returns
            index, train, val, before = item
            try:
                self.writers["train"].write(index, train, self.eos_id, before)
                if "val" in self.writers:
                    self.writers["val"].write(index, val, self.eos_id, before)
            except BaseException as exc:  # re-raised in the main thread, which owns the run
                self.error = exc

    def _raise(self) -> None:
        if self.error is not None:
            raise self.error

    def put(self, index: int, train: np.ndarray, val: np.ndarray, before: dict[str, int]) -> None:
        """Queue one task's tokens; raises what the thread hit earlier."""
        self._raise()
        self.queue.put((index, train, val, before))

    def stop(self) -> None:
        """Wait for every queued write to finish (the writers are the main thread's again)."""
        if self.thread.is_alive():
            self.queue.put(None)
            self.thread.join()

    def finish(self) -> None:
        """``stop`` and raise what the thread hit, if anything."""
        self.stop()
        self._raise()


def _make_runner(spec: EncodeSpec, workers: int) -> Any:
    # Byte-level "tokenizing" is one copy: a worker pool would spend more on pickling tokens
    # through pipes than it offloads (measured 0.4x of inline with 2 workers), so bytes run inline
    # and the writer thread supplies the second core.
    if spec.kind == "byte":
        return _Inline(spec)
    return _Pool(spec, workers)


def _stream(opts: PrepareOptions, sources: list[Source], spec: EncodeSpec,
            writers: dict[str, ShardWriter], start: SplitResume, progress: _Progress,
            result: PrepareResult) -> tuple[int, dict[str, int]]:
    """Run the tasks from ``start.task`` on, feeding the writers in task order.

    Returns the number of tasks and the final error tallies.
    """
    workers = opts.workers or default_workers()
    runner = _make_runner(spec, workers)
    errors = Counts(**start.errors_before)
    pending: deque[tuple[int, int, Callable[[], Any]]] = deque()
    window = 2 * workers  # bounded read-ahead: memory stays ~window x chunk_bytes
    writer = _WriterThread(writers, spec.eos_id, depth=2)

    def consume() -> None:
        index, nbytes, get = pending.popleft()
        train, val, counts = get()
        writer.put(index, train, val, errors.as_dict())
        errors.add(Counts(**counts))
        result.tasks_run += 1
        progress.advance(nbytes)

    n_tasks = 0
    try:
        for index, (task, nbytes) in enumerate(plan_tasks(sources, opts.chunk_bytes, opts.text_field)):
            n_tasks = index + 1
            if index < start.task:
                result.tasks_skipped += 1
                progress.advance(nbytes)
                continue
            pending.append((index, nbytes, runner.submit(task)))
            while len(pending) > window:
                consume()
        while pending:
            consume()
        writer.finish()
    finally:
        writer.stop()  # before anything else touches the writers (abort, cleanup)
        runner.close()
    return n_tasks, errors.as_dict()


def _resume_all(out: Path, splits: list[str], key: str, itemsize: int) -> dict[str, SplitResume]:
    return {s: _resume_split(out, s, key, itemsize) for s in splits}


def _earliest(resumes: dict[str, SplitResume]) -> SplitResume:
    """The split whose stream restarts first: the whole run restarts at its task."""
    open_ = [r for r in resumes.values() if not r.complete]
    return min(open_ or list(resumes.values()), key=lambda r: r.task)


def prepare(opts: PrepareOptions) -> PrepareResult:
    """Tokenize ``opts.inputs`` into ``opts.out`` (shards + manifest); see the module docstring.

    Raises ``UserError`` (one line naming the file) for bad input, leaving no manifest and no
    temporary file behind.
    """
    t0 = time.perf_counter()
    _validate(opts)
    # Everything that can be checked without writing is checked first.
    sources = resolve_inputs(opts.inputs, opts.builtin_bytes, opts.text_field)
    if not sources:
        raise _empty_corpus_error(opts, "no input files found")
    input_bytes = sum(s.size for s in sources)
    if input_bytes == 0:
        raise _empty_corpus_error(opts, f"empty corpus ({len(sources)} files, all empty)")
    hf = _load_hf_early(opts)
    key = run_key(sources, opts, hashlib.sha256(hf.files[tokmod.TOKENIZER_FILE]).hexdigest() if hf else None)

    out = Path(opts.out)
    created = not out.exists()
    if out.exists() and not out.is_dir():
        raise UserError(f"--out {out}: exists and is not a directory")
    out.mkdir(parents=True, exist_ok=True)
    lock = _lock_dir(out, created)
    _remove_temp_files(out)
    result = PrepareResult(out=out, manifest={}, input_bytes=input_bytes)
    writers: dict[str, ShardWriter] = {}
    try:
        state = _read_json(out / STATE_DIR / "run.json")
        manifest = _manifest_up_to_date(out, key, state)
        if manifest is not None:
            result.manifest, result.up_to_date = manifest, True
            result.shards_skipped = sum(len(s["shards"]) for s in manifest["splits"].values())
            result.seconds = time.perf_counter() - t0
            return result
        (out / MANIFEST_NAME).unlink(missing_ok=True)
        setup = _reuse_or_setup(out, key, state, opts, sources, hf)
        identity = setup.identity
        dtype = tokmod.dtype_for_vocab(identity["vocab_size"])
        splits = ["train", "val"] if opts.val_fraction > 0 else ["train"]
        resumes = _resume_all(out, splits, key, np.dtype(dtype).itemsize)
        start = _earliest(resumes)
        for split in splits:
            r = resumes[split]
            writers[split] = ShardWriter(out, split, np.dtype(dtype), opts.shard_tokens, key,
                                         r.done, r.task, r.skip, r.complete)
        result.shards_skipped = sum(len(r.done) for r in resumes.values())
        spec = EncodeSpec(identity["kind"], setup.tokenizer_json, identity["eos_id"], dtype,
                          opts.val_fraction, opts.text_field, opts.errors)
        progress = _Progress(sys.stderr.isatty() if opts.progress is None else opts.progress, input_bytes)
        try:
            if all(r.complete for r in resumes.values()):
                n_tasks, errors = start.task, dict(start.errors_before)
            else:
                n_tasks, errors = _stream(opts, sources, spec, writers, start, progress, result)
        finally:
            progress.stop()
        for w in writers.values():
            w.close(n_tasks, errors)
        _check_not_empty(opts, writers)
        manifest = _build_manifest(opts, sources, identity, dtype, writers, errors)
        atomic_write_text(out / MANIFEST_NAME, json.dumps(manifest, indent=1) + "\n")
        _publish(out / MANIFEST_NAME)
        result.manifest = manifest
        result.shards_written = sum(w.written for w in writers.values())
    except UserError:
        for w in writers.values():
            w.abort()
        clean_outputs(out)
        if created and out.is_dir() and not any(out.iterdir()):
            out.rmdir()
        raise
    finally:
        for w in writers.values():
            w.abort()
        _remove_temp_files(out)
        os.close(lock)
    result.seconds = time.perf_counter() - t0
    return result


def _lock_dir(out: Path, created: bool) -> int:
    """An exclusive lock on DATA_DIR for this run: two prepares into one directory (a command run
    on every rank, a demo started twice) would interleave their shards."""
    fd = os.open(out, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        if created:
            out.rmdir()
        raise UserError(f"--out {out}: another `podtrain prepare` is writing this directory") from None
    return fd


def _reuse_or_setup(out: Path, key: str, state: dict[str, Any] | None, opts: PrepareOptions,
                    sources: list[Source], hf: tokmod.LoadedHF | None) -> TokenizerSetup:
    """The tokenizer of an interrupted run with the same key, or a fresh start (old files removed)."""
    if state is not None and state.get("key") == key:
        blob = _tokenizer_files_ok(out, state["tokenizer"])
        if blob is not None:
            return TokenizerSetup(state["tokenizer"], blob.decode("utf-8") or None, {})
    clean_outputs(out)
    setup = _setup_tokenizer(opts, sources, hf)
    _write_tokenizer(out, setup)
    atomic_write_text(out / STATE_DIR / "run.json", json.dumps({"key": key, "tokenizer": setup.identity}))
    return setup


def _check_not_empty(opts: PrepareOptions, writers: dict[str, ShardWriter]) -> None:
    train = writers["train"].tokens()
    val = writers["val"].tokens() if "val" in writers else 0
    if train == 0 and val == 0:
        raise _empty_corpus_error(opts, "empty corpus (no text left after decoding; "
                                  "every document was empty or skipped)")
    if train == 0:
        raise _empty_corpus_error(opts, f"every document fell into the validation split "
                                  f"(--val-fraction {opts.val_fraction}); lower it or add documents")
    if "val" in writers and val == 0:
        raise _empty_corpus_error(opts, f"no document fell into the validation split "
                                  f"(--val-fraction {opts.val_fraction}); raise it, add documents, "
                                  "or pass --val-fraction 0")


# ------------------------------------------------------------------------------------------ CLI


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of ``podtrain prepare``."""
    parser.add_argument("inputs", nargs="+", metavar="INPUT",
                        help="text files, directories, globs, .jsonl, .parquet, or `builtin`")
    parser.add_argument("--out", required=True, type=Path, metavar="DATA_DIR")
    parser.add_argument("--tokenizer", default="byte",
                        help="byte (default), bpe:VOCAB (trained here), or a tokenizer.json / folder / hub name")
    parser.add_argument("--val-fraction", type=float, default=DEFAULT_VAL_FRACTION,
                        help=f"share of documents held out for validation (default {DEFAULT_VAL_FRACTION})")
    parser.add_argument("--text-field", default="text", help="JSONL key / Parquet column holding the text")
    parser.add_argument("--errors", choices=ERROR_POLICIES, default="strict",
                        help="undecodable UTF-8: stop with an error naming the file (strict, default), "
                        "replace with U+FFFD, or skip the document (the piece, for files cut at "
                        "--chunk-bytes); counted in the manifest")
    parser.add_argument("--workers", type=int, default=0, help="worker processes (default: one per core)")
    parser.add_argument("--shard-tokens", type=int, default=DEFAULT_SHARD_TOKENS, help="tokens per shard")
    parser.add_argument("--chunk-bytes", type=int, default=DEFAULT_CHUNK_BYTES,
                        help="raw bytes per worker task (changes where large files are cut)")
    parser.add_argument("--builtin-bytes", type=int, default=builtin_corpus.DEFAULT_BUILTIN_BYTES,
                        help="size budget of the built-in corpus")
    parser.add_argument("--bpe-train-bytes", type=int, default=DEFAULT_BPE_TRAIN_BYTES,
                        help="text a bpe:VOCAB tokenizer is trained on")
    parser.add_argument("--eos-token", default=None, help="EOS token of a Hugging Face tokenizer")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")


def options_from_args(args: argparse.Namespace) -> PrepareOptions:
    """The ``PrepareOptions`` an argparse namespace describes."""
    return PrepareOptions(inputs=tuple(args.inputs), out=Path(args.out), tokenizer=args.tokenizer,
                          val_fraction=args.val_fraction, text_field=args.text_field, errors=args.errors,
                          shard_tokens=args.shard_tokens, chunk_bytes=args.chunk_bytes,
                          workers=args.workers, builtin_bytes=args.builtin_bytes,
                          bpe_train_bytes=args.bpe_train_bytes, eos_token=args.eos_token,
                          progress=False if args.no_progress else None)


def summary(result: PrepareResult) -> str:
    """One line saying what was made (or that nothing needed doing)."""
    m = result.manifest
    parts = []
    for split, s in m["splits"].items():
        parts.append(f"{split} {s['tokens']:,} tokens / {s['documents']:,} docs / {len(s['shards'])} shards")
    tok = m["tokenizer"]
    head = "up to date" if result.up_to_date else \
        f"{result.input_bytes / 1e6:.1f} MB in {result.seconds:.1f}s " \
        f"({result.input_bytes / 1e6 / max(result.seconds, 1e-9):.1f} MB/s)"
    err = m.get("errors", {})
    errs = f", {err.get('replaced', 0)} replaced / {err.get('skipped', 0)} skipped (undecodable)" \
        if err.get("replaced") or err.get("skipped") else ""
    return (f"prepared {result.out}: {head}; {'; '.join(parts)}; tokenizer {tok['name']} "
            f"(vocab {tok['vocab_size']}, {m['dtype']}); shards written {result.shards_written}, "
            f"skipped {result.shards_skipped}{errs}")


def run(args: argparse.Namespace) -> int:
    """Entry point of ``podtrain prepare``."""
    result = prepare(options_from_args(args))
    print(summary(result))
    return 0
