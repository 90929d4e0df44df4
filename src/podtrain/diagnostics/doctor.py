"""``podtrain doctor``: a preflight of the cluster before a long run, launched like training.

Every rank collects facts about itself; rank 0 prints one line per check; every rank returns the
same exit code (0 healthy, 1 a check failed), and each failure names the host and rank at fault:

* versions: torch, CUDA and NCCL the same on every rank;
* gpus: GPUs found on each host against ``--gpus-per-node`` (and enough for the local ranks);
* efa: EFA/RDMA devices (/sys/class/infiniband, ``fi_info -p efa`` when installed), FI_PROVIDER;
* transport: the network NCCL uses on each host (``transport.probe``: NET/OFI, NET/IB,
  NET/Socket), failing a host that has EFA devices but whose NCCL fell back to TCP sockets;
* network: interfaces up, and GLOO_/NCCL_SOCKET_IFNAME naming an interface that exists;
* run dir: ``--run-dir`` writable from every rank, and every rank's file visible to every rank
  (a shared filesystem, not a node-local path);
* rendezvous: MASTER_ADDR:MASTER_PORT reachable before the group forms, then a barrier's time;
* all_reduce: one checked all_reduce (element by element) and its busbw;
* compute: a matmul benchmark per rank; a rank more than ``--slow-threshold`` (10%) slower
  than the median of the other ranks fails.

One process works too: the cross-rank checks then report that they had nothing to compare.
This module gathers the facts, runs the probes that talk to other ranks and holds the CLI; the
verdicts over the gathered facts are in ``checks``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import time
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from podtrain.diagnostics import transport
from podtrain.diagnostics.checks import (FAIL, INFO, OK, Check, check_compute, check_efa,
                                         check_gpus, check_network, check_run_dir, check_transport,
                                         check_versions, culprit_names)
from podtrain.distributed.env import ClusterEnv, launcher_variables
from podtrain.distributed.health import write_verdict
from podtrain.distributed.placement import ipv4_of
from podtrain.errors import UserError, storage_error
from podtrain.observe.hardware import best_matmul_seconds

# ---------------------------------------------------------------------------------------------
# Facts one rank gathers about itself (no collectives)
# ---------------------------------------------------------------------------------------------


def _nccl_version() -> str | None:
    try:
        if torch.cuda.is_available():
            return ".".join(map(str, torch.cuda.nccl.version()))
    except Exception:
        pass
    return None


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None


def network_interfaces() -> list[dict[str, Any]]:
    """This host's interfaces: name, state, MTU, speed (Mb/s) and IPv4 address where known."""
    out = []
    for _, name in socket.if_nameindex():
        base = Path("/sys/class/net") / name
        speed = _read(base / "speed")
        out.append({"name": name, "state": _read(base / "operstate") or "?",
                    "mtu": _read(base / "mtu"),
                    "speed_mbps": int(speed) if speed and speed.lstrip("-").isdigit()
                    and int(speed) > 0 else None,
                    "ipv4": ipv4_of(name)})
    return out


def efa_facts(sysfs: Path = Path("/sys/class/infiniband")) -> dict[str, Any]:
    """RDMA devices in /sys/class/infiniband, which of them are EFA, and whether libfabric's
    fi_info sees EFA.

    rdma-core names EFA devices ``rdmap<bus>s<slot>`` (``efa_<n>`` without its udev rules), so a
    device is EFA by its driver (``device/driver`` links to the ``efa`` driver) or by its name.
    """
    devices = sorted(p.name for p in sysfs.iterdir()) if sysfs.is_dir() else []
    efa = [d for d in devices if "efa" in d or (sysfs / d / "device" / "driver").resolve().name == "efa"]
    fi_info = None
    if shutil.which("fi_info"):
        try:
            res = subprocess.run(["fi_info", "-p", "efa"], capture_output=True, text=True,
                                 timeout=15)
            fi_info = res.returncode == 0 and "provider: efa" in res.stdout
        except (OSError, subprocess.TimeoutExpired):
            fi_info = False
    return {"devices": devices, "efa_devices": efa, "fi_info_efa": fi_info}


