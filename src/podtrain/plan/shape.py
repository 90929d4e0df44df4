"""A run config's model as the numbers the plan needs, counted on the meta device (no memory, no
download, no GPU): the same transformers model training builds, so counts match the run's."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from podtrain.config import RunConfig
from podtrain.data.manifest import MANIFEST_NAME, read_manifest
from podtrain.data.mixture import primary_path
from podtrain.model import attention_width, model_size, num_layers, preset_config, round_up
from podtrain.plan.memory import ModelShape


def run_vocab(cfg: RunConfig) -> int | None:
    """The vocabulary training will use: model.vocab_size, else the prepared data's rounded up to
    64 when the data exists, else None (the preset's own)."""
    if cfg.model.vocab_size:
        return cfg.model.vocab_size
    data = primary_path(cfg.data.mix, cfg.data.path)
    if (Path(data) / MANIFEST_NAME).is_file():
        return round_up(read_manifest(data).vocab_size, 64)
    return None


def model_shape(cfg: RunConfig) -> ModelShape:
    """The ``ModelShape`` of ``cfg``'s model at ``cfg.data.seq_len``."""
    from transformers import AutoModelForCausalLM

    config = preset_config(cfg.model.preset, run_vocab(cfg))
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    size = model_size(model, config, cfg.data.seq_len)
    return shape_of(config, size.params, size.embedding_params, size.matmul_params,
                    size.flops_per_token)


def shape_of(config: Any, params: int, embedding: int, matmul: int, flops_per_token: float) -> ModelShape:
    """Combine counted parameters with a transformers config's architecture numbers."""
    hidden = int(getattr(config, "hidden_size", None) or getattr(config, "n_embd"))
    heads = int(getattr(config, "num_attention_heads", None) or getattr(config, "n_head"))
    width = attention_width(config)
    kv_heads = int(getattr(config, "num_key_value_heads", None) or heads)
    gpt2 = getattr(config, "model_type", "") == "gpt2"
    intermediate = int(getattr(config, "intermediate_size", None) or getattr(config, "n_inner", None)
                       or 4 * hidden)
    return ModelShape(params=params, embedding_params=embedding, matmul_params=matmul,
                      flops_per_token=flops_per_token, layers=num_layers(config), hidden=hidden,
                      attn_width=width, kv_width=kv_heads * (width // heads), heads=heads,
                      intermediate=intermediate, vocab=int(config.vocab_size),
                      gated_mlp=not gpt2, rotary=not gpt2)
