"""Training state as plain data: JSON-able structure plus a flat map of named tensors.

An optimizer's ``state_dict()``, a GradScaler's, the RNG states and the loop's train state are
nested dicts, lists and tuples of numbers, strings and tensors. ``to_plain`` walks such a value,
moves every tensor into a ``{name: tensor}`` map (saved as safetensors) and leaves a reference
``{"__tensor__": name}`` in the structure (saved as JSON). ``from_plain`` reverses it. Tuples and
dicts with non-string keys (optimizer state is keyed by int) are tagged so they come back as they
were: ``optimizer.load_state_dict`` then sees exactly what ``state_dict`` produced. Nothing is
pickled, so loading can never run code.
"""

from __future__ import annotations

import random
from typing import Any, Callable

import numpy as np
import torch

_TENSOR, _TUPLE, _DICT, _NDARRAY = "__tensor__", "__tuple__", "__dict__", "__ndarray__"

TensorSink = Callable[[str, torch.Tensor], None]


def to_plain(obj: Any, sink: TensorSink, path: str) -> Any:
    """A JSON-able copy of ``obj``; each tensor goes to ``sink(name, tensor)`` under a path name."""
    if isinstance(obj, torch.Tensor):
        sink(path, obj)
        return {_TENSOR: path}
    if isinstance(obj, np.ndarray):
        return {_NDARRAY: obj.tolist(), "dtype": str(obj.dtype)}
    if isinstance(obj, np.generic):
        return obj.item()
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    if isinstance(obj, tuple):
        return {_TUPLE: [to_plain(v, sink, f"{path}/{i}") for i, v in enumerate(obj)]}
    if isinstance(obj, list):
        return [to_plain(v, sink, f"{path}/{i}") for i, v in enumerate(obj)]
    if isinstance(obj, dict):
        plain_keys = all(isinstance(k, str) and not k.startswith("__") for k in obj)
        if plain_keys:
            return {k: to_plain(v, sink, f"{path}/{k}") for k, v in obj.items()}
        return {_DICT: [[to_plain(k, sink, f"{path}/key{i}"), to_plain(v, sink, f"{path}/{k}")]
                        for i, (k, v) in enumerate(obj.items())]}
    raise TypeError(f"{path}: {type(obj).__name__} cannot be stored in a checkpoint "
                    "(only tensors, numbers, strings, lists, tuples and dicts)")


def from_plain(obj: Any, tensors: dict[str, torch.Tensor]) -> Any:
    """Rebuild what ``to_plain`` encoded, taking tensors from ``tensors`` by name."""
    if isinstance(obj, list):
        return [from_plain(v, tensors) for v in obj]
    if not isinstance(obj, dict):
        return obj
    if _TENSOR in obj and len(obj) == 1:
        name = obj[_TENSOR]
        if name not in tensors:
            raise KeyError(f"tensor {name!r} is referenced by the state but missing from the file")
        return tensors[name]
    if _TUPLE in obj and len(obj) == 1:
        return tuple(from_plain(v, tensors) for v in obj[_TUPLE])
    if _DICT in obj and len(obj) == 1:
        return {_hashable(from_plain(k, tensors)): from_plain(v, tensors) for k, v in obj[_DICT]}
    if _NDARRAY in obj:
        return np.asarray(obj[_NDARRAY], dtype=np.dtype(obj["dtype"]))
    return {k: from_plain(v, tensors) for k, v in obj.items()}


def _hashable(key: Any) -> Any:
    return tuple(key) if isinstance(key, list) else key


def capture_rng(device: torch.device) -> dict[str, Any]:
    """This rank's RNG states: Python, numpy (global), torch CPU and, on a GPU, its device's."""
    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
        "accelerator": None,
    }
    if device.type != "cpu" and torch.cuda.is_available():
        state["accelerator"] = torch.cuda.get_rng_state(device)
    return state


def restore_rng(state: dict[str, Any], device: torch.device) -> None:
    """Set this rank's RNG states from ``capture_rng``'s (decoded) output."""
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, np.asarray(keys, dtype=np.uint32), int(pos), int(has_gauss), float(cached)))
    torch.set_rng_state(state["torch"].to(torch.uint8))
    if state.get("accelerator") is not None and device.type != "cpu" and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["accelerator"].to(torch.uint8), device)