def local_facts(env: ClusterEnv) -> dict[str, Any]:
    """Everything this rank reports about itself."""
    fabric = launcher_variables()
    return {
        "rank": env.rank, "host": env.hostname, "local_rank": env.local_rank,
        "local_world_size": env.local_world_size,
        "torch": torch.__version__, "cuda": torch.version.cuda, "nccl": _nccl_version(),
        "python": sys.version.split()[0],
        "gpus": torch.cuda.device_count(),
        "efa": efa_facts(), "fi_provider": fabric.get("FI_PROVIDER"),
        "socket_ifnames": {k: fabric[k] for k in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")
                           if k in fabric},
        "interfaces": network_interfaces(),
    }



# ---------------------------------------------------------------------------------------------
# Steps that talk to other ranks
# ---------------------------------------------------------------------------------------------


def probe_rendezvous(env: ClusterEnv, timeout_s: float) -> str | None:
    """Connect to MASTER_ADDR:MASTER_PORT before joining the group; None or the error.

    Rank 0 under srun hosts the store itself (it is not up yet), so only the others probe;
    they retry until ``timeout_s``, as the store may start after them.
    """
    if env.world_size < 2 or env.rank == 0:
        return None
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with socket.create_connection((env.master_addr, env.master_port), timeout=5):
                return None
        except OSError as exc:
            if time.monotonic() >= deadline:
                return f"{type(exc).__name__}: {exc}"
            time.sleep(0.5)


def write_run_dir(ctx: Any, run_dir: str | None) -> tuple[dict[str, Any], Path | None]:
    """Each rank writes its file under ``run_dir``, waits for all, then lists what it sees.

    Returns the result and the probe directory (which rank 0 removes once all have looked).
    """
    result: dict[str, Any] = {"error": None, "seen": []}
    # A fresh directory per run, named by rank 0, so files of an earlier run cannot count.
    token = ctx.broadcast_object(uuid.uuid4().hex if ctx.is_main else None)
    probe = Path(run_dir or ".") / ".doctor" / token
    if run_dir is not None:
        try:
            probe.mkdir(parents=True, exist_ok=True)
            path = probe / f"rank{ctx.rank}"
            path.write_text(ctx.env.hostname)
            with open(path, "rb") as fh:
                os.fsync(fh.fileno())
        except OSError as exc:
            result["error"] = f"{type(exc).__name__}: {exc}"
    ctx.barrier()  # every rank has written (or failed) before anyone looks
    if run_dir is not None:
        with contextlib.suppress(OSError):
            result["seen"] = sorted(int(p.name[4:]) for p in probe.iterdir()
                                    if p.name.startswith("rank"))
    return result, (probe if run_dir is not None else None)


def barrier_time(ctx: Any, repeats: int = 5) -> float | None:
    """Median seconds of a barrier (a round trip through every rank), or None for one rank."""
    if not ctx.initialized:
        return None
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        ctx.barrier()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def matmul_seconds(ctx: Any, size: int, budget_s: float = 0.3) -> tuple[float, float]:
    """``(seconds, flops)`` of one ``size`` x ``size`` matmul on this rank's device (fp32 on CPU,
    bf16 on a GPU), timed by ``observe.hardware.best_matmul_seconds``."""
    dtype = torch.float32 if ctx.device.type == "cpu" else torch.bfloat16
    return best_matmul_seconds(ctx.device, size, dtype, budget_s), 2.0 * size ** 3


# ---------------------------------------------------------------------------------------------
# The doctor
# ---------------------------------------------------------------------------------------------


@dataclass
class DoctorOptions:
    """What to check (see ``add_arguments``)."""

    run_dir: str | None = None
    gpus_per_node: int | None = None
    expect_efa: bool = False
    allreduce_bytes: int = 64 << 20
    min_busbw: float | None = None
    matmul_size: int | None = None
    slow_threshold: float = 0.10


