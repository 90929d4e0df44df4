"""Model presets -> transformers config -> randomly initialised causal LM; sizes and FLOPs.

Pre-training starts from random weights, so nothing is downloaded: a preset is a set of
architecture numbers, or a local ``config.json`` (e.g. copied from a hub model folder). Continued
pre-training (``model.init_from``) takes the architecture from a Hugging Face model folder's
``config.json`` instead (``init_config``); its weights are loaded by ``podtrain.ckpt.hf_source``.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from podtrain.errors import UserError

log = logging.getLogger(__name__)


class _TorchaoNoise(logging.Filter):
    """Drops the lines torchao's import logs that say nothing to a podtrain user: a warning per
    optional CUDA extension it cannot load here (``Failed to load ..._C_cutlass_90a.abi3.so``:
    Float8Linear needs none of them), that Triton is missing (a CPU: FP8 there needs none) and
    torch's pytree warning about Enums torchao registers."""

    NOISE = ("Failed to load ", "is an Enum subclass and is now natively supported", "Detected no triton")

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not any(text in message for text in self.NOISE)


def quiet_torchao_logs() -> None:
    """Install ``_TorchaoNoise`` on the loggers those lines come from (once; idempotent, imports nothing). It must
    run before torchao is first imported, which transformers does by itself when torchao is
    installed (the ``fp8`` extra; its torchao quantizer), at the first model built or loaded
    (train, export, sample, eval): this module, which they all import, calls it on import."""
    # A logger's filters see only its own records, not its children's: each logger by name.
    for name in ("torchao", "torchao.kernel.intmm", "torch.utils._pytree"):
        logger = logging.getLogger(name)
        if not any(isinstance(f, _TorchaoNoise) for f in logger.filters):
            logger.addFilter(_TorchaoNoise())


quiet_torchao_logs()


# Architecture numbers. vocab_size here is the preset's own; a run replaces it with its
# tokenizer's (config model.vocab_size, default: the data manifest's, rounded up to 64).
PRESETS: dict[str, dict[str, Any]] = {
    # ~2M parameters with a byte-level vocabulary: the CPU demo and the tests.
    "tiny": dict(model_type="llama", hidden_size=192, intermediate_size=512, num_hidden_layers=4,
                 num_attention_heads=6, num_key_value_heads=6, max_position_embeddings=2048,
                 rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=True, vocab_size=320),
    # GPT-2 small (124M with its 50257-token vocabulary).
    "gpt2-124m": dict(model_type="gpt2", n_embd=768, n_layer=12, n_head=12, n_positions=1024,
                      vocab_size=50257, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                      tie_word_embeddings=True),  # GPT2Config's default, said here for preset_numbers
    # The public Qwen2.5-0.5B config.json's architecture numbers.
    "qwen2.5-0.5b": dict(model_type="qwen2", hidden_size=896, intermediate_size=4864,
                         num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                         max_position_embeddings=32768, rms_norm_eps=1e-6, rope_theta=1000000.0,
                         tie_word_embeddings=True, vocab_size=151936, use_sliding_window=False,
                         hidden_act="silu"),
    # Llama 3.2 1B's architecture numbers (without its long-context RoPE scaling).
    "llama-1b": dict(model_type="llama", hidden_size=2048, intermediate_size=8192,
                     num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
                     max_position_embeddings=131072, rms_norm_eps=1e-5, rope_theta=500000.0,
                     tie_word_embeddings=True, vocab_size=128256, head_dim=64),
    # Llama 3.1 8B's architecture numbers.
    "llama-8b": dict(model_type="llama", hidden_size=4096, intermediate_size=14336,
                     num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                     max_position_embeddings=131072, rms_norm_eps=1e-5, rope_theta=500000.0,
                     tie_word_embeddings=False, vocab_size=128256),
}


