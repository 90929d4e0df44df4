"""``podtrain launch k8s CONFIG --nodes N --gpus-per-node G --image IMAGE``: a Kubernetes job.

Writes two YAML documents: a ConfigMap holding the validated training config, and either a
Kubeflow ``PyTorchJob`` (kubeflow.org/v1, the default) or SageMaker HyperPod's
``HyperPodPyTorchJob`` (``--kind hyperpodpytorchjob``, whose image needs HyperPod's
``hyperpodrun``: ``pip install hyperpod-elastic-agent``). What the PyTorchJob gets right:

* ``elasticPolicy`` with c10d rendezvous, min/max replicas and ``maxRestarts``, and
  ``nprocPerNode``: the training operator turns them into the ``PET_*`` variables torchrun reads.
* The worker waits until the rendezvous host's pod DNS name resolves (it appears a few seconds
  after the pods start) instead of failing the rendezvous, and passes its pod IP as
  ``--local-addr`` so the ranks are told addresses, not names that may not resolve yet.
* Resources ``nvidia.com/gpu`` and ``vpc.amazonaws.com/efa`` (without the EFA devices NCCL quietly
  falls back to TCP sockets) and the NoSchedule tolerations of their taints; with
  ``--instance-type``, CPU and memory requests equal to limits inside the node's EKS allocatable
  (a Guaranteed pod, evicted last) and the EFA huge pages (``instances.pod_resources``); a
  memory-backed ``/dev/shm``, the shared-storage claim mounted where the run directory lives, and
  the EFA/NCCL environment of the instance type.
* The container runs ``launch.agent`` around torchrun/hyperpodrun, so its exit status is the
  workers' (0, 2, 124, 130, 143), and ``restartPolicy: ExitCode``: the training operator retries
  a pod that ended with 128-255 (143 after a preemption save) and fails the job on 1-127 (2: a
  user mistake; 124: a hang).
* ``--hyperpod-auto-resume``: HyperPod's job auto-resume annotations (which need ``OnFailure``)
  and a node affinity for nodes that passed its health checks.
* The node-local checkpoint tier (``ckpt.local_dir``) on a volume the pod mounts, or refused
  (``check_local_tier``): ``--local-tier-host-path`` mounts a directory of the node (its NVMe) there,
  and where the volume has a size limit (the memory-backed ``/dev/shm``) the tier's retained steps
  must fit in it at the planner's checkpoint size.

Every manifest is checked at generation time against the schemas shipped in ``launch/schemas/``
(``podtrain.launch.schemas``): the PyTorchJob CRD, HyperPod's HyperPodPyTorchJob model, and the
core Kubernetes pod template.
"""

from __future__ import annotations

import argparse
import math
import posixpath
import re
import sys
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

import yaml

from podtrain.config import load_config
from podtrain.distributed.env import DEFAULT_MASTER_PORT
from podtrain.errors import UserError
from podtrain.launch import schemas
from podtrain.launch.instances import efa_share, pod_resources
from podtrain.launch.jobspec import (JobSpec, add_job_arguments, build_spec, check_image, config_yaml, dns_label,
                                     mix_with_paths)
from podtrain.launch.k8s_names import check_names, quantity_bytes, service_account
from podtrain.launch.schemas import (CRD_FILE, crd_schema, job_pod_template, unknown_fields,  # noqa: F401
                                     validate_pod_template, validate_pytorchjob)
from podtrain.launch.shell import Var, check, line
from podtrain.launch.torchrun import (TORCHRUN_MODULE, TRAIN_MODULE, kill_grace_s, shutdown_timeout_s,
                                      torchrun_flags, worker_env)