@dataclass
class DoctorReport:
    """The checks (the same on every rank) and where they ran."""

    checks: list[Check]
    world_size: int
    hosts: list[str]

    @property
    def failed(self) -> list[Check]:
        """The checks that failed."""
        return [c for c in self.checks if c.status == FAIL]

    def format(self) -> str:
        """One line per check, then the verdict naming the ranks and hosts at fault."""
        lines = [f"podtrain doctor: {self.world_size} rank(s) on {len(self.hosts)} host(s)"]
        lines += [f"[{c.status:<4}] {c.name:<10} {c.detail}" for c in self.checks]
        if self.failed:
            lines.append(f"doctor: FAIL ({len(self.failed)} check(s)): " + "; ".join(
                f"{c.name}: {culprit_names(c.culprits) or c.detail}" for c in self.failed))
        else:
            lines.append("doctor: OK")
        return "\n".join(lines)


def run_doctor(ctx: Any, opts: DoctorOptions) -> DoctorReport:
    """Run every check on this rank (call on every rank); every rank gets the same report."""
    facts = local_facts(ctx.env)
    # NCCL's network is a host's fact: its first rank asks NCCL (a subprocess, ~10 s on a GPU).
    uses_nccl = ctx.device.type != "cpu" and ctx.backend != "gloo"
    facts["nccl_net"] = transport.probe() if uses_nccl and ctx.env.local_rank == 0 else None
    facts["run_dir"], probe_dir = write_run_dir(ctx, opts.run_dir)
    barrier_s = barrier_time(ctx)
    allreduce = _allreduce_check(ctx, opts)
    size = opts.matmul_size or (512 if ctx.device.type == "cpu" else 4096)
    ctx.barrier()  # every rank benchmarks at the same time, as they will when training
    facts["matmul_s"], facts["matmul_flops"] = matmul_seconds(ctx, size)
    everyone = ctx.all_gather_object(facts)  # also: every rank has listed the run dir
    if ctx.is_main and probe_dir is not None:
        shutil.rmtree(probe_dir, ignore_errors=True)
        with contextlib.suppress(OSError):  # .doctor itself, unless another doctor runs
            probe_dir.parent.rmdir()
    hosts = {f["rank"]: f["host"] for f in everyone}
    for culprit in allreduce.culprits:
        culprit["host"] = hosts[culprit["rank"]]
    if allreduce.culprits:
        allreduce.detail += f" on {culprit_names(allreduce.culprits)}"
    checks = [
        check_versions(everyone), check_gpus(everyone, opts.gpus_per_node, ctx.backend),
        check_efa(everyone, opts.expect_efa), check_transport(everyone), check_network(everyone),
        check_run_dir(everyone, opts.run_dir, ctx.world_size), _rendezvous_check(ctx, barrier_s),
        allreduce, check_compute(everyone, opts.slow_threshold),
    ]
    return DoctorReport(checks, ctx.world_size, sorted(set(hosts.values())))


def _allreduce_check(ctx: Any, opts: DoctorOptions) -> Check:
    from podtrain.diagnostics import busbw, collectives as C

    if not ctx.initialized:
        return Check("all_reduce", INFO, "one process: nothing to reduce")
    bench = C.BenchOptions(ops=["all_reduce"], sizes=[opts.allreduce_bytes], iters=5, warmup=2)
    rec = C.run_benchmark(ctx, bench)[0]
    detail = (f"{busbw.format_size(rec['bytes'])} float32: busbw {rec['busbw_gbps']:.3f} GB/s, "
              f"{rec['time_s'] * 1e3:.2f} ms")
    if rec["wrong"]:
        return Check("all_reduce", FAIL, f"{rec['wrong']} wrong element(s) ({detail})",
                     [{"rank": r, "host": None} for r in rec["wrong_ranks"]])
    if opts.min_busbw is not None and rec["busbw_gbps"] < opts.min_busbw:
        return Check("all_reduce", FAIL, f"busbw below --min-busbw {opts.min_busbw:g} ({detail})")
    return Check("all_reduce", OK, f"correct on every rank; {detail}")


