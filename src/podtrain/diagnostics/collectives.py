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

This module runs the benchmark over scopes, ops and sizes, judges and prints the records, and holds
the CLI; the arithmetic is in ``busbw``, one checked and timed (op, size) in ``cases``.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist

from podtrain.diagnostics.busbw import (OPS, algbw_gbps, buffer_bytes, busbw_gbps, format_size,
                                        message_sizes, parse_size, split_groups, tolerance)
from podtrain.diagnostics.cases import build_case, measure, native_collective
from podtrain.distributed.env import ClusterEnv
from podtrain.errors import UserError

log = logging.getLogger(__name__)

DTYPES = {
    "float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
    "float64": torch.float64, "int32": torch.int32, "int64": torch.int64,
}
GROUP_KINDS = ("intra", "inter")


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
    scatter = native_collective("reduce_scatter_single", "reduce_scatter_tensor")
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
    """
    need = max(buffer_bytes(op, max(opts.sizes), ctx.world_size) for op in opts.ops)
    avail = available_bytes(ctx.device)
    # Host memory is shared by the node's ranks; a GPU's free memory is its own rank's alone.
    ranks_sharing = max(1, ctx.env.local_world_size) if ctx.device.type == "cpu" else 1
    share = None if avail is None else avail // ranks_sharing
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


def available_bytes(device: torch.device) -> int | None:
    """Free memory of ``device``: the GPU's free bytes, or this host's MemAvailable on CPU (None
    when unknown)."""
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


def run_benchmark(ctx: Any, opts: BenchOptions, node_of_rank: list[int] | None = None,
                  on_record: Callable[[dict[str, Any], int, int], None] | None = None) -> list[dict[str, Any]]:
    """Measure every (scope, op, size) on every rank; return the records (the same on all ranks).

    ``ctx`` is a ``DistContext`` with more than one rank. ``node_of_rank`` overrides each rank's
    node id for ``--groups`` (tests fake a two-node layout on one machine). ``on_record(record,
    done, total)`` is called on every rank as soon as each (scope, op, size) is measured: the
    ranks gather each case's results right after timing it (outside the timed calls).
    """
    require_ranks(ctx)
    dtype = DTYPES[opts.dtype]
    records: list[dict[str, Any]] = []
    scopes = _scopes(ctx, opts.groups, node_of_rank)
    members = {s.name: s.members for s in scopes}
    total = len(scopes) * len(opts.ops) * len(opts.sizes)
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
                mine = (scope.name, op, case.nbytes, t, wrong, case.impl)
                del case
                gathered = ctx.all_gather_object([mine])
                (record,) = _records(gathered, members, ctx.world_size, opts.dtype, ctx.backend)
                records.append(record)
                if on_record is not None:
                    on_record(record, len(records), total)
    return records


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


_WIDTHS = (14, 6, 6, 12, 11, 11, 5)
"""Column widths of the streamed table (rows are printed before the later ones are known)."""


class RecordStream:
    """Prints each record as a table row the moment it is measured (with ``done/total``), and
    appends it to the ``--json`` file (flushed per line), so a long run shows progress and a
    killed one keeps what it measured."""

    def __init__(self, title: str, json_path: str | Path | None) -> None:
        """Print ``title`` and the header; truncate and open ``json_path`` when given."""
        self._json = None
        if json_path is not None:
            Path(json_path).parent.mkdir(parents=True, exist_ok=True)
            self._json = open(json_path, "w", encoding="utf-8")
        print(title)
        print(self._line(("progress",) + _COLUMNS), flush=True)

    @staticmethod
    def _line(cells: tuple[str, ...]) -> str:
        progress, rest = cells[0], cells[1:]
        body = "  ".join(cell.rjust(w) if i >= 2 else cell.ljust(w)
                         for i, (cell, w) in enumerate(zip(rest, _WIDTHS)))
        return f"{progress:>9}  {body}"

    def __call__(self, record: dict[str, Any], done: int, total: int) -> None:
        """Emit one record (the ``on_record`` hook of ``run_benchmark``)."""
        print(self._line((f"{done}/{total}",) + _row(record)), flush=True)
        if self._json is not None:
            self._json.write(json.dumps(record) + "\n")
            self._json.flush()

    def close(self) -> None:
        """Close the JSON file."""
        if self._json is not None:
            self._json.close()


def write_records_jsonl(path: str | Path, records: list[dict[str, Any]]) -> None:
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
    parser.add_argument("--max-bytes", default=None,
                        help=f"largest message (default {format_size(DEFAULT_MAX_BYTES['nccl'])} on "
                        f"NCCL, {format_size(DEFAULT_MAX_BYTES['gloo'])} on gloo, where large "
                        "messages take minutes and say nothing new)")
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


DEFAULT_MAX_BYTES = {"nccl": 1 << 30, "gloo": 16 << 20}
"""--max-bytes by backend: NCCL reaches its bus bandwidth near 1 GiB; gloo on CPU is flat long
before 16 MiB, and its defaults then finish in about a minute on 2 cores."""


def options_from_args(args: argparse.Namespace, backend: str = "nccl") -> BenchOptions:
    """Validated options from the parsed command line (one-line errors); ``backend`` sizes the
    default --max-bytes."""
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
    max_bytes = parse_size(args.max_bytes) if args.max_bytes else DEFAULT_MAX_BYTES.get(backend, 1 << 30)
    sizes = message_sizes(parse_size(args.min_bytes), max_bytes, args.factor)
    return BenchOptions(ops=ops, sizes=sizes, dtype=args.dtype, iters=args.iters,
                        warmup=args.warmup, groups=groups)


def run(args: argparse.Namespace) -> int:
    """Run the benchmark on this rank; 0 when every result is right and fast enough, else 1."""
    from podtrain.distributed.group import process_group

    options_from_args(args)  # flag mistakes before any process group
    env = ClusterEnv.detect()
    with process_group(env, args.backend, init_timeout_s=args.timeout_s,
                       timeout_s=args.timeout_s) as ctx:
        require_ranks(ctx)
        opts = options_from_args(args, ctx.backend)
        check_memory(ctx, opts)
        stream = None
        if ctx.is_main:
            stream = RecordStream(f"podtrain bench collectives: {ctx.world_size} ranks, {ctx.backend}, "
                                  f"{opts.dtype}, {ctx.device.type}, {format_size(opts.sizes[0])}"
                                  f"-{format_size(opts.sizes[-1])}, torch {torch.__version__}",
                                  args.json_path)
        try:
            records = run_benchmark(ctx, opts, on_record=stream)
        finally:
            if stream is not None:
                stream.close()
    failures = check_results(records, args.min_busbw)
    if ctx.is_main:
        for failure in failures:
            print(f"podtrain bench collectives: FAIL: {failure}", file=sys.stderr)
    return 1 if failures else 0
