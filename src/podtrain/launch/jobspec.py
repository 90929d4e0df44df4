"""What the cluster launchers (Slurm, Kubernetes) share: the checks made before anything is written.

A cluster job that dies an hour later on a typo in the training config, or because the global batch
does not divide over the nodes it got, is the failure these launchers exist to prevent. So every
launcher builds a ``JobSpec`` first: it loads and validates the training config, checks it against
the job's world size, and resolves the GPUs per node; only then is a script or manifest written.
The resolved config is shipped inside the script or manifest, so what runs on the cluster is
exactly what was validated here, even if the YAML file is edited after submission.
"""

from __future__ import annotations

import argparse

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import yaml

from podtrain.config import RunConfig, accumulation_steps, load_config, to_dict
from podtrain.errors import UserError
from podtrain.launch.instances import InstanceType, lookup, resolve_gpus
from podtrain.launch.shell import check
from podtrain.plan.fit import Devices, check_memory


@dataclass(frozen=True)
class JobSpec:
    """A validated multi-node job: how many nodes and processes, and the training config.

    Attributes:
        nodes: nodes (Slurm nodes or Kubernetes worker pods), at least 1.
        nproc_per_node: training processes per node (one per GPU, or CPU ranks).
        gpus_per_node: GPUs per node; 0 for a CPU partition.
        instance: the instance-type preset, or None.
        cfg: the validated training config.
    """

    nodes: int
    nproc_per_node: int
    gpus_per_node: int
    instance: InstanceType | None
    cfg: RunConfig

    @property
    def world_size(self) -> int:
        """Training processes in the whole job."""
        return self.nodes * self.nproc_per_node

    def fabric_env(self) -> dict[str, str]:
        """EFA/libfabric variables for this job's instance type (none on CPU or without EFA)."""
        if self.instance is None or self.gpus_per_node == 0:
            return {}
        return self.instance.fabric_env()


def build_spec(config: str, overrides: Sequence[str], nodes: int, gpus_per_node: int | None,
               nproc_per_node: int | None, instance_type: str | None,
               min_nodes: int | None = None, gpu_memory_gib: float | None = None) -> JobSpec:
    """Validate the launch flags and the training config; raise UserError on the first problem
    (a run.dir or data path no job script can carry, ``shell.check``, among them).

    ``min_nodes`` is the smallest world an elastic job may shrink to; the batch arithmetic must
    work for every node count between it and ``nodes``, and the memory (``check_job_memory``) at
    the smallest.
    """
    if nodes < 1:
        raise UserError(f"--nodes must be at least 1, got {nodes}")
    instance = lookup(instance_type) if instance_type else None
    gpus = resolve_gpus(instance, gpus_per_node)
    nproc = _resolve_nproc(gpus, nproc_per_node)
    cfg = load_config(config, overrides)
    for key, path in data_paths(cfg):  # they reach the job's script or command line (shell.py)
        check(path, key)
    low = nodes if min_nodes is None else min_nodes
    if not 1 <= low <= nodes:
        raise UserError(f"--min-nodes must be between 1 and --nodes ({nodes}), got {low}")
    for n in range(low, nodes + 1):
        accumulation_steps(cfg.train.global_batch_size, cfg.train.micro_batch_size, n * nproc)
    check_job_memory(cfg, low * nproc, nproc, gpus, instance, gpu_memory_gib)
    return JobSpec(nodes=nodes, nproc_per_node=nproc, gpus_per_node=gpus, instance=instance, cfg=cfg)