def _rendezvous_check(ctx: Any, barrier_s: float | None) -> Check:
    if not ctx.initialized or barrier_s is None:
        return Check("rendezvous", INFO, "one process: no rendezvous")
    env = ctx.env
    return Check("rendezvous", OK, f"{env.master_addr}:{env.master_port} reached by all "
                 f"{ctx.world_size} ranks; barrier {barrier_s * 1e3:.2f} ms")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``podtrain doctor``."""
    parser.add_argument("--run-dir", default=None,
                        help="a directory every node must share (checked by writing into it)")
    parser.add_argument("--gpus-per-node", type=int, default=None, help="GPUs expected per node")
    parser.add_argument("--expect-efa", action="store_true", help="fail on a node without EFA")
    parser.add_argument("--backend", default="auto", help="auto, nccl or gloo")
    parser.add_argument("--allreduce-bytes", default="64M", help="all_reduce check size")
    parser.add_argument("--min-busbw", type=float, default=None,
                        help="all_reduce busbw floor, GB/s")
    parser.add_argument("--matmul-size", type=int, default=None,
                        help="matmul side (default 512 on CPU, 4096 on GPU)")
    parser.add_argument("--slow-threshold", type=float, default=0.10,
                        help="fail a rank this much slower than the median of the others "
                        "(default 0.10)")
    parser.add_argument("--timeout-s", type=float, default=120.0,
                        help="rendezvous and collective timeout")
    parser.add_argument("--json", dest="json_path", default=None, help="write the checks as JSON")


def options_from_args(args: argparse.Namespace) -> DoctorOptions:
    """Validated options from the command line."""
    from podtrain.diagnostics.busbw import parse_size

    if args.slow_threshold <= 0:
        raise UserError(f"--slow-threshold {args.slow_threshold} must be positive")
    return DoctorOptions(run_dir=args.run_dir, gpus_per_node=args.gpus_per_node,
                         expect_efa=args.expect_efa,
                         allreduce_bytes=parse_size(args.allreduce_bytes),
                         min_busbw=args.min_busbw, matmul_size=args.matmul_size,
                         slow_threshold=args.slow_threshold)


def run(args: argparse.Namespace) -> int:
    """Run the doctor on this rank; 0 when every check passes, else 1 (the same on every rank)."""
    from podtrain.distributed.group import process_group

    opts = options_from_args(args)
    env = ClusterEnv.detect()
    error = probe_rendezvous(env, args.timeout_s)
    if error is not None:
        # This rank cannot join, so it cannot tell the others: it names itself and stops.
        print(f"podtrain doctor: FAIL rendezvous: rank {env.rank} on host {env.hostname} cannot "
              f"reach {env.master_addr}:{env.master_port} ({error})", file=sys.stderr)
        return 1
    with contextlib.ExitStack() as stack:
        try:
            ctx = stack.enter_context(process_group(env, args.backend, args.timeout_s,
                                                    args.timeout_s))
        except RuntimeError as exc:  # the store answered, but not every rank joined in time
            first = (str(exc).splitlines() or [""])[0]
            print(f"podtrain doctor: FAIL rendezvous: rank {env.rank} on host {env.hostname}: "
                  f"the process group did not form within {args.timeout_s:g} s "
                  f"({type(exc).__name__}: {first})", file=sys.stderr)
            return 1
        report = run_doctor(ctx, opts)
    if ctx.is_main:
        print(report.format(), flush=True)  # first: an unwritable run dir is a finding, not a crash
        if opts.run_dir:
            _record_culprits(report, opts.run_dir)
        if args.json_path:
            Path(args.json_path).write_text(json.dumps(
                {"ok": not report.failed, "hosts": report.hosts,
                 "checks": [asdict(c) for c in report.checks]}, indent=1))
    return 1 if report.failed else 0


def _record_culprits(report: DoctorReport, run_dir: str) -> None:
    """The failed checks' culprits as verdicts under RUN_DIR/health, for the scheduler to avoid
    (``podtrain.distributed.health``); where the run dir cannot take them (its own check failed)
    one line says so."""
    try:
        for check in report.failed:
            for culprit in check.culprits:
                write_verdict(run_dir, "doctor", culprit["host"], culprit["rank"],
                              {"check": check.name, "detail": check.detail})
    except OSError as exc:
        error = storage_error(exc)
        print(f"podtrain doctor: verdicts not recorded under {run_dir}: "
              f"{error if error is not None else exc}", file=sys.stderr)
