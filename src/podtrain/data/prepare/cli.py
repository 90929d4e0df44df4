"""``podtrain prepare``: the command's flags, the options they map to, and its summary line.

The work itself is ``pipeline.prepare``; this module only translates between argv and it.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from podtrain.data.prepare import builtin as builtin_corpus
from podtrain.data.prepare.pipeline import (DEFAULT_BPE_TRAIN_BYTES, DEFAULT_CHUNK_BYTES,
                                            DEFAULT_SHARD_TOKENS, DEFAULT_VAL_FRACTION, ERROR_POLICIES,
                                            PrepareOptions, PrepareResult, mib, prepare, train_tokenizer)
from podtrain.data.prepare.parts import choose_part
from podtrain.data.prepare.sources import is_s3
from podtrain.errors import UserError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of ``podtrain prepare``."""
    parser.add_argument("inputs", nargs="+", metavar="INPUT",
                        help="text files, directories, globs, .jsonl, .parquet (text and .jsonl also "
                        ".gz/.bz2/.xz/.zst), s3:// prefixes, or `builtin`")
    parser.add_argument("--out", required=True, metavar="DATA_DIR", help="a folder or an s3:// prefix")
    parser.add_argument("--tokenizer", default="byte",
                        help="byte (default), bpe:VOCAB (trained here), a prepared DATA_DIR (reuses its "
                        "tokenizer: how sources to mix share one), or a tokenizer.json / folder / hub name")
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
                        help=f"bytes of text a bpe:VOCAB tokenizer is trained on (default "
                        f"{DEFAULT_BPE_TRAIN_BYTES} = {mib(DEFAULT_BPE_TRAIN_BYTES)})")
    parser.add_argument("--eos-token", default=None, help="EOS token of a Hugging Face tokenizer")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.add_argument("--force", action="store_true",
                        help="replace DATA_DIR even when it holds another dataset (other inputs, "
                        "tokenizer or options)")
    parser.add_argument("--num-parts", type=int, default=1, metavar="N",
                        help="prepare one of N parts of the inputs (then `podtrain prepare merge DATA_DIR`)")
    parser.add_argument("--part", type=int, default=None, metavar="I",
                        help="which part, 0..N-1 (default: the Slurm array / srun task id)")
    parser.add_argument("--train-tokenizer-only", action="store_true",
                        help="train the bpe:VOCAB tokenizer into DATA_DIR and stop: run once before the parts")


def options_from_args(args: argparse.Namespace) -> PrepareOptions:
    """The ``PrepareOptions`` an argparse namespace describes (the part from Slurm when not given)."""
    num_parts = args.num_parts
    part = choose_part(num_parts, args.part) if num_parts != 1 or args.part is not None else 0
    return PrepareOptions(num_parts=num_parts, part=part, inputs=tuple(args.inputs),
                          out=args.out if is_s3(args.out) else Path(args.out), tokenizer=args.tokenizer,
                          val_fraction=args.val_fraction, text_field=args.text_field, errors=args.errors,
                          shard_tokens=args.shard_tokens, chunk_bytes=args.chunk_bytes,
                          workers=args.workers, builtin_bytes=args.builtin_bytes,
                          bpe_train_bytes=args.bpe_train_bytes, eos_token=args.eos_token,
                          progress=False if args.no_progress else None, force=args.force)


def summary(result: PrepareResult) -> str:
    """One line saying what was made (or that nothing needed doing)."""
    m = result.manifest
    parts = []
    for split, s in m["splits"].items():
        parts.append(f"{split} {s['tokens']:,} tokens / {s['documents']:,} docs / {len(s['shards'])} shards")
    tok = m["tokenizer"]
    head = "up to date" if result.up_to_date else _read_and_speed(result)
    err = m.get("errors", {})
    errs = f", {err.get('replaced', 0)} replaced / {err.get('skipped', 0)} skipped (undecodable)" \
        if err.get("replaced") or err.get("skipped") else ""
    skipped = f"; {result.skipped_files}" if result.skipped_files else ""
    return (f"prepared {result.out}: {head}; {'; '.join(parts)}; tokenizer {tok['name']} "
            f"(vocab {tok['vocab_size']}, {m['dtype']}); shards written {result.shards_written}, "
            f"reused {result.shards_skipped}{errs}{skipped}")


def _read_and_speed(result: PrepareResult) -> str:
    """``5.9 MB in 9.6s (0.6 MB/s)``; where the text read differs from the bytes on disk
    (compressed inputs, Parquet), both, and the speed on the text: ``5.9 MB read (19.1 MB of
    text) in 9.6s (2.0 MB/s)``."""
    read, text, secs = f"{result.input_bytes / 1e6:.1f}", f"{result.text_bytes / 1e6:.1f}", result.seconds
    if not result.text_bytes or text == read:
        return f"{read} MB in {secs:.1f}s ({result.input_bytes / 1e6 / max(secs, 1e-9):.1f} MB/s)"
    return f"{read} MB read ({text} MB of text) in {secs:.1f}s ({result.text_bytes / 1e6 / max(secs, 1e-9):.1f} MB/s)"


def run(args: argparse.Namespace) -> int:
    """Entry point of ``podtrain prepare``."""
    opts = options_from_args(args)
    if args.train_tokenizer_only:
        if opts.num_parts > 1:
            raise UserError("--train-tokenizer-only runs once for all parts: drop --num-parts/--part")
        print(train_tokenizer(opts))
        return 0
    result = prepare(opts)
    print(summary(result))
    if opts.num_parts > 1:
        print(f"part {opts.part} of {opts.num_parts} done: when every part is, run "
              f"`podtrain prepare merge {args.out}`")
    return 0

