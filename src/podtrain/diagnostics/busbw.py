"""The arithmetic of ``podtrain bench collectives``: sizes, bandwidths, groups, the check pattern.

Pure functions (no processes, no collectives), so they are tested directly. Bandwidths follow the
nccl-tests conventions (https://github.com/NVIDIA/nccl-tests/blob/master/doc/PERFORMANCE.md):
``algbw = bytes / time_s``, ``busbw = algbw x bus_factor(op, n)``, in GB/s of 1e9 bytes.
"""

from __future__ import annotations

import re

import torch

from podtrain.errors import UserError

OPS = ("all_reduce", "broadcast", "all_gather", "reduce_scatter", "all_to_all")

# The check pattern: rank r holds (3r + i) mod 11 at index i. Small integers stay exact in every
# dtype for sums over up to 23 ranks (bf16's 8-bit mantissa), and the rank-dependent offset makes a
# chunk from the wrong rank visible.
PATTERN_MOD = 11

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(i?B)?\s*$", re.IGNORECASE)


def parse_size(text: str) -> int:
    """``1K``, ``64M``, ``1G``, ``512`` or ``4KiB`` as bytes (binary multiples: 1K = 1024)."""
    match = _SIZE.match(str(text))
    if not match:
        raise UserError(f"size {text!r} is not a number of bytes such as 1K, 64M or 1G")
    scale = 1024 ** " KMGT".index((match[2] or " ").upper())
    return int(float(match[1]) * scale)


def format_size(nbytes: int) -> str:
    """Bytes in the largest binary unit that keeps an integer when possible (``64M``)."""
    for unit, scale in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if nbytes >= scale:
            value = nbytes / scale
            return f"{value:.0f}{unit}" if value == int(value) else f"{value:.1f}{unit}"
    return f"{nbytes}B"


def message_sizes(min_bytes: int, max_bytes: int, factor: float) -> list[int]:
    """Sizes from ``min_bytes`` to ``max_bytes`` (inclusive), each ``factor`` times the last."""
    if min_bytes < 1 or max_bytes < min_bytes:
        raise UserError(f"--min-bytes {min_bytes} and --max-bytes {max_bytes}: "
                        "need 1 <= min <= max")
    if factor <= 1 and max_bytes > min_bytes:
        raise UserError(f"--factor {factor} must be greater than 1")
    sizes, size = [], float(min_bytes)
    while size <= max_bytes * (1 + 1e-9):
        sizes.append(int(round(size)))
        if factor <= 1:
            break
        size *= factor
    return sizes


def bus_factor(op: str, n: int) -> float:
    """nccl-tests' busbw/algbw ratio for ``op`` on ``n`` ranks."""
    if op == "all_reduce":
        return 2.0 * (n - 1) / n
    if op in ("all_gather", "reduce_scatter", "all_to_all"):
        return (n - 1) / n
    if op == "broadcast":
        return 1.0
    raise UserError(f"unknown op {op!r}; choose from {', '.join(OPS)}")


def algbw_gbps(nbytes: int, time_s: float) -> float:
    """Algorithm bandwidth in GB/s (1e9 bytes per second)."""
    return nbytes / time_s / 1e9 if time_s > 0 else 0.0


def busbw_gbps(op: str, nbytes: int, time_s: float, n: int) -> float:
    """Bus bandwidth in GB/s: algbw times ``bus_factor(op, n)``."""
    return algbw_gbps(nbytes, time_s) * bus_factor(op, n)


def element_counts(op: str, nbytes: int, elem_size: int, n: int) -> tuple[int, int]:
    """``(total, per_rank)`` element counts for a message of about ``nbytes``.

    ``total`` is what the reported bytes count (see the module docstring); for the ops that split
    the message into ``n`` chunks it is rounded down to a multiple of ``n`` (at least ``n``).
    """
    total = max(1, nbytes // elem_size)
    if op in ("all_gather", "reduce_scatter", "all_to_all"):
        per_rank = max(1, total // n)
        return per_rank * n, per_rank
    return total, total


def buffer_bytes(op: str, nbytes: int, n: int) -> int:
    """Device memory one rank holds for one case of ``op`` (input + output), in bytes."""
    if op in ("all_reduce", "broadcast"):
        return nbytes
    return nbytes + (nbytes // n if op in ("all_gather", "reduce_scatter") else nbytes)


def split_groups(node_of_rank: list[int]) -> dict[str, list[list[int]]]:
    """Intra-node groups (the ranks of each node) and inter-node groups (one rank per node, the
    ranks with the same index within their node), from each rank's node id."""
    nodes: dict[int, list[int]] = {}
    for rank, node in enumerate(node_of_rank):
        nodes.setdefault(node, []).append(rank)
    members = list(nodes.values())
    if len({len(m) for m in members}) > 1:
        sizes = {node: len(m) for node, m in nodes.items()}
        raise UserError(f"--groups needs the same number of ranks on every node; got {sizes}")
    per_node = len(members[0])
    # Sorted, because a group's rank order is its members' sorted global ranks.
    inter = [sorted(m[i] for m in members) for i in range(per_node)]
    return {"intra": members, "inter": inter}


def pattern(rank: int | torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """The value rank ``rank`` holds at index ``idx`` before the collective."""
    return (3 * rank + idx) % PATTERN_MOD


def sum_table(n: int) -> torch.Tensor:
    """``T[k] = sum over ranks r < n of (3r + k) mod 11``: the all-reduced pattern at index k.

    The terms repeat every 11 ranks, so whole periods are counted, not summed rank by rank.
    """
    k = torch.arange(PATTERN_MOD, dtype=torch.int64)
    full, rest = divmod(n, PATTERN_MOD)
    table = torch.zeros(PATTERN_MOD, dtype=torch.int64)
    for r in range(PATTERN_MOD if full else 0):
        table += full * ((3 * r + k) % PATTERN_MOD)
    for r in range(rest):
        table += (3 * r + k) % PATTERN_MOD
    return table


def tolerance(op: str, dtype: torch.dtype, n: int) -> float:
    """Largest acceptable error of a checked element.

    Data movement must be exact. A sum of n pattern values (each <= 10) is exact too while it
    stays below the dtype's largest exact integer (256 for bf16, 2048 for fp16); beyond that,
    allow each of the n additions to round.
    """
    if op not in ("all_reduce", "reduce_scatter") or not dtype.is_floating_point:
        return 0.0
    eps = torch.finfo(dtype).eps
    largest_sum = (PATTERN_MOD - 1) * n
    return 0.0 if largest_sum <= 2 / eps else eps * largest_sum * n

