"""A run config's model as the numbers the plan needs, counted on the meta device (no memory, no
download, no GPU): the same transformers model training builds, so counts match the run's.

Two vocabularies: ``trained_vocab`` is what training builds (the launchers' memory check and
``report`` use it); ``plan_vocab`` is what ``podtrain plan`` counts, the preset's own unless the
user's data is meant (its rule is in its docstring and on the plan's first line)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from podtrain.config import RunConfig
from podtrain.data.manifest import MANIFEST_NAME, Manifest, read_manifest
from podtrain.data.mixture import primary_path
from podtrain.model import (attention_width, formula_counts, hf_folder_config, meta_counts, num_layers,
                            preset_config, round_up, size_from_counts)
from podtrain.plan.memory import ModelShape


@dataclass(frozen=True)
class VocabChoice:
    """The vocabulary a plan counts the model with, and why (``plan_vocab``)."""

    size: int | None
    """Tokens in the embedding; None: the preset's own."""
    source: str
    """For the plan's first line: ``the preset's own vocabulary``, ``the vocabulary of
    model.vocab_size``, ``the vocabulary of the data's bpe:4096 tokenizer``."""
    reason: str
    """Why this vocabulary and the override that plans another; empty when the user set it."""


TRAINED_KINDS = ("bpe", "hf")
"""Tokenizer kinds whose vocabulary a plan takes from the data (``plan_vocab``)."""


def trained_vocab(cfg: RunConfig) -> int | None:
    """The vocabulary training builds the model with (``train.preflight.check_run``):
    model.vocab_size, else the prepared data's rounded up to 64 when the data exists here, else
    None (the preset's own). What a launcher checks and a report compares with: the run's model.
    ``model.init_from``: the folder's config.json's (training refuses any other)."""
    if cfg.model.init_from:
        return int(hf_folder_config(cfg.model.init_from).vocab_size)
    if cfg.model.vocab_size:
        return cfg.model.vocab_size
    manifest = _local_manifest(cfg)
    return None if manifest is None else round_up(manifest.vocab_size, 64)


def plan_vocab(cfg: RunConfig) -> VocabChoice:
    """The vocabulary ``podtrain plan`` counts: the model the config names, not a stand-in's.

    The rule: ``model.vocab_size`` when set; else the prepared data's tokenizer (rounded up to 64,
    as training pads it) when it is a trained one (``bpe`` or ``hf``), because that is the
    tokenizer the preset's embedding will be trained with; else the preset's own vocabulary. So
    a preset planned over byte-level data (the demo's ``data/builtin``, a stand-in for a real
    corpus) is planned at its published size: llama-8b is 8.03B parameters, not the 6.98B a
    320-token embedding would make it. Training that config as written does build the 320-token
    model, so the reason says so and names the override that plans it. ``model.init_from``: the
    folder's own vocabulary, the one its embedding has."""
    if cfg.model.init_from:
        return VocabChoice(trained_vocab(cfg), f"the vocabulary of {cfg.model.init_from}/config.json", "")
    preset_vocab = int(preset_config(cfg.model.preset).vocab_size)
    if cfg.model.vocab_size:
        return VocabChoice(cfg.model.vocab_size, "the vocabulary of model.vocab_size", "")
    data = primary_path(cfg.data.mix, cfg.data.path)
    manifest = _local_manifest(cfg)
    if manifest is None:
        return VocabChoice(None, "the preset's own vocabulary", f"{data} has no prepared data here; "
                           "model.vocab_size=N plans another")
    found = manifest.vocab_size
    padded = round_up(found, 64)
    kind = str(manifest.tokenizer.get("kind", "byte"))
    name = str(manifest.tokenizer.get("name") or kind)
    if kind in TRAINED_KINDS:
        label = name if name.startswith(kind) else f"{kind}:{name}"
        return VocabChoice(padded, f"the vocabulary of the data's {label} tokenizer",
                           f"the tokenizer of {data} ({found:,} tokens, rounded up to 64), which the "
                           f"embedding is trained with; model.vocab_size=N plans another")
    if padded == preset_vocab:
        return VocabChoice(None, "the preset's own vocabulary",
                           f"the same as {data}'s {kind}-level tokenizer ({found:,} ids, rounded up to 64)")
    return VocabChoice(None, "the preset's own vocabulary",
                       f"{data} is {kind}-level ({found:,} ids), a stand-in, not {cfg.model.preset}'s "
                       f"tokenizer; training this config as written builds a {padded:,}-token "
                       f"embedding: model.vocab_size={padded} plans that")


def _local_manifest(cfg: RunConfig) -> Manifest | None:
    """The run's (first) data directory's manifest when it is prepared on this machine."""
    data = primary_path(cfg.data.mix, cfg.data.path)
    return read_manifest(data) if (Path(data) / MANIFEST_NAME).is_file() else None


def model_shape(cfg: RunConfig) -> ModelShape:
    """The ``ModelShape`` of the model training builds from ``cfg`` (``trained_vocab``)."""
    return vocab_shape(cfg, trained_vocab(cfg))


def vocab_shape(cfg: RunConfig, vocab: int | None) -> ModelShape:
    """The ``ModelShape`` of ``cfg``'s preset with ``vocab`` tokens (None: the preset's own) at
    ``cfg.data.seq_len``; under ``model.init_from`` the folder's model (its config.json)."""
    if cfg.model.init_from:
        return config_shape(hf_folder_config(cfg.model.init_from), cfg.data.seq_len)
    return config_shape(preset_config(cfg.model.preset, vocab), cfg.data.seq_len)


def model_config(cfg: RunConfig, vocab: int | None) -> Any:
    """The transformers config ``vocab_shape`` counts (the one training builds the model from)."""
    if cfg.model.init_from:
        return hf_folder_config(cfg.model.init_from)
    return preset_config(cfg.model.preset, vocab)


def mean_document_tokens(cfg: RunConfig) -> float | None:
    """Tokens per document of the run's (first) prepared training data here, else None."""
    manifest = _local_manifest(cfg)
    if manifest is None:
        return None
    train = manifest.raw.get("splits", {}).get("train", {})
    tokens, documents = int(train.get("tokens") or 0), int(train.get("documents") or 0)
    return tokens / documents if tokens and documents else None


def config_shape(config: Any, seq_len: int) -> ModelShape:
    """The ``ModelShape`` of a transformers model config at ``seq_len``: counted by formula for the
    built-in presets' architectures, else on the meta device (``podtrain.model.formula_counts``)."""
    params, embedding = formula_counts(config) or meta_counts(config)
    size = size_from_counts(params, embedding, config, seq_len)
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
