"""``prepare --tokenizer DATA_DIR``: the tokenizer of a dataset already prepared, for the next one.

Sources mixed in one run must share one tokenizer (``data.mix``). The way to get that: train it
once (``--train-tokenizer-only``, or a first ``prepare`` with ``bpe:VOCAB``) and prepare every
other source with ``--tokenizer`` naming that folder. DATA_DIR (a folder or an ``s3://`` prefix)
is either a finished dataset (its ``manifest.json`` names the tokenizer) or the output of
``--train-tokenizer-only`` (its record in ``.prepare/``). The tokenizer keeps its kind and name
(``bpe:4096``), so both datasets' manifests show the same tokenizer; its files are checked
against the recorded SHA-256 before use.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from podtrain.data import tokenizer as tokmod
from podtrain.data.manifest import MANIFEST_NAME
from podtrain.data.prepare.parts import TRAINED_RECORD
from podtrain.data.prepare.shards import STATE_DIR
from podtrain.errors import UserError
from podtrain.storage import NotFound, Store, is_s3_url, open_store


def is_dataset(spec: str) -> bool:
    """Whether ``--tokenizer spec`` names a prepared data directory (or a trained-tokenizer
    folder) rather than a tokenizer file, folder or hub name: an ``s3://`` prefix, or a folder
    holding ``manifest.json`` or ``.prepare/trained-tokenizer.json``."""
    if is_s3_url(spec):
        return True
    path = Path(spec)
    return (path / MANIFEST_NAME).is_file() or (path / STATE_DIR / TRAINED_RECORD).is_file()


def _identity(store: Store, spec: str) -> dict[str, Any]:
    """The tokenizer identity DATA_DIR records: its manifest's, else the trained-only record's."""
    for name in (MANIFEST_NAME, f"{STATE_DIR}/{TRAINED_RECORD}"):
        try:
            record = json.loads(store.read_bytes(name))
        except NotFound:
            continue
        except ValueError:
            raise UserError(f"{store.where(name)}: not valid JSON (--tokenizer {spec})") from None
        identity = record.get("tokenizer") if isinstance(record, dict) else None
        if not isinstance(identity, dict) or "kind" not in identity:
            raise UserError(f"{store.where(name)}: names no tokenizer (--tokenizer {spec})")
        return identity
    raise UserError(f"--tokenizer {spec}: no {MANIFEST_NAME} there: not a prepared data directory "
                    "(or a --train-tokenizer-only output)")


def dataset_tokenizer(spec: str) -> tokmod.LoadedHF | None:
    """The tokenizer of the dataset ``spec`` with its files (name -> bytes) to copy; ``None`` for
    a byte-level dataset. A file that is missing or changed since is a one-line error."""
    store = open_store(spec)
    identity = _identity(store, spec)
    if identity["kind"] == "byte":
        return None
    files = identity.get("files") or []
    if not files:
        raise UserError(f"--tokenizer {spec}: its tokenizer {identity.get('name')!r} lists no files")
    blobs = {}
    for rel in files:
        try:
            blobs[Path(rel).name] = store.read_bytes(rel)
        except NotFound:
            raise UserError(f"{store.where(rel)} is missing (the tokenizer of {spec})") from None
    main = blobs[tokmod.TOKENIZER_FILE]
    if hashlib.sha256(main).hexdigest() != identity.get("sha256"):
        raise UserError(f"{store.where(files[0])}: sha256 does not match what {spec} recorded "
                        "(tokenizer file changed)")
    import tokenizers  # only non-byte tokenizers get here

    tok = tokmod.HFTokenizer(tokenizers.Tokenizer.from_str(main.decode("utf-8")), int(identity["eos_id"]),
                             kind=str(identity["kind"]), name=str(identity.get("name")))
    return tokmod.LoadedHF(tok, blobs)