CONFIG_DIR = "/etc/podtrain"
RDZV_PORT = DEFAULT_MASTER_PORT
HYPERPOD_AGENT_PORT = 8080  # the HyperPod elastic agent listens here
HYPERPOD_EVAL_PERIOD_S = 1800  # restarts within this window count toward a full-job restart
HEALTH_LABEL = "sagemaker.amazonaws.com/node-health-status"
AUTO_RESUME = "sagemaker.amazonaws.com/enable-job-auto-resume"
MAX_RETRY = "sagemaker.amazonaws.com/job-max-retry-count"
KINDS = ("pytorchjob", "hyperpodpytorchjob")
GIB = 2**30
AGENT = ("python3", "-m", "podtrain.launch.agent")
"""The container's entry point around the launcher (``launch/agent.py``)."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``podtrain launch k8s``."""
    add_job_arguments(parser, "pod", "a ConfigMap", max_restarts=3)
    parser.add_argument("--min-nodes", type=int, default=None,
                        help="elastic minimum of worker pods (default: --nodes)")
    parser.add_argument("--efa", type=int, default=None,
                        help="EFA devices per pod (default: its GPUs' share of the instance type's)")
    parser.add_argument("--image", required=True, help="container image with podtrain, tagged")
    parser.add_argument("--kind", default="pytorchjob", metavar="{pytorchjob,hyperpodpytorchjob}",
                        help="pytorchjob (Kubeflow's PyTorchJob) or hyperpodpytorchjob (SageMaker "
                        "HyperPod's HyperPodPyTorchJob: the image needs hyperpodrun)")
    parser.add_argument("--name", default=None, help="job name (default: podtrain-RUN)")
    parser.add_argument("--namespace", default=None,
                        help="namespace (default: kubeflow with --hyperpod-auto-resume, else none)")
    parser.add_argument("--service-account", default=None, metavar="NAME",
                        help="the pods' Kubernetes service account: S3 credentials through IRSA or "
                             "EKS Pod Identity (no secret in the manifest)")
    parser.add_argument("--pvc", default=None, help="shared-storage claim (e.g. FSx) for the run")
    parser.add_argument("--mount", default="/fsx", help="where the claim is mounted (default /fsx)")
    parser.add_argument("--shm-size", default="32Gi", help="memory-backed /dev/shm size (default 32Gi)")
    parser.add_argument("--local-tier-host-path", default=None, metavar="HOST_DIR",
                        help="a directory of the node (its NVMe, e.g. /opt/dlami/nvme/podtrain) mounted "
                             "at ckpt.local_dir for the node-local checkpoint tier (hostPath, "
                             "DirectoryOrCreate; kept across pod restarts on that node)")
    parser.add_argument("--hyperpod-auto-resume", action="store_true",
                        help="a PyTorchJob with HyperPod's job auto-resume annotations and "
                        "healthy-node affinity (not a HyperPodPyTorchJob: see --kind)")
    parser.add_argument("--hyperpod", action="store_true", help=argparse.SUPPRESS)  # renamed
    parser.add_argument("--max-retry", type=int, default=10,
                        help="HyperPod job retries: auto-resume's, or a HyperPodPyTorchJob's "
                        "jobMaxRetryCount (default 10)")
    parser.add_argument("--output", "-o", default="-",
                        help="where to write the manifest (default: standard output)")


