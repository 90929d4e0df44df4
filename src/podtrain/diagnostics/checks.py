"""The doctor's verdicts: pure functions of the facts every rank gathered.

They read only the gathered facts (one dict per rank, see ``doctor.local_facts``), so every rank
reaches the same verdict without talking to the others, and the tests call them with made-up facts.
Each failing ``Check`` names its culprits: the ranks and hosts at fault.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Any

OK, INFO, WARN, FAIL = "ok", "info", "warn", "FAIL"


@dataclass
class Check:
    """One line of the report; ``culprits`` are the ``{"rank", "host"}`` at fault."""

    name: str
    status: str
    detail: str
    culprits: list[dict[str, Any]] = field(default_factory=list)


def _who(fact: dict[str, Any]) -> dict[str, Any]:
    return {"rank": fact["rank"], "host": fact["host"]}


def culprit_names(culprits: list[dict[str, Any]]) -> str:
    """``rank R on host H, ...`` for the culprits of a check."""
    return ", ".join(f"rank {c['rank']} on host {c['host']}" for c in culprits)


def _per_host(facts: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One fact set per host (its lowest rank's): host-wide facts are checked once per host."""
    seen: dict[str, dict[str, Any]] = {}
    for f in facts:
        seen.setdefault(f["host"], f)
    return list(seen.values())


def check_versions(facts: list[dict[str, Any]]) -> Check:
    """torch, CUDA and NCCL identical on every rank (rank 0's are the reference)."""
    keys = ("torch", "cuda", "nccl")
    ref = facts[0]
    odd = [f for f in facts if any(f[k] != ref[k] for k in keys)]
    desc = f"torch {ref['torch']}, CUDA {ref['cuda'] or 'none'}, NCCL {ref['nccl'] or 'none'}"
    if odd:
        diffs = "; ".join(f"rank {f['rank']} on host {f['host']} has " + ", ".join(
            f"{k} {f[k]}" for k in keys if f[k] != ref[k]) for f in odd)
        return Check("versions", FAIL, f"rank 0 has {desc}; {diffs}", [_who(f) for f in odd])
    return Check("versions", OK, f"{desc} on every rank")


def check_gpus(facts: list[dict[str, Any]], expected: int | None, backend: str) -> Check:
    """GPUs found on each host against ``expected`` and against its local ranks (for nccl)."""
    bad = []
    for f in _per_host(facts):
        if expected is not None and f["gpus"] != expected:
            bad.append((f, expected))
        elif expected is None and backend == "nccl" and f["gpus"] < f["local_world_size"]:
            bad.append((f, f["local_world_size"]))  # one GPU per local rank at least
    if bad:
        detail = "; ".join(f"host {f['host']} (rank {f['rank']}) has {f['gpus']} GPU(s), "
                           f"expected {want}" for f, want in bad)
        return Check("gpus", FAIL, detail, [_who(f) for f, _ in bad])
    counts = sorted({f["gpus"] for f in facts})
    if counts == [0]:
        return Check("gpus", INFO, "no GPU on any host (a CPU run)")
    return Check("gpus", OK, f"{'/'.join(map(str, counts))} GPU(s) per host")


def check_efa(facts: list[dict[str, Any]], expect_efa: bool) -> Check:
    """EFA devices present where expected, and FI_PROVIDER=efa not set on a host without them."""
    hosts = _per_host(facts)
    missing = [f for f in hosts if not f["efa"]["devices"]]
    # FI_PROVIDER=efa on a host without the device is a misconfiguration even when not expected.
    culprits = [_who(f) for f in missing
                if expect_efa or (f["fi_provider"] or "").lower() == "efa"]
    if culprits:
        return Check("efa", FAIL, "no EFA/RDMA device in /sys/class/infiniband (NCCL would fall "
                     f"back to TCP sockets) on {culprit_names(culprits)}", culprits)
    first = hosts[0]
    devices = ",".join(first["efa"]["devices"]) or "none"
    fi = {None: "fi_info absent", True: "fi_info sees efa", False: "fi_info sees no efa"}[
        first["efa"]["fi_info_efa"]]
    return Check("efa", OK if first["efa"]["devices"] else INFO,
                 f"devices {devices} ({fi}); FI_PROVIDER={first['fi_provider'] or 'unset'}")


