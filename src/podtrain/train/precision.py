"""Mixed precision: which autocast dtype, and whether a GradScaler is needed.

Weights, gradients and optimizer state stay fp32 (master weights); autocast runs the matmuls in
the chosen dtype. bf16 needs no loss scaling; fp16 does (GradScaler). On CPUs without bf16
matmul units (this project's CI: ~250x slower than fp32) ``auto`` means fp32.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass(frozen=True)
class Precision:
    """The resolved precision of a run.

    Attributes:
        name: fp32, bf16 or fp16.
        device_type: "cpu" or the accelerator's type, for autocast.
        autocast_enabled: False where the weights are already cast (FSDP's
            ``MixedPrecisionPolicy`` runs forward and backward in bf16 without autocast).
    """

    name: str
    device_type: str
    autocast_enabled: bool = True

    @property
    def autocast_dtype(self) -> torch.dtype | None:
        """The autocast dtype, or None for plain fp32."""
        return DTYPES.get(self.name)

    def autocast(self) -> contextlib.AbstractContextManager:
        """Context for forward passes: autocast with an explicit dtype, or nothing for fp32."""
        if self.autocast_dtype is None or not self.autocast_enabled:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device_type, dtype=self.autocast_dtype)

    def grad_scaler(self) -> torch.amp.GradScaler | None:
        """A GradScaler for fp16 only (bf16 has fp32's exponent range)."""
        return torch.amp.GradScaler(self.device_type) if self.name == "fp16" else None


def resolve_precision(requested: str, device: torch.device) -> Precision:
    """``auto`` is bf16 on accelerators and fp32 on CPU; explicit choices are kept."""
    name = requested
    if requested == "auto":
        name = "fp32" if device.type == "cpu" else "bf16"
    return Precision(name=name, device_type=device.type)
