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
exported without its tokenizer. The folder is written under a temporary name and renamed into
place, so a killed export never leaves a half folder.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import uuid
from pathlib import Path
from typing import Any

from podtrain import __version__
from podtrain.ckpt.reader import build_model_from_checkpoint, load_latest, run_config_of, run_data
from podtrain.data.manifest import Manifest
from podtrain.errors import UserError
from podtrain.fsutil import file_mode, writable_dir

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
    writable_dir(out_dir.parent)  # a read-only or full disk: one line before any work
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
    tmp = out_dir.parent / f".{out_dir.name}.tmp-{uuid.uuid4().hex[:8]}"
    try:
        _save_quietly(model, tmp)
        copied = _copy_tokenizer(manifest, tmp)
        info = {"podtrain": __version__, "run_dir": str(run_dir), "checkpoint": str(ckpt.path),
                "step": ckpt.step, "tokenizer": {**tokenizer, "files": copied, "data": str(manifest.root)}}
        (tmp / EXPORT_INFO).write_text(json.dumps(info, indent=1))
        for path in tmp.rglob("*"):  # the weights come out 0600; an export is meant to be shared
            if path.is_file():
                path.chmod(file_mode())
        if out_dir.exists():
            shutil.rmtree(out_dir)
        tmp.rename(out_dir)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return info


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


def _copy_tokenizer(manifest: Manifest, out: Path) -> list[str]:
    """Copy the data's tokenizer files next to the weights (where HF looks for them), read through
    the data's store (a folder or s3://); the first (tokenizer.json) is checked against the
    manifest's SHA-256, as training checked it."""
    tokenizer = manifest.tokenizer
    files = tokenizer.get("files") or []
    copied = []
    if tokenizer.get("kind") == "byte":
        (out / "tokenizer.json").write_text(byte_level_tokenizer_json(int(tokenizer["eos_id"])))
        copied.append("tokenizer.json")
    for i, rel in enumerate(files):
        name, blob = rel.rsplit("/", 1)[-1], manifest.read_file(rel)  # missing: one line naming it
        if i == 0 and tokenizer.get("sha256") and hashlib.sha256(blob).hexdigest() != tokenizer["sha256"]:
            raise UserError(f"{manifest.root / rel}: sha256 does not match the manifest (tokenizer file changed)")
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
