"""Tokenizers: byte-level, a byte-level BPE trained locally, or a Hugging Face tokenizer on disk.

All three present the same small interface (``encode``, ``decode``, ``encode_batch``,
``vocab_size``, ``eos_id``) so ``prepare`` and ``podtrain sample`` never care which one they hold.
Corpus encoding never adds special tokens and never turns a literal ``<|endoftext|>`` in the text
into the EOS id: document boundaries come only from ``prepare``, so document counts are exact.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from podtrain.data.manifest import Manifest, RemotePath, read_manifest
from podtrain.errors import UserError
from podtrain.fsutil import atomic_write_bytes

BYTE_VOCAB_SIZE = 257
BYTE_EOS_ID = 256
EOS_TOKEN = "<|endoftext|>"
TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_DIR = "tokenizer"  # inside DATA_DIR: the files a manifest's tokenizer identity lists
# Files copied next to tokenizer.json when present: they carry the EOS token and chat metadata.
SIDE_FILES = ("tokenizer_config.json", "special_tokens_map.json")
# A stable identity for the byte-level tokenizer, which has no file to hash.
BYTE_IDENTITY_SHA256 = hashlib.sha256(b"podtrain byte-level tokenizer v1: ids 0-255 bytes, 256 EOS").hexdigest()
# EOS candidates tried, in order, when a tokenizer folder does not name its EOS token.
EOS_CANDIDATES = ("<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>", "<|im_end|>", "[SEP]")
MIN_BPE_VOCAB = 258  # 256 byte symbols + EOS + at least one merge

log = logging.getLogger(__name__)


def dtype_for_vocab(vocab_size: int) -> str:
    """``uint16`` when every id fits in 16 bits, else ``uint32``."""
    return "uint16" if vocab_size <= 1 << 16 else "uint32"


class ByteTokenizer:
    """UTF-8 bytes as ids 0..255, EOS = 256."""

    kind = "byte"
    name = "byte"
    vocab_size = BYTE_VOCAB_SIZE
    eos_id = BYTE_EOS_ID

    def encode(self, text: str) -> list[int]:
        """The UTF-8 bytes of ``text``."""
        return list(text.encode("utf-8"))

    def decode(self, ids: Sequence[int]) -> str:
        """UTF-8 text of the byte ids; EOS and out-of-range ids are dropped, bad bytes replaced."""
        return bytes(int(i) for i in ids if 0 <= int(i) < 256).decode("utf-8", errors="replace")

    def encode_batch(self, texts: list[str]) -> list[Sequence[int]]:
        """The UTF-8 bytes of each text as a uint8 array (zero Python-level per-byte work)."""
        return [np.frombuffer(t.encode("utf-8"), dtype=np.uint8) for t in texts]


class HFTokenizer:
    """A ``tokenizers.Tokenizer`` (locally trained BPE or a Hugging Face ``tokenizer.json``)."""

    def __init__(self, tok: Any, eos_id: int, kind: str, name: str) -> None:
        """Wrap ``tok``; ``eos_id`` separates documents."""
        self.tok = tok
        # Literal special-token strings in a corpus stay text, so only prepare inserts EOS.
        if hasattr(tok, "encode_special_tokens"):
            tok.encode_special_tokens = True
        self.eos_id = int(eos_id)
        self.kind = kind
        self.name = name
        self.vocab_size = vocab_size_of(tok)

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` without special tokens."""
        return list(self.tok.encode(text, add_special_tokens=False).ids)

    def decode(self, ids: Sequence[int]) -> str:
        """Text of ``ids`` (special tokens kept, so an EOS shows where a document ended)."""
        return self.tok.decode([int(i) for i in ids], skip_special_tokens=False)

    def encode_batch(self, texts: list[str]) -> list[Sequence[int]]:
        """Token ids of each text; ``encode_batch_fast`` (no offsets) where the library has it."""
        fn = getattr(self.tok, "encode_batch_fast", None) or self.tok.encode_batch
        return [e.ids for e in fn(texts, add_special_tokens=False)]


def vocab_size_of(tok: Any) -> int:
    """Ids are below this: max id + 1 over the vocabulary and added tokens (ids may be sparse)."""
    vocab = tok.get_vocab(with_added_tokens=True)
    return max(max(vocab.values()) + 1, tok.get_vocab_size(with_added_tokens=True)) if vocab else 0


