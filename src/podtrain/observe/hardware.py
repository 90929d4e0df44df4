"""What the hardware can do: peak FLOP/s for MFU, a matmul timer, and memory (peak and total).

MFU (model FLOPs utilisation) = achieved training FLOP/s per device / peak FLOP/s per device, with
FLOPs per token from ``podtrain.model.model_size`` (6 x matmul params + 12 x layers x hidden x
seq_len). The peak comes from ``log.peak_flops`` when set; else from a dtype-aware table of GPUs
(dense, no sparsity); on CPU it is measured once at start-up with an fp32 matmul on the rank's own
threads. When none applies, MFU is null rather than a guess.
"""

from __future__ import annotations

import os
import resource
import time

import torch

from podtrain.distributed.group import accelerator_memory_bytes, accelerator_name, peak_allocated_bytes

# Dense peak FLOP/s per device by (name fragment, precision). fp32 means plain FP32 (no TF32).
PEAK_FLOPS: dict[tuple[str, str], float] = {
    ("B200", "bf16"): 2.25e15, ("B200", "fp16"): 2.25e15, ("B200", "fp32"): 80e12,
    ("H200", "bf16"): 989e12, ("H200", "fp16"): 989e12, ("H200", "fp32"): 67e12,
    ("H100", "bf16"): 989e12, ("H100", "fp16"): 989e12, ("H100", "fp32"): 67e12,
    ("A100", "bf16"): 312e12, ("A100", "fp16"): 312e12, ("A100", "fp32"): 19.5e12,
    ("L40S", "bf16"): 362e12, ("L40S", "fp16"): 362e12, ("L40S", "fp32"): 91.6e12,
    ("L4", "bf16"): 121e12, ("L4", "fp16"): 121e12, ("L4", "fp32"): 30.3e12,
    ("A10G", "bf16"): 70e12, ("A10G", "fp16"): 70e12, ("A10G", "fp32"): 31.2e12,
}


def gpu_peak_flops(device_name: str, precision: str) -> float | None:
    """Table lookup by device name (e.g. "NVIDIA H100 80GB HBM3") and precision, or None."""
    for (fragment, prec), flops in PEAK_FLOPS.items():
        if fragment in device_name and prec == precision:
            return flops
    return None


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


def measure_cpu_matmul_flops(size: int = 768) -> float:
    """fp32 matmul FLOP/s of this process with its current thread count (the CPU 'peak')."""
    return 2.0 * size**3 / best_matmul_seconds(torch.device("cpu"), size, torch.float32)


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
