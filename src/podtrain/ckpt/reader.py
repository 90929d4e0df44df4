"""Reading checkpoints whole, without a process group: ``sample``, ``export``, tests.

(A resume loads tensor by tensor instead: ``podtrain.ckpt.streamed_load``.)

``read_checkpoint`` turns a validated checkpoint directory into a ``CheckpointData`` (weights,
decoded state, model config); ``load_latest`` finds a run's newest valid checkpoint first (a
directory holding a pickle file is refused with a ``UserError`` before any of it is read).
``build_model_from_checkpoint`` gives the transformers model it holds, ready to generate.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from podtrain.ckpt import layout
from podtrain.ckpt.state import from_plain
from podtrain.ckpt.tensorio import read_dcp_folder, read_safetensors
from podtrain.errors import UserError


@dataclass
class CheckpointData:
    """A checkpoint read into memory."""

    path: Path
    step: int
    model_state: dict[str, torch.Tensor]
    """Weights by unwrapped name, tied names included."""
    state: dict[str, Any]
    """Decoded state.json: optimizer, scaler, rng (per rank), train_state, aliases."""
    model_config: dict[str, Any] | None
    """The transformers model config (config.json), when the model had one."""


def read_checkpoint(path: Path, manifest: dict) -> CheckpointData:
    """Read a validated checkpoint directory (files named by ``manifest``); no process group."""
    state_raw = json.loads((path / layout.STATE_JSON).read_text())
    if manifest.get("layout") in ("dcp", layout.SHARDED):
        merged: dict[str, torch.Tensor] = {}
        if manifest["layout"] == layout.SHARDED:  # FSDP/HSDP: every rank's pieces, put together
            merged = read_dcp_folder(path / layout.DCP_SUBDIR)
        else:
            for rel in manifest["files"]:
                if rel.startswith(f"{layout.DCP_SUBDIR}/"):
                    merged.update(read_safetensors(path / rel))  # DDP: every tensor whole in one shard
        weights = {k[len("model/"):]: v for k, v in merged.items() if k.startswith("model/")}
        tensors = {k[len("state/"):]: v for k, v in merged.items() if k.startswith("state/")}
        tensors.update(read_safetensors(path / layout.STATE_FILE))
    else:
        weights = read_safetensors(path / layout.MODEL_FILE)
        tensors = read_safetensors(path / layout.STATE_FILE)
    for name, target in state_raw.get("aliases", {}).items():
        weights[name] = weights[target]
    state = {k: from_plain(v, tensors) for k, v in state_raw.items() if k not in ("aliases",)}
    config = None
    if layout.CONFIG_JSON in manifest["files"]:
        config = json.loads((path / layout.CONFIG_JSON).read_text())
    return CheckpointData(path=path, step=int(manifest["step"]), model_state=weights, state=state,
                          model_config=config)


def peek_train_state(path: Path) -> dict[str, Any]:
    """The loop's train state of a validated checkpoint (config, tokenizer, step...), from
    state.json alone: no tensor is read (the train state holds none)."""
    raw = json.loads((path / layout.STATE_JSON).read_text()).get("train_state") or {}
    try:
        return from_plain(raw, {})
    except KeyError:  # a train state with tensors: not podtrain's loop's, nothing to compare
        return {}


def load_weights(net: nn.Module, weights: dict[str, torch.Tensor], path: Path) -> None:
    """Copy ``weights`` into ``net``; a different architecture is a one-line user error."""
    check_fit(net.state_dict(), {k: tuple(v.shape) for k, v in weights.items()}, path)
    net.load_state_dict(weights, strict=True)


def check_fit(own: dict[str, torch.Tensor], stored: dict[str, tuple[int, ...]], path: Path) -> None:
    """Raise a one-line ``UserError`` unless ``stored`` (name -> shape) has ``own``'s names and shapes."""
    missing = sorted(set(own) - set(stored))
    unexpected = sorted(set(stored) - set(own))
    shapes = [k for k in own if k in stored and tuple(own[k].shape) != tuple(stored[k])]
    if missing or unexpected or shapes:
        parts = []
        for label, names in (("missing", missing), ("unexpected", unexpected), ("shape differs", shapes)):
            if names:
                parts.append(f"{label}: {', '.join(names[:3])}{' ...' if len(names) > 3 else ''}")
        raise UserError(f"checkpoint {path} does not fit this model ({'; '.join(parts)}): "
                        "was it saved with another model.preset or vocabulary?")


