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


def run_vocab(cfg: RunConfig) -> tuple[int | None, str]:
    """The vocabulary training will use and where it comes from: model.vocab_size, else the
    prepared data's rounded up to 64 when the data exists here, else None (the preset's own)."""
    if cfg.model.vocab_size:
        return cfg.model.vocab_size, "model.vocab_size"
    data = primary_path(cfg.data.mix, cfg.data.path)
    if (Path(data) / MANIFEST_NAME).is_file():
        found = read_manifest(data).vocab_size
        return round_up(found, 64), (f"the data's tokenizer in {data} ({found:,} rounded up to 64; "
                                     "set model.vocab_size to plan another)")
    return None, f"the preset's own ({data} has no prepared data here)"


def model_shape(cfg: RunConfig) -> ModelShape:
    """The ``ModelShape`` of ``cfg``'s model at ``cfg.data.seq_len``."""
    return config_shape(preset_config(cfg.model.preset, run_vocab(cfg)[0]), cfg.data.seq_len)


def config_shape(config: Any, seq_len: int) -> ModelShape:
    """The ``ModelShape`` of a transformers model config at ``seq_len``, counted on the meta device."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    size = model_size(model, config, seq_len)
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
