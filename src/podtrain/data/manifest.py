"""``manifest.json``: what ``podtrain prepare`` made and what the loader trusts.

Layout of a data directory::

    DATA_DIR/manifest.json        written last (its presence means the directory is complete)
    DATA_DIR/train_00000.bin ...  raw little-endian token ids (dtype below), documents separated by EOS
    DATA_DIR/val_00000.bin ...
    DATA_DIR/tokenizer/           tokenizer files (BPE or HF tokenizers; empty for byte-level)

The manifest (JSON)::

    {"format": "podtrain-shards/1",
     "tokenizer": {"kind": "byte"|"bpe"|"hf", "name": str, "vocab_size": int, "eos_id": int,
                   "files": ["tokenizer/tokenizer.json", ...], "sha256": str},
     "dtype": "uint16"|"uint32",
     "splits": {"train": {"tokens": int, "documents": int,
                          "shards": [{"file": str, "tokens": int, "documents": int, "sha256": str,
                                      "max_token_id": int}]},
                "val": {...}},              (absent when prepared with --val-fraction 0)
     "val_fraction": float, "sources": [{"input": str, "files": int, "bytes": int}, ...],
     "errors": {"policy": "strict"|"replace"|"skip", "replaced": int, "skipped": int},
     "text_field": str, "shard_tokens": int,
     "recipe": {"inputs": [str], "tokenizer": str, "options": {...}},  (what a later prepare into the
                                            same folder is compared with: data/prepare/replace.py)
     "token_counts": "token_counts.json"}   (absent in data prepared before podtrain counted tokens)

``DATA_DIR/token_counts.json`` (written before the manifest) holds how often each id occurs in each
split, counted by ``prepare`` as it writes the shards (``{"format": "podtrain-token-counts/1",
"vocab_size": V, "splits": {"train": [count of id 0, ..., count of id V-1], ...}}``): O(vocabulary),
so the closing line's unigram entropy reads no token (``Manifest.token_counts``).

A document may continue from one shard into the next (shards have a fixed token count); a split
is the concatenation of its shards in order. ``documents`` counts the EOS ids in a shard.
``max_token_id`` lets a run check the ids against its model's vocabulary without reading shards.
A shard's ``file`` may name a folder (``parts/00001-of-00004/train_00000.bin``: a merged
``prepare --num-parts``). ``DATA_DIR`` may be ``s3://bucket/prefix``: the manifest, tokenizer and
shards are then read through ``podtrain.storage`` (the loader's shard reads go through
``data/cache.py``). A run's start lists such a prefix once (``read_manifest(..., list_files=True)``:
one paged LIST, then the manifest read at its listed size, no HEAD) and the ``Manifest`` carries
those sizes, so every split, ``data.verify`` and, broadcast by rank 0 (``data/sources.py``), every
other rank check the shards without another request.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from podtrain.errors import UserError
from podtrain.fsutil import sha256_file
from podtrain.storage import NoSuchBucket, NotFound, Store, is_s3_url, open_store

MANIFEST_NAME = "manifest.json"
COUNTS_NAME = "token_counts.json"
COUNTS_FORMAT = "podtrain-token-counts/1"
FORMAT = "podtrain-shards/1"
DTYPES = {"uint16": np.uint16, "uint32": np.uint32}
DIGEST_CHARS = 12  # of a tokenizer's SHA-256 in its identity (48 bits: no collision among anyone's tokenizers)


class RemotePath(str):
    """An ``s3://`` location that joins like a ``Path`` (``root / "manifest.json"``), so messages and
    shard names read the same for local and S3 data."""

    def __truediv__(self, other: str) -> "RemotePath":
        return RemotePath(self.rstrip("/") + "/" + str(other))

    @property
    def name(self) -> str:
        """The last component."""
        return self.rstrip("/").rsplit("/", 1)[-1]


@dataclass(frozen=True)
class Shard:
    """One binary file of token ids."""

    path: Path | RemotePath
    tokens: int
    documents: int
    sha256: str
    max_token_id: int | None = None
    name: str = ""
    """The manifest's ``file``: relative to the data directory (the store's name of the shard)."""


@dataclass(frozen=True)
class Manifest:
    """A parsed, checked manifest of a data directory."""

    root: Path | RemotePath
    raw: dict[str, Any]
    sizes: dict[str, int] | None = None
    """Bytes of every file under an S3 ``root`` as one listing found them, by name relative to the
    root (``read_manifest(..., list_files=True)``); None: not listed (local data is stat-ed)."""

    @property
    def is_remote(self) -> bool:
        """Whether the data lives on S3 (read through the store, not memory-mapped)."""
        return isinstance(self.root, RemotePath)

    def store(self) -> Store:
        """The data directory as a ``Store`` (no request is made until it is used)."""
        return open_store(str(self.root))

    @property
    def dtype(self) -> np.dtype:
        """numpy dtype of the shards."""
        return np.dtype(DTYPES[self.raw["dtype"]])

    @property
    def vocab_size(self) -> int:
        """Tokenizer vocabulary size (ids are < this)."""
        return int(self.raw["tokenizer"]["vocab_size"])

    @property
    def eos_id(self) -> int:
        """The id that separates documents."""
        return int(self.raw["tokenizer"]["eos_id"])

    @property
    def tokenizer(self) -> dict[str, Any]:
        """The tokenizer's identity: kind, name, vocab_size, eos_id, files, sha256."""
        return self.raw["tokenizer"]

    def splits(self) -> list[str]:
        """Names of the splits present (train, val)."""
        return list(self.raw["splits"])

    def shards(self, split: str) -> list[Shard]:
        """Shards of ``split``; a missing split is a user error naming the directory."""
        if split not in self.raw["splits"]:
            raise UserError(f"{self.root / MANIFEST_NAME}: no {split!r} split "
                            f"(has {', '.join(self.splits()) or 'none'})")
        return [Shard(self.root / s["file"], int(s["tokens"]), int(s["documents"]), s["sha256"],
                      None if s.get("max_token_id") is None else int(s["max_token_id"]), s["file"])
                for s in self.raw["splits"][split]["shards"]]

    def head_tokens(self, split: str, max_tokens: int) -> np.ndarray:
        """The first ``max_tokens`` tokens of ``split`` (fewer when it is shorter), as the shards'
        dtype: memory-mapped locally, range reads on S3."""
        parts, budget = [], max_tokens
        store = self.store() if self.is_remote else None
        for shard in self.shards(split):
            if budget <= 0:
                break
            if store is None:
                tokens = np.asarray(np.memmap(shard.path, dtype=self.dtype, mode="r")[:budget])
            else:
                tokens = np.empty(min(budget, shard.tokens), dtype=self.dtype)
                store.read_into(shard.name, 0, tokens)
            parts.append(tokens)
            budget -= len(tokens)
        return np.concatenate(parts) if parts else np.zeros(0, self.dtype)

    def token_counts(self, split: str) -> np.ndarray:
        """How often each token id occurs in ``split`` (int64, one entry per id of the vocabulary),
        as ``prepare`` counted it: one small file read, no shard. ``NoTokenCounts`` (its message
        says why, in a few words) when the data has none (prepared before podtrain counted) or
        they do not add up to the split's tokens."""
        name = self.raw.get("token_counts")
        if not name:
            raise NoTokenCounts(f"{self.root} was prepared before podtrain counted tokens")
        try:
            counted = decode_token_counts(self.read_file(name))[split]
        except (UserError, KeyError, ValueError, TypeError):
            raise NoTokenCounts(f"{self.root / name} is missing or unreadable") from None
        if int(counted.sum()) != int(self.raw["splits"][split]["tokens"]):
            raise NoTokenCounts(f"{self.root / name} does not match the manifest's {split} split")
        return counted

    def read_file(self, name: str) -> bytes:
        """A file of the data directory (a tokenizer file); a missing one is a one-line error."""
        try:
            store = self.store()
            if self.sizes is not None and name in self.sizes:  # listed: a GET alone, no HEAD
                return store.read_range(name, 0, self.sizes[name])
            return store.read_bytes(name)
        except NoSuchBucket:
            raise
        except NotFound:
            raise UserError(f"{self.root / name} is missing (tokenizer of {self.root})") from None