def build_manifests(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Validate flags and config, then return ``[ConfigMap, job]``; UserError on bad input."""
    _check_kind(args)
    check_image(args.image)
    check_names(args)
    spec = build_spec(args.config, args.overrides, args.nodes, args.gpus_per_node,
                      args.nproc_per_node, args.instance_type, min_nodes=args.min_nodes,
                      gpu_memory_gib=args.gpu_memory)
    check(args.mount, "--mount")  # with run.dir (checked by build_spec), in the pod's command line
    hyperpod = args.hyperpod_auto_resume or args.kind == "hyperpodpytorchjob"
    name = dns_label(args.name or f"podtrain-{Path(spec.cfg.run.dir).name}", limit=40)
    namespace = _namespace(args.namespace, args.hyperpod_auto_resume)
    paths = _shared_paths(spec, args.pvc, args.mount)
    if args.max_restarts < 0 or args.join_timeout < 1 or args.max_retry < 0:
        raise UserError("--max-restarts and --max-retry must be >= 0, --join-timeout >= 1")
    efa = _efa_count(spec, args.efa)
    config_map = {
        "apiVersion": "v1", "kind": "ConfigMap",
        "metadata": _metadata(f"{name}-config", namespace, spec),
        "data": {"config.yaml": config_yaml(spec.cfg, paths)},
    }
    template = pod_template(spec, args, name, paths["run.dir"], efa, hyperpod)
    check_local_tier(spec, template["spec"], args.min_nodes or spec.nodes)
    if args.kind == "hyperpodpytorchjob":
        job = _hyperpod_job(spec, args, name, namespace, template)
    else:
        job = _pytorch_job(spec, args, name, namespace, template, args.hyperpod_auto_resume)
    return [config_map, job]


def _check_kind(args: argparse.Namespace) -> None:
    """``--kind`` is one of ``KINDS``; the old, confusable spellings say their new names."""
    if args.hyperpod:
        raise UserError("--hyperpod is now --hyperpod-auto-resume (HyperPod's auto-resume of a "
                        "Kubeflow PyTorchJob; a HyperPodPyTorchJob is --kind hyperpodpytorchjob)")
    if args.kind == "hyperpod":
        raise UserError("--kind hyperpod is now --kind hyperpodpytorchjob (its image needs "
                        "hyperpodrun; HyperPod's auto-resume of a PyTorchJob is --hyperpod-auto-resume)")
    if args.kind not in KINDS:
        raise UserError(f"--kind {args.kind} is not one of {', '.join(KINDS)}")
    if args.hyperpod_auto_resume and args.kind == "hyperpodpytorchjob":
        raise UserError("--hyperpod-auto-resume is for a PyTorchJob; a HyperPodPyTorchJob restarts "
                        "by its own runPolicy (--max-retry, --max-restarts)")


def _namespace(namespace: str | None, auto_resume: bool) -> str | None:
    if not auto_resume:
        return namespace
    namespace = namespace or "kubeflow"
    # HyperPod only auto-resumes jobs in these namespaces.
    if namespace != "kubeflow" and not namespace.startswith("hyperpod"):
        raise UserError(f"--namespace {namespace}: HyperPod auto-resume needs the kubeflow "
                        "namespace or one whose name starts with 'hyperpod'")
    return namespace


def _shared_paths(spec: JobSpec, pvc: str | None, mount: str) -> dict[str, Any]:
    """run.dir and data.path as the pods see them: relative paths live on the shared claim."""
    if not PurePosixPath(mount).is_absolute():
        raise UserError(f"--mount {mount} must be an absolute path")
    run_dir, data = spec.cfg.run.dir, spec.cfg.data.path
    if pvc is None:
        if spec.nodes > 1:
            raise UserError("--nodes > 1 needs --pvc CLAIM: every pod must see the run directory "
                            "(rank 0 writes checkpoints, all ranks read them)")
        return {"run.dir": run_dir, "data.path": data}
    def place(value: str) -> str:
        return value if PurePosixPath(value).is_absolute() else str(PurePosixPath(mount) / value)

    resolved: dict[str, Any] = {"run.dir": place(run_dir), "data.path": place(data)}
    if spec.cfg.data.mix:
        resolved["data.mix"] = mix_with_paths(spec.cfg.data.mix, place)
    if not PurePosixPath(resolved["run.dir"]).is_relative_to(mount):
        raise UserError(f"run.dir {run_dir} is not under --mount {mount}: checkpoints would be "
                        "written inside a pod and lost when it restarts")
    return resolved


LOCAL_TIER_VOLUME = "local-tier"
"""The hostPath volume of ``--local-tier-host-path``."""
_IMAGE_DIRS = ("/bin", "/dev", "/etc", "/lib", "/proc", "/sbin", "/sys", "/usr")
"""Directories of the image a mount at or above would hide from the container (its programs, devices)."""


def local_tier_root(local_dir: str) -> PurePosixPath:
    """The directory ``ckpt.local_dir`` lies in whatever its environment variables expand to on a
    rank (``/local/${NODE}`` -> ``/local``), normalised as Kubernetes requires a mountPath (no
    ``..``): where a volume must be mounted for the local tier to be on it."""
    parts: list[str] = []
    for part in PurePosixPath(local_dir).parts:
        if "$" in part:
            break
        parts.append(part)
    return PurePosixPath(posixpath.normpath(str(PurePosixPath(*parts)))) if parts else PurePosixPath(".")


def local_tier_mount(local_dir: str, host_dir: str, mounts: list[dict[str, Any]]) -> str:
    """Where ``--local-tier-host-path host_dir`` is mounted: at ``ckpt.local_dir`` (its part before
    any environment variable), which must be set; UserError when the two cannot make a mount
    Kubernetes takes beside the pod's other ``mounts``."""
    flag = f"--local-tier-host-path {host_dir}"
    check(host_dir, "--local-tier-host-path")
    if not local_dir:
        raise UserError(f"{flag} needs the local tier on: set ckpt.local_dir (where the pods mount that "
                        "directory, e.g. /local) and ckpt.local_every")
    if not PurePosixPath(host_dir).is_absolute() or ".." in PurePosixPath(host_dir).parts:
        raise UserError(f"{flag} must be an absolute path on the node without '..'")
    at = local_tier_root(local_dir)
    if not at.is_absolute() or at == PurePosixPath("/"):
        raise UserError(f"{flag}: config key 'ckpt.local_dir' {local_dir} gives no directory to mount it "
                        "at (an absolute path such as /local is needed)")
    hidden = next((d for d in _IMAGE_DIRS if PurePosixPath(d).is_relative_to(at)), None)
    if hidden is not None:
        raise UserError(f"{flag}: config key 'ckpt.local_dir' {local_dir} would mount it over the image's "
                        f"{hidden}, which the container needs: choose another directory, e.g. /local")
    for mount in mounts:
        if PurePosixPath(mount["mountPath"]) == at or (
                mount.get("readOnly") and at.is_relative_to(mount["mountPath"])):
            raise UserError(f"{flag}: config key 'ckpt.local_dir' {local_dir} is the pod's "
                            f"{'read-only ' if mount.get('readOnly') else ''}{mount['mountPath']} mount "
                            f"(volume {mount['name']}): choose another directory, e.g. /local")
    return str(at)


@dataclass(frozen=True)
class _Volume:
    """A volume as the container sees it: where, what it is, how long its files live."""

    path: str
    kind: str
    lifetime: str
    read_only: bool
    size_limit: tuple[str, str] | None
    """``(flag, quantity)`` of a known size limit (an emptyDir's sizeLimit), or None."""


def _pod_volumes(pod: dict[str, Any]) -> list[_Volume]:
    """The container's mounts, described from the pod spec itself (the manifest being written)."""
    volumes = {v["name"]: v for v in pod["volumes"]}
    out = []
    for mount in pod["containers"][0]["volumeMounts"]:
        volume = volumes[mount["name"]]
        limit = None
        if "emptyDir" in volume:
            memory = volume["emptyDir"].get("medium") == "Memory"
            kind = f"{'memory-backed ' if memory else ''}emptyDir {mount['name']}"
            lifetime = "kept across container restarts, lost when the pod is deleted or replaced"
            if "sizeLimit" in volume["emptyDir"]:
                # the only emptyDir launch k8s writes is /dev/shm, sized by --shm-size
                limit = ("--shm-size", volume["emptyDir"]["sizeLimit"])
        elif "hostPath" in volume:
            kind = f"hostPath {volume['hostPath']['path']} of the node"
            lifetime = "kept across pod restarts on that node, lost with the node (ckpt.local_replicas covers that)"
        elif "persistentVolumeClaim" in volume:
            kind = f"claim {volume['persistentVolumeClaim']['claimName']}"
            lifetime = "shared storage, not node-local: kept, at the claim's speed"
        else:
            kind, lifetime = f"ConfigMap {volume.get('configMap', {}).get('name', mount['name'])}", "read-only"
        out.append(_Volume(mount["mountPath"], kind, lifetime, bool(mount.get("readOnly")), limit))
    return out


def local_tier_volume(local_dir: str, pod: dict[str, Any]) -> _Volume | None:
    """The volume of ``pod`` that holds ``ckpt.local_dir`` (the innermost mount it lies under)."""
    root = local_tier_root(local_dir)
    under = [v for v in _pod_volumes(pod) if root.is_absolute() and root.is_relative_to(v.path)]
    return max(under, key=lambda v: len(PurePosixPath(v.path).parts), default=None)


def check_local_tier(spec: JobSpec, pod: dict[str, Any], min_nodes: int) -> None:
    """``ckpt.local_dir`` must lie on a writable volume of ``pod``, and where that volume has a size
    limit, hold the tier's steps at the planner's checkpoint size (``local_tier_bytes``); UserError
    (one line, naming the key, the path and the volumes or both sizes) otherwise."""
    ckpt = spec.cfg.ckpt
    if not ckpt.local_dir:
        return
    key = f"config key 'ckpt.local_dir' {ckpt.local_dir}"
    mounted = ", ".join(f"{v.path} ({v.kind})" for v in _pod_volumes(pod))
    if not local_tier_root(ckpt.local_dir).is_absolute():
        raise UserError(f"{key} is relative: in a pod it would land in the container's working directory; "
                        "give an absolute path on a volume of the pod (mounted: "
                        f"{mounted}), e.g. /local with --local-tier-host-path /opt/dlami/nvme/podtrain")
    volume = local_tier_volume(ckpt.local_dir, pod)
    if volume is None:
        raise UserError(
            f"{key} is on none of the pod's volumes ({mounted}): it would be the container's own "
            "filesystem, which survives only torchrun's restarts inside the container and is discarded "
            "when the container restarts or the pod is replaced, so no restart would find a local "
            "checkpoint; mount the node's NVMe there with --local-tier-host-path (e.g. "
            "/opt/dlami/nvme/podtrain: kept across pod restarts on that node) or put it under /dev/shm "
            "(kept across container restarts, lost with the pod)")
    if volume.read_only:
        raise UserError(f"{key} is on the pod's read-only {volume.path} ({volume.kind}); mounted: {mounted}")
    if volume.size_limit is None:
        return
    flag, quantity = volume.size_limit
    need, how = local_tier_bytes(spec, min_nodes)
    have = quantity_bytes(quantity)
    if need > have:
        raise UserError(
            f"{key} is on the pod's {volume.path} ({volume.kind}, {flag} {quantity} = {_size(have)}), "
            f"too small for the local tier: it holds {_size(need)} per node ({how}); give {flag} "
            f"{_quantity_at_least(need)} or more, or put the tier on the node's NVMe (--local-tier-host-path)")


def _size(nbytes: float) -> str:
    """Bytes for a person: MiB below a GiB, else GiB."""
    return f"{nbytes / 2**20:.1f} MiB" if nbytes < GIB else f"{nbytes / GIB:.1f} GiB"


def _quantity_at_least(nbytes: int) -> str:
    """The smallest round Kubernetes quantity of at least ``nbytes`` (Mi below 10 GiB, else Gi)."""
    return f"{math.ceil(nbytes / 2**20)}Mi" if nbytes < 10 * GIB else f"{math.ceil(nbytes / GIB)}Gi"


def local_tier_bytes(spec: JobSpec, min_nodes: int) -> tuple[int, str]:
    """Bytes the local tier holds on one node at most, and how they add up: ``ckpt.local_keep``
    steps plus the one being written (retention prunes after a save commits), each the node's
    share of the planner's checkpoint size (``plan.memory.checkpoint_bytes`` of the model training
    builds: ``plan.shape.model_shape``), spread over the fewest nodes the job may run on, plus the
    copies of ``ckpt.local_replicas`` peers' shares."""
    from podtrain.plan.memory import checkpoint_bytes
    from podtrain.plan.shape import model_shape

    ckpt = spec.cfg.ckpt
    params = model_shape(spec.cfg).params
    total = checkpoint_bytes(params)
    replicas = min(ckpt.local_replicas, min_nodes - 1)  # one node has no peers
    share = total / min_nodes
    steps = ckpt.local_keep + 1
    need = math.ceil(steps * (1 + replicas) * share)
    copies = (f"own pieces + {replicas} peer replica{'s' * (replicas > 1)} (ckpt.local_replicas)" if replicas
              else "own pieces, no peer replica")
    how = (f"ckpt.local_keep {ckpt.local_keep} + the step being written = {steps} steps x {1 + replicas} "
           f"({copies}) x {_size(share)}: the planner's {_size(total)} checkpoint of {params:,} "
           f"parameters over {min_nodes} node{'s' * (min_nodes != 1)}")
    return need, how


def _print_path_mapping(args: argparse.Namespace, docs: list[dict[str, Any]]) -> None:
    """Say where run.dir and data.path are inside the pods (relative paths move onto the claim),
    and on which volume the local tier is, with what survives there."""
    cfg = load_config(args.config, args.overrides)
    pods = yaml.safe_load(docs[0]["data"]["config.yaml"])
    where = f"on claim {args.pvc} mounted at {args.mount}" if args.pvc else "inside the pod (no --pvc)"
    for section, key in (("run", "dir"), ("data", "path")):
        mine, theirs = getattr(getattr(cfg, section), key), pods[section][key]
        arrow = f"{mine} -> {theirs}" if mine != theirs else theirs
        print(f"podtrain: {section}.{key} in the pods: {arrow} ({where})", file=sys.stderr)
    local_dir = pods["ckpt"]["local_dir"]
    volume = local_tier_volume(local_dir, job_pod_template(docs[1])["spec"]) if local_dir else None
    if volume is not None:  # build_manifests refused a local tier on no volume
        print(f"podtrain: ckpt.local_dir in the pods: {local_dir} (on {volume.path}, {volume.kind}: "
              f"{volume.lifetime})", file=sys.stderr)


def _efa_count(spec: JobSpec, efa: int | None) -> int:
    if efa is not None:
        if efa < 0:
            raise UserError(f"--efa must be 0 or more, got {efa}")
        return efa
    if spec.instance is None or spec.gpus_per_node == 0:
        return 0
    return efa_share(spec.instance, spec.gpus_per_node)


def _metadata(name: str, namespace: str | None, spec: JobSpec) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": name, "labels": {
        "app.kubernetes.io/name": "podtrain", "podtrain/run": dns_label(Path(spec.cfg.run.dir).name)}}
    if namespace:
        meta["namespace"] = namespace
    return meta


