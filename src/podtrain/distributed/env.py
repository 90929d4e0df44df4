"""Which launcher started this process, and where it sits: the only reader of launcher variables.

Three cases, checked in this order:

* ``torchrun`` (also a Kubeflow PyTorchJob's pods and HyperPod's launcher, which set the same
  variables): RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, GROUP_RANK, MASTER_ADDR, MASTER_PORT.
* ``srun`` without torchrun: SLURM_PROCID, SLURM_LOCALID, SLURM_NTASKS, SLURM_NODEID and the first
  host of SLURM_JOB_NODELIST as the rendezvous address.
* ``single``: one process, no launcher.

``task_slot`` also reads the Slurm job-array variables (SLURM_ARRAY_TASK_*), for the tasks of
``podtrain prepare --num-parts``.

Everything here is pure: ``ClusterEnv.detect(environ)`` takes a mapping so tests need no processes.
"""

from __future__ import annotations

import dataclasses
import os
import re
import socket
from dataclasses import dataclass
from typing import Mapping

from podtrain.errors import UserError

DEFAULT_MASTER_PORT = 29400


@dataclass(frozen=True)
class ClusterEnv:
    """Where this process sits in the job.

    Attributes:
        launcher: "torchrun", "srun" or "single".
        rank: global rank, 0..world_size-1.
        local_rank: index of this process on its node (the GPU it binds to).
        world_size: number of processes in the job.
        local_world_size: processes on this node.
        node_rank: index of this node.
        master_addr: rendezvous host for the default process group.
        master_port: rendezvous port.
        hostname: this host's name, for messages that must name a host.
        job_id: the job this process belongs to, the same for every rank and across restarts of
            the job ("slurm:<SLURM_JOB_ID>", else "torchrun:<TORCHELASTIC_RUN_ID>"; "" alone).
    """

    launcher: str
    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    node_rank: int
    master_addr: str
    master_port: int
    hostname: str
    job_id: str = ""

    @property
    def is_main(self) -> bool:
        """True on global rank 0, the only writer of shared files and INFO logs."""
        return self.rank == 0

    @property
    def is_distributed(self) -> bool:
        """True when a process group with more than one member is needed."""
        return self.world_size > 1

    @property
    def num_nodes(self) -> int:
        """Number of nodes, assuming the same number of processes on every node."""
        return max(1, self.world_size // max(1, self.local_world_size))

    @classmethod
    def detect(cls, environ: Mapping[str, str] | None = None) -> "ClusterEnv":
        """Build the environment from launcher variables (``os.environ`` by default)."""
        env = os.environ if environ is None else environ
        return dataclasses.replace(cls._detect(env), job_id=job_id(env))

    @classmethod
    def _detect(cls, env: Mapping[str, str]) -> "ClusterEnv":
        # Not $HOSTNAME: under srun it is the batch shell's, i.e. the first node's, on every node.
        hostname = env.get("PODTRAIN_HOSTNAME") or socket.gethostname()
        if "RANK" in env and "WORLD_SIZE" in env:
            return cls._from_torchrun(env, hostname)
        if "SLURM_PROCID" in env and "SLURM_NTASKS" in env:
            return cls._from_srun(env, hostname)
        return cls(
            launcher="single", rank=0, local_rank=0, world_size=1, local_world_size=1, node_rank=0,
            master_addr="127.0.0.1", master_port=_int(env, "MASTER_PORT", DEFAULT_MASTER_PORT),
            hostname=hostname,
        )

    @classmethod
    def _from_torchrun(cls, env: Mapping[str, str], hostname: str) -> "ClusterEnv":
        rank = _int(env, "RANK")
        world = _int(env, "WORLD_SIZE")
        local_rank = _int(env, "LOCAL_RANK", 0)
        local_world = _int(env, "LOCAL_WORLD_SIZE", world)
        node_rank = _int(env, "GROUP_RANK", rank // max(1, local_world))
        _check_rank(rank, world, "RANK", "WORLD_SIZE")
        return cls(
            launcher="torchrun", rank=rank, local_rank=local_rank, world_size=world,
            local_world_size=local_world, node_rank=node_rank,
            master_addr=env.get("MASTER_ADDR", "127.0.0.1"),
            master_port=_int(env, "MASTER_PORT", DEFAULT_MASTER_PORT), hostname=hostname,
        )

    @classmethod
    def _from_srun(cls, env: Mapping[str, str], hostname: str) -> "ClusterEnv":
        rank = _int(env, "SLURM_PROCID")
        world = _int(env, "SLURM_NTASKS")
        _check_rank(rank, world, "SLURM_PROCID", "SLURM_NTASKS")
        nodelist = env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST") or ""
        hosts = expand_nodelist(nodelist) if nodelist else []
        num_nodes = _int(env, "SLURM_JOB_NUM_NODES", _int(env, "SLURM_NNODES", max(1, len(hosts))))
        # SLURM_NTASKS_PER_NODE looks like "2" or "2(x3)"; its leading number is what we need.
        per_node = re.match(r"\d+", env.get("SLURM_NTASKS_PER_NODE", ""))
        local_world = int(per_node.group()) if per_node else max(1, world // max(1, num_nodes))
        # MASTER_ADDR wins when the batch script worked it out (Slurm node names may not resolve).
        master = env.get("MASTER_ADDR") or (hosts[0] if hosts else "127.0.0.1")
        return cls(
            launcher="srun", rank=rank, local_rank=_int(env, "SLURM_LOCALID", 0), world_size=world,
            local_world_size=local_world, node_rank=_int(env, "SLURM_NODEID", 0),
            master_addr=master,
            master_port=_int(env, "MASTER_PORT", slurm_port(env.get("SLURM_JOB_ID", "0"))),
            hostname=hostname,
        )


def job_id(env: Mapping[str, str]) -> str:
    """The job's identity across its restarts (a Slurm requeue keeps SLURM_JOB_ID; torchrun's
    restarts keep its rendezvous id, as does every pod of a PyTorchJob); "" without a launcher."""
    if env.get("SLURM_JOB_ID"):
        return f"slurm:{env['SLURM_JOB_ID']}"
    if env.get("TORCHELASTIC_RUN_ID", "none") != "none":  # torchrun's default id is "none"
        return f"torchrun:{env['TORCHELASTIC_RUN_ID']}"
    return ""


SLURM_PORT_BASE = 20000
SLURM_PORT_SPAN = 20000


def slurm_port(job_id: str, base: int = SLURM_PORT_BASE, span: int = SLURM_PORT_SPAN) -> int:
    """A rendezvous port derived from the Slurm job id, so two jobs on one node rarely collide."""
    digits = "".join(ch for ch in str(job_id) if ch.isdigit()) or "0"
    return base + int(digits) % span


_BRACKET = re.compile(r"^(?P<prefix>[^\[]*)\[(?P<body>[^\]]+)\](?P<suffix>.*)$")


def expand_nodelist(nodelist: str) -> list[str]:
    """Expand a Slurm hostlist such as ``p5-[001-004,010],gpu7`` into host names, in order.

    Zero padding is kept (``001-004`` gives ``001``..``004``). Nested brackets in one name
    (``a[1-2]-b[3-4]``) expand as a cross product, as Slurm does.
    """
    hosts: list[str] = []
    for item in _split_top_level(nodelist.strip()):
        hosts.extend(_expand_one(item))
    return hosts


def _split_top_level(text: str) -> list[str]:
    items, depth, current = [], 0, []
    for ch in text:
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise UserError(f"SLURM_JOB_NODELIST: unbalanced ']' in {text!r}")
        if ch == "," and depth == 0:
            if current:
                items.append("".join(current))
            current = []
        else:
            current.append(ch)
    if depth != 0:
        raise UserError(f"SLURM_JOB_NODELIST: unbalanced '[' in {text!r}")
    if current:
        items.append("".join(current))
    return items


def _expand_one(item: str) -> list[str]:
    match = _BRACKET.match(item)
    if not match:
        return [item]
    prefix, body, suffix = match["prefix"], match["body"], match["suffix"]
    names = []
    for part in body.split(","):
        if "-" in part:
            lo, hi = part.split("-", 1)
            if not (lo.isdigit() and hi.isdigit()) or int(lo) > int(hi):
                raise UserError(f"SLURM_JOB_NODELIST: bad range {part!r} in {item!r}")
            width = len(lo)
            names.extend(f"{prefix}{i:0{width}d}" for i in range(int(lo), int(hi) + 1))
        else:
            names.append(f"{prefix}{part}")
    # The suffix may hold another bracket group: expand it and take the cross product.
    return [name + rest for name in names for rest in _expand_one(suffix)] if suffix else names


def _int(env: Mapping[str, str], key: str, default: int | None = None) -> int:
    raw = env.get(key)
    if raw is None or raw == "":
        if default is None:
            raise UserError(f"launcher variable {key} is not set")
        return default
    try:
        return int(raw)
    except ValueError:
        raise UserError(f"launcher variable {key}={raw!r} is not an integer") from None


def _check_rank(rank: int, world: int, rank_key: str, world_key: str) -> None:
    if world < 1 or not 0 <= rank < world:
        raise UserError(f"launcher variables {rank_key}={rank} and {world_key}={world} disagree")


def task_slot(environ: Mapping[str, str] | None = None) -> tuple[int, int] | None:
    """``(index, count)`` of this process among the tasks of a Slurm job array and/or ``srun`` step.

    An array task counts from ``SLURM_ARRAY_TASK_MIN`` (``--array=1-8`` gives 0..7); under ``srun -n
    K`` inside an array task the index is ``array_index * K + SLURM_PROCID``. ``None`` outside Slurm
    (used by ``podtrain prepare --num-parts N`` to pick its part when ``--part`` is not given).
    """
    env = os.environ if environ is None else environ
    index, count = 0, 1
    if env.get("SLURM_ARRAY_TASK_ID"):
        lo = _int(env, "SLURM_ARRAY_TASK_MIN", 0)
        hi = _int(env, "SLURM_ARRAY_TASK_MAX", _int(env, "SLURM_ARRAY_TASK_ID"))
        index, count = _int(env, "SLURM_ARRAY_TASK_ID") - lo, _int(env, "SLURM_ARRAY_TASK_COUNT", hi - lo + 1)
        _check_rank(index, count, "SLURM_ARRAY_TASK_ID - SLURM_ARRAY_TASK_MIN", "SLURM_ARRAY_TASK_COUNT")
    elif "SLURM_PROCID" not in env or "SLURM_NTASKS" not in env:
        return None
    if "SLURM_PROCID" in env and "SLURM_NTASKS" in env:
        rank, world = _int(env, "SLURM_PROCID"), _int(env, "SLURM_NTASKS")
        _check_rank(rank, world, "SLURM_PROCID", "SLURM_NTASKS")
        index, count = index * world + rank, count * world
    return index, count


def launcher_variables(environ: Mapping[str, str] | None = None, prefixes: tuple[str, ...] = (
        "SLURM_", "PET_", "TORCHELASTIC_", "NCCL_", "FI_", "GLOO_")) -> dict[str, str]:
    """The launcher and fabric variables present, for diagnostics (doctor, placement lines)."""
    env = os.environ if environ is None else environ
    return {k: v for k, v in sorted(env.items()) if k.startswith(prefixes)}


def threads_per_rank(local_ranks: int, cores: int | None = None) -> int:
    """Each rank's share of this machine's cores (at least 1): the rule ``cap_cpu_threads`` and
    the launchers apply, so ranks never oversubscribe the cores."""
    return max(1, (cores or os.cpu_count() or 1) // max(1, local_ranks))


def omp_num_threads(environ: Mapping[str, str] | None = None) -> int | None:
    """OMP_NUM_THREADS when a launcher or the user set it (torchrun sets 1 per worker), else None."""
    env = os.environ if environ is None else environ
    raw = env.get("OMP_NUM_THREADS", "")
    return int(raw) if raw.isdigit() and int(raw) > 0 else None
