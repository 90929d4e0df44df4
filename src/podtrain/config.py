"""The typed run configuration: dataclasses, a YAML file plus dotted overrides, validation.

``load_config("configs/demo.yaml", ["optim.lr=3e-4", "train.steps=200"])`` returns a ``RunConfig``.
Unknown keys and values of the wrong type raise ``UserError`` with one line naming the key and the
closest valid key. ``dump_config`` writes the resolved config (what ``RUN_DIR/config.yaml`` holds).
Each component receives only its own section (``cfg.train``, ``cfg.data``...), never the whole tree.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import signal
import types
import typing
from pathlib import Path
from typing import Any, Union

import yaml

from podtrain.config_sections import RunConfig
from podtrain.data.mixture import parse_mix
from podtrain.errors import UserError


# Allowed values of string keys that act as enums, checked at load time.
CHOICES: dict[str, tuple[str, ...]] = {
    "train.precision": ("auto", "fp32", "bf16", "fp16"),
    "optim.implementation": ("auto", "fused", "foreach"),
    "log.progress": ("auto", "rich", "plain", "off"),
    "dist.backend": ("auto", "nccl", "gloo"),
    "model.memory_check": ("error", "warn", "off"),
    "optim.schedule": ("cosine", "wsd", "constant"),
    "dist.strategy": ("ddp", "fsdp", "hsdp"),
    "train.activation_checkpointing": ("none", "full"),
    "train.fp8": ("off", "tensorwise", "rowwise"),
}


# Keys whose change between a checkpoint and its resume changes what is being trained: refused
# unless listed in ckpt.allow_changes (data.tokenizer is the data manifest's, not a config key).
MATH_KEYS: tuple[str, ...] = ("model.preset", "model.vocab_size", "data.path", "data.mix", "data.seq_len",
                              "data.tokenizer", "train.global_batch_size", "run.seed")


def all_keys(cls: type = RunConfig, prefix: str = "") -> list[str]:
    """Every dotted key of the config tree (``optim.lr``, ``train.steps``, ...)."""
    keys = []
    for f in dataclasses.fields(cls):
        ftype = _field_types(cls)[f.name]
        if dataclasses.is_dataclass(ftype):
            keys.extend(all_keys(ftype, f"{prefix}{f.name}."))
        else:
            keys.append(prefix + f.name)
    return keys


def load_config(path: str | os.PathLike | None, overrides: list[str] | tuple[str, ...] = ()) -> RunConfig:
    """Read a YAML file (or start from defaults when ``path`` is None) and apply ``key=value``s."""
    cfg = RunConfig()
    for key, value in _settings(path, overrides).items():
        _set(cfg, key, value)
    validate(cfg)
    return cfg


def explicit_keys(path: str | os.PathLike | None, overrides: list[str] | tuple[str, ...] = ()) -> set[str]:
    """The dotted keys the YAML file or the overrides set, whatever their value (a key left to
    its default is not among them): ``podtrain plan`` plans ``train.steps`` only when it is set."""
    return set(_settings(path, overrides))


def _settings(path: str | os.PathLike | None, overrides: list[str] | tuple[str, ...]) -> dict[str, Any]:
    """The file's keys, flattened, then the overrides: what ``load_config`` applies."""
    raw: dict[str, Any] = {}
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise UserError(f"config file {p} does not exist")
        try:
            raw = yaml.safe_load(p.read_text()) or {}
        except yaml.YAMLError as exc:
            mark = getattr(exc, "problem_mark", None)
            where = f" line {mark.line + 1}" if mark else ""
            raise UserError(f"config file {p}{where}: invalid YAML ({getattr(exc, 'problem', exc)})") from None
        if not isinstance(raw, dict):
            raise UserError(f"config file {p}: top level must be a mapping of sections")
    flat = _flatten(raw, source=str(path) if path else "defaults")
    for item in overrides:
        key, value = parse_override(item)
        flat[key] = value
    return flat


