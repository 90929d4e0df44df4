"""``podtrain export RUN_DIR OUT_DIR``: a Hugging Face model folder from a run's newest checkpoint.

The folder holds ``config.json``, ``model.safetensors`` and ``generation_config.json`` written by
transformers' own ``save_pretrained`` (so ``AutoModelForCausalLM.from_pretrained(OUT_DIR)`` loads
it and gives the trained model's logits; only the model's tensors are read from the checkpoint),
the run's tokenizer files (BPE or Hugging Face tokenizers; for a byte-level run, a tokenizers
``tokenizer.json`` built here that maps ids 0-255 to the UTF-8 bytes and 256 to
``<|endoftext|>``, so ``AutoTokenizer`` loads every export), and ``podtrain_export.json`` naming
the run, the step and the tokenizer. The tokenizer comes from the run's data as for ``sample`` and
``eval`` (``ckpt.reader.run_data``: ``data.path`` or the first source of ``data.mix``, local or
``s3://``; ``--data`` overrides); a run whose data cannot be found is refused in one line, never
exported without its tokenizer. The folder is written under a temporary name, its files made
durable, and renamed into place only when complete (``--force``: the old folder is moved aside
first and removed after), so a killed or failed export never leaves a half folder. A disk too
small for it is one line naming OUT_DIR, the space it needs and the space free (exit 2): checked
before anything is written, and again if the disk fills up while writing (the half-written
temporary folder is removed).
"""

from __future__ import annotations

import argparse
import errno
import hashlib
import json
import os
import shutil
import uuid
from pathlib import Path
from typing import Any

from podtrain import __version__
from podtrain.ckpt.reader import build_model_from_checkpoint, load_latest, run_config_of, run_data
from podtrain.data.manifest import Manifest
from podtrain.errors import UserError
from podtrain.fsutil import file_mode, fsync_path, writable_dir