def round_up(value: int, multiple: int) -> int:
    """``value`` rounded up to a multiple (vocabularies padded to 64 for faster matmuls)."""
    return -(-value // multiple) * multiple


def preset_config(preset: str, vocab_size: int | None = None) -> Any:
    """A transformers ``PretrainedConfig`` for a preset name or a local config.json path."""
    from transformers import AutoConfig

    if preset in PRESETS:
        numbers = dict(PRESETS[preset])
        model_type = numbers.pop("model_type")
        config = AutoConfig.for_model(model_type, **numbers)
    else:
        path = Path(preset)
        if path.is_dir():
            path = path / "config.json"
        if not path.is_file():
            raise UserError(f"model.preset {preset!r} is neither a preset "
                            f"({', '.join(PRESETS)}) nor an existing config.json")
        try:
            config = AutoConfig.from_pretrained(str(path))
        except (ValueError, OSError, json.JSONDecodeError) as exc:
            raise UserError(f"model.preset {path}: not a transformers config ({exc})") from None
    if vocab_size is not None:
        config.vocab_size = vocab_size
    config.use_cache = False  # training never reuses the KV cache
    return config


def preset_numbers(preset: str, vocab_size: int | None = None) -> Any | None:
    """A built-in preset's architecture numbers as the attributes of a config (``model_type``,
    ``hidden_size``, ...: what ``formula_counts`` and ``plan.shape`` read; where a preset leaves a
    field out, their own ``getattr`` defaults must be transformers' defaults), without importing
    transformers; None for a config.json path, whose defaults only transformers knows. For checks that need the model's
    shape and not the model (``launch local``'s pre-flight: importing transformers' config
    machinery there cost ~2.4 s of CPU before torchrun could start); tests/test_optim_model.py
    checks that its shape equals ``preset_config``'s for every preset."""
    from types import SimpleNamespace

    if preset not in PRESETS:
        return None
    numbers = dict(PRESETS[preset])
    if vocab_size is not None:
        numbers["vocab_size"] = vocab_size
    return SimpleNamespace(**numbers)


HF_CONFIG = "config.json"
HF_TOKENIZER = "tokenizer.json"


def hf_folder_config(url: str) -> Any:
    """The transformers config of the Hugging Face model folder ``url`` (a path or ``s3://``),
    read from its ``config.json`` through ``podtrain.storage``; one-line ``UserError`` when it is
    missing, not JSON, or names an architecture this transformers cannot build as a causal LM."""
    import transformers
    from transformers import CONFIG_MAPPING
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    from podtrain.storage import NotFound, StorageError, open_store

    where = f"model.init_from {url}"
    try:
        raw = json.loads(open_store(url).read_bytes(HF_CONFIG))
    except NotFound:
        raise UserError(f"{where}: no {HF_CONFIG} there (a Hugging Face model folder holds config.json "
                        "and model.safetensors or model-0000X-of-0000N.safetensors)") from None
    except StorageError as exc:
        raise UserError(f"{where}: {exc}") from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise UserError(f"{where}/{HF_CONFIG} is not JSON ({exc})") from None
    model_type = raw.get("model_type") if isinstance(raw, dict) else None
    arch = ", ".join(raw.get("architectures") or []) if isinstance(raw, dict) else ""
    if model_type not in CONFIG_MAPPING or model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        raise UserError(f"{where}: architecture model_type={model_type!r}{f' ({arch})' if arch else ''} is not "
                        f"a causal LM transformers {transformers.__version__} knows: upgrade transformers "
                        "or start from a supported model")
    try:
        config = CONFIG_MAPPING[model_type].from_dict(raw)
    except (ValueError, TypeError, KeyError) as exc:
        raise UserError(f"{where}/{HF_CONFIG}: not a valid {model_type} config ({exc})") from None
    config.use_cache = False  # training never reuses the KV cache
    return config


def init_config(url: str, vocab_size: int | None, tokenizer: dict[str, Any], data_where: str) -> Any:
    """``model.init_from``'s config, checked against the run's data: the data's tokenizer must be
    the folder's own (when the folder ships a ``tokenizer.json``: same SHA-256) and its vocabulary
    must fit the folder's embedding; ``vocab_size`` (``model.vocab_size``), when set, must be the
    folder's. Each mismatch is one line naming both sides and the command that fixes it."""
    import hashlib

    from podtrain.storage import NotFound, StorageError, open_store

    config = hf_folder_config(url)
    vocab = int(config.vocab_size)
    if vocab_size is not None and int(vocab_size) != vocab:
        raise UserError(f"model.vocab_size={vocab_size}, but model.init_from {url} has an embedding of "
                        f"{vocab} tokens: drop model.vocab_size (the folder's model decides it)")
    fix = f"podtrain prepare INPUT... --tokenizer {url} --out NEW_DATA_DIR, then data.path=NEW_DATA_DIR"
    try:
        blob = open_store(url).read_bytes(HF_TOKENIZER)
    except NotFound:
        blob = None  # a folder without its tokenizer: only the vocabulary can be checked
    except StorageError as exc:
        raise UserError(f"model.init_from {url}: {exc}") from None
    if blob is not None and tokenizer.get("sha256") and hashlib.sha256(blob).hexdigest() != tokenizer["sha256"]:
        raise UserError(f"tokenizer mismatch: the data {data_where} was tokenised with {tokenizer.get('name')!r} "
                        f"(sha256 {str(tokenizer['sha256'])[:12]}), not the tokenizer of model.init_from {url} "
                        f"(sha256 {hashlib.sha256(blob).hexdigest()[:12]}): {fix}")
    data_vocab = int(tokenizer.get("vocab_size") or 0)
    if data_vocab > vocab:
        raise UserError(f"tokenizer mismatch: the data {data_where} uses {tokenizer.get('name')!r} with "
                        f"{data_vocab} tokens, more than the embedding of model.init_from {url} holds "
                        f"({vocab}): {fix}")
    return config


INITS = ("random", "zeros", "empty")


def build_model(config: Any, attn_implementation: str = "sdpa", seed: int | None = None,
                device: torch.device | str | None = None, init: str = "random") -> nn.Module:
    """A randomly initialised causal LM (fp32 master weights) from a transformers config.

    With ``seed`` the initialisation is a pure function of it, so every rank builds the same
    weights (DDP also broadcasts rank 0's, and ``check_replicas`` verifies it). ``device``:
    where the weights are created; ``meta`` builds an empty model (``build_for_strategy``).
    ``init``: ``random``; ``zeros`` or ``empty`` skip the random initialisation (seconds to
    minutes of CPU for a large model) when every weight is about to be overwritten
    (``model.init_from``): ``zeros`` so replicas agree before then, ``empty`` leaves the weights'
    memory untouched (no resident pages) for a copy whose buffers alone are read. Buffers
    (rotary frequencies) are computed either way, and tied weights stay tied.
    """
    from transformers import AutoModelForCausalLM

    if init not in INITS:
        raise ValueError(f"init={init!r}: one of {INITS}")
    if seed is not None:
        torch.manual_seed(seed)
    try:
        with torch.device(device or "cpu"), _skipping_init(init != "random"):
            model = AutoModelForCausalLM.from_config(config, attn_implementation=attn_implementation,
                                                     dtype=torch.float32)
    except (ValueError, ImportError) as exc:
        raise UserError(f"model.attn_implementation={attn_implementation!r}: {exc}") from None
    if init != "random":
        model.tie_weights()  # skipped with the initialisation
        if init == "zeros" and str(device or "cpu") != "meta":
            with torch.no_grad():
                for p in model.parameters():
                    p.zero_()
    return model


def _skipping_init(skip: bool):
    """transformers' ``no_init_weights`` (torch's and its own initialisers made no-ops) when ``skip``."""
    import contextlib

    if not skip:
        return contextlib.nullcontext()
    try:
        from transformers.initialization import no_init_weights  # transformers 5
    except ImportError:  # 4.x, down to the 4.56 floor
        from transformers.modeling_utils import no_init_weights

    return no_init_weights()


@dataclass(frozen=True)
class ModelSize:
    """Parameter counts and per-token FLOPs of a model at a given sequence length."""

    params: int
    """All trainable parameters (tied weights counted once)."""
    embedding_params: int
    """Input-embedding parameters (lookups cost no matmul FLOPs)."""
    matmul_params: int
    """Parameters that take part in a matmul per token: all but the input embedding, plus the
    LM head when it is tied to the embedding."""
    flops_per_token: float
    """Training FLOPs per token: 6 x matmul_params + 12 x layers x (heads x head_dim) x seq_len
    (attention scores and values, forward + backward), the PaLM / nanoGPT accounting."""


def model_size(model: nn.Module, config: Any, seq_len: int) -> ModelSize:
    """Count parameters and FLOPs per token (documented in ``ModelSize``)."""
    params = sum(p.numel() for p in model.parameters())
    return size_from_counts(params, model.get_input_embeddings().weight.numel(), config, seq_len)


def size_from_counts(params: int, embedding: int, config: Any, seq_len: int) -> ModelSize:
    """``ModelSize`` from a model's parameter and input-embedding counts (built or by formula)."""
    tied = getattr(config, "tie_word_embeddings", False)
    matmul = params - embedding + (embedding if tied else 0)
    flops = 6.0 * matmul + 12.0 * num_layers(config) * attention_width(config) * seq_len
    return ModelSize(params=params, embedding_params=embedding, matmul_params=matmul,
                     flops_per_token=flops)


def num_layers(config: Any) -> int:
    """Transformer blocks of a transformers config (Llama/Qwen or GPT-2 naming)."""
    return int(getattr(config, "num_hidden_layers", None) or getattr(config, "n_layer"))


def attention_width(config: Any) -> int:
    """num_heads x head_dim: the width of the attention scores' matmuls. It equals hidden_size
    unless the config sets head_dim otherwise (Qwen3, Gemma: heads x head_dim != hidden)."""
    hidden = int(getattr(config, "hidden_size", None) or getattr(config, "n_embd"))
    heads = int(getattr(config, "num_attention_heads", None) or getattr(config, "n_head"))
    head_dim = getattr(config, "head_dim", None) or hidden // heads
    return heads * int(head_dim)


def estimate_params(config: Any) -> int:
    """Parameter count without building the model: by formula where ``formula_counts`` knows the
    architecture, else counted on the meta device."""
    counts = formula_counts(config)
    return counts[0] if counts is not None else meta_counts(config)[0]


def meta_counts(config: Any) -> tuple[int, int]:
    """(parameters, input-embedding parameters) of ``config``'s model built on the meta device (no
    memory; ~1.7 s of CPU the first time, most of it importing the architecture's modeling code)."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return sum(p.numel() for p in model.parameters()), model.get_input_embeddings().weight.numel()


def formula_counts(config: Any) -> tuple[int, int] | None:
    """(parameters, input-embedding parameters) of the model transformers builds from ``config``,
    by formula, for the architectures of the built-in presets (``llama``, ``qwen2``, ``gpt2``);
    None for any other, which ``meta_counts`` builds. A launcher and ``podtrain plan`` need only
    the counts: the formula spares them importing the modeling code (``meta_counts``'s ~1.7 s of
    CPU). Tied weights count once, as ``parameters()`` does; tests/test_optim_model.py checks it
    equals ``meta_counts`` for every preset and the variants the flags below make."""
    kind = getattr(config, "model_type", "")
    vocab = int(config.vocab_size)
    tied = bool(getattr(config, "tie_word_embeddings", False))
    if kind == "gpt2":
        hidden = int(config.n_embd)
        inner = int(getattr(config, "n_inner", None) or 4 * hidden)
        layer = (2 * hidden + hidden * 3 * hidden + 3 * hidden + hidden * hidden + hidden  # ln_1, attention
                 + 2 * hidden + hidden * inner + inner + inner * hidden + hidden)  # ln_2, MLP
        embedding = vocab * hidden
        params = embedding + int(config.n_positions) * hidden + num_layers(config) * layer + 2 * hidden
        return params + (0 if tied else embedding), embedding
    if kind not in ("llama", "qwen2"):
        return None
    hidden, inner = int(config.hidden_size), int(config.intermediate_size)
    width = attention_width(config)
    heads = int(config.num_attention_heads)
    kv = int(getattr(config, "num_key_value_heads", None) or heads) * (width // heads)
    qkv_bias = kind == "qwen2" or bool(getattr(config, "attention_bias", False))
    o_bias = kind == "llama" and bool(getattr(config, "attention_bias", False))
    mlp_bias = kind == "llama" and bool(getattr(config, "mlp_bias", False))
    attention = hidden * (width + 2 * kv) + width * hidden + qkv_bias * (width + 2 * kv) + o_bias * hidden
    mlp = 3 * hidden * inner + mlp_bias * (2 * inner + hidden)
    layer = attention + mlp + 2 * hidden  # two RMSNorm weights
    embedding = vocab * hidden
    params = embedding + num_layers(config) * layer + hidden  # the final norm
    return params + (0 if tied else embedding), embedding


def parameter_fingerprint(model: nn.Module) -> torch.Tensor:
    """A float64 vector of per-parameter sums: cheap to all-gather, different if any replica differs."""
    with torch.no_grad():
        return torch.stack([p.detach().double().sum() for p in model.parameters()])


def unwrap(model: nn.Module) -> nn.Module:
    """The plain model inside DDP and/or torch.compile wrappers (for saving and sampling)."""
    while True:
        if hasattr(model, "_orig_mod"):
            model = model._orig_mod
        elif hasattr(model, "module") and isinstance(model.module, nn.Module):
            model = model.module
        else:
            return model


def is_sharded(model: nn.Module) -> bool:
    """Is ``model`` (unwrapped) an FSDP2 module, its parameters DTensor shards?"""
    from torch.distributed.fsdp import FSDPModule

    return isinstance(unwrap(model), FSDPModule)


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The transformer blocks of a transformers model: the classes its ``_no_split_modules`` names."""
    names = set(getattr(model, "_no_split_modules", None) or ())
    layers = [m for m in model.modules() if type(m).__name__ in names]
    if not layers:
        raise UserError(f"{type(model).__name__} names no decoder layer class (_no_split_modules): "
                        "dist.strategy=fsdp/hsdp and train.activation_checkpointing need one")
    return layers
