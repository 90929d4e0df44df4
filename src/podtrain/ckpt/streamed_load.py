"""Resuming tensor by tensor: every weight and optimizer tensor read from the file into its final home.

Reading a whole checkpoint into memory first costs every rank a full second copy of the state at
once (~20 GB per rank for llama-1b, ~160 GB per 8-GPU node). Here the files' headers are indexed
(``SafetensorsIndex``), then each tensor's bytes go straight into the model's parameter, or into
an optimizer state tensor allocated where torch's ``Optimizer.load_state_dict`` would put it (on
the parameter's device, in its dtype, so that its own ``.to()`` is a no-op). CPU destinations are
read into directly; GPU destinations through the rank's ``StagingPool`` (pinned slabs, async
copies), so host memory beyond the page cache stays within ``ckpt.host_staging_mb``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import torch
from torch import nn

from podtrain.ckpt import layout
from podtrain.ckpt.host_buffers import StagingPool
from podtrain.ckpt.reader import check_fit
from podtrain.ckpt.state import from_plain
from podtrain.ckpt.tensorio import SafetensorsIndex
from podtrain.errors import UserError


@dataclass(frozen=True)
class _Ref:
    """A tensor of the checkpoint, not read yet."""

    name: str


class StoredTensors(Mapping):
    """Name -> where the checkpoint stores that tensor (``(SafetensorsIndex, name in the file)``)."""

    def __init__(self) -> None:
        """Empty; ``add`` files to it."""
        self._where: dict[str, tuple[SafetensorsIndex, str]] = {}

    def add(self, index: SafetensorsIndex, prefix: str = "", path: Path | None = None) -> None:
        """Index the tensors of ``index`` whose names start with ``prefix`` (which is dropped)."""
        for stored in index.tensors:
            if not stored.startswith(prefix):
                continue
            name = stored[len(prefix):]
            if name in self._where:
                raise UserError(f"checkpoint {path}: tensor {stored!r} is stored in more than one shard "
                                "(a sharded checkpoint this resume path cannot assemble)")
            self._where[name] = (index, stored)

    def shape(self, name: str) -> tuple[int, ...]:
        """The stored shape of ``name``."""
        index, stored = self._where[name]
        return index.tensors[stored].spec.shape

    def load(self, name: str, pool: StagingPool, device: torch.device | str = "cpu",
             dtype: torch.dtype | None = None) -> torch.Tensor:
        """A new tensor on ``device`` (in ``dtype``, default the stored one) holding ``name``."""
        index, stored = self._where[name]
        spec = index.tensors[stored].spec
        out = torch.empty(spec.shape, dtype=dtype or spec.dtype, device=device)
        index.read_into(stored, out, pool)
        return out

    def read_into(self, name: str, dst: torch.Tensor, pool: StagingPool) -> None:
        """Fill ``dst`` with ``name``'s values."""
        index, stored = self._where[name]
        index.read_into(stored, dst, pool)

    def __getitem__(self, name: str) -> _Ref:
        if name not in self._where:
            raise KeyError(name)
        return _Ref(name)

    def __iter__(self) -> Iterator[str]:
        return iter(self._where)

    def __len__(self) -> int:
        return len(self._where)


def index_checkpoint(path: Path, manifest: dict) -> tuple[StoredTensors, StoredTensors]:
    """``(weights, state tensors)`` of a validated checkpoint directory, from the headers alone."""
    weights, state = StoredTensors(), StoredTensors()
    if manifest.get("layout") == "dcp":
        for rel in manifest["files"]:
            if rel.startswith(f"{layout.DCP_SUBDIR}/"):
                shard = SafetensorsIndex(path / rel)
                weights.add(shard, "model/", path)
                state.add(shard, "state/", path)
    else:
        weights.add(SafetensorsIndex(path / layout.MODEL_FILE), path=path)
    state.add(SafetensorsIndex(path / layout.STATE_FILE), path=path)
    return weights, state