EXPORT_INFO = "podtrain_export.json"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``podtrain export``."""
    parser.add_argument("run_dir", help="run directory (holds ckpt/)")
    parser.add_argument("out_dir", help="folder to write (must not exist, or be empty)")
    parser.add_argument("--force", action="store_true", help="replace OUT_DIR if it exists")
    parser.add_argument("--data", default=None, help="data directory holding the tokenizer, a folder or "
                        "s3://... (default: the run's data.path, or the first source of its data.mix)")


def run(args: argparse.Namespace) -> int:
    """Export and print one line saying what was written."""
    info = export_run(Path(args.run_dir), Path(args.out_dir), force=args.force, data=args.data)
    tok = info["tokenizer"]
    print(f"exported step {info['step']} of {args.run_dir} to {args.out_dir} "
          f"(tokenizer: {tok['kind']} from {tok['data']})")
    return 0


def export_run(run_dir: Path, out_dir: Path, force: bool = False, data: str | None = None) -> dict[str, Any]:
    """Write the Hugging Face folder; returns what ``podtrain_export.json`` records. ``data``:
    where the tokenizer is (default: the run's own data, see the module docstring)."""
    if out_dir.exists() and any(out_dir.iterdir()) and not force:
        raise UserError(f"{out_dir} exists and is not empty (choose another OUT_DIR or pass --force)")
    try:
        writable_dir(out_dir.parent)  # a read-only disk, permissions: one line before any work
    except OSError as exc:
        if exc.errno != errno.ENOSPC:
            raise
        # A full disk: the space check below says so in a line that says how much is needed.
    ckpt = load_latest(run_dir)
    run_config = run_config_of(run_dir, ckpt)
    manifest = run_data(ckpt, run_config, data)  # before the model: a missing tokenizer fails fast
    tokenizer = {k: manifest.tokenizer.get(k) for k in ("kind", "name", "vocab_size", "eos_id", "files", "sha256")}
    model = build_model_from_checkpoint(ckpt, run_config)
    model.config.use_cache = True  # training turned the KV cache off; inference wants it
    model.generation_config.use_cache = True
    eos = tokenizer.get("eos_id")
    if eos is not None:
        # Documents are packed as ...EOS doc EOS...: what precedes a document is EOS, so it is
        # also the BOS (GPT-2's convention); the preset's own BOS id means nothing to this data.
        model.config.eos_token_id = model.config.bos_token_id = eos
        model.generation_config.eos_token_id = model.generation_config.bos_token_id = eos
        model.generation_config.pad_token_id = eos
    blobs = _tokenizer_blobs(manifest)  # read (and checked) before anything is written
    need = export_size(model) + sum(len(b) for b in blobs.values()) + SLACK_BYTES
    _require_space(out_dir, need)
    tmp = out_dir.parent / f".{out_dir.name}.tmp-{uuid.uuid4().hex[:8]}"
    old = out_dir.parent / f".{out_dir.name}.old-{uuid.uuid4().hex[:8]}"
    try:
        try:
            _save_quietly(model, tmp)
            copied = _copy_tokenizer(manifest, blobs, tmp)
            info = {"podtrain": __version__, "run_dir": str(run_dir), "checkpoint": str(ckpt.path),
                    "step": ckpt.step, "tokenizer": {**tokenizer, "files": copied, "data": str(manifest.root)}}
            (tmp / EXPORT_INFO).write_text(json.dumps(info, indent=1))
            for path in tmp.rglob("*"):  # the weights come out 0600; an export is meant to be shared
                if path.is_file():
                    path.chmod(file_mode())
                    fsync_path(path)  # complete on disk before the rename makes it visible
        except Exception as exc:
            if _is_out_of_space(exc):  # the disk filled up under us (safetensors' error is no OSError)
                shutil.rmtree(tmp, ignore_errors=True)  # first: the free space said is what is left
                raise _no_space(out_dir, need, _free_bytes(out_dir.parent)) from None
            raise
        replaced = out_dir.exists()
        if replaced:  # --force: out of the way first, so OUT_DIR is never half of either
            out_dir.rename(old)
        try:
            tmp.rename(out_dir)
        except BaseException:
            if replaced:  # the earlier export back, whole
                old.rename(out_dir)
            raise
        fsync_path(out_dir.parent)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.rmtree(old, ignore_errors=True)
    return info


SLACK_BYTES = 1 << 20
"""Room for what ``export_size`` does not count: config.json, generation_config.json,
podtrain_export.json, the safetensors header, and the file system's block rounding."""


def export_size(model: Any) -> int:
    """Bytes of the weights ``save_pretrained`` writes: every tensor storage once (tied weights,
    such as the embedding and the LM head, are stored once)."""
    unique = {(t.device, t.data_ptr(), t.numel() * t.element_size()) for t in model.state_dict().values()}
    return sum(nbytes for _, _, nbytes in unique)


def _free_bytes(folder: Path) -> int:
    return shutil.disk_usage(folder).free


def _require_space(out_dir: Path, need: int) -> None:
    """One line before any write when the destination's file system has less than ``need`` free."""
    free = _free_bytes(out_dir.parent)
    if free < need:
        raise _no_space(out_dir, need, free)


def _no_space(out_dir: Path, need: int, free: int) -> UserError:
    from podtrain.diagnostics.busbw import format_size

    return UserError(f"cannot export to {out_dir}: no space left on the device (the export needs about "
                     f"{format_size(need)}, {format_size(free)} is free in {out_dir.parent}); free some "
                     "space or choose another OUT_DIR")


OUT_OF_SPACE = (errno.ENOSPC, errno.EDQUOT)
OUT_OF_SPACE_TEXT = ("No space left on device", "Disk quota exceeded", "StorageFull", "QuotaExceeded")
"""How a full disk shows in an error that is not an ``OSError`` (safetensors' Rust ``IoError``)."""


def _is_out_of_space(exc: BaseException | None) -> bool:
    """A full disk or an exhausted quota, in ``exc`` or what it was raised from."""
    for _ in range(8):
        if exc is None:
            return False
        if isinstance(exc, OSError) and exc.errno in OUT_OF_SPACE:
            return True
        if any(text in str(exc) for text in OUT_OF_SPACE_TEXT):
            return True
        exc = exc.__cause__ or exc.__context__
    return False


def _save_quietly(model: Any, folder: Path) -> None:
    """``save_pretrained`` without its progress bar on stderr (the CLI prints one line)."""
    from transformers.utils import logging as hf_logging

    was_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        model.save_pretrained(str(folder), safe_serialization=True)
    finally:
        if was_enabled:
            hf_logging.enable_progress_bar()


def _tokenizer_blobs(manifest: Manifest) -> dict[str, bytes]:
    """The data's tokenizer files (name -> bytes), read through the data's store (a folder or
    s3://); the first (tokenizer.json) is checked against the manifest's SHA-256, as training
    checked it. A missing or changed file: one line naming it."""
    tokenizer = manifest.tokenizer
    blobs = {}
    for i, rel in enumerate(tokenizer.get("files") or []):
        blob = manifest.read_file(rel)
        if i == 0 and tokenizer.get("sha256") and hashlib.sha256(blob).hexdigest() != tokenizer["sha256"]:
            raise UserError(f"{manifest.root / rel}: sha256 does not match the manifest (tokenizer file changed)")
        blobs[rel.rsplit("/", 1)[-1]] = blob
    return blobs


def _copy_tokenizer(manifest: Manifest, blobs: dict[str, bytes], out: Path) -> list[str]:
    """Write the tokenizer files (``blobs``, from ``_tokenizer_blobs``) next to the weights, where
    HF looks for them; a byte-level run gets a ``tokenizer.json`` built here."""
    tokenizer = manifest.tokenizer
    copied = []
    if tokenizer.get("kind") == "byte":
        (out / "tokenizer.json").write_text(byte_level_tokenizer_json(int(tokenizer["eos_id"])))
        copied.append("tokenizer.json")
    for name, blob in blobs.items():
        (out / name).write_bytes(blob)
        copied.append(name)
    if "tokenizer.json" in copied and "tokenizer_config.json" not in copied:
        _write_tokenizer_config(out, tokenizer)
        copied.append("tokenizer_config.json")
    return copied


def _write_tokenizer_config(out: Path, tokenizer: dict[str, Any]) -> None:
    """A minimal tokenizer_config.json so ``AutoTokenizer.from_pretrained`` knows the EOS token."""
    import tokenizers

    tok = tokenizers.Tokenizer.from_file(str(out / "tokenizer.json"))
    eos = tok.id_to_token(int(tokenizer["eos_id"])) if tokenizer.get("eos_id") is not None else None
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": eos, "pad_token": eos,
              "add_bos_token": False, "add_eos_token": False}
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=1))


