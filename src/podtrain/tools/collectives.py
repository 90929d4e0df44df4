"""``podtrain bench collectives``: how fast, and how correct, the fabric's collectives are.

Launched like training (torchrun, srun, a PyTorchJob): every rank runs this module. For each op and
message size it checks one result element by element, then times ``--iters`` calls after
``--warmup`` calls, and reports with the nccl-tests conventions
(https://github.com/NVIDIA/nccl-tests/blob/master/doc/PERFORMANCE.md):

* ``bytes``: the message size; for all_gather and reduce_scatter the *total* (the gathered output,
  the scattered input), for all_to_all the bytes each rank sends in all;
* ``time_s``: seconds per call, measured on every rank and averaged across ranks;
* ``algbw = bytes / time_s``; ``busbw = algbw x factor`` with factor 2(n-1)/n for all_reduce,
  (n-1)/n for all_gather, reduce_scatter and all_to_all, and 1 for broadcast, so busbw is
  comparable to the link's bandwidth whatever the op and the number of ranks n; GB/s are 1e9.
* ``wrong``: elements that differ from the expected result, summed over ranks (must be 0).

``--groups intra,inter`` also measures within each node and across nodes (ranks with the same
local index), all groups at once, to find a slow link; each record then says which group was
slowest.

reduce_scatter runs natively on every backend of torch 2.13 (gloo included, CPU tensors); an older
torch whose gloo lacks it gets an all_reduce followed by taking this rank's slice, marked
``impl: "all_reduce+slice"`` in the record (its busbw is then not the native one).
"""

from __future__ import annotations

import argparse
import json
import logging
import re
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist

from podtrain.distributed.env import ClusterEnv, env_flag
from podtrain.errors import UserError

log = logging.getLogger(__name__)

OPS = ("all_reduce", "broadcast", "all_gather", "reduce_scatter", "all_to_all")
DTYPES = {
    "float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
    "float64": torch.float64, "int32": torch.int32, "int64": torch.int64,
}
GROUP_KINDS = ("intra", "inter")
# Test-only: corrupt one element of these ops' checked result (comma list, or "all").
CORRUPT_VAR = "PODTRAIN_TEST_CORRUPT"
# Test-only: this rank sees no free memory, so the memory check refuses the run.
LOW_MEMORY_VAR = "PODTRAIN_TEST_LOW_MEMORY_RANK"

# The check pattern: rank r holds (3r + i) mod 11 at index i. Small integers stay exact in every
# dtype for sums over up to 23 ranks (bf16's 8-bit mantissa), and the rank-dependent offset makes a
# chunk from the wrong rank visible.
_MOD = 11
_CHUNK = 1 << 24  # elements per fill/check slice, which bounds the check's extra memory


# ---------------------------------------------------------------------------------------------
# Pure arithmetic (tested without processes)
# ---------------------------------------------------------------------------------------------

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


# ---------------------------------------------------------------------------------------------
# One op on one message size
# ---------------------------------------------------------------------------------------------


@dataclass
class Case:
    """Buffers and the call for one (op, size): ``call()`` runs the collective once."""

    op: str
    call: Callable[[], Any]
    output: torch.Tensor
    expected: Callable[[torch.Tensor], torch.Tensor]  # global output index -> expected values
    nbytes: int
    impl: str = "native"
    reset: Callable[[], None] = lambda: None  # put the buffers in their timing state