def _tokenizers() -> Any:
    try:
        import tokenizers
    except ImportError:  # pragma: no cover - a declared dependency
        raise UserError("the `tokenizers` package is needed for BPE and Hugging Face tokenizers "
                        "(pip install tokenizers)") from None
    return tokenizers


def parse_bpe_vocab(spec: str) -> int:
    """The vocabulary size of a ``bpe:VOCAB`` spec; a bad one is a user error naming it."""
    _, _, value = spec.partition(":")
    try:
        vocab = int(value)
    except ValueError:
        raise UserError(f"--tokenizer {spec}: VOCAB must be an integer, e.g. bpe:8192") from None
    if not MIN_BPE_VOCAB <= vocab < 1 << 32:
        raise UserError(f"--tokenizer {spec}: VOCAB must be between {MIN_BPE_VOCAB} and 2**32-1")
    return vocab


def train_bpe(texts: Iterable[str], vocab_size: int) -> HFTokenizer:
    """Train a byte-level BPE (GPT-2 style) on ``texts``; EOS is ``<|endoftext|>`` with id 0.

    The ``tokenizers`` trainer is deterministic for a given input sequence, so the same corpus
    gives the same tokenizer.json byte for byte.
    """
    tk = _tokenizers()
    tok = tk.Tokenizer(tk.models.BPE())
    tok.pre_tokenizer = tk.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tk.decoders.ByteLevel()
    trainer = tk.trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=[EOS_TOKEN], show_progress=False,
        # The full byte alphabet, so any text (not only what training saw) encodes without <unk>.
        initial_alphabet=tk.pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer)
    learnt = tok.get_vocab_size()
    if learnt < vocab_size:  # a small corpus runs out of merges: say so rather than surprise later
        log.warning("bpe:%d: the corpus yielded only %d tokens (vocab_size is %d)", vocab_size,
                    learnt, learnt)
    return HFTokenizer(tok, tok.token_to_id(EOS_TOKEN), kind="bpe", name=f"bpe:{vocab_size}")


def _eos_from_config(folder: Path) -> str | None:
    for fname in SIDE_FILES:
        path = folder / fname
        if not path.is_file():
            continue
        try:
            conf = json.loads(path.read_text(encoding="utf-8"))
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise UserError(f"{path}: not valid JSON ({exc})") from None
        eos = conf.get("eos_token") if isinstance(conf, dict) else None
        if isinstance(eos, dict):
            eos = eos.get("content")
        if isinstance(eos, str):
            return eos
    return None


def _choose_eos(tok: Any, where: str, folder: Path | None, eos_token: str | None) -> int:
    wanted = eos_token or (_eos_from_config(folder) if folder is not None else None)
    if wanted is not None:
        eos_id = tok.token_to_id(wanted)
        if eos_id is None:
            raise UserError(f"{where}: EOS token {wanted!r} is not in the tokenizer's vocabulary")
        return int(eos_id)
    for cand in EOS_CANDIDATES:
        eos_id = tok.token_to_id(cand)
        if eos_id is not None:
            return int(eos_id)
    raise UserError(f"{where}: cannot tell the EOS token (no tokenizer_config.json eos_token, none of "
                    f"{', '.join(EOS_CANDIDATES)}); pass --eos-token")


@dataclass(frozen=True)
class LoadedHF:
    """A Hugging Face tokenizer and the files that define it (name -> bytes), to copy into DATA_DIR."""

    tokenizer: HFTokenizer
    files: dict[str, bytes]


HUB_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*")
"""The shape of a Hugging Face Hub repository id ``org/name``: exactly one ``/``, letters, digits,
``-``, ``_`` and ``.`` (the Hub's own rule, which also forbids ``..`` and ``--``)."""