def worker_script(hyperpod_kind: bool, spec: JobSpec, run_dir: str) -> str:
    """The shell command each worker pod runs (``bash -c``): it ``exec``s ``launch.agent``
    around torchrun or hyperpodrun, so the agent is the container's PID 1 and gets the kubelet's
    SIGTERM, and the container's exit status is the workers' (see ``launch/agent.py``).

    The PyTorchJob variant leaves nnodes, rendezvous and restarts to the ``PET_*`` variables the
    training operator sets from ``elasticPolicy``; torchrun's ``--shutdown-timeout`` is added by
    the agent where the image's torch has it (2.12+). Each rank's output is also kept under
    ``RUN_DIR/logs``. The command lines are built by ``shell.line``: ``run_dir`` reaches the
    launcher as one argument, whatever it holds.
    """
    train = (*TRAIN_MODULE, Var("PODTRAIN_CONFIG"))
    grace_s = spec.cfg.ckpt.grace_s
    if hyperpod_kind:
        hyperpodrun = line(*AGENT, "hyperpodrun", f"--nnodes={spec.nodes}",
                           f"--nproc-per-node={spec.nproc_per_node}", "--shutdown-signal=SIGTERM",
                           f"--shutdown-timeout={shutdown_timeout_s(grace_s)}",
                           f"--log-dir={run_dir}/logs", "--tee=3", *train)
        return (
            "set -euo pipefail\n"
            "# hyperpodrun: HyperPod's torchrun (pip hyperpod-elastic-agent), talking to its operator.\n"
            "# Its default shutdown is SIGKILL: SIGTERM and a timeout give the workers their save.\n"
            f"exec {hyperpodrun}\n")
    flags = torchrun_flags(nproc=spec.nproc_per_node, local_addr=Var("POD_IP"), grace_s=grace_s,
                           log_dir=f"{run_dir}/logs", shutdown_flag=False)
    torchrun = line(*AGENT, "python3", *TORCHRUN_MODULE, *flags, *train)
    return (
        "set -euo pipefail\n"
        "trap 'exit 143' TERM  # PID 1 until the exec: a SIGTERM while waiting ends the wait\n"
        "# Pod DNS names are published a few seconds after the pods start: wait for the\n"
        "# rendezvous host's name instead of failing the rendezvous on it.\n"
        'host="${PET_RDZV_ENDPOINT%:*}"\n'
        "for _ in $(seq 1 300); do getent hosts \"$host\" >/dev/null && break; sleep 1; done\n"
        "getent hosts \"$host\" >/dev/null || "
        "{ echo \"podtrain: rendezvous host $host does not resolve\" >&2; exit 1; }\n"
        "# torchrun takes nnodes, rendezvous and max-restarts from the operator's PET_* variables;\n"
        "# nproc is explicit because operator versions disagree on PET_NPROC_PER_NODE.\n"
        f"exec {torchrun}\n")


