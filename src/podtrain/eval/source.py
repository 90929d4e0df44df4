"""What ``podtrain eval`` evaluates: a run's checkpoint or an exported Hugging Face folder.

A run directory's checkpoint is read through ``ckpt.reader`` (the same functions ``sample`` and
``export`` use: the model's tensors only, never the optimizer's; FSDP/HSDP checkpoints come back
as whole weights), so every rank holds the whole model; the tokenizer is the run's data
(``ckpt.reader.run_data``: ``data.path`` or the first source of ``data.mix``, local or ``s3://``;
``--data`` overrides), checked against the hash the checkpoint recorded; it is scored in windows
of the run's ``data.seq_len`` tokens, as in training. Which checkpoint is rank 0's decision (the
newest, or ``--step``), broadcast, so a save landing meanwhile cannot split the ranks.
An exported folder (``podtrain export``, or any folder with ``config.json`` and
``tokenizer.json``) loads through transformers; its tokenizer is podtrain's byte tokenizer when
``podtrain_export.json`` says so, else the folder's ``tokenizer.json``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch import nn

from podtrain.data.manifest import Manifest, read_manifest
from podtrain.distributed.group import DistContext
from podtrain.errors import UserError


@dataclass
class Source:
    """A model ready to evaluate, its tokenizer, and where they came from."""

    model: nn.Module
    tokenizer: Any
    manifest: Manifest | None
    """The data directory the tokenizer belongs to (its validation split makes the shipped tasks)."""
    step: int | None
    label: str
    max_length: int | None = None
    """Tokens per scored window: a run's ``data.seq_len`` (what it was trained on, and what its
    in-training evaluation scores with); None: the model's position limit."""


def is_hf_folder(path: Path) -> bool:
    """A model folder (``config.json``) rather than a run directory (``ckpt/``)."""
    return (path / "config.json").is_file() and not (path / "ckpt").is_dir()


def load_source(path: Path, step: int | None, data: str | None, ctx: DistContext) -> Source:
    """The model and tokenizer of ``path`` on this rank (called on every rank)."""
    if not path.exists():
        raise UserError(f"{path} does not exist (a run directory or an exported model folder)")
    if is_hf_folder(path):
        if step is not None:
            raise UserError(f"--step {step}: {path} is an exported folder (one step), not a run directory")
        return _load_hf(path, data)
    chosen = ctx.broadcast_object(ctx.agree_on(lambda: _latest_step(path, step) if ctx.is_main else None))
    return ctx.agree_on(lambda: _load_run(path, chosen, data))


def _latest_step(run_dir: Path, step: int | None) -> int:
    """``step``, else the newest valid checkpoint's (its manifest and a listing: no tensor read)."""
    from podtrain.ckpt import layout
    from podtrain.ckpt.store import open_store

    if step is not None:
        return step
    store = open_store(layout.run_ckpt_url(run_dir))
    found = layout.find_latest(store).step
    if found is None:
        raise UserError(f"run directory {run_dir} has no complete checkpoint under {store.url} "
                        "(train first, or check the path)")
    return found


def _load_run(run_dir: Path, step: int, data: str | None) -> Source:
    from podtrain.ckpt.reader import build_model_from_checkpoint, load_step, run_config_of, run_data
    from podtrain.data.tokenizer import load_tokenizer

    ckpt = load_step(run_dir, step)
    run_config = run_config_of(run_dir, ckpt)
    manifest = run_data(ckpt, run_config, data)
    model = build_model_from_checkpoint(ckpt, run_config)
    seq_len = (run_config.get("data") or {}).get("seq_len")
    return Source(model, load_tokenizer(manifest), manifest, ckpt.step, f"{run_dir} step {ckpt.step}",
                  int(seq_len) if seq_len else None)


def _load_hf(folder: Path, data: str | None) -> Source:
    import torch
    from transformers import AutoModelForCausalLM

    from podtrain.data.tokenizer import ByteTokenizer, load_hf

    info_path = folder / "podtrain_export.json"
    info = json.loads(info_path.read_text()) if info_path.is_file() else {}
    if (info.get("tokenizer") or {}).get("kind") == "byte":
        tokenizer: Any = ByteTokenizer()
    else:
        tokenizer = load_hf(str(folder)).tokenizer
    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    manifest = read_manifest(data) if data is not None else None
    return Source(model, tokenizer, manifest, info.get("step"), str(folder))
