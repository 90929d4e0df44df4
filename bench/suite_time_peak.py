"""CPU seconds every CPU rank spends at start-up measuring its matmul peak (for MFU): the measurement
podtrain made before 2026-12-03 (a 768 x 768 fp32 matmul, a 0.3 s budget, at least 20 trials of
~18 ms) against ``observe.hardware.measure_cpu_matmul_flops`` now (``CPU_PEAK_SIZE``,
``CPU_PEAK_BUDGET_S``), side by side in one process, paired by round (the order alternates), on one
thread as a rank of a 2-rank job on 2 cores runs.

    OMP_NUM_THREADS=1 python bench/suite_time_peak.py [--rounds 6]

Prints each round's CPU seconds and peak (GFLOP/s), then the median of the per-round ratios.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from podtrain.observe.hardware import best_matmul_seconds, measure_cpu_matmul_flops

OLD_SIZE, OLD_BUDGET_S = 768, 0.3


def old_measurement() -> float:
    """The measurement as it was: 2 x 768^3 FLOPs over the best trial of a 0.3 s budget."""
    return 2.0 * OLD_SIZE**3 / best_matmul_seconds(torch.device("cpu"), OLD_SIZE, torch.float32, OLD_BUDGET_S)


def cpu_seconds(fn) -> tuple[float, float]:
    """(this process's CPU seconds for ``fn()``, its result)."""
    start = time.process_time()
    result = fn()
    return time.process_time() - start, result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=6)
    args = parser.parse_args()
    torch.set_num_threads(1)
    ratios = []
    for i in range(args.rounds):
        if i % 2 == 0:
            old_s, old_peak = cpu_seconds(old_measurement)
            new_s, new_peak = cpu_seconds(measure_cpu_matmul_flops)
        else:
            new_s, new_peak = cpu_seconds(measure_cpu_matmul_flops)
            old_s, old_peak = cpu_seconds(old_measurement)
        ratios.append(new_s / old_s)
        print(f"round {i}: before {old_s:.3f} s CPU ({old_peak / 1e9:.1f} GFLOP/s), after {new_s:.3f} s CPU "
              f"({new_peak / 1e9:.1f} GFLOP/s), after/before {new_s / old_s:.2f}", flush=True)
    print(f"median after/before CPU per rank start: {statistics.median(ratios):.2f}")


if __name__ == "__main__":
    main()
