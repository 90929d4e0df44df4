"""``podtrain prepare ... --out s3://bucket/prefix``: prepare in a local staging folder, then upload.

The pipeline (resume, locking, done records) works on a local folder, so an ``s3://`` output is
prepared into ``$PODTRAIN_PREPARE_STAGING`` (default: the temporary directory) under a name derived
from the url, then uploaded through ``podtrain.storage``: every shard and tokenizer file first,
each an atomic write (a multipart upload completed only when the file is whole), and the manifest
last, so the prefix never looks complete before it is. The staging folder is removed after the
upload; an interrupted run resumes from it when run again on the same machine. A part of a
``--num-parts`` prepare has a staging folder of its own (its space is one part's output), first
fetches the BPE that ``--train-tokenizer-only`` uploaded, and uploads to ``parts/IIIII-of-NNNNN/``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from podtrain.data.manifest import MANIFEST_NAME
from podtrain.data.prepare.parts import TRAINED_RECORD, part_name
from podtrain.data.prepare.shards import PARTS_DIR, STATE_DIR
from podtrain.data.tokenizer import TOKENIZER_DIR, TOKENIZER_FILE
from podtrain.errors import UserError
from podtrain.fsutil import atomic_write_bytes
from podtrain.storage import NotFound, Store, open_store

UPLOAD_CHUNK = 8 << 20
TRAINED_FILES = (f"{STATE_DIR}/{TRAINED_RECORD}", f"{TOKENIZER_DIR}/{TOKENIZER_FILE}")


def staging_dir(url: str) -> Path:
    """The local folder an ``s3://`` output is prepared in (the same for the same url)."""
    base = Path(os.environ.get("PODTRAIN_PREPARE_STAGING") or tempfile.gettempdir())
    return base / f"podtrain-prepare-{hashlib.sha256(url.encode('utf-8')).hexdigest()[:16]}"


def upload_file(store: Store, name: str, path: Path) -> None:
    """Copy the local ``path`` to ``name`` in ``store``, atomically, in bounded memory."""
    with open(path, "rb") as src, store.open_write(name) as dst:
        while chunk := src.read(UPLOAD_CHUNK):
            dst.write(chunk)


def upload(store: Store, prefix: str, local: Path, manifest: dict[str, Any]) -> None:
    """Upload a prepared folder: shards, tokenizer files and token counts, then the manifest (last)."""
    names = [s["file"] for split in manifest["splits"].values() for s in split["shards"]]
    counts = [manifest["token_counts"]] if manifest.get("token_counts") else []
    for name in names + list(manifest["tokenizer"]["files"]) + counts:
        upload_file(store, prefix + name, local / name)
    store.write_bytes(prefix + MANIFEST_NAME, (json.dumps(manifest, indent=1) + "\n").encode("utf-8"))


def prepare_remote(opts: Any, prepare: Callable[[Any], Any]) -> Any:
    """Run ``prepare`` (the local pipeline) for ``opts`` whose ``out`` is an ``s3://`` url."""
    url = str(opts.out).rstrip("/")
    store, prefix = open_store(url), ""
    # A folder per part: parts running on one machine never touch each other's staging.
    stage = staging_dir(url if opts.num_parts == 1 else f"{url}#{opts.part}/{opts.num_parts}")
    if opts.num_parts > 1:
        prefix = f"{PARTS_DIR}/{part_name(opts.part, opts.num_parts)}/"
        store.delete(MANIFEST_NAME)  # the merged manifest is stale while a part is being (re)made
        for name in TRAINED_FILES:   # the BPE trained before the parts, if there is one
            try:
                blob = store.read_bytes(name)
            except NotFound:
                continue
            atomic_write_bytes(stage / name, blob)
    result = prepare(dataclasses.replace(opts, out=stage))
    upload(store, prefix, Path(result.out), result.manifest)
    shutil.rmtree(stage, ignore_errors=True)
    result.out = store.where(prefix) if prefix else url
    return result


def train_remote(opts: Any, train: Callable[[Any], str]) -> str:
    """``--train-tokenizer-only`` into an ``s3://`` url: train locally, upload the tokenizer."""
    url = str(opts.out).rstrip("/")
    store, stage = open_store(url), staging_dir(url)
    for name in TRAINED_FILES:  # the tokenizer already there: kept, or refused to replace (train)
        try:
            atomic_write_bytes(stage / name, store.read_bytes(name))
        except NotFound:
            (stage / name).unlink(missing_ok=True)  # a stale local copy must not pass for it
    try:
        line = train(dataclasses.replace(opts, out=stage))
    except UserError as exc:
        shutil.rmtree(stage, ignore_errors=True)
        raise UserError(str(exc).replace(str(stage), url)) from None
    for name in TRAINED_FILES:
        if (stage / name).is_file():
            upload_file(store, name, stage / name)
    shutil.rmtree(stage, ignore_errors=True)
    return line.replace(str(stage), url)