def load_latest(run_dir: str | os.PathLike) -> CheckpointData:
    """The newest valid checkpoint of a run, read into memory (no process group needed)."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise UserError(f"run directory {run_dir} does not exist")
    choice = layout.find_latest_valid(run_dir / layout.CKPT_SUBDIR)
    if choice.path is None:
        raise UserError(f"run directory {run_dir} has no complete checkpoint under "
                        f"{run_dir / layout.CKPT_SUBDIR} (train first, or check run.dir)")
    return read_checkpoint(choice.path, choice.manifest)


def load_step(run_dir: str | os.PathLike, step: int) -> CheckpointData:
    """A run's checkpoint of ``step``, read into memory; a UserError naming the steps there when
    it is absent or not valid."""
    root = Path(run_dir) / layout.CKPT_SUBDIR
    path = root / layout.step_name(step)
    verdict = layout.verify(path) if path.is_dir() else None
    if verdict is None or not verdict.ok:
        steps = [s for s, _ in layout.list_checkpoints(root)] if root.is_dir() else []
        why = verdict.reason if verdict is not None else "no such checkpoint"
        raise UserError(f"{path}: {why} (checkpoints of {run_dir}: {', '.join(map(str, steps)) or 'none'})")
    return read_checkpoint(path, verdict.manifest)


def run_config_of(run_dir: str | os.PathLike, ckpt: CheckpointData) -> dict[str, Any]:
    """The run's resolved config: the checkpoint's own copy, else ``RUN_DIR/config.yaml``."""
    config = ckpt.state.get("train_state", {}).get("config")
    if isinstance(config, dict):
        return config
    path = Path(run_dir) / "config.yaml"
    if not path.is_file():
        raise UserError(f"{path} is missing and checkpoint {ckpt.path} carries no config")
    import yaml

    return yaml.safe_load(path.read_text()) or {}


def load_latest_weights(run_dir: str | os.PathLike) -> tuple[dict, dict[str, torch.Tensor], int]:
    """``(resolved run config dict, weights by unwrapped name, step)`` of a run's newest checkpoint."""
    ckpt = load_latest(run_dir)
    return run_config_of(run_dir, ckpt), ckpt.model_state, ckpt.step


def build_model_from_checkpoint(ckpt: CheckpointData, run_config: dict[str, Any]) -> nn.Module:
    """The transformers model a checkpoint holds, weights loaded, in eval mode, on the CPU."""
    from transformers import AutoModelForCausalLM

    config = model_config_of(ckpt, run_config)
    net = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    load_weights(net, ckpt.model_state, ckpt.path)
    return net.eval()


def model_config_of(ckpt: CheckpointData, run_config: dict[str, Any]) -> Any:
    """The transformers config: the checkpoint's config.json, else rebuilt from the preset."""
    if ckpt.model_config is not None:
        from transformers import CONFIG_MAPPING

        raw = dict(ckpt.model_config)
        return CONFIG_MAPPING[raw["model_type"]].from_dict(raw)
    from podtrain.model import preset_config

    embed = next((v for k, v in ckpt.model_state.items() if k.endswith("embed_tokens.weight")
                  or k.endswith("wte.weight")), None)
    vocab = int(embed.shape[0]) if embed is not None else None
    return preset_config(run_config.get("model", {}).get("preset", "tiny"), vocab)


def check_tokenizer(ckpt: CheckpointData, identity: dict[str, Any], where: str | os.PathLike) -> None:
    """A UserError when the tokenizer of the data at ``where`` (its manifest's ``identity``) is not
    the one the checkpoint was trained with: the SHA-256 the checkpoint recorded (checkpoints
    from before it was recorded: the vocabulary must at least fit the model)."""
    recorded = (ckpt.state.get("train_state") or {}).get("tokenizer_sha256")
    if recorded and identity.get("sha256") and recorded != identity["sha256"]:
        raise UserError(f"tokenizer mismatch: {ckpt.path} was trained with tokenizer sha256 "
                        f"{recorded[:12]}, but {where} holds {identity.get('name')!r} (sha256 "
                        f"{identity['sha256'][:12]}); pass the run's own data directory")
    vocab = (ckpt.model_config or {}).get("vocab_size")
    if vocab and int(identity.get("vocab_size", 0)) > int(vocab):
        raise UserError(f"tokenizer mismatch: {where} holds {identity.get('name')!r} with "
                        f"{identity['vocab_size']} tokens, but {ckpt.path} has a vocabulary of {vocab}")