def hub_name_or_path(spec: str) -> str:
    """Whether ``--tokenizer spec`` (not ``byte``, ``bpe:VOCAB`` or a dataset) means a Hub id
    (``"hub"``) or a local path (``"path"``), decided without the network, so that a mistyped
    path fails at once instead of being looked up on the Hub.

    A path: anything that exists; anything starting with ``/``, ``.``, ``~`` (``./x``, ``../x``,
    ``~/x``) or ending in ``.json``; more than one ``/`` (a Hub id has exactly one); a relative
    ``a/b`` whose ``a`` is a folder here (``data/tokk`` with ``data/`` present); and anything not
    shaped like a Hub id. The rest, ``org/name`` whose ``org`` is no local folder, is a Hub id. To
    reach a Hub repository whose org is also a local folder, run from another directory.
    """
    path = Path(os.path.expanduser(spec))  # (an unknown ~user stays as typed)
    if path.exists() or spec.startswith(("/", ".", "~")) or spec.endswith(".json"):
        return "path"
    if spec.count("/") != 1 or (os.sep != "/" and os.sep in spec):
        return "path"
    if Path(spec.split("/", 1)[0]).is_dir():
        return "path"
    if not HUB_ID.fullmatch(spec) or ".." in spec or "--" in spec:
        return "path"
    return "hub"


def load_hf(spec: str, eos_token: str | None = None) -> LoadedHF:
    """Load a tokenizer from a ``tokenizer.json`` file, a folder holding one, or a hub name.

    A path that exists is read locally. What ``hub_name_or_path`` calls a Hub id (``org/name``)
    is fetched from the Hugging Face Hub (needs a network); any other value is a path, and a
    missing one is a user error naming it, with no network tried.
    """
    tk = _tokenizers()
    path = Path(os.path.expanduser(spec))
    if path.is_dir():
        folder, tok_path = path, path / TOKENIZER_FILE
        if not tok_path.is_file():
            raise UserError(f"{path}: tokenizer folder has no {TOKENIZER_FILE} "
                            "(only fast tokenizers saved as tokenizer.json are supported)")
    elif path.is_file():
        folder, tok_path = path.parent, path
    elif hub_name_or_path(spec) == "hub":
        return _load_from_hub(spec, eos_token)
    else:
        raise UserError(f"--tokenizer {spec}: no such file or directory ({_why_a_path(spec)}; expected "
                        "byte, bpe:VOCAB, a tokenizer.json, a tokenizer folder, or a Hub id org/name)")
    blob = tok_path.read_bytes()
    try:
        tok = tk.Tokenizer.from_str(blob.decode("utf-8"))
    except Exception as exc:  # the Rust side raises plain Exception subclasses
        raise UserError(f"{tok_path}: not a valid tokenizers JSON file ({str(exc).splitlines()[0]})") from None
    files = {TOKENIZER_FILE: blob}
    if path.is_dir() or tok_path.name == TOKENIZER_FILE:
        files.update({f: (folder / f).read_bytes() for f in SIDE_FILES if (folder / f).is_file()})
    eos_id = _choose_eos(tok, str(tok_path), folder, eos_token)
    return LoadedHF(HFTokenizer(tok, eos_id, kind="hf", name=str(spec)), files)


def _why_a_path(spec: str) -> str:
    """Why ``spec`` was read as a local path and not sent to the Hub (for the one-line error)."""
    first = spec.split("/", 1)[0]
    if spec.count("/") == 1 and not spec.startswith(("/", ".", "~")) and first and Path(first).is_dir():
        return f"read as a local path, not a Hugging Face Hub id, because {first}/ is a folder here"
    return "read as a local path, not a Hugging Face Hub id"


HUB_PROBE_TIMEOUT_S = 3.0  # resolving and reaching the Hub's host: a few seconds, then give up
HUB_ETAG_TIMEOUT_S = 10.0  # huggingface_hub's first request (its default is 10 s as well)
PROXY_VARS = ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy")
SUGGEST_DEPTH = 2          # how deep under the working directory a "did you mean" looks
SUGGEST_MAX_DIRS = 2000    # and how many folders at most (a huge working directory stays fast)