class NoTokenCounts(Exception):
    """The data directory has no usable token counts (``Manifest.token_counts``); the message says why."""


def add_token_counts(total: np.ndarray, tokens: np.ndarray) -> np.ndarray:
    """``total`` (int64 counts by id) plus the ids in ``tokens``, grown to the largest id seen."""
    counts = np.bincount(tokens)
    if len(counts) > len(total):
        total = np.concatenate([total, np.zeros(len(counts) - len(total), dtype=np.int64)])
    total[:len(counts)] += counts
    return total


def sum_token_counts(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Two count arrays (by id) added, the shorter padded with zeros."""
    if len(a) < len(b):
        a, b = b, a
    out = a.astype(np.int64, copy=True)
    out[:len(b)] += b
    return out


def encode_token_counts(by_split: dict[str, np.ndarray], vocab_size: int) -> bytes:
    """The ``token_counts.json`` of a data directory: each split's counts, one per id up to the vocabulary."""
    splits = {}
    for split, counts in by_split.items():
        dense = np.zeros(max(vocab_size, len(counts)), dtype=np.int64)
        dense[:len(counts)] = counts
        splits[split] = dense.tolist()
    return json.dumps({"format": COUNTS_FORMAT, "vocab_size": vocab_size, "splits": splits},
                      separators=(",", ":")).encode("utf-8")


def decode_token_counts(blob: bytes) -> dict[str, np.ndarray]:
    """``{split: int64 counts by id}`` of a ``token_counts.json``; ValueError when it is not one."""
    raw = json.loads(blob)
    if not isinstance(raw, dict) or raw.get("format") != COUNTS_FORMAT:
        raise ValueError(f"not {COUNTS_FORMAT}")
    return {split: np.asarray(counts, dtype=np.int64) for split, counts in raw["splits"].items()}


class TokenizerIdentity(str):
    """A tokenizer's short name for people (``bpe:4096:81689b37afb4``) that compares by content.

    A tokenizer is its content: the same ``tokenizer.json`` trained as ``bpe:4096`` or loaded from
    ``data/web/tokenizer`` is one tokenizer. So two identities are equal when their hashes (the
    last part, 12 hex digits of the tokenizer file's SHA-256) are; kind, name and vocabulary are
    display only. An identity without a hash (a hand-written manifest) compares as its text.
    It is a ``str`` so that it is stored in checkpoints and printed as the plain text; and since
    the comparison lives in ``==`` itself, a checkpoint's stored identity (any podtrain's format,
    read back through ``said_once``) compares with this run's by content wherever it is compared
    (train/resume.py's ``check_resume``).
    """

    @property
    def content(self) -> str:
        """What equality compares: the hash, or the whole text when there is none."""
        last = self.rsplit(":", 1)[-1]
        return f"sha256:{last}" if _is_digest(last) else str(self)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, str):
            return NotImplemented
        return self.content == TokenizerIdentity(other).content

    def __ne__(self, other: object) -> bool:
        equal = self.__eq__(other)
        return equal if equal is NotImplemented else not equal

    def __hash__(self) -> int:
        return hash(self.content)


