"""What the hardware can do: peak FLOP/s for MFU, a matmul timer, and memory (peak and total).

MFU (model FLOPs utilisation) = achieved training FLOP/s per device / peak FLOP/s per device, with
FLOPs per token from ``podtrain.model.model_size`` (6 x matmul params + 12 x layers x heads x
head_dim x seq_len). The peak comes from ``log.peak_flops`` when set; else from an exact table of
GPU models by precision (dense, no sparsity); on CPU it is measured once at start-up with an fp32 matmul on the rank's own
threads. When none applies, MFU is null rather than a guess.
"""

from __future__ import annotations

import os
import re
import resource
import time

import torch

from podtrain.distributed.group import accelerator_memory_bytes, accelerator_name, peak_allocated_bytes

# Dense (no sparsity) peak FLOP/s per device by (GPU model, precision), from NVIDIA's datasheets;
# fp32 means plain FP32 (no TF32). Keys are exact models: "L4" and "L40S" differ 3x, and an H100
# PCIe (114 SMs, 350 W) or NVL (400 W) is slower than the SXM part.
_DATASHEET = (  # (model, bf16 = fp16 dense tensor-core FLOP/s, fp32 FLOP/s)
    ("B200", 2.25e15, 80e12),
    ("H200", 989e12, 67e12), ("H200 NVL", 835e12, 60e12),
    ("H100 SXM", 989e12, 67e12), ("H100 NVL", 835e12, 60e12), ("H100 PCIe", 756e12, 51e12),
    ("A100 80GB", 312e12, 19.5e12), ("A100 40GB", 312e12, 19.5e12),
    ("L40S", 362e12, 91.6e12), ("L4", 121e12, 30.3e12), ("A10G", 70e12, 31.2e12),
)
PEAK_FLOPS: dict[tuple[str, str], float] = {
    (model, precision): fp32 if precision == "fp32" else half
    for model, half, fp32 in _DATASHEET for precision in ("bf16", "fp16", "fp32")
}

def gpu_model(device_name: str) -> str | None:
    """The exact ``PEAK_FLOPS`` model of a device name as CUDA reports it, or None when unknown.

    Names are split into words, never searched for fragments: "NVIDIA L40" is not an "L4", and
    "NVIDIA H100 PCIe" / "NVIDIA H100 NVL" are told apart from the SXM part ("NVIDIA H100 80GB
    HBM3"). A100s are told apart by their memory ("NVIDIA A100-SXM4-40GB", "A100 80GB PCIe").
    """
    words = [w for w in re.split(r"[\s\-_]+", device_name.upper()) if w and w not in ("NVIDIA", "TESLA")]
    if not words:
        return None
    base, rest = words[0], set(words[1:])
    if base == "H100":
        return "H100 PCIe" if "PCIE" in rest else "H100 NVL" if "NVL" in rest else "H100 SXM"
    if base == "H200":
        return "H200 NVL" if "NVL" in rest else "H200"
    if base == "A100":
        return "A100 80GB" if "80GB" in rest else "A100 40GB"
    return base if base in ("B200", "L40S", "L4", "A10G") else None


def gpu_peak_flops(device_name: str, precision: str) -> float | None:
    """Dense peak FLOP/s of a device (e.g. "NVIDIA H100 80GB HBM3") at ``precision``, or None."""
    model = gpu_model(device_name)
    return PEAK_FLOPS.get((model, precision)) if model else None


def best_matmul_seconds(device: torch.device, size: int, dtype: torch.dtype, budget_s: float = 0.3,
                        trial_s: float = 0.001) -> float:
    """Seconds of one ``size`` x ``size`` matmul on ``device``: the best of many ~1 ms trials.

    A trial shorter than a scheduler time slice usually runs uninterrupted, so the best one
    measures the device rather than the other processes sharing its cores; a device that is slow
    all the time is slow in every trial. The operands come from a private generator: the global
    RNG belongs to training and its checkpointed state.
    """
    gen = torch.Generator().manual_seed(0)
    a = torch.randn(size, size, generator=gen).to(device=device, dtype=dtype)
    b = torch.randn(size, size, generator=gen).to(device=device, dtype=dtype)
    sync = (lambda: None) if device.type == "cpu" else (lambda: torch.accelerator.synchronize(device))
    a @ b  # warm-up: allocations, kernels
    sync()
    start = time.perf_counter()
    a @ b
    sync()
    reps = max(1, int(trial_s / max(1e-7, time.perf_counter() - start)))
    best, trials, deadline = float("inf"), 0, time.perf_counter() + budget_s
    while trials < 20 or time.perf_counter() < deadline:
        start = time.perf_counter()
        for _ in range(reps):
            a @ b
        sync()
        best = min(best, (time.perf_counter() - start) / reps)
        trials += 1
    return best


CPU_PEAK_SIZE = 384
"""The square fp32 matmul that measures a CPU's peak: ~1 ms on one core (~100 GFLOP/s), so a trial
fits in a scheduler time slice (a 768 matmul took ~18 ms: its 20 trials cost every rank 0.25-0.4 s of
CPU at start, and a loaded machine interrupted most of them), and its operands fit the caches, so it
runs at least as fast as a training's own matmuls."""

CPU_PEAK_BUDGET_S = 0.1
"""Seconds of trials for the CPU peak: ~100 trials of ``CPU_PEAK_SIZE`` (at least 20); every rank pays
it at start-up."""


def measure_cpu_matmul_flops(size: int = CPU_PEAK_SIZE, budget_s: float = CPU_PEAK_BUDGET_S) -> float:
    """fp32 matmul FLOP/s of this process with its current thread count (the CPU 'peak'): the best
    of the ~1 ms trials ``best_matmul_seconds`` makes within ``budget_s``."""
    return 2.0 * size**3 / best_matmul_seconds(torch.device("cpu"), size, torch.float32, budget_s)


def peak_flops(device: torch.device, precision: str, override: float | None) -> float | None:
    """Peak FLOP/s of one device for MFU: the override, the GPU table, or a CPU measurement."""
    if override:
        return float(override)
    name = accelerator_name(device)
    if name is not None:
        return gpu_peak_flops(name, precision)
    if device.type == "cpu" and precision == "fp32":
        return measure_cpu_matmul_flops()
    return None


def max_memory_bytes(device: torch.device) -> int:
    """Peak memory of this rank: allocator peak on GPU, peak resident set size on CPU."""
    allocated = peak_allocated_bytes(device)
    if allocated is not None:
        return allocated
    rss_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # Linux reports KiB
    return int(rss_kib) * 1024


def device_memory_bytes(device: torch.device, local_world_size: int) -> int | None:
    """Memory one rank may use: its GPU's, or this host's RAM shared by the local ranks."""
    total = accelerator_memory_bytes(device)
    if total is not None:
        return total
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        return None
    return total // max(1, local_world_size)