def _hub_unreachable(endpoint: str) -> str | None:
    """Why the Hub ``endpoint`` cannot be reached (name does not resolve, connection refused,
    timed out), or None when a TCP connection to it opens, within ``HUB_PROBE_TIMEOUT_S``.

    Why probe first: huggingface_hub retries a failed connection (a DNS failure included) five
    times with backoff, 1+2+4+8+8 s, and logs a warning each time; no setting turns that off. With
    a proxy configured the host need not resolve here, so the probe is skipped (None)."""
    import socket
    import threading
    from urllib.parse import urlsplit

    if any(os.environ.get(v) for v in PROXY_VARS):
        return None
    url = urlsplit(endpoint)
    host, port = url.hostname or "", url.port or (443 if url.scheme == "https" else 80)
    outcome: list[str | None] = []

    def probe() -> None:
        try:  # getaddrinfo has no timeout of its own: the thread's join has the deadline
            with socket.create_connection((host, port), timeout=HUB_PROBE_TIMEOUT_S):
                outcome.append(None)
        except socket.gaierror as exc:
            outcome.append(f"cannot reach {endpoint}: {host} does not resolve ({exc.strerror})")
        except OSError as exc:
            outcome.append(f"cannot reach {endpoint}: {exc.strerror or exc}")

    thread = threading.Thread(target=probe, daemon=True)
    thread.start()
    thread.join(HUB_PROBE_TIMEOUT_S + 0.5)
    return outcome[0] if outcome else f"cannot reach {endpoint}: no answer in {HUB_PROBE_TIMEOUT_S:.0f} s"


def _tokenizer_paths(root: Path) -> list[str]:
    """Relative paths under ``root`` (at most ``SUGGEST_DEPTH`` levels, hidden ones left out) that
    ``--tokenizer`` could name: folders with a tokenizer.json, prepared datasets, ``*.json`` files."""
    found: list[str] = []
    seen = 0
    for dirpath, dirnames, filenames in os.walk(root):
        rel = Path(dirpath).relative_to(root)
        depth = len(rel.parts)
        dirnames[:] = sorted(d for d in dirnames if not d.startswith(".")) if depth < SUGGEST_DEPTH else []
        seen += 1
        if seen > SUGGEST_MAX_DIRS:
            break
        if depth and (TOKENIZER_FILE in filenames or "manifest.json" in filenames
                      or Path(dirpath, ".prepare", "trained-tokenizer.json").is_file()):
            found.append(rel.as_posix())
        found += [(rel / f).as_posix() for f in filenames if f.endswith(".json") and depth]
    return found


def suggest_local(spec: str, root: Path | None = None) -> str | None:
    """The local path under ``root`` (the working directory) closest to ``spec``, a value read as
    a Hub id (``dat/tok`` when ``data/tok`` holds a tokenizer), or None when none is close."""
    import difflib

    close = difflib.get_close_matches(spec, _tokenizer_paths(root or Path.cwd()), n=1, cutoff=0.75)
    return close[0] if close else None


def _load_from_hub(name: str, eos_token: str | None) -> LoadedHF:
    """``name``'s tokenizer.json from the Hugging Face Hub (``HF_ENDPOINT``), or one line saying
    why not, within a few seconds when the Hub cannot be reached, without huggingface_hub's log."""
    import warnings

    tk = _tokenizers()
    try:
        from huggingface_hub import constants, hf_hub_download
    except ImportError:  # pragma: no cover - a dependency of tokenizers
        raise UserError(f"--tokenizer {name}: loading from the Hugging Face Hub needs huggingface_hub "
                        "(pip install huggingface_hub)") from None
    hub_log = logging.getLogger("huggingface_hub")
    level = hub_log.level
    why = None if constants.HF_HUB_OFFLINE else _hub_unreachable(constants.ENDPOINT)
    if why is None:
        hub_log.setLevel(logging.CRITICAL)  # its retry warnings are not ours to print: one line says it
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                path = hf_hub_download(name, TOKENIZER_FILE, etag_timeout=HUB_ETAG_TIMEOUT_S)
            tok = tk.Tokenizer.from_file(path)
        except Exception as exc:
            why = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        finally:
            hub_log.setLevel(level)
    if why is not None:
        # The suggestion comes only once the Hub failed: a real Hub id may look like a local
        # folder's name, and must still load.
        near = suggest_local(name)
        hint = f"; did you mean {near}? (write ./{name} for a local path)" if near else ""
        raise UserError(f"--tokenizer {name}: not a local path, and loading it from the Hugging Face "
                        f"Hub failed ({why}){hint}")
    eos_id = _choose_eos(tok, name, None, eos_token)
    return LoadedHF(HFTokenizer(tok, eos_id, kind="hf", name=name),
                    {TOKENIZER_FILE: tok.to_str().encode("utf-8")})


