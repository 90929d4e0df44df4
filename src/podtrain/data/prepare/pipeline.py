"""The ``podtrain prepare`` pipeline: any corpus -> fixed-size token shards + ``manifest.json``.

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
file named directly or matched by a glob: its path relative to the deepest folder holding all such
files of the command (``sources``); a JSONL line: NAME:LINE; a Parquet row: NAME#ROW. Moving the
corpus therefore keeps every document in its split.

Why nothing is lost: a finished dataset already at DATA_DIR that this run would replace by another
(other inputs, tokenizer or options) is refused before any work unless ``force`` (``replace``).

Why nothing is half-written: shards are streamed into a temporary file and renamed when full,
other files go through ``fsutil.atomic_write_*``, the manifest is written last, and a user error
removes everything this run wrote (a Ctrl-C keeps finished shards for the resume).

This module holds the options, the pipeline and the manifest it builds; the flags are in ``cli``
and each stage lives in its own module of this package: ``sources`` (resolve INPUTs), ``readers``
(cut them into tasks; ``compression`` decompresses), ``encode`` (the encoder and the worker pool),
``shards`` (shard writing, done records, cleanup), ``holdout`` (a small corpus's validation
document), ``replace`` (the dataset already there), ``reuse`` (``--tokenizer DATA_DIR``), ``parts``
(one part of a ``--num-parts`` prepare; ``merge`` joins them); ``podtrain.data.tokenizer`` holds
the tokenizer's identity and files.
"""

from __future__ import annotations

import contextvars
import hashlib
import json
import os
import sys
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import numpy as np

from podtrain.data import tokenizer as tokmod
from podtrain.data.manifest import COUNTS_NAME, MANIFEST_NAME, encode_token_counts
from podtrain.data.prepare import builtin as builtin_corpus
from podtrain.data.prepare import parts, replace, reuse
from podtrain.data.prepare.encode import Counts, EncodeSpec, make_runner, train_texts
from podtrain.data.prepare.holdout import fallback_val_document
from podtrain.data.prepare.output import build_manifest, lock_dir
from podtrain.data.prepare.progress import Progress
from podtrain.data.prepare.readers import plan_tasks
from podtrain.data.prepare.shards import (ShardWriter, SplitResume, WriterThread, clean_outputs, earliest,
                                          read_run_state, remove_temp_files, resume_splits,
                                          up_to_date_manifest, write_run_state)
from podtrain.data.prepare.sources import Source, is_s3, resolve_corpus
from podtrain.errors import UserError
from podtrain.fsutil import atomic_write_bytes, atomic_write_text
from podtrain.storage.s3_client import sharing_s3_clients

DEFAULT_VAL_FRACTION = 0.03
DEFAULT_SHARD_TOKENS = 1 << 26          # 128 MiB per uint16 shard
DEFAULT_CHUNK_BYTES = 1 << 20           # raw text per worker task (small: load balance)
DEFAULT_BPE_TRAIN_BYTES = 256 << 20     # text a BPE is trained on (the first train documents)
ERROR_POLICIES = ("strict", "replace", "skip")
PIPELINE_VERSION = 1                    # bump when the same options would give different shards


# --------------------------------------------------------------------------------------- options


@dataclass(frozen=True)
class PrepareOptions:
    """Everything ``prepare`` needs; the CLI flags map one to one."""

    inputs: tuple[str, ...]
    out: Path | str                      # str: an s3:// url (prepared locally, then uploaded: ``remote``)
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
    num_parts: int = 1                   # > 1: prepare only part ``part`` of the corpus (see ``parts``)
    part: int = 0
    force: bool = False                  # replace a finished dataset of another recipe at ``out``

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
    skipped_files: str = ""              # "skipped 2 files: 2 binary (NUL bytes: a.png, b)" (not read), or ""
    text_bytes: int = 0                  # bytes of text read (decompressed): input_bytes where not compressed


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
    if isinstance(opts.out, Path) and str(opts.out).startswith("s3:/"):  # Path() ate one slash
        raise UserError(f"--out {opts.out}: pass an s3:// url as a string, not a Path")
    parts.choose_part(opts.num_parts, opts.part)


