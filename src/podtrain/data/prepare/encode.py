"""Encoding tasks for ``podtrain prepare``: decode with the --errors policy, split, tokenize, pack.

A document's split is a hash of its name, so it never depends on the worker count or on the
order tasks finish in. Documents are named after their source (see ``sources``): a JSONL line
is NAME:LINE and a Parquet row NAME#ROW.

Tasks run either inline (byte-level) or in a pool of spawned worker processes, each holding its
own encoder; both runners hand results back through a getter called in task order.
"""

from __future__ import annotations

import hashlib
import json
import multiprocessing
import os
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from typing import Any

import numpy as np

from podtrain.data import tokenizer as tokmod
from podtrain.data.prepare.readers import JsonlItem, RowsItem, Task, TextItem
from podtrain.errors import UserError


def doc_hash(name: str) -> int:
    """The 64-bit hash of a document's name that decides its split."""
    digest = hashlib.blake2b(name.encode("utf-8", "surrogatepass"), digest_size=8).digest()
    return int.from_bytes(digest, "big")


def is_val(name: str, val_fraction: float) -> bool:
    """Whether the document called ``name`` belongs to the validation split by its hash alone
    (``holdout`` may add one more document to a small corpus's split: ``EncodeSpec.val_doc``)."""
    return val_fraction > 0.0 and doc_hash(name) < val_fraction * 2.0 ** 64


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
    val_doc: str | None = None   # held out as well when no document hashes into val (holdout)

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

    def _is_val(self, name: str) -> bool:
        return name == self.spec.val_doc or is_val(name, self.spec.val_fraction)

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
        for item in task:
            if isinstance(item, TextItem):
                yield from self._text_units(item, counts)
            elif isinstance(item, JsonlItem):
                yield from self._jsonl_units(item, counts)
            else:
                yield from self._row_units(item, counts)

    def _text_units(self, item: TextItem, counts: Counts) -> Iterator[Unit]:
        val = self._is_val(item.name)
        empty: bytes | str = b"" if self.want_bytes else ""
        payload = self._decode(item.data, item.where, counts, base=item.offset) if item.data else empty
        # A skipped piece still closes its document when it was the last one of a larger file.
        payload = empty if payload is None else payload
        if payload or (item.last and item.offset):
            yield Unit(payload, item.last, val)

    def _row_units(self, item: RowsItem, counts: Counts) -> Iterator[Unit]:
        for i, raw in enumerate(item.rows):
            if raw:
                row = item.first_row + i
                payload = self._decode(raw, f"{item.where} row {row}", counts)
                if payload:
                    yield Unit(payload, True, self._is_val(f"{item.name}#{row}"))

    def _jsonl_units(self, item: JsonlItem, counts: Counts) -> Iterator[Unit]:
        field_name = self.spec.text_field
        for i, raw in enumerate(item.data.split(b"\n")):
            line_no = item.first_line + i
            if not raw.strip():
                continue
            at = f"{item.where}:{line_no}"
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
                    yield Unit(payload, True, self._is_val(f"{item.name}:{line_no}"))

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


def train_texts(tasks: Iterable[Task], val_fraction: float, text_field: str, errors: str,
                budget: int, val_doc: str | None = None) -> Iterator[str]:
    """Train-split texts of ``tasks``, in order, until ``budget`` characters have been yielded
    (what a BPE is trained on; validation documents never leak in)."""
    # Kind "hf" makes the encoder hand out decoded str, what a BPE trainer takes; no tokenizer is
    # needed because nothing is tokenized here.
    enc = Encoder(EncodeSpec("hf", None, 0, "uint32", val_fraction, text_field, errors, val_doc), None)
    counts = Counts()
    for task in tasks:
        for unit in enc.units(task, counts):
            if not unit.val and unit.payload:
                text = str(unit.payload)
                yield text
                budget -= len(text)
                if budget <= 0:
                    return


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
        """A getter that encodes ``task`` when called (in task order, by the caller)."""
        return lambda: self.encoder.run(task)

    def close(self) -> None:
        """Nothing to release."""


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
        """Start encoding ``task`` in a worker; returns a getter of its result."""
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
        """Stop the workers, dropping tasks not yet started (after an error nobody wants them)."""
        self.pool.shutdown(wait=True, cancel_futures=True)


def make_runner(spec: EncodeSpec, workers: int) -> _Inline | _Pool:
    """What runs the tasks: ``submit(task)`` returns a getter of its result; ``close()`` at the end."""
    # Byte-level "tokenizing" is one copy: a worker pool would spend more on pickling tokens
    # through pipes than it offloads (measured 0.4x of inline with 2 workers), so bytes run inline
    # and the writer thread supplies the second core.
    if spec.kind == "byte":
        return _Inline(spec)
    return _Pool(spec, workers)