def _fill(t: torch.Tensor, fn: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """``t[i] = fn(i)`` slice by slice, so no index tensor of the full size is ever built."""
    flat = t.view(-1)
    for start in range(0, flat.numel(), _CHUNK):
        stop = min(start + _CHUNK, flat.numel())
        idx = torch.arange(start, stop, device=t.device, dtype=torch.int64)
        flat[start:stop] = fn(idx).to(t.dtype)
    return t


def _pattern(rank: int | torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    return (3 * rank + idx) % _MOD


def sum_table(n: int) -> torch.Tensor:
    """``T[k] = sum over ranks r < n of (3r + k) mod 11``: the all-reduced pattern at index k.

    The terms repeat every 11 ranks, so whole periods are counted, not summed rank by rank.
    """
    k = torch.arange(_MOD, dtype=torch.int64)
    full, rest = divmod(n, _MOD)
    table = torch.zeros(_MOD, dtype=torch.int64)
    for r in range(_MOD if full else 0):
        table += full * ((3 * r + k) % _MOD)
    for r in range(rest):
        table += (3 * r + k) % _MOD
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
    largest_sum = (_MOD - 1) * n
    return 0.0 if largest_sum <= 2 / eps else eps * largest_sum * n


def count_wrong(out: torch.Tensor, expected: Callable[[torch.Tensor], torch.Tensor],
                tol: float) -> int:
    """Elements of ``out`` further than ``tol`` from ``expected(index)``, slice by slice."""
    flat = out.view(-1)
    wrong = 0
    for start in range(0, flat.numel(), _CHUNK):
        stop = min(start + _CHUNK, flat.numel())
        idx = torch.arange(start, stop, device=out.device, dtype=torch.int64)
        diff = (flat[start:stop].double() - expected(idx).double()).abs()
        wrong += int((~(diff <= tol)).sum())  # NaN counts as wrong
    return wrong


def _native(name: str, old: str) -> Callable[..., Any] | None:
    # torch 2.13 renamed the *_tensor collectives to *_single; older releases have only the old.
    return getattr(dist, name, None) or getattr(dist, old, None)


def build_case(op: str, nbytes: int, dtype: torch.dtype, device: torch.device, group: Any,
               rank: int, n: int, src: int, fallback_rs: bool = False) -> Case:
    """Allocate and fill the buffers of ``op`` for a message of about ``nbytes``.

    ``rank`` is this rank's index in ``group`` (n ranks); ``src`` the global rank broadcasting.
    """
    es = torch.empty((), dtype=dtype).element_size()
    total, per = element_counts(op, nbytes, es, n)
    mk = lambda count, fill: torch.full((count,), fill, dtype=dtype, device=device)  # noqa: E731
    if op == "all_reduce":
        buf = _fill(mk(total, 0), lambda i: _pattern(rank, i))
        table = sum_table(n).to(device)
        return Case(op, lambda: dist.all_reduce(buf, group=group), buf,
                    lambda i: table[i % _MOD], total * es,
                    # in place: zeros keep repeated sums finite (no overflow to inf in fp16)
                    reset=buf.zero_)
    if op == "broadcast":
        # Non-source ranks start at -1 so a message that never arrived is seen as wrong.
        buf = _fill(mk(total, 0), lambda i: _pattern(0, i)) if rank == 0 else mk(total, -1)
        return Case(op, lambda: dist.broadcast(buf, src=src, group=group), buf,
                    lambda i: _pattern(0, i), total * es)
    if op == "all_gather":
        inp = _fill(mk(per, 0), lambda i: _pattern(rank, i))
        out = mk(total, -1)
        gather = _native("all_gather_single", "all_gather_into_tensor")
        return Case(op, lambda: gather(out, inp, group=group), out,
                    lambda i: _pattern(i // per, i % per), total * es)
    if op == "reduce_scatter":
        inp = _fill(mk(total, 0), lambda i: _pattern(rank, i))
        out = mk(per, -1)
        table = sum_table(n).to(device)
        expected = lambda i: table[(rank * per + i) % _MOD]  # noqa: E731
        if fallback_rs:
            def call() -> None:
                tmp = inp.clone()
                dist.all_reduce(tmp, group=group)
                out.copy_(tmp[rank * per:(rank + 1) * per])
            return Case(op, call, out, expected, total * es, impl="all_reduce+slice")
        scatter = _native("reduce_scatter_single", "reduce_scatter_tensor")
        return Case(op, lambda: scatter(out, inp, group=group), out, expected, total * es)
    if op == "all_to_all":
        inp = _fill(mk(total, 0), lambda i: _pattern(rank, i))
        out = mk(total, -1)
        return Case(op, lambda: dist.all_to_all_single(out, inp, group=group), out,
                    lambda i: _pattern(i // per, rank * per + i % per), total * es)
    raise UserError(f"unknown op {op!r}; choose from {', '.join(OPS)}")


def _sync(device: torch.device) -> None:
    # Collectives on an accelerator are asynchronous: time only what has finished.
    if device.type != "cpu":
        torch.accelerator.synchronize(device)


def _corrupted(op: str) -> bool:
    flag = env_flag(CORRUPT_VAR) or ""
    names = {s.strip() for s in flag.split(",") if s.strip()}
    return op in names or "all" in names


def measure(case: Case, device: torch.device, tol: float, iters: int, warmup: int,
            group: Any) -> tuple[float, int]:
    """Check one result of ``case``, then time it: ``(seconds per call, wrong elements)``.

    Every rank of ``group`` must call this at the same point. The timed loop is the bare call
    in a Python loop, one device sync at the end: the same work a hand-written loop does.
    """
    case.call()
    _sync(device)
    if _corrupted(case.op):
        case.output.view(-1)[0] = -7  # test-only: a value no pattern produces
    wrong = count_wrong(case.output, case.expected, tol)
    case.reset()
    for _ in range(warmup):
        case.call()
    _sync(device)
    dist.barrier(group=group)
    call = case.call
    start = time.perf_counter()
    for _ in range(iters):
        call()
    _sync(device)
    return (time.perf_counter() - start) / max(1, iters), wrong


# ---------------------------------------------------------------------------------------------
# The benchmark over ops, sizes and groups
# ---------------------------------------------------------------------------------------------


@dataclass
class BenchOptions:
    """What to measure (see ``add_arguments`` for the meaning of each)."""

    ops: list[str] = field(default_factory=lambda: list(OPS))
    sizes: list[int] = field(default_factory=lambda: message_sizes(1 << 10, 1 << 30, 2))
    dtype: str = "float32"
    iters: int = 20
    warmup: int = 5
    groups: list[str] = field(default_factory=list)


@dataclass
class _Scope:
    """One way of splitting the ranks: the whole world, or intra/inter-node groups."""

    name: str
    group: Any
    members: list[list[int]]  # every group of this scope, as global ranks
    mine: list[int]  # the group this rank belongs to

    @property
    def size(self) -> int:
        return len(self.mine)


def _scopes(ctx: Any, kinds: list[str], node_of_rank: list[int] | None) -> list[_Scope]:
    world = list(range(ctx.world_size))
    scopes = [_Scope("world", None, [world], world)]
    if not kinds:
        return scopes
    if node_of_rank is None:
        node_of_rank = ctx.all_gather_object(ctx.env.node_rank)
    split = split_groups(node_of_rank)
    for kind in kinds:
        members = split[kind]
        if len(members[0]) < 2:
            if ctx.is_main:
                log.info("--groups %s: one rank per group on this job's layout; skipped", kind)
            continue
        # Every rank creates every group, in the same order: new_group is itself collective.
        mine, _ = dist.new_subgroups_by_enumeration(members)
        scopes.append(_Scope(kind, mine, members,
                             next(m for m in members if ctx.rank in m)))
    return scopes


def _reduce_scatter_native(device: torch.device, group: Any) -> bool:
    """Whether this backend runs reduce_scatter itself (a capability of the backend, so every
    rank gets the same answer; the probe is a one-element collective)."""
    scatter = _native("reduce_scatter_single", "reduce_scatter_tensor")
    n = dist.get_world_size(group)
    try:
        scatter(torch.zeros(1, device=device), torch.zeros(n, device=device), group=group)
        ok = True
    except RuntimeError:
        ok = False
    return ok


def require_ranks(ctx: Any) -> None:
    """Refuse one process: a collective needs company."""
    if not ctx.initialized or ctx.world_size < 2:
        raise UserError("bench collectives needs at least 2 ranks: run it under torchrun or srun")


def check_memory(ctx: Any, opts: BenchOptions) -> None:
    """Refuse, with one line, a largest message some node cannot hold on all its ranks.

    Free memory differs by node (and by device), so each rank judges its own and the verdicts are
    gathered: every rank raises the same UserError, naming the rank(s) and host(s) short of
    memory, rather than only those ranks stopping while the others wait in the next collective.
    ``PODTRAIN_TEST_LOW_MEMORY_RANK=R`` makes rank R see no free memory (tests only).
    """
    need = max(buffer_bytes(op, max(opts.sizes), ctx.world_size) for op in opts.ops)
    avail = _available_bytes(ctx.device)
    if (env_flag(LOW_MEMORY_VAR) or "").strip() == str(ctx.rank):
        avail = 0
    share = None if avail is None else avail // max(1, ctx.env.local_world_size)
    # Keep a quarter back for the check's temporaries and everything else on the node.
    mine = share if share is not None and need > share * 0.75 else None
    short = [(rank, host, got)
             for rank, (host, got) in enumerate(ctx.all_gather_object((ctx.env.hostname, mine)))
             if got is not None]
    if short:
        where = ", ".join(f"rank {rank} on host {host} (~{format_size(got)} per rank available)"
                          for rank, host, got in short)
        raise UserError(
            f"--max-bytes {format_size(max(opts.sizes))} needs ~{format_size(need)} per rank, "
            f"more than {where} can hold; lower --max-bytes")


def _available_bytes(device: torch.device) -> int | None:
    if device.type != "cpu":
        try:
            free, _ = torch.cuda.mem_get_info(device)
            return int(free)
        except Exception:
            return None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def run_benchmark(ctx: Any, opts: BenchOptions,
                  node_of_rank: list[int] | None = None) -> list[dict[str, Any]]:
    """Measure every (scope, op, size) on every rank; return the records (the same on all ranks).

    ``ctx`` is a ``DistContext`` with more than one rank. ``node_of_rank`` overrides each rank's
    node id for ``--groups`` (tests fake a two-node layout on one machine).
    """
    require_ranks(ctx)
    dtype = DTYPES[opts.dtype]
    local: list[tuple] = []
    scopes = _scopes(ctx, opts.groups, node_of_rank)
    for scope in scopes:
        n = scope.size
        grank = scope.mine.index(ctx.rank)
        rs_native = "reduce_scatter" not in opts.ops or _reduce_scatter_native(ctx.device,
                                                                                scope.group)
        for op in opts.ops:
            for size in opts.sizes:
                case = build_case(op, size, dtype, ctx.device, scope.group, grank, n,
                                  src=scope.mine[0], fallback_rs=not rs_native)
                t, wrong = measure(case, ctx.device, tolerance(op, dtype, n), opts.iters,
                                   opts.warmup, scope.group)
                local.append((scope.name, op, case.nbytes, t, wrong, case.impl))
                del case
    gathered = ctx.all_gather_object(local)
    return _records(gathered, {s.name: s.members for s in scopes}, ctx.world_size,
                    opts.dtype, ctx.backend)


def _records(gathered: list[list[tuple]], members: dict[str, list[list[int]]], world: int,
             dtype: str, backend: str) -> list[dict[str, Any]]:
    """One record per (scope, op, size) from every rank's local results."""
    records = []
    for k, (scope, op, nbytes, _, _, impl) in enumerate(gathered[0]):
        times = [gathered[r][k][3] for r in range(world)]
        wrongs = [gathered[r][k][4] for r in range(world)]
        groups = members[scope]
        n = len(groups[0])
        mean = statistics.fmean(times)
        rec: dict[str, Any] = {
            "op": op, "bytes": nbytes, "time_s": mean,
            "algbw_gbps": algbw_gbps(nbytes, mean), "busbw_gbps": busbw_gbps(op, nbytes, mean, n),
            "wrong": sum(wrongs), "world_size": n, "group": scope, "groups": len(groups),
            "dtype": dtype, "backend": backend, "time_min_s": min(times),
            "time_max_s": max(times), "wrong_ranks": [r for r, w in enumerate(wrongs) if w],
        }
        if impl != "native":
            rec["impl"] = impl
        if len(groups) > 1:
            by_group = [statistics.fmean(times[r] for r in g) for g in groups]
            slowest = max(range(len(groups)), key=by_group.__getitem__)
            rec["slowest_group"] = groups[slowest]
            rec["slowest_group_busbw_gbps"] = busbw_gbps(op, nbytes, by_group[slowest], n)
        records.append(rec)
    return records


def check_results(records: list[dict[str, Any]], min_busbw: float | None) -> list[str]:
    """Failures: any wrong element, and with ``min_busbw`` each op's busbw at its largest size
    (small messages measure latency, not bandwidth) below the threshold."""
    failures = [f"{r['op']} {format_size(r['bytes'])} ({r['group']}): {r['wrong']} wrong "
                f"element(s) on rank(s) {r['wrong_ranks']}" for r in records if r["wrong"]]
    if min_busbw is not None:
        largest: dict[tuple[str, str], dict[str, Any]] = {}
        for r in records:
            key = (r["op"], r["group"])
            if key not in largest or r["bytes"] > largest[key]["bytes"]:
                largest[key] = r
        for (op, scope), r in largest.items():
            if r["busbw_gbps"] < min_busbw:
                where = f", slowest group {r['slowest_group']}" if "slowest_group" in r else ""
                failures.append(f"{op} {format_size(r['bytes'])} ({scope}): busbw "
                                f"{r['busbw_gbps']:.3f} GB/s < --min-busbw {min_busbw:g}{where}")
    return failures


_COLUMNS = ("op", "group", "size", "time_us", "algbw_GB/s", "busbw_GB/s", "wrong")


def _row(r: dict[str, Any]) -> tuple[str, ...]:
    return (r["op"], r["group"], format_size(r["bytes"]), f"{r['time_s'] * 1e6:.1f}",
            f"{r['algbw_gbps']:.3f}", f"{r['busbw_gbps']:.3f}", str(r["wrong"]))


def format_table(records: list[dict[str, Any]]) -> str:
    """The records as a plain fixed-width table."""
    rows = [_COLUMNS] + [_row(r) for r in records]
    widths = [max(len(row[i]) for row in rows) for i in range(len(_COLUMNS))]
    lines = ["  ".join(cell.rjust(w) if i >= 2 else cell.ljust(w)
                       for i, (cell, w) in enumerate(zip(row, widths))) for row in rows]
    return "\n".join(lines)


def _print_table(records: list[dict[str, Any]], title: str) -> None:
    if sys.stdout.isatty():
        from rich.console import Console
        from rich.table import Table

        table = Table(title=title)
        for i, col in enumerate(_COLUMNS):
            table.add_column(col, justify="right" if i >= 2 else "left")
        for r in records:
            table.add_row(*_row(r), style="red" if r["wrong"] else None)
        Console().print(table)
    else:
        print(title)
        print(format_table(records), flush=True)


def write_json(path: str | Path, records: list[dict[str, Any]]) -> None:
    """One JSON object per line, one line per (op, size, group)."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text("".join(json.dumps(r) + "\n" for r in records))


# ---------------------------------------------------------------------------------------------
# CLI
# ---------------------------------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``podtrain bench collectives``."""
    parser.add_argument("--ops", default=",".join(OPS),
                        help=f"comma-separated ops (default: all of {','.join(OPS)})")
    parser.add_argument("--min-bytes", default="1K", help="smallest message (default 1K)")
    parser.add_argument("--max-bytes", default="1G", help="largest message (default 1G)")
    parser.add_argument("--factor", type=float, default=2.0, help="size step factor (default 2)")
    parser.add_argument("--dtype", default="float32", choices=sorted(DTYPES))
    parser.add_argument("--backend", default="auto", help="auto, nccl or gloo")
    parser.add_argument("--iters", type=int, default=20, help="timed calls per size")
    parser.add_argument("--warmup", type=int, default=5, help="untimed calls per size")
    parser.add_argument("--groups", default="",
                        help="also measure 'intra' (within a node) and/or 'inter' (across nodes)")
    parser.add_argument("--json", dest="json_path", default=None, help="write records (JSONL)")
    parser.add_argument("--min-busbw", type=float, default=None,
                        help="fail when an op's busbw at its largest size is below this (GB/s)")
    parser.add_argument("--timeout-s", type=float, default=600.0, help="collective timeout")


def options_from_args(args: argparse.Namespace) -> BenchOptions:
    """Validated options from the parsed command line (one-line errors)."""
    ops = [o.strip() for o in args.ops.split(",") if o.strip()]
    unknown = [o for o in ops if o not in OPS]
    if unknown or not ops:
        raise UserError(f"--ops: unknown op(s) {unknown or ops}; choose from {', '.join(OPS)}")
    groups = [g.strip() for g in args.groups.split(",") if g.strip()]
    bad = [g for g in groups if g not in GROUP_KINDS]
    if bad:
        raise UserError(f"--groups: unknown {bad}; choose from {', '.join(GROUP_KINDS)}")
    if args.iters < 1 or args.warmup < 0:
        raise UserError("--iters must be >= 1 and --warmup >= 0")
    sizes = message_sizes(parse_size(args.min_bytes), parse_size(args.max_bytes), args.factor)
    return BenchOptions(ops=ops, sizes=sizes, dtype=args.dtype, iters=args.iters,
                        warmup=args.warmup, groups=groups)


def run(args: argparse.Namespace) -> int:
    """Run the benchmark on this rank; 0 when every result is right and fast enough, else 1."""
    from podtrain.distributed.group import process_group

    opts = options_from_args(args)
    env = ClusterEnv.detect()
    with process_group(env, args.backend, init_timeout_s=args.timeout_s,
                       timeout_s=args.timeout_s) as ctx:
        require_ranks(ctx)
        check_memory(ctx, opts)
        records = run_benchmark(ctx, opts)
    failures = check_results(records, args.min_busbw)
    if ctx.is_main:
        title = (f"podtrain bench collectives: {ctx.world_size} ranks, {ctx.backend}, "
                 f"{opts.dtype}, {ctx.device.type}, torch {torch.__version__}")
        _print_table(records, title)
        if args.json_path:
            write_json(args.json_path, records)
        for failure in failures:
            print(f"podtrain bench collectives: FAIL: {failure}", file=sys.stderr)
    return 1 if failures else 0