class RawText(str):
    """An override's value as typed; parsed by the type of the key it sets (see ``_coerce``).

    Parsing by type matters because YAML 1.1 reads ``off``, ``no`` and ``on`` as booleans: a
    string key such as ``log.progress=off`` must keep the text.
    """


def parse_override(item: str) -> tuple[str, Any]:
    """Split ``section.key=value``; the value stays text until its key's type is known."""
    if "=" not in item:
        raise UserError(f"override {item!r} must look like section.key=value")
    key, text = item.split("=", 1)
    return key.strip(), RawText(text)


def _parse_yaml_scalar(text: str) -> Any:
    try:
        return yaml.safe_load(text) if text.strip() else ""
    except yaml.YAMLError:
        return str(text)


def _flatten(raw: dict, source: str, prefix: str = "") -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for k, v in raw.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict) and key.count(".") == 0 and not prefix:
            flat.update(_flatten(v, source, key + "."))
        else:
            flat[key] = v
    return flat


# Names other trainers give podtrain's keys (Hugging Face Trainer, nanoGPT, Megatron, torchtitan):
# a key that uses one is pointed at podtrain's, whatever its section.
SYNONYMS: dict[str, str] = {
    **dict.fromkeys(("learning_rate", "max_lr", "lr_max", "peak_lr"), "optim.lr"),
    **dict.fromkeys(("min_learning_rate", "lr_min", "final_lr"), "optim.min_lr"),
    **dict.fromkeys(("batch_size", "global_batch", "train_batch_size", "total_batch_size"),
                    "train.global_batch_size"),
    **dict.fromkeys(("micro_batch", "per_device_batch_size", "per_device_train_batch_size", "local_batch_size"),
                    "train.micro_batch_size"),
    **dict.fromkeys(("max_steps", "num_steps", "total_steps", "max_iters", "iterations", "train_iters"),
                    "train.steps"),
    **dict.fromkeys(("warmup", "warmup_iters", "lr_warmup_steps", "num_warmup_steps"), "optim.warmup_steps"),
    **dict.fromkeys(("max_grad_norm", "clip_grad_norm", "gradient_clipping", "clip_grad"), "train.grad_clip"),
    **dict.fromkeys(("seq_length", "max_seq_len", "max_seq_length", "context_length", "block_size",
                     "sequence_length"), "data.seq_len"),
    "wd": "optim.weight_decay",
    **dict.fromkeys(("save_steps", "save_every", "checkpoint_every", "save_interval"), "ckpt.every"),
    **dict.fromkeys(("eval_steps", "eval_interval", "eval_every"), "eval.every"),
    **dict.fromkeys(("logging_steps", "log_interval", "log_every"), "log.every"),
    **dict.fromkeys(("output_dir", "out_dir", "run_dir"), "run.dir"),
    **dict.fromkeys(("model_name", "model_type", "arch", "architecture"), "model.preset"),
    **dict.fromkeys(("dataset", "data_dir", "dataset_path"), "data.path"),
    **dict.fromkeys(("dtype", "mixed_precision"), "train.precision"),
}
# Keys podtrain has no equivalent of, because the value follows from others: what to set instead.
DERIVED: dict[str, str] = dict.fromkeys(
    ("gradient_accumulation_steps", "accumulation_steps", "grad_accum", "gradient_accumulation"),
    "gradient accumulation follows from train.global_batch_size / (train.micro_batch_size x world "
    "size): set those")
CLOSE = 0.7
"""difflib ratio from which a spelling is a likely typo of a key (``stepz`` for ``steps``: 0.8)."""


