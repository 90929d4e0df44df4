"""The GPU defaults a torchtitan user expects, each decided by a pure function (tested on the CPU).

* TF32 matmuls under ``train.precision=fp32`` on Ampere or newer (compute capability 8+):
  ``torch.set_float32_matmul_precision("high")``, as torchtitan does; bf16/fp16 runs are not
  affected (autocast already picks the dtype). NVIDIA's own ``NVIDIA_TF32_OVERRIDE=0`` turns
  it off, and is respected here so the start-up line says so.
* ``expandable_segments:True`` in the CUDA caching allocator (fewer fragmentation OOMs when
  activations change size), added to the allocator variable before CUDA starts unless the user's
  own ``PYTORCH_ALLOC_CONF``/``PYTORCH_CUDA_ALLOC_CONF`` already says something about it (or
  picks the cudaMallocAsync backend, which has no such option).
* ``train.compile`` compiles each decoder block (``compile_blocks``), before DDP or FSDP's
  ``fully_shard`` wrap it: the blocks are the repeated, compute-heavy part; one graph per block
  type compiles once, and the wrappers' hooks and collectives stay outside the graphs.

The decisions go to the start-up log line (``describe``).
"""

from __future__ import annotations

import os
from typing import Mapping, MutableMapping

import torch
from torch import nn

from podtrain.distributed.group import accelerator_available, accelerator_capability
from podtrain.model import decoder_layers

# torch reads PYTORCH_CUDA_ALLOC_CONF first and PYTORCH_ALLOC_CONF (the newer, device-generic
# name) when it is unset.
ALLOC_VARS = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")
EXPANDABLE = "expandable_segments:True"


def allocator_update(environ: Mapping[str, str]) -> dict[str, str]:
    """The environment change that turns on expandable segments: ``{}`` when the user's own
    allocator setting mentions them or another backend; else the variable in use (or
    PYTORCH_CUDA_ALLOC_CONF) with ``expandable_segments:True`` appended."""
    name = next((v for v in ALLOC_VARS if environ.get(v)), ALLOC_VARS[0])
    current = environ.get(name, "")
    if "expandable_segments" in current or "cudaMallocAsync" in current:
        return {}
    return {name: f"{current},{EXPANDABLE}" if current else EXPANDABLE}


def set_allocator_default(environ: MutableMapping[str, str] | None = None, gpu: bool | None = None) -> None:
    """Apply ``allocator_update`` where there is a GPU (``gpu``: default, whether one is visible),
    before CUDA initialises: torch reads the variable once, at its first allocation on the device."""
    if gpu if gpu is not None else accelerator_available():
        environ = os.environ if environ is None else environ
        environ.update(allocator_update(environ))


def allocator_phrase(environ: Mapping[str, str]) -> str:
    """The allocator setting in force, for the start-up line."""
    name = next((v for v in ALLOC_VARS if environ.get(v)), None)
    return f"allocator {environ[name]}" if name else "allocator defaults"


def tf32_wanted(precision: str, capability: tuple[int, int] | None, environ: Mapping[str, str]) -> bool:
    """TF32 matmuls: fp32 runs on a GPU of compute capability 8 (Ampere) or newer, unless
    NVIDIA_TF32_OVERRIDE=0 forbids it. ``capability``: None on the CPU."""
    return (precision == "fp32" and capability is not None and capability[0] >= 8
            and environ.get("NVIDIA_TF32_OVERRIDE") != "0")


def apply_gpu_defaults(precision: str, device: torch.device,
                       environ: Mapping[str, str] | None = None) -> str:
    """Set what ``tf32_wanted`` decides; returns the phrase for the start-up line ("" on the CPU,
    where none of these applies)."""
    environ = os.environ if environ is None else environ
    capability = accelerator_capability(device)
    if capability is None:
        return ""
    tf32 = tf32_wanted(precision, capability, environ)
    if tf32:
        torch.set_float32_matmul_precision("high")
    matmul = ("tf32 matmuls" if tf32 else "fp32 matmuls (NVIDIA_TF32_OVERRIDE=0)" if precision == "fp32"
              and capability[0] >= 8 else "")
    return ", ".join(filter(None, [matmul, allocator_phrase(environ)]))


def compile_blocks(model: nn.Module) -> int:
    """``torch.compile`` each decoder block in place (``nn.Module.compile``: parameter names, and
    so checkpoints, stay those of the eager model); returns how many. Call it before the
    strategy wraps the model, after anything that runs a forward to inspect it."""
    layers = decoder_layers(model)
    for layer in layers:
        layer.compile()
    return len(layers)