def kubelet_literal(text: str) -> str:
    """``text`` escaped for the kubelet, which rewrites a container's command, args and env values
    (Kubernetes' ``expansion.Expand``): ``$(NAME)`` becomes NAME's value where one is defined,
    ``$$`` becomes ``$``, and a ``$`` before a non-ASCII character garbles that character (it
    reads one byte as a whole character). Doubling each ``$`` that precedes ``$``, ``(``, a
    non-ASCII character or the end makes it hand the text over exactly: a run.dir holding
    ``$(HOME)`` stays that, and the script's own ``$(seq ...)`` reaches bash as written."""
    return re.sub(r"\$(?=[$(]|[^\x00-\x7f]|\Z)", "$$", text)


def _environment(spec: JobSpec, run_dir: str) -> list[dict[str, Any]]:
    env = {"PODTRAIN_CONFIG": f"{CONFIG_DIR}/config.yaml",
           **worker_env(f"{run_dir}/debug", gpus=bool(spec.gpus_per_node)), **spec.fabric_env()}
    items: list[dict[str, Any]] = [{"name": k, "value": kubelet_literal(v)} for k, v in env.items()]
    items.append({"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}})
    return items


def pod_template(spec: JobSpec, args: argparse.Namespace, name: str, run_dir: str, efa: int,
                 hyperpod: bool) -> dict[str, Any]:
    """The worker pod template (a core ``PodTemplateSpec``)."""
    hyperpod_kind = args.kind == "hyperpodpytorchjob"
    limits: dict[str, Any] = {}
    if spec.gpus_per_node:
        limits["nvidia.com/gpu"] = spec.gpus_per_node
    if efa:
        limits["vpc.amazonaws.com/efa"] = efa
    if spec.instance is not None and spec.gpus_per_node:
        limits.update(pod_resources(spec.instance, spec.gpus_per_node, efa))
    container: dict[str, Any] = {
        "name": "pytorch",  # the training operator looks for this container name
        "image": args.image,
        "imagePullPolicy": "IfNotPresent",
        "command": ["bash", "-c", kubelet_literal(worker_script(hyperpod_kind, spec, run_dir))],
        "env": _environment(spec, run_dir),
        "ports": [{"name": "pytorchjob-port",
                   "containerPort": HYPERPOD_AGENT_PORT if hyperpod_kind else RDZV_PORT}],
        "volumeMounts": [{"name": "shm", "mountPath": "/dev/shm"},
                         {"name": "podtrain-config", "mountPath": CONFIG_DIR, "readOnly": True}],
    }
    if limits:
        container["resources"] = {"limits": dict(limits), "requests": dict(limits)}
    volumes: list[dict[str, Any]] = [
        {"name": "shm", "emptyDir": {"medium": "Memory", "sizeLimit": args.shm_size}},
        {"name": "podtrain-config", "configMap": {"name": f"{name}-config"}},
    ]
    if args.pvc:
        container["volumeMounts"].append({"name": "shared", "mountPath": args.mount})
        container["workingDir"] = args.mount
        volumes.append({"name": "shared", "persistentVolumeClaim": {"claimName": args.pvc}})
    host_dir = getattr(args, "local_tier_host_path", None)
    if host_dir is not None:
        at = local_tier_mount(spec.cfg.ckpt.local_dir, host_dir, container["volumeMounts"])
        container["volumeMounts"].append({"name": LOCAL_TIER_VOLUME, "mountPath": at})
        volumes.append({"name": LOCAL_TIER_VOLUME, "hostPath": {"path": host_dir, "type": "DirectoryOrCreate"}})
    pod_spec: dict[str, Any] = {
        "containers": [container], "volumes": volumes,
        # Kubernetes sends SIGTERM, then SIGKILL after this: longer than torchrun's shutdown
        # timeout (ckpt.grace_s), so the workers' checkpoint finishes and torchrun exits itself.
        "terminationGracePeriodSeconds": kill_grace_s(spec.cfg.ckpt.grace_s),
    }
    if getattr(args, "service_account", None):
        pod_spec["serviceAccountName"] = service_account(args.service_account)
    tolerations = device_tolerations(spec.gpus_per_node, efa)
    if tolerations:
        pod_spec["tolerations"] = tolerations
    if spec.instance is not None:
        itype = spec.instance.name
        pod_spec["nodeSelector"] = {"node.kubernetes.io/instance-type":
                                    f"ml.{itype}" if hyperpod else itype}
    if hyperpod:
        pod_spec["affinity"] = {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
            "nodeSelectorTerms": [{"matchExpressions": [
                {"key": HEALTH_LABEL, "operator": "In", "values": ["Schedulable"]}]}]}}}
    return {"metadata": {"labels": {"app.kubernetes.io/name": "podtrain"}}, "spec": pod_spec}


