"""What a ``prepare`` run leaves in DATA_DIR besides its shards: the lock that keeps two runs out
of one directory, and the manifest of a finished run."""

from __future__ import annotations

import fcntl
import os
import sys
from pathlib import Path
from typing import Any

from podtrain.data.manifest import FORMAT
from podtrain.data.prepare.sources import Source
from podtrain.errors import UserError


def lock_dir(out: Path, created: bool) -> int:
    """An exclusive lock on DATA_DIR for this run (a file descriptor to ``os.close``): two prepares into one directory (a command run
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


def build_manifest(opts: Any, sources: list[Source], identity: dict[str, Any], dtype: str,
                   shard_records: dict[str, list[dict[str, Any]]], errors: dict[str, int],
                   recipe: dict[str, Any]) -> dict[str, Any]:
    """The manifest of a finished ``prepare`` run (``opts``: its ``PrepareOptions``; not imported,
    the pipeline imports this module), from each split's shard done records; its
    ``recipe`` is what a later prepare into the same folder is compared with (``replace``)."""
    splits = {}
    for split, records in shard_records.items():
        shards = [{k: r[k] for k in ("file", "tokens", "documents", "sha256", "max_token_id")}
                  for r in records]
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
            "text_field": opts.text_field, "shard_tokens": opts.shard_tokens, "recipe": recipe}