def _is_digest(text: str) -> bool:
    return len(text) == DIGEST_CHARS and all(c in "0123456789abcdef" for c in text)


def tokenizer_identity(tokenizer: dict[str, Any]) -> TokenizerIdentity:
    """A short, comparable name of a data manifest's tokenizer: kind, name, vocabulary, hash
    (``bpe:4096:1f2e...``, ``hf:gpt2:50257:...``: a name that repeats the kind or the vocabulary,
    as ``bpe:4096`` does, is not said twice); it compares by the hash (``TokenizerIdentity``)."""
    digest = str(tokenizer.get("sha256") or "")[:DIGEST_CHARS]
    return said_once(f"{tokenizer.get('kind')}:{tokenizer.get('name')}:{tokenizer.get('vocab_size')}"
                     + (f":{digest}" if digest else ""))


def said_once(identity: str) -> TokenizerIdentity:
    """``bpe:bpe:4096:4096:ab`` -> ``bpe:4096:ab``: repeated neighbours dropped (applied to a
    checkpoint's stored identity too, which older podtrain wrote with the repeats); the result
    compares by content (``TokenizerIdentity``)."""
    parts = identity.split(":")
    return TokenizerIdentity(":".join(p for i, p in enumerate(parts) if i == 0 or p != parts[i - 1]))