def check_transport(facts: list[dict[str, Any]]) -> Check:
    """The network NCCL uses on each host (``facts["nccl_net"]``, from ``transport.probe``); a
    host with EFA devices (by driver, or as ``fi_info -p efa`` sees them) whose NCCL is on TCP
    sockets fails: the aws-ofi-nccl plugin did not load, and collectives run ~10x slower."""
    from podtrain.diagnostics.transport import NET_SOCKET

    hosts = [f for f in _per_host(facts) if f.get("nccl_net") is not None]
    if not hosts:
        return Check("transport", INFO, "not checked: no NCCL on these ranks (gloo or no GPU)")
    fallen, failed, seen = [], [], {}
    for f in hosts:
        net = f["nccl_net"]
        if "error" in net:
            failed.append(f)
            continue
        efa = f["efa"].get("efa_devices") or f["efa"]["fi_info_efa"]
        if efa and net["transport"] == NET_SOCKET:
            fallen.append(f)
        label = net["transport"] + (f" ({net['network']})" if net.get("network") else "")
        seen.setdefault(label, []).append(f["host"])
    if fallen:
        detail = "; ".join(f"host {f['host']} has EFA devices ({','.join(f['efa']['efa_devices']) or 'fi_info'}) "
                           f"but NCCL uses {NET_SOCKET} (TCP sockets, ~10x slower: aws-ofi-nccl did not "
                           "load; check NCCL_NET_PLUGIN, LD_LIBRARY_PATH, FI_PROVIDER)" for f in fallen)
        return Check("transport", FAIL, detail, [_who(f) for f in fallen])
    if failed:
        detail = "; ".join(f"host {f['host']}: {f['nccl_net']['error']}" for f in failed)
        return Check("transport", WARN, f"NCCL's network unknown: {detail}", [_who(f) for f in failed])
    return Check("transport", OK, "NCCL uses " + "; ".join(
        f"{label} on {', '.join(hosts_)}" for label, hosts_ in seen.items()))


def check_network(facts: list[dict[str, Any]]) -> Check:
    """Interfaces of rank 0's host; a *_SOCKET_IFNAME naming no interface of its host fails."""
    bad = []
    for f in facts:  # the variables are per rank, even if the interfaces are per host
        names = {i["name"] for i in f["interfaces"]}
        for var, value in f["socket_ifnames"].items():
            # NCCL accepts prefixes and ^exclusions; only a plain list of names is checked.
            wanted = [v for v in value.split(",") if v and not v.startswith(("^", "="))]
            if wanted and not any(w in names or any(n.startswith(w) for n in names)
                                  for w in wanted):
                bad.append((f, f"{var}={value} but host {f['host']} (rank {f['rank']}) has "
                            f"{sorted(names)}"))
    if bad:
        return Check("network", FAIL, "; ".join(msg for _, msg in bad), [_who(f) for f, _ in bad])
    up = [i for i in facts[0]["interfaces"] if i["state"] in ("up", "unknown")]
    desc = ", ".join(f"{i['name']}({i['ipv4'] or '-'}, mtu {i['mtu']}"
                     + (f", {i['speed_mbps']} Mb/s" if i["speed_mbps"] else "") + ")" for i in up)
    return Check("network", OK, f"host {facts[0]['host']}: {desc or 'no interface up'}")


def check_run_dir(facts: list[dict[str, Any]], run_dir: str | None, world: int) -> Check:
    """Every rank wrote its file, and every rank saw every rank's file."""
    if run_dir is None:
        return Check("run dir", INFO, "not checked (pass --run-dir)")
    failed = [f for f in facts if f["run_dir"]["error"]]
    if failed:
        detail = "; ".join(f"rank {f['rank']} on host {f['host']}: {f['run_dir']['error']}"
                           for f in failed)
        return Check("run dir", FAIL, f"{run_dir} not writable: {detail}",
                     [_who(f) for f in failed])
    blind = [f for f in facts if len(f["run_dir"]["seen"]) < world]
    if blind:
        detail = "; ".join(f"rank {f['rank']} on host {f['host']} sees only ranks "
                           f"{f['run_dir']['seen']}" for f in blind)
        return Check("run dir", FAIL, f"{run_dir} is not shared by every node: {detail}",
                     [_who(f) for f in blind])
    return Check("run dir", OK, f"{run_dir} writable and shared by all {world} rank(s)")


def check_compute(facts: list[dict[str, Any]], threshold: float) -> Check:
    """A rank whose matmul time exceeds the median of the OTHER ranks' by more than
    ``threshold`` fails.

    Against the median of all ranks, a slow rank would pull the reference towards itself: with 2
    ranks the median is the mean, which halves its excess (a rank 50% slower than the other reads
    as 20% slower than the median).
    """
    times = [f["matmul_s"] for f in facts]
    median = statistics.median(times)
    med_gflops = facts[0]["matmul_flops"] / median / 1e9
    if len(facts) < 2:
        return Check("compute", OK, f"matmul {med_gflops:.1f} GFLOP/s (one rank: nothing to compare)")
    others = [statistics.median(times[:i] + times[i + 1:]) for i in range(len(facts))]
    excess = [t / ref - 1 for t, ref in zip(times, others)]
    slow = [i for i, e in enumerate(excess) if e > threshold]
    gflops = lambda s: facts[0]["matmul_flops"] / s / 1e9  # noqa: E731
    if slow:
        detail = "; ".join(
            f"rank {facts[i]['rank']} on host {facts[i]['host']} is {100 * excess[i]:.0f}% slower "
            f"than the median of the other ranks ({gflops(times[i]):.1f} against "
            f"{gflops(others[i]):.1f} GFLOP/s)" for i in slow)
        return Check("compute", FAIL, detail, [_who(facts[i]) for i in slow])
    return Check("compute", OK, f"matmul {med_gflops:.1f} GFLOP/s median, slowest rank "
                 f"+{100 * max(excess):.0f}% over the others (limit {100 * threshold:.0f}%)")