def check_job_memory(cfg: RunConfig, world: int, nproc: int, gpus: int, instance: InstanceType | None,
                     gpu_memory_gib: float | None) -> None:
    """``podtrain plan``'s memory check (``plan.fit.check_memory``) for the job's GPUs: memory from
    ``--gpu-memory`` GiB, else the instance type; without either (or on CPU) nothing is known."""
    if gpu_memory_gib is not None and (gpu_memory_gib <= 0 or gpus == 0):
        raise UserError(f"--gpu-memory {gpu_memory_gib:g}: give the GiB of one GPU (> 0) of GPU nodes")
    if gpu_memory_gib is not None:
        devices = Devices(f"one GPU (--gpu-memory {gpu_memory_gib:g})", nproc, int(gpu_memory_gib * 2**30), True)
    elif instance is not None and gpus:
        devices = Devices(f"each {instance.name} GPU", nproc, int(instance.gpu_memory_gib * 2**30), True)
    else:
        return
    from podtrain.plan.shape import model_shape

    check_memory(cfg, model_shape(cfg), devices, world, cfg.model.memory_check)


def _resolve_nproc(gpus: int, nproc: int | None) -> int:
    if gpus == 0:
        if nproc is None:
            raise UserError("--gpus-per-node 0 (a CPU partition) needs --nproc-per-node P")
        if nproc < 1:
            raise UserError(f"--nproc-per-node must be at least 1, got {nproc}")
        return nproc
    if nproc is None:
        return gpus
    if not 1 <= nproc <= gpus:
        raise UserError(f"--nproc-per-node {nproc} must be between 1 and --gpus-per-node ({gpus}): "
                        "each process drives one GPU")
    return nproc


def mix_with_paths(mix: list[dict[str, Any]], place: Callable[[str], str]) -> list[dict[str, Any]]:
    """``data.mix`` with each local source's path passed through ``place`` (s3:// kept as is)."""
    return [dict(entry, path=entry["path"] if "://" in entry["path"] else place(entry["path"])) for entry in mix]


def absolute_paths(cfg: RunConfig, base: Path) -> dict[str, Any]:
    """``run.dir``, ``data.path`` and ``data.mix``'s paths made absolute against ``base`` (the
    submit directory).

    Nodes may start in another working directory (a container's, a pod's), so relative paths are
    pinned here, where the user meant them.
    """
    def place(value: str) -> str:
        return str((base / value).resolve()) if not Path(value).is_absolute() else value

    paths: dict[str, Any] = {"run.dir": place(cfg.run.dir), "data.path": place(cfg.data.path)}
    if cfg.data.mix:
        paths["data.mix"] = mix_with_paths(cfg.data.mix, place)
    return paths


def data_paths(cfg: RunConfig) -> list[tuple[str, str]]:
    """(key, path) of the run directory and every local data source, for the storage warnings."""
    data = [("data.mix", e["path"]) for e in cfg.data.mix if "://" not in e["path"]] if cfg.data.mix \
        else [("data.path", cfg.data.path)]
    return [("run.dir", cfg.run.dir)] + data


NODE_LOCAL_ROOTS = ("/tmp", "/var/tmp", "/dev/shm", "/run")
"""Directories that are on every node but never the same storage on two nodes."""


def shared_storage_warnings(cfg: RunConfig, base: Path, home: Path | None = None) -> list[str]:
    """One line per run.dir / data.path that the other nodes may not see: a relative path (pinned
    to ``base``, this machine's directory), a node-local directory, or a home directory (shared on
    some clusters, local on others)."""
    home = (home or Path.home()).resolve()
    lines = []
    for key, value in data_paths(cfg):
        path = (base / value).resolve()  # an absolute value ignores base
        if not Path(value).is_absolute():
            lines.append(f"{key} {value} is relative: the job uses {path} on every node; is that on "
                         "storage every node mounts?")
        elif any(path.is_relative_to(root) for root in NODE_LOCAL_ROOTS):
            lines.append(f"{key} {value} is node-local storage: other nodes cannot see it")
        elif path.is_relative_to(home) or path.is_relative_to("/home"):
            lines.append(f"{key} {value} is in a home directory: make sure every node mounts it "
                         "(shared storage such as /fsx is safer)")
    return lines