def same_tokenizer(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """Whether two manifests' tokenizers make the same ids: the same tokenizer file (SHA-256) and
    EOS id; where a manifest records no hash, the same kind, name, vocabulary and EOS id."""
    if a.get("sha256") and b.get("sha256"):
        return (a["sha256"], a.get("eos_id")) == (b["sha256"], b.get("eos_id"))
    keys = ("kind", "name", "vocab_size", "eos_id", "sha256")
    return all(a.get(k) == b.get(k) for k in keys)


def read_manifest(data_dir: str | Path, list_files: bool = False) -> Manifest:
    """Open ``DATA_DIR/manifest.json``; a missing or malformed one is a one-line user error.

    ``list_files`` (S3): list the whole prefix first, one paged LIST, and keep every file's size
    in the manifest (``Manifest.sizes``): the manifest is then read at its listed size (a GET, no
    HEAD) and nothing of the directory is listed again (``shard_sizes``)."""
    sizes = None
    if is_s3_url(data_dir):
        root: Path | RemotePath = RemotePath(str(data_dir).rstrip("/"))
        path = root / MANIFEST_NAME
        try:
            store = open_store(root)
            if list_files:
                sizes = {e.name: e.size for e in store.list()}
                if MANIFEST_NAME not in sizes:
                    raise NotFound(str(path), "not found")
                text = store.read_range(MANIFEST_NAME, 0, sizes[MANIFEST_NAME]).decode("utf-8", "replace")
            else:
                text = store.read_bytes(MANIFEST_NAME).decode("utf-8", "replace")
        except NoSuchBucket:
            raise
        except NotFound:
            raise UserError(f"{path} is missing: {root} is not a finished `podtrain prepare` output") from None
    else:
        root = Path(data_dir)
        path = root / MANIFEST_NAME
        if not root.exists():
            raise UserError(f"data directory {root} does not exist (run `podtrain prepare ... --out {root}`)")
        if not path.is_file():
            raise UserError(f"{path} is missing: {root} is not a finished `podtrain prepare` output")
        text = path.read_text()
    try:
        raw = json.loads(text)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise UserError(f"{path}: not valid JSON ({exc})") from None
    if not isinstance(raw, dict) or raw.get("format") != FORMAT:
        raise UserError(f"{path}: unknown format {raw.get('format') if isinstance(raw, dict) else None!r}, "
                        f"expected {FORMAT!r}")
    for key in ("tokenizer", "dtype", "splits"):
        if key not in raw:
            raise UserError(f"{path}: missing key {key!r}")
    if raw["dtype"] not in DTYPES:
        raise UserError(f"{path}: dtype {raw['dtype']!r} is not one of {', '.join(DTYPES)}")
    return Manifest(root=root, raw=raw, sizes=sizes)


def verify_shards(manifest: Manifest, splits: list[str] | None = None,
                  part: tuple[int, int] = (0, 1)) -> None:
    """Check shards' sizes and SHA-256 against the manifest (all splits unless ``splits``).

    ``part=(i, n)`` checks every n-th shard starting at the i-th, so n ranks share the work: a rank
    stats and reads only its own part (n ranks check every shard once between them, and what one
    rank does shrinks as n grows). A missing, truncated or altered shard is a one-line user error
    naming the shard.
    """
    index, count = part
    shards = [s for split in (splits if splits is not None else manifest.splits())
              for s in manifest.shards(split)][index::count]
    sizes = shard_sizes(manifest, shards)
    for shard in shards:
        expected = shard.tokens * manifest.dtype.itemsize
        size = sizes.get(shard.name)
        if size is None:
            raise UserError(f"shard {shard.path} is missing (listed in {manifest.root / MANIFEST_NAME}); "
                            "run `podtrain prepare` again")
        if size != expected:
            raise UserError(f"shard {shard.path} has {size} bytes, the manifest says {expected}; "
                            "run `podtrain prepare` again")
        if _sha256(manifest, shard) != shard.sha256:
            raise UserError(f"shard {shard.path}: sha256 does not match {manifest.root / MANIFEST_NAME} "
                            "(file corrupted or changed); run `podtrain prepare` again")


def shard_sizes(manifest: Manifest, shards: list[Shard]) -> dict[str, int]:
    """``{shard.name: bytes}`` of the shards that exist: ``stat`` locally; on S3 the sizes the
    manifest was listed with (``Manifest.sizes``: no request), else one listing."""
    if manifest.is_remote:
        listed = manifest.sizes if manifest.sizes is not None else \
            {e.name: e.size for e in manifest.store().list()}
        return {s.name: listed[s.name] for s in shards if s.name in listed}
    sizes = {}
    for shard in shards:
        try:
            sizes[shard.name] = shard.path.stat().st_size
        except OSError:
            pass
    return sizes


def _sha256(manifest: Manifest, shard: Shard, chunk: int = 1 << 22) -> str:
    """A shard's SHA-256: read locally, streamed through the store on S3."""
    if not manifest.is_remote:
        return sha256_file(shard.path, chunk)
    digest = hashlib.sha256()
    size = shard.tokens * manifest.dtype.itemsize  # checked against the listing first: no HEAD
    for piece in manifest.store().iter_chunks(shard.name, chunk, size=size):
        digest.update(piece)
    return digest.hexdigest()


def check_vocab(manifest: Manifest, model_vocab_size: int) -> None:
    """Refuse data whose tokenizer has more ids than the model's embedding has rows.

    Also checks each shard's recorded ``max_token_id`` when present (free: no shard is read).
    """
    path = manifest.root / MANIFEST_NAME
    name = manifest.tokenizer.get("name", "?")
    if manifest.vocab_size > model_vocab_size:
        raise UserError(f"{path}: tokenizer {name!r} has vocab_size {manifest.vocab_size} but the model's "
                        f"vocabulary has {model_vocab_size}: prepare the data with the model's tokenizer "
                        f"or set model.vocab_size >= {manifest.vocab_size}")
    for split in manifest.splits():
        for shard in manifest.shards(split):
            if shard.max_token_id is not None and shard.max_token_id >= model_vocab_size:
                raise UserError(f"shard {shard.path} holds token id {shard.max_token_id}, at or above the "
                                f"model's vocabulary size {model_vocab_size}")