def _closest(key: str) -> str | None:
    """The valid key a mistyped one most likely meant, or None: a known synonym
    (``learning_rate`` -> ``optim.lr``), the same name in another section (``train.lr``), the
    same words in another order (``lr_min`` -> ``min_lr``), then a close spelling (difflib) of
    the section and of the name within it; nothing when no key is close (``optim.foo``)."""
    keys = all_keys()
    section, _, leaf = key.rpartition(".")
    name = leaf.lower().replace("-", "_")
    if name in SYNONYMS:
        return SYNONYMS[name]
    for candidate in keys:
        other = candidate.rsplit(".", 1)[-1]
        if other == name or sorted(other.split("_")) == sorted(name.split("_")):
            return candidate
    sections = {k.split(".", 1)[0] for k in keys}
    if section not in sections:  # a mistyped section (modle.preset): its closest, then the name there
        close = difflib.get_close_matches(section, sections, n=1, cutoff=CLOSE)
        if not close:
            close = difflib.get_close_matches(key, keys, n=1, cutoff=CLOSE)
            return close[0] if close else None
        section = close[0]
        if f"{section}.{name}" in keys:
            return f"{section}.{name}"
    in_section = [k.rsplit(".", 1)[-1] for k in keys if k.startswith(section + ".")]
    close = difflib.get_close_matches(name, in_section, n=1, cutoff=CLOSE)
    return f"{section}.{close[0]}" if close else None


def _unknown_key(key: str) -> UserError:
    """The one-line error for a key the config tree does not have, with the closest key (or
    what to set instead, or the section's keys when nothing is close)."""
    name = key.rsplit(".", 1)[-1].lower().replace("-", "_")
    if name in DERIVED:
        return UserError(f"unknown config key {key!r}: {DERIVED[name]}")
    closest = _closest(key)
    if closest:
        return UserError(f"unknown config key {key!r} (did you mean {closest!r}?)")
    section = key.split(".", 1)[0]
    leaves = [k.split(".", 1)[1] for k in all_keys() if k.startswith(section + ".")]
    if leaves:
        return UserError(f"unknown config key {key!r} ({section} has: {', '.join(leaves)})")
    sections = list(dict.fromkeys(k.split(".", 1)[0] for k in all_keys()))
    return UserError(f"unknown config key {key!r} (sections: {', '.join(sections)})")


# Keys that existed once: naming one is a one-line error saying what replaced it.
REMOVED_KEYS: dict[str, str] = {
    "ckpt.format": "every run now writes the one checkpoint layout (each rank its own pieces); "
                   "delete the key",
}


def _set(cfg: RunConfig, key: str, value: Any) -> None:
    if key in REMOVED_KEYS:
        raise UserError(f"config key {key!r} was removed: {REMOVED_KEYS[key]}")
    parts = key.split(".")
    if len(parts) != 2:
        raise _unknown_key(key)
    section_name, leaf = parts
    section = getattr(cfg, section_name, None)
    if section is None or not dataclasses.is_dataclass(section):
        raise _unknown_key(key)
    types_ = _field_types(type(section))
    if leaf not in types_:
        raise _unknown_key(key)
    setattr(section, leaf, _coerce(key, value, types_[leaf]))


def _field_types(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _coerce(key: str, value: Any, ftype: Any) -> Any:
    """Check ``value`` against the field type; allow the safe widenings (int -> float)."""
    origin = typing.get_origin(ftype)
    if origin in (Union, types.UnionType):
        args = typing.get_args(ftype)
        if isinstance(value, RawText) and value.strip() in ("null", "~", "none", "None"):
            return None
        if value is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        for member in inner[:-1]:  # e.g. ckpt.every: int | str takes 100 as an int, auto as text
            try:
                return _coerce(key, value, member)
            except UserError:
                continue
        return _coerce(key, value, inner[-1])
    if isinstance(value, RawText):
        value = str(value) if ftype is str else _parse_yaml_scalar(value)
    if ftype is str and isinstance(value, bool) and "off" in CHOICES.get(key, ()):
        value = "on" if value else "off"  # a YAML file's bare `off` is a boolean to YAML 1.1
    if origin is list:
        (item_type,) = typing.get_args(ftype)
        if isinstance(value, str):
            value = [v.strip() for v in value.split(",") if v.strip()]
        if not isinstance(value, list):
            raise UserError(f"config key {key!r} expects a list, got {value!r}")
        return [_coerce(key, v, item_type) for v in value]
    if ftype is bool:
        if isinstance(value, bool):
            return value
        raise UserError(f"config key {key!r} expects true or false, got {value!r}")
    if ftype is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        raise UserError(f"config key {key!r} expects an integer, got {value!r}")
    if ftype is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):
            try:
                return float(value)  # YAML 1.1 reads "3e-4" as a string
            except ValueError:
                pass
        raise UserError(f"config key {key!r} expects a number, got {value!r}")
    if ftype is str:
        if isinstance(value, (str, int, float)) and not isinstance(value, bool):
            return str(value)
        raise UserError(f"config key {key!r} expects a string, got {value!r}")
    return value