@dataclass
class TokenizerSetup:
    """The tokenizer chosen for a ``prepare`` run: its identity (for the manifest), its
    ``tokenizer.json`` text (for the workers; ``None`` for byte-level) and the files to save."""

    identity: dict[str, Any]
    tokenizer_json: str | None
    files: dict[str, bytes]


def byte_setup() -> TokenizerSetup:
    """The byte-level tokenizer's setup (no files: its identity is a fixed hash)."""
    return TokenizerSetup({"kind": "byte", "name": "byte", "vocab_size": BYTE_VOCAB_SIZE,
                           "eos_id": BYTE_EOS_ID, "files": [],
                           "sha256": BYTE_IDENTITY_SHA256}, None, {})


def hf_setup(tok: HFTokenizer, files: dict[str, bytes]) -> TokenizerSetup:
    """The setup of a trained or loaded tokenizer; ``files`` (name -> bytes) holds tokenizer.json."""
    main = files[TOKENIZER_FILE]
    # tokenizer.json first: from_identity and read_setup_file read files[0].
    names = [f"{TOKENIZER_DIR}/{TOKENIZER_FILE}"] + \
        [f"{TOKENIZER_DIR}/{n}" for n in sorted(files) if n != TOKENIZER_FILE]
    return TokenizerSetup({"kind": tok.kind, "name": tok.name, "vocab_size": tok.vocab_size,
                           "eos_id": tok.eos_id, "files": names,
                           "sha256": hashlib.sha256(main).hexdigest()}, main.decode("utf-8"), files)


def write_setup_files(out: Path, setup: TokenizerSetup) -> None:
    """Save the setup's files under ``out/tokenizer/``."""
    for name, blob in setup.files.items():
        atomic_write_bytes(out / TOKENIZER_DIR / name, blob)


def read_setup_file(out: Path, identity: dict[str, Any]) -> bytes | None:
    """The saved tokenizer.json of ``identity`` if it is intact (``b""`` for byte-level), else ``None``."""
    if identity["kind"] == "byte":
        return b""
    path = out / identity["files"][0]
    try:
        blob = path.read_bytes()
    except OSError:
        return None
    return blob if hashlib.sha256(blob).hexdigest() == identity["sha256"] else None


def from_identity(root: Path | RemotePath, identity: dict[str, Any]) -> ByteTokenizer | HFTokenizer:
    """Rebuild the tokenizer a manifest names, from the files under ``root`` (the data directory,
    or an ``s3://`` one)."""
    kind = identity.get("kind")
    if kind == "byte":
        return ByteTokenizer()
    if kind in ("bpe", "hf"):
        files = identity.get("files") or []
        if not files:
            raise UserError(f"{root}/manifest.json: tokenizer {identity.get('name')!r} lists no files")
        path = root / files[0]
        if isinstance(root, RemotePath):  # s3://: through the store
            blob = Manifest(root, {}).read_file(files[0])
        elif not path.is_file():
            raise UserError(f"{path} is missing (tokenizer of {root})")
        else:
            blob = path.read_bytes()
        tk = _tokenizers()
        if identity.get("sha256") and hashlib.sha256(blob).hexdigest() != identity["sha256"]:
            raise UserError(f"{path}: sha256 does not match the manifest (tokenizer file changed)")
        tok = tk.Tokenizer.from_str(blob.decode("utf-8"))
        return HFTokenizer(tok, int(identity["eos_id"]), kind=kind, name=str(identity.get("name")))
    raise UserError(f"{root}/manifest.json: unknown tokenizer kind {kind!r}")


def load_tokenizer(data_dir_or_manifest: str | Path | Manifest) -> ByteTokenizer | HFTokenizer:
    """The tokenizer a prepared data directory was made with (for ``podtrain sample``).

    Accepts the data directory or an already read ``Manifest``. The result has ``encode(text)``,
    ``decode(ids)``, ``vocab_size`` and ``eos_id``.
    """
    manifest = data_dir_or_manifest if isinstance(data_dir_or_manifest, Manifest) \
        else read_manifest(data_dir_or_manifest)
    return from_identity(manifest.root, manifest.tokenizer)