DEVICE_TAINTS = {"gpu": "nvidia.com/gpu", "efa": "vpc.amazonaws.com/efa"}
"""Taints GPU and EFA node groups carry (EKS managed node groups, eksctl and Karpenter's GPU node
pools taint ``nvidia.com/gpu``; EFA node groups ``vpc.amazonaws.com/efa``) so that other pods
stay off them; a pod that uses the device tolerates its taint."""


def device_tolerations(gpus: int, efa: int) -> list[dict[str, str]]:
    """NoSchedule tolerations for the devices the pod requests. Kubernetes' admission plugin
    ExtendedResourceToleration would add them, but EKS does not enable it: without them a
    pod never schedules on nodes tainted for their GPUs."""
    keys = [DEVICE_TAINTS["gpu"]] * bool(gpus) + [DEVICE_TAINTS["efa"]] * bool(efa)
    return [{"key": key, "operator": "Exists", "effect": "NoSchedule"} for key in keys]


def _pytorch_job(spec: JobSpec, args: argparse.Namespace, name: str, namespace: str | None,
                 template: dict[str, Any], auto_resume: bool) -> dict[str, Any]:
    meta = _metadata(name, namespace, spec)
    if auto_resume:
        meta["annotations"] = {AUTO_RESUME: "true", MAX_RETRY: str(args.max_retry)}
    return {
        "apiVersion": "kubeflow.org/v1", "kind": "PyTorchJob", "metadata": meta,
        "spec": {
            "elasticPolicy": {
                "rdzvBackend": "c10d", "rdzvId": name, "rdzvPort": RDZV_PORT,
                "rdzvConf": [{"key": "join_timeout", "value": str(args.join_timeout)}],
                "minReplicas": args.min_nodes or spec.nodes, "maxReplicas": spec.nodes,
                "maxRestarts": args.max_restarts,
            },
            # spec.nprocPerNode (a string) replaced elasticPolicy.nProcPerNode in operator v1.7.
            "nprocPerNode": str(spec.nproc_per_node),
            "pytorchReplicaSpecs": {"Worker": {
                "replicas": spec.nodes,
                # ExitCode: the operator re-creates a pod that exited with 128-255 (143 after a
                # preemption save, a kill) and fails the job on 1-127 (2: a user mistake, 124: a
                # hang, 1: a crash). HyperPod's auto-resume requires OnFailure, which retries all.
                "restartPolicy": "OnFailure" if args.hyperpod_auto_resume else "ExitCode",
                "template": template,
            }},
        },
    }