def validate(cfg: RunConfig) -> None:
    """Cross-field checks that need no processes (the world size is checked by ``accumulation``)."""
    for key, choices in CHOICES.items():
        section, leaf = key.split(".")
        value = getattr(getattr(cfg, section), leaf)
        if value not in choices:
            raise UserError(f"config key {key!r} must be one of {', '.join(choices)}, got {value!r}")
    positive = {
        "train.steps": cfg.train.steps, "train.micro_batch_size": cfg.train.micro_batch_size,
        "train.global_batch_size": cfg.train.global_batch_size, "data.seq_len": cfg.data.seq_len,
        "log.every": cfg.log.every, "dist.timeout_s": cfg.dist.timeout_s,
        "dist.init_timeout_s": cfg.dist.init_timeout_s, "data.prefetch": cfg.data.prefetch,
    }
    for key, value in positive.items():
        if value <= 0:
            raise UserError(f"config key {key!r} must be positive, got {value}")
    if isinstance(cfg.ckpt.every, str) and cfg.ckpt.every != "auto":
        raise UserError(f"config key 'ckpt.every' must be a number of steps or auto, got {cfg.ckpt.every!r}")
    if not 0 < cfg.optim.decay_fraction <= 1:
        raise UserError(f"config key 'optim.decay_fraction' must be in (0, 1], got {cfg.optim.decay_fraction}")
    non_negative = {
        "eval.every": cfg.eval.every, "optim.lr": cfg.optim.lr,
        "ckpt.every": cfg.ckpt.every if cfg.ckpt.every != "auto" else 0,
        "optim.min_lr": cfg.optim.min_lr, "optim.warmup_steps": cfg.optim.warmup_steps,
        "train.grad_clip": cfg.train.grad_clip, "ckpt.keep_every": cfg.ckpt.keep_every,
        "data.num_workers": cfg.data.num_workers, "monitor.straggler_every": cfg.monitor.straggler_every,
        "optim.weight_decay": cfg.optim.weight_decay,
        "ckpt.keep_last": cfg.ckpt.keep_last, "guard.spike_factor": cfg.guard.spike_factor,
        "ckpt.mtbf_h": cfg.ckpt.mtbf_h, "data.cache_gb": cfg.data.cache_gb,
    }
    for key, value in non_negative.items():
        if value < 0:
            raise UserError(f"config key {key!r} must not be negative, got {value}")
    parse_mix(cfg.data.mix, cfg.data.path)  # each data.mix entry: path, positive weight, unique name
    if cfg.optim.min_lr > cfg.optim.lr:
        raise UserError(f"config key 'optim.min_lr' ({cfg.optim.min_lr}) exceeds 'optim.lr' ({cfg.optim.lr})")
    if cfg.train.global_batch_size % cfg.train.micro_batch_size:
        raise UserError(
            f"config key 'train.global_batch_size' ({cfg.train.global_batch_size}) is not a multiple of "
            f"'train.micro_batch_size' ({cfg.train.micro_batch_size})")
    positive_guard = {"guard.history": cfg.guard.history, "guard.max_skips": cfg.guard.max_skips,
                      "guard.window": cfg.guard.window}
    for key, value in positive_guard.items():
        if value <= 0:
            raise UserError(f"config key {key!r} must be positive, got {value}")
    for key in cfg.ckpt.allow_changes:
        if key not in MATH_KEYS:
            raise UserError(f"config key 'ckpt.allow_changes' lists {key!r}, which is not a key that "
                            f"alters the math (one of {', '.join(MATH_KEYS)})")
    for name in cfg.ckpt.signals:
        signal_from_name(name, "config key 'ckpt.signals'")
    _validate_observe(cfg)
    if cfg.ckpt.host_staging_mb is not None and not cfg.ckpt.host_staging_mb >= 1:
        raise UserError(f"config key 'ckpt.host_staging_mb' must be at least 1 (MB), got {cfg.ckpt.host_staging_mb}")
    _validate_ckpt_tiers(cfg.ckpt)
    if cfg.dist.strategy != "ddp" and cfg.train.precision == "fp16":
        raise UserError(f"config key 'dist.strategy' ({cfg.dist.strategy}) does not support "
                        "train.precision=fp16 (the GradScaler's found-inf flag would have to be reduced "
                        "over the shards): use bf16")
    if cfg.dist.shard_size is not None and cfg.dist.shard_size < 1:
        raise UserError(f"config key 'dist.shard_size' must be at least 1 (or null: a node's ranks), "
                        f"got {cfg.dist.shard_size}")
    for key in ("tasks_every", "tasks_limit"):
        if getattr(cfg.eval, key) < 0:
            raise UserError(f"config key 'eval.{key}' must be 0 or more, got {getattr(cfg.eval, key)}")
    if cfg.eval.every and cfg.eval.max_batches < 1:
        raise UserError(f"config key 'eval.max_batches' must be at least 1 when eval.every > 0, "
                        f"got {cfg.eval.max_batches}")
    if cfg.data.document_masking:
        _validate_document_masking(cfg)