def default_workers() -> int:
    """One worker per core this process may run on."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # pragma: no cover - not Linux
        return max(1, os.cpu_count() or 1)


# ------------------------------------------------------------------------------------ pipeline


def _empty_corpus_error(opts: PrepareOptions, what: str) -> UserError:
    return UserError(f"{replace.shown_inputs(list(opts.inputs))}: {what}")


def _load_hf_early(opts: PrepareOptions) -> tokmod.LoadedHF | None:
    """The tokenizer to load rather than make: None for byte-level (``byte`` or a byte-level
    dataset) and for ``bpe:VOCAB`` (trained later, from the inputs)."""
    if opts.tokenizer == "byte":
        return None
    if opts.tokenizer.startswith("bpe:"):
        tokmod.parse_bpe_vocab(opts.tokenizer)  # a bad VOCAB fails before anything is written
        return None
    if reuse.is_dataset(opts.tokenizer):
        return reuse.dataset_tokenizer(opts.tokenizer)
    return tokmod.load_hf(opts.tokenizer, opts.eos_token)


def _setup_tokenizer(opts: PrepareOptions, sources: list[Source], hf: tokmod.LoadedHF | None,
                     val_doc: str | None) -> tokmod.TokenizerSetup:
    if hf is not None:
        return tokmod.hf_setup(hf.tokenizer, hf.files)
    if not opts.tokenizer.startswith("bpe:"):  # byte, or a byte-level dataset's
        return tokmod.byte_setup()
    vocab = tokmod.parse_bpe_vocab(opts.tokenizer)
    # Training has no progress bar of its own: say what the pause is.
    print(f"prepare: training {opts.tokenizer} on up to {mib(opts.bpe_train_bytes)} of train text",
          file=sys.stderr)
    tasks = (task for task, _ in plan_tasks(sources, opts.chunk_bytes, opts.text_field))
    texts = train_texts(tasks, opts.val_fraction, opts.text_field, opts.errors, opts.bpe_train_bytes, val_doc)
    tok = tokmod.train_bpe(in_this_context(texts), vocab)
    return tokmod.hf_setup(tok, {tokmod.TOKENIZER_FILE: tok.tok.to_str().encode("utf-8")})


def mib(n: int) -> str:
    """A byte count as ``--bpe-train-bytes`` is written about everywhere (help, docs, messages):
    in MiB (``256 MiB``; ``286.1 MiB`` when not whole), or in bytes below one MiB."""
    if n < 1 << 20:
        return f"{n:,} bytes"
    value = n / (1 << 20)
    return f"{value:,.0f} MiB" if value == int(value) else f"{value:,.1f} MiB"


def in_this_context(items: Iterator[Any]) -> Iterator[Any]:
    """``items``, each drawn inside the caller's context, whichever thread pulls them: the
    tokenizers library iterates from a thread of its own, which would not see the command's
    ``shared_s3_clients()`` scope (every S3 object would make, and tear down, a client)."""
    context = contextvars.copy_context()  # now, in the caller's thread (a generator would copy at its first next)

    def drawn() -> Iterator[Any]:
        while True:
            try:
                yield context.run(next, items)
            except StopIteration:
                return
    return drawn()


def _reuse_or_setup(out: Path, key: str, state: dict[str, Any] | None, opts: PrepareOptions,
                    sources: list[Source], hf: tokmod.LoadedHF | None,
                    val_doc: str | None) -> tokmod.TokenizerSetup:
    """The tokenizer of an interrupted run with the same key, or a fresh start (old files removed)."""
    if state is not None and state.get("key") == key:
        blob = tokmod.read_setup_file(out, state["tokenizer"])
        if blob is not None:
            return tokmod.TokenizerSetup(state["tokenizer"], blob.decode("utf-8") or None, {})
    clean_outputs(out)
    setup = _setup_tokenizer(opts, sources, hf, val_doc)
    tokmod.write_setup_files(out, setup)
    write_run_state(out, key, setup.identity)
    return setup


def run_key(sources: list[Source], opts: PrepareOptions, tokenizer_sha: str | None,
            val_doc: str | None = None) -> str:
    """Fingerprint of the inputs (name, path, size, mtime) and the options that shape the shards."""
    desc: dict[str, Any] = {"sources": [[s.input, s.name, s.where(), s.kind, s.size, s.mtime_ns]
                                        + ([s.version] if s.version else []) for s in sources],
                            "options": opts.key_fields(), "tokenizer_file_sha256": tokenizer_sha}
    if val_doc is not None:  # only then: keys of existing data directories stay valid
        desc["val_doc"] = val_doc
    return hashlib.sha256(json.dumps(desc, sort_keys=True).encode("utf-8")).hexdigest()


def _stream(opts: PrepareOptions, sources: list[Source], spec: EncodeSpec,
            writers: dict[str, ShardWriter], start: SplitResume, progress: Progress,
            result: PrepareResult) -> tuple[int, dict[str, int]]:
    """Run the tasks from ``start.task`` on, feeding the writers in task order.

    Returns the number of tasks and the final error tallies.
    """
    workers = opts.workers or default_workers()
    runner = make_runner(spec, workers)
    errors = Counts(**start.errors_before)
    pending: deque[tuple[int, int, Callable[[], Any]]] = deque()
    window = 2 * workers  # bounded read-ahead: memory stays ~window x chunk_bytes
    writer = WriterThread(writers, spec.eos_id, depth=2)

    def consume() -> None:
        index, nbytes, get = pending.popleft()
        train, val, counts = get()
        writer.put(index, train, val, errors.as_dict())
        errors.add(Counts(**counts))
        result.tasks_run += 1
        result.text_bytes += nbytes
        progress.advance(nbytes)

    n_tasks = 0
    try:
        for index, (task, nbytes) in enumerate(plan_tasks(sources, opts.chunk_bytes, opts.text_field)):
            n_tasks = index + 1
            if index < start.task:
                result.tasks_skipped += 1
                result.text_bytes += nbytes
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


@dataclass(frozen=True)
class _Corpus:
    """The resolved, checked inputs of a run and what is decided from the whole corpus."""

    sources: list[Source]
    hf: tokmod.LoadedHF | None
    val_doc: str | None
    key: str
    recipe: dict[str, Any]     # what ``replace`` compares with a dataset already at the output
    skipped_files: str         # the summary's "skipped N files: ...; skipped M duplicates (...)", or ""


def _resolve(opts: PrepareOptions) -> _Corpus:
    """Everything that can be checked without writing, checked (the whole corpus, even in a part);
    then a finished dataset of another recipe at the output refused (unless ``opts.force``)."""
    _validate(opts)
    existing = replace.read_existing(opts.out)  # first: on S3 the one request that checks credentials
    inputs = resolve_corpus(opts.inputs, opts.builtin_bytes, opts.text_field)
    sources = inputs.sources
    if not sources:
        skipped = inputs.skipped_line()
        raise _empty_corpus_error(opts, "no input files found" + (f" ({skipped})" if skipped else ""))
    if sum(s.size for s in sources) == 0:
        raise _empty_corpus_error(opts, f"empty corpus ({len(sources)} files, all empty)")
    hf = _load_hf_early(opts)
    sha = hashlib.sha256(hf.files[tokmod.TOKENIZER_FILE]).hexdigest() if hf else None
    recipe = replace.make_recipe(opts.inputs, replace.tokenizer_recipe(opts.tokenizer, sha), opts.key_fields(),
                                 len(sources))
    if not opts.force:
        replace.refuse_replacing(opts.out, existing, recipe, opts.tokenizer, opts.inputs, len(sources))
    val_doc = fallback_val_document(sources, opts.val_fraction, opts.text_field)
    return _Corpus(sources, hf, val_doc, run_key(sources, opts, sha, val_doc), recipe, inputs.left_out_line())


@sharing_s3_clients
def prepare(opts: PrepareOptions) -> PrepareResult:
    """Tokenize ``opts.inputs`` into ``opts.out`` (shards + manifest); see the module docstring.

    With ``opts.num_parts > 1`` only part ``opts.part`` is prepared, into its folder under
    ``opts.out`` (see ``parts``). Raises ``UserError`` (one line naming the file) for bad input,
    leaving no manifest and no temporary file behind.
    """
    t0 = time.perf_counter()
    corpus = _resolve(opts)
    if is_s3(opts.out):
        from podtrain.data.prepare.remote import prepare_remote
        return prepare_remote(opts, lambda staged: _prepare_local(staged, corpus, t0))
    return _prepare_local(opts, corpus, t0)


def _prepare_local(opts: PrepareOptions, corpus: _Corpus, t0: float) -> PrepareResult:
    """``prepare`` into a local folder (``opts.out``) of the resolved ``corpus``."""
    sources, hf, key, out, part = corpus.sources, corpus.hf, corpus.key, Path(opts.out), None
    if opts.num_parts > 1:
        part = {"index": opts.part, "count": opts.num_parts, "corpus": key}
        if opts.tokenizer.startswith("bpe:"):
            hf = parts.load_trained(out, key, opts.tokenizer)
        sources = parts.split_sources(sources, opts.part, opts.num_parts)
        key = parts.part_key(key, opts.part, opts.num_parts)
        if out.is_dir():
            parts.invalidate_merge(out)
        out = parts.part_dir(out, opts.part, opts.num_parts)

    created = not out.exists()
    if out.exists() and not out.is_dir():
        raise UserError(f"--out {out}: exists and is not a directory")
    out.mkdir(parents=True, exist_ok=True)
    lock = lock_dir(out, created)
    remove_temp_files(out)
    result = PrepareResult(out=out, manifest={}, input_bytes=sum(s.size for s in sources),
                           skipped_files=corpus.skipped_files)
    writers: dict[str, ShardWriter] = {}
    try:
        state = read_run_state(out)
        manifest = up_to_date_manifest(out, key, state)
        if manifest is not None:
            result.manifest, result.up_to_date = manifest, True
            result.shards_skipped = sum(len(s["shards"]) for s in manifest["splits"].values())
            result.seconds = time.perf_counter() - t0
            return result
        (out / MANIFEST_NAME).unlink(missing_ok=True)
        setup = _reuse_or_setup(out, key, state, opts, sources, hf, corpus.val_doc)
        identity = setup.identity
        dtype = tokmod.dtype_for_vocab(identity["vocab_size"])
        splits = ["train", "val"] if opts.val_fraction > 0 else ["train"]
        resumes = resume_splits(out, splits, key, np.dtype(dtype).itemsize)
        start = earliest(resumes)
        for split in splits:
            r = resumes[split]
            writers[split] = ShardWriter(out, split, np.dtype(dtype), opts.shard_tokens, key,
                                         r.done, r.task, r.skip, r.complete, counts=r.counts)
        result.shards_skipped = sum(len(r.done) for r in resumes.values())
        spec = EncodeSpec(identity["kind"], setup.tokenizer_json, identity["eos_id"], dtype,
                          opts.val_fraction, opts.text_field, opts.errors, corpus.val_doc)
        # Compressed inputs: how many bytes they hold is known only once they are read.
        progress = Progress(sys.stderr.isatty() if opts.progress is None else opts.progress,
                            None if any(s.codec for s in sources) else result.input_bytes)
        try:
            if all(r.complete for r in resumes.values()):
                n_tasks, errors = start.task, dict(start.errors_before)
            else:
                n_tasks, errors = _stream(opts, sources, spec, writers, start, progress, result)
        finally:
            progress.stop()
        for w in writers.values():
            w.close(n_tasks, errors)
        if part is None:  # a part may hold no document of a split: merge checks the whole
            check_not_empty(opts, {s: w.tokens() for s, w in writers.items()},
                            skipped_note(errors, corpus.skipped_files))
        manifest = build_manifest(opts, sources, identity, dtype,
                                  {s: w.records for s, w in writers.items()}, errors, corpus.recipe)
        if part is not None:
            manifest["part"] = part
        # the token counts (the closing line's entropy reads them, not the shards), before the manifest
        atomic_write_bytes(out / COUNTS_NAME, encode_token_counts({s: w.counts for s, w in writers.items()},
                                                                  int(identity["vocab_size"])))
        manifest["token_counts"] = COUNTS_NAME
        atomic_write_text(out / MANIFEST_NAME, json.dumps(manifest, indent=1) + "\n")
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
        remove_temp_files(out)
        os.close(lock)
    result.seconds = time.perf_counter() - t0
    return result


@sharing_s3_clients
def train_tokenizer(opts: PrepareOptions) -> str:
    """``--train-tokenizer-only``: train a ``bpe:VOCAB`` tokenizer once, before the parts of a
    ``--num-parts`` prepare (on the text a one-shot prepare trains on); returns a summary line.

    The same command again is a no-op (the tokenizer there is kept); over a tokenizer trained from
    other inputs or options it stops in one line unless ``opts.force`` (``parts.tokenizer_already_trained``)."""
    corpus = _resolve(opts)
    if not opts.tokenizer.startswith("bpe:"):
        return f"nothing to train: --tokenizer {opts.tokenizer} is used as it is"
    if is_s3(opts.out):
        from podtrain.data.prepare.remote import train_remote
        return train_remote(opts, lambda staged: _train_local(staged, corpus))
    return _train_local(opts, corpus)


def _train_local(opts: PrepareOptions, corpus: _Corpus) -> str:
    """``train_tokenizer`` into a local folder (``opts.out``) for the resolved ``corpus``."""
    out = Path(opts.out)
    created = not out.exists()
    out.mkdir(parents=True, exist_ok=True)
    lock = lock_dir(out, created)
    try:
        if parts.tokenizer_already_trained(out, corpus.key, corpus.recipe, opts.tokenizer, opts.force):
            return f"{out / tokmod.TOKENIZER_DIR}: {opts.tokenizer} already trained for these inputs"
        setup = _setup_tokenizer(opts, corpus.sources, None, corpus.val_doc)
        tokmod.write_setup_files(out, setup)
        parts.write_trained_record(out, corpus.key, setup.identity, corpus.recipe)
    finally:
        os.close(lock)
    return (f"trained {opts.tokenizer} into {out / tokmod.TOKENIZER_DIR}: now run the parts (--num-parts N "
            f"--part I), or prepare each source of a mix with --tokenizer {opts.out}")


def skipped_note(errors: dict[str, int], skipped_files: str) -> str:
    """What was left out of the corpus, for an error about what is left (empty, or a split
    empty): ``"; --errors skip dropped 19 undecodable documents or pieces; skipped 2 files: ..."``
    (empty when nothing was): a split emptied by skipping is not a fraction to change."""
    note = ""
    if errors.get("skipped"):
        n = errors["skipped"]
        note += f"; --errors skip dropped {n:,} undecodable document{'s' if n != 1 else ''} or pieces"
    if skipped_files:
        note += f"; {skipped_files}"
    return note


def check_not_empty(opts: PrepareOptions, tokens: dict[str, int], note: str = "") -> None:
    """Refuse a result whose train split, or validation split when asked for, is empty; ``note``
    (``skipped_note``) says what was left out."""
    train, val = tokens["train"], tokens.get("val", 0)
    if train == 0 and val == 0:
        raise _empty_corpus_error(opts, "empty corpus (no text left after decoding; "
                                  f"every document was empty or skipped{note})")
    if train == 0:
        raise _empty_corpus_error(opts, f"every document fell into the validation split "
                                  f"(--val-fraction {opts.val_fraction}); lower it or add documents{note}")
    if "val" in tokens and val == 0:
        raise _empty_corpus_error(opts, f"no document fell into the validation split "
                                  f"(--val-fraction {opts.val_fraction}); raise it, add documents, "
                                  f"or pass --val-fraction 0{note}")