def _hyperpod_job(spec: JobSpec, args: argparse.Namespace, name: str, namespace: str | None,
                  template: dict[str, Any]) -> dict[str, Any]:
    return {
        "apiVersion": "sagemaker.amazonaws.com/v1", "kind": "HyperPodPyTorchJob",
        "metadata": _metadata(name, namespace, spec),
        "spec": {
            "nprocPerNode": str(spec.nproc_per_node),
            "replicaSpecs": [{"name": "pods", "replicas": spec.nodes, "template": template}],
            "runPolicy": {
                "jobMaxRetryCount": args.max_retry,
                "restartPolicy": {"numRestartBeforeFullJobRestart": args.max_restarts,
                                  "evalPeriodSeconds": HYPERPOD_EVAL_PERIOD_S,
                                  "maxFullJobRestarts": 1},
                "cleanPodPolicy": "All",
            },
        },
    }


class _Dumper(yaml.SafeDumper):
    """YAML with multi-line strings (the worker script) as readable literal blocks."""


def _str(dumper: yaml.SafeDumper, text: str) -> yaml.Node:
    style = "|" if "\n" in text else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", text, style=style)


_Dumper.add_representer(str, _str)


def to_yaml(docs: list[dict[str, Any]]) -> str:
    """The manifests as one multi-document YAML text (``kubectl apply -f`` reads it)."""
    return yaml.dump_all(docs, Dumper=_Dumper, sort_keys=False)


def run(args: argparse.Namespace) -> int:
    """Validate, then write the manifests (standard output or --output)."""
    docs = build_manifests(args)
    # A failure here is a podtrain bug, never the user's: a traceback, and nothing written.
    if docs[1]["kind"] == "PyTorchJob":
        validate_pytorchjob(docs[1], CRD_FILE)
    else:
        schemas.validate_hyperpodpytorchjob(docs[1])
    try:  # optional dependency (pip install podtrain[k8s])
        validate_pod_template(job_pod_template(docs[1]))
    except ImportError:
        pass
    _print_path_mapping(args, docs)
    text = to_yaml(docs)
    if args.output == "-":
        sys.stdout.write(text)
    else:
        try:
            Path(args.output).parent.mkdir(parents=True, exist_ok=True)
            Path(args.output).write_text(text)
        except OSError as exc:
            raise UserError(f"--output {args.output}: cannot write it ({exc.strerror})") from None
        print(f"podtrain: wrote {args.output} (kubectl apply -f {args.output})", file=sys.stderr)
    return 0