def _validate_document_masking(cfg: RunConfig) -> None:
    """What data.document_masking needs of the config alone (the device and the model's
    architecture are checked at start: ``data.doc_mask.mask_kind``)."""
    attn = cfg.model.attn_implementation
    if attn not in ("sdpa", "eager", "flex_attention"):
        raise UserError(f"config key 'data.document_masking' needs model.attn_implementation sdpa or eager (CPU) "
                        f"or flex_attention (GPU): {attn} takes no document mask")
    if attn == "flex_attention" and cfg.data.seq_len % 128:
        raise UserError(f"config key 'data.document_masking' with flex_attention needs data.seq_len a multiple "
                        f"of 128 (its mask's tiles), got {cfg.data.seq_len}")


def ignored_data_path(data: Any) -> str | None:
    """A warning when ``data.mix`` is set and ``data.path`` was changed from its default: the
    mix is the data and the path is not read (not even checked), which a user who set both
    would not guess; None otherwise. (A config that leaves data.path at its default, as one
    extending configs/demo.yaml with a data.mix override does, gets none.)"""
    from podtrain.config_sections import DataSection

    if not data.mix or data.path == DataSection.path:
        return None
    return (f"data.path={data.path} is ignored: data.mix is set and its {len(data.mix)} source(s) are the "
            "data (remove data.path, or data.mix to train from it)")


RESUME_FROM_RESETS = ("optimizer", "data")
"""What ``ckpt.resume_from_reset`` may list."""