def load_into(path: Path, manifest: dict, net: nn.Module, optimizer: torch.optim.Optimizer,
              pool: StagingPool) -> dict[str, Any]:
    """Load a checkpoint's weights into ``net`` and its optimizer state into ``optimizer``.

    Returns the rest of the decoded state.json (``train_state``, ``scaler``, ``rng``; their few
    small tensors on the CPU). A checkpoint of another architecture or optimizer is a one-line
    ``UserError``, raised before any tensor is read.
    """
    raw = json.loads((path / layout.STATE_JSON).read_text())
    weights, state = index_checkpoint(path, manifest)
    aliases: dict[str, str] = raw.get("aliases", {})
    _load_weights(net, weights, aliases, path, pool)
    _load_optimizer(optimizer, from_plain(raw["optimizer"], state), state, path, pool)
    rest = {k: from_plain(v, state) for k, v in raw.items() if k not in ("aliases", "optimizer")}
    return _materialize(rest, state, pool)


def _load_weights(net: nn.Module, weights: StoredTensors, aliases: dict[str, str], path: Path,
                  pool: StagingPool) -> None:
    own = net.state_dict()
    stored = {name: weights.shape(name) for name in weights}
    stored.update({name: stored[target] for name, target in aliases.items() if target in stored})
    check_fit(own, stored, path)
    with torch.no_grad():
        for name, dst in own.items():
            source = aliases.get(name, name)
            if source != name and dst.untyped_storage().data_ptr() == own[source].untyped_storage().data_ptr():
                continue  # tied to ``source`` in this model too: filled with it
            weights.read_into(source, dst, pool)


def _load_optimizer(optimizer: torch.optim.Optimizer, saved: dict, state: StoredTensors, path: Path,
                    pool: StagingPool) -> None:
    """Read the optimizer's tensors where ``load_state_dict`` keeps them, then load the state."""
    groups, saved_groups = optimizer.param_groups, saved.get("param_groups", [])
    if len(groups) != len(saved_groups) or any(len(g["params"]) != len(s["params"])
                                               for g, s in zip(groups, saved_groups)):
        raise UserError(f"checkpoint {path}: optimizer state does not fit this optimizer "
                        f"(parameter groups of sizes {[len(s['params']) for s in saved_groups]}, "
                        f"this optimizer has {[len(g['params']) for g in groups]})")
    owner = {saved_id: (param, group) for group, saved_group in zip(groups, saved_groups)
             for saved_id, param in zip(saved_group["params"], group["params"])}
    for saved_id, values in saved.get("state", {}).items():
        if saved_id not in owner:
            continue
        param, group = owner[saved_id]
        on_device = group.get("fused") or group.get("capturable")
        for key, value in values.items():
            if not isinstance(value, _Ref):
                continue
            if key == "step":  # torch keeps the step where it was unless fused or capturable
                values[key] = (state.load(value.name, pool, param.device, torch.float32) if on_device
                               else state.load(value.name, pool))
            elif param.is_floating_point():
                values[key] = state.load(value.name, pool, param.device, param.dtype)
            else:
                values[key] = state.load(value.name, pool, param.device)
    try:
        optimizer.load_state_dict(_materialize(saved, state, pool))
    except (ValueError, KeyError, RuntimeError) as exc:
        raise UserError(f"checkpoint {path}: optimizer state does not fit this optimizer ({exc})") from None


def _materialize(obj: Any, state: StoredTensors, pool: StagingPool) -> Any:
    """``obj`` with every remaining ``_Ref`` read into a CPU tensor (small: scaler, RNG, steps)."""
    if isinstance(obj, _Ref):
        return state.load(obj.name, pool)
    if isinstance(obj, dict):
        return {k: _materialize(v, state, pool) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_materialize(v, state, pool) for v in obj]
    if isinstance(obj, tuple):
        return tuple(_materialize(v, state, pool) for v in obj)
    return obj