BYTE_EOS_TOKEN = "<|endoftext|>"
"""The EOS token's text in a byte-level export's tokenizer."""


def _byte_to_unicode() -> dict[int, str]:
    """GPT-2's printable stand-in for each byte (what tokenizers' ByteLevel pre-tokenizer emits)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    extra = [b for b in range(256) if b not in printable]
    return {**{b: chr(b) for b in printable}, **{b: chr(256 + i) for i, b in enumerate(extra)}}


def byte_level_tokenizer_json(eos_id: int) -> str:
    """A tokenizers ``tokenizer.json`` equal to podtrain's byte tokenizer: id b is byte b (no
    merges, no prefix space), ``eos_id`` is ``<|endoftext|>``."""
    import tokenizers
    from tokenizers import decoders, models, pre_tokenizers

    chars = _byte_to_unicode()
    tok = tokenizers.Tokenizer(models.BPE(vocab={chars[b]: b for b in range(256)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([tokenizers.AddedToken(BYTE_EOS_TOKEN, special=True)])
    if tok.token_to_id(BYTE_EOS_TOKEN) != eos_id:
        raise UserError(f"byte-level EOS id {eos_id} is not {tok.token_to_id(BYTE_EOS_TOKEN)}: cannot export its tokenizer")
    return tok.to_str()