def _validate_ckpt_tiers(ckpt: Any) -> None:
    """ckpt.dir may be s3:// (never with credentials in it); the local tier is a local path."""
    if "://" in ckpt.dir and "@" in ckpt.dir.split("://", 1)[1].split("/", 1)[0]:
        raise UserError("config key 'ckpt.dir' must not carry credentials (user:secret@): S3 credentials "
                        "come from the AWS chain (environment, profile, IRSA, EKS Pod Identity)")
    if "://" in ckpt.local_dir:
        raise UserError(f"config key 'ckpt.local_dir' must be a node-local path (NVMe, /dev/shm), "
                        f"got {ckpt.local_dir!r}")
    if ckpt.local_every < 0:
        raise UserError(f"config key 'ckpt.local_every' must not be negative, got {ckpt.local_every}")
    if ckpt.local_keep < 1:
        raise UserError(f"config key 'ckpt.local_keep' must be at least 1, got {ckpt.local_keep}")
    if ckpt.local_replicas < 0:
        raise UserError(f"config key 'ckpt.local_replicas' must not be negative, got {ckpt.local_replicas}")
    for key in ("lease_timeout_s", "save_wait_s", "max_outage_s"):
        if not getattr(ckpt, key) > 0:
            raise UserError(f"config key 'ckpt.{key}' must be positive, got {getattr(ckpt, key)}")
    for part in ckpt.resume_from_reset:
        if part not in RESUME_FROM_RESETS:
            raise UserError(f"config key 'ckpt.resume_from_reset' lists {part!r}: choose from "
                            f"{', '.join(RESUME_FROM_RESETS)}")
    if bool(ckpt.local_every) != bool(ckpt.local_dir):
        raise UserError("config keys 'ckpt.local_dir' and 'ckpt.local_every' go together: set both "
                        f"(got local_dir={ckpt.local_dir!r}, local_every={ckpt.local_every})")


def _validate_observe(cfg: RunConfig) -> None:
    """Tracker names and the profile range (whether a tracker is installed is checked at start)."""
    from podtrain.observe.profile import parse_steps
    from podtrain.observe.trackers import TRACKER_NAMES

    for name in cfg.log.trackers:
        if name not in TRACKER_NAMES:
            raise UserError(f"config key 'log.trackers': unknown tracker {name!r} "
                            f"(choose from {', '.join(TRACKER_NAMES)})")
    steps = parse_steps(cfg.profile.steps)
    if steps is not None and steps[0] > cfg.train.steps:
        hint = ("; YAML reads an unquoted 10:13 as the base-60 number 613: quote it"
                if ":" not in cfg.profile.steps else "")
        raise UserError(f"config key 'profile.steps' ({cfg.profile.steps}) starts after the last "
                        f"step (train.steps={cfg.train.steps}){hint}")


def signal_from_name(name: str | int, where: str = "signal") -> signal.Signals:
    """``"SIGTERM"``, ``"TERM"``, ``"sigusr1"`` or a number -> the signal; else a UserError
    naming ``where``. SIGKILL and SIGSTOP are refused: a process cannot catch them."""
    text = str(name).strip().upper()
    try:
        sig = signal.Signals(int(text)) if text.isdigit() else signal.Signals[
            text if text.startswith("SIG") else "SIG" + text]
    except (KeyError, ValueError):
        raise UserError(f"{where}: unknown signal {name!r} (e.g. SIGTERM, SIGUSR1)") from None
    if sig in (signal.SIGKILL, signal.SIGSTOP):
        raise UserError(f"{where}: {sig.name} cannot be caught")
    return sig


def accumulation_steps(global_batch: int, micro_batch: int, world_size: int) -> int:
    """Micro-batches per optimizer step on each rank: global / (micro x world), which must divide."""
    per_step = micro_batch * world_size
    if global_batch % per_step:
        raise UserError(
            f"train.global_batch_size={global_batch} is not divisible by train.micro_batch_size x "
            f"world size = {micro_batch} x {world_size} = {per_step}; choose a global batch that is "
            f"a multiple of {per_step}")
    return global_batch // per_step


def to_dict(cfg: RunConfig) -> dict[str, Any]:
    """The config as plain data (YAML/JSON-ready)."""
    return dataclasses.asdict(cfg)


def dump_config(cfg: RunConfig, path: str | os.PathLike) -> None:
    """Write the resolved config atomically (temporary name, fsync, rename)."""
    from podtrain.fsutil import atomic_write_text

    atomic_write_text(Path(path), yaml.safe_dump(to_dict(cfg), sort_keys=False))