def config_yaml(cfg: RunConfig, updates: dict[str, object] | None = None) -> str:
    """The resolved config as YAML, with dotted ``updates`` applied (e.g. ``{"run.dir": ...}``)."""
    data = to_dict(cfg)
    for key, value in (updates or {}).items():
        section, leaf = key.split(".")
        data[section][leaf] = value
    return yaml.safe_dump(data, sort_keys=False)


# registry[:port]/path/name[:tag][@sha256:digest]; the tag is on the last path component.
_DIGEST = re.compile(r"@sha256:[0-9a-f]{64}$")
_TAG = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}")
"""An image tag as registries take it (the OCI distribution spec's tag grammar)."""


def check_image(image: str, flag: str = "--image") -> None:
    """UserError unless ``image`` names a tag or digest: an untagged image means ``:latest``,
    which changes under a running job, so restarted pods could run different code. A tag no
    registry takes (``:v1 && x``, ``:$(...)``) is refused here, not at the first pull."""
    if not image or any(c.isspace() for c in image):
        raise UserError(f"{flag} {image!r} is not a container image name")
    check(image, flag)
    if _DIGEST.search(image):
        return
    last = image.replace("#", "/").rsplit("/", 1)[-1]  # pyxis writes registry#image
    if ":" not in last or last.endswith(":"):
        raise UserError(f"{flag} {image} has no tag: name one (e.g. {image.rstrip(':')}:v1) "
                        "or a digest, so every node runs the same image")
    tag = last.rsplit(":", 1)[1]
    if not _TAG.fullmatch(tag):
        raise UserError(f"{flag} {image}: {tag!r} is not an image tag (up to 128 letters, digits, '_', "
                        "'.' and '-', not starting with '.' or '-')")


def dns_label(text: str, limit: int = 50) -> str:
    """``text`` as a Kubernetes/Slurm-friendly name: lower case, [a-z0-9-], trimmed."""
    name = re.sub(r"[^a-z0-9-]+", "-", text.lower()).strip("-")
    return name[:limit].rstrip("-") or "podtrain"


def add_job_arguments(parser: "argparse.ArgumentParser", unit: str, shipped_in: str,
                      max_restarts: int) -> None:
    """The options both cluster launchers share: the config, overrides, each ``unit``'s shape
    (``unit`` is "node" for Slurm, "pod" for Kubernetes) and torchrun's restarts and rendezvous
    wait (``max_restarts``: the launcher's default)."""
    parser.add_argument("config", help=f"YAML training config (validated now, shipped in {shipped_in})")
    parser.add_argument("overrides", nargs="*", help="section.key=value overrides")
    parser.add_argument("--nodes", type=int, required=True, help=f"{unit}s to run (one torchrun each)")
    parser.add_argument("--gpus-per-node", type=int, default=None,
                        help=f"GPUs per {unit} (0: CPU only, then give --nproc-per-node)")
    parser.add_argument("--nproc-per-node", type=int, default=None,
                        help=f"training processes per {unit} (default: one per GPU)")
    parser.add_argument("--max-restarts", type=int, default=max_restarts,
                        help=f"torchrun restarts of the worker group after a failure (default {max_restarts})")
    parser.add_argument("--join-timeout", type=int, default=600,
                        help=f"seconds torchrun waits for all {unit}s at rendezvous (default 600)")
    parser.add_argument("--instance-type", default=None,
                        help="preset filling GPUs and EFA devices, e.g. p5.48xlarge, p4d.24xlarge")
    add_gpu_memory_argument(parser)


def add_gpu_memory_argument(parser: "argparse.ArgumentParser") -> None:
    """``--gpu-memory GIB``: the memory of one GPU, for the memory check ``podtrain plan`` makes."""
    parser.add_argument("--gpu-memory", type=float, default=None, metavar="GIB",
                        help="GiB of one GPU (default: the instance type's): the job is refused "
                             "before anything is written when it does not fit, as `podtrain plan` says")
