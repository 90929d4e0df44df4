"""How podtrain runs torchrun: one home for the facts every launcher (local, Slurm, Kubernetes) uses.

Each fact here is a failure seen on a real cluster or on a CPU machine, written once; ``local.py``
builds its command from these functions, ``slurm.py`` renders them into the batch script, and
``k8s.py`` into the pod spec:

* ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``: after a restart (``--max-restarts``) the workers build a
  fresh TCPStore instead of reusing the rendezvous store, which still names a dead rank's old port
  (gloo restarts then fail with "Connection refused" about half the time).
* ``TORCH_NCCL_ASYNC_ERROR_HANDLING=1``: a failed or timed-out NCCL collective aborts the process
  instead of hanging the job.
* The flight recorder (``flight_recorder_env``): each rank's last collectives, dumped into
  ``RUN_DIR/debug`` on a timeout.
* ``NCCL_SOCKET_IFNAME=^lo,docker,veth``: loopback, docker bridges and veth pairs never carry
  traffic between nodes (NCCL takes ^exclusions; gloo does not, so the launchers pin gloo to the
  interface that routes to the rendezvous host instead).
* ``--shutdown-timeout``: on SIGTERM torchrun relays the signal to its workers and SIGKILLs them
  after this many seconds (30 by default). podtrain sets it from ``ckpt.grace_s`` so the
  checkpoint a preemption asks for can finish (``shutdown_timeout_s``). torchrun has the flag
  from torch 2.12 and rejects it before, so it is passed only where the torchrun that will run
  has it: the installed torch for ``launch local`` and ``launch slurm`` (a shared environment),
  the image's, checked at run time by ``launch.agent``, on Kubernetes.
* ``join_timeout`` in ``--rdzv-conf``: a missing node fails the rendezvous in a minute, not ten;
  ``is_host=1`` on the node that hosts the c10d store (needed when the host name resolves to
  127.0.0.1, as in containers and network namespaces).
* torchrun starts each worker in a session of its own, and ``launch local`` starts torchrun in its
  own (so a terminal's Ctrl-C reaches only the launcher, which relays it once): a ``kill -9`` of
  the launcher (the OOM killer, a CI timeout) or of torchrun would leave the job training
  unseen and holding its lease. So the launcher's agents get a parent-death signal
  (``start_with_parent_death_signal``) and, where the launcher asks (``DIE_WITH_AGENT``), each
  worker sets one too (``die_with_agent``): SIGKILL, the same end a ``kill -9`` of the job gives.
"""

from __future__ import annotations

import ctypes
import importlib.metadata
import math
import os
import re
import signal
import sys
from pathlib import Path

from podtrain.launch.shell import Var, Word, concat

RELIABLE_RESTARTS = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
"""Workers make their own TCPStore after a restart (see the module docstring)."""

NCCL_ERRORS_ABORT = {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "1"}
"""A failed NCCL collective ends the process instead of hanging it."""

NCCL_SOCKET_EXCLUDE = "^lo,docker,veth"
"""NCCL's bootstrap/socket interfaces: everything but loopback, docker bridges and veth pairs."""

FLIGHT_RECORDER_ENTRIES = 2000
"""Collectives the flight recorder keeps per rank."""

TRAIN_MODULE = ("-m", "podtrain.cli", "train")
"""What each worker runs: ``python -m podtrain.cli train CONFIG [overrides]``."""

TORCHRUN_MODULE = ("-m", "torch.distributed.run")
"""How the launchers start torchrun: ``python -m torch.distributed.run`` (the ``torchrun``
script of the same Python, without relying on PATH)."""

TORCHRUN_DEFAULT_SHUTDOWN_S = 30
"""Seconds torchrun waits between SIGTERM and SIGKILL to its workers unless told otherwise (and
always, before torch 2.12)."""

SHUTDOWN_TIMEOUT_SINCE = (2, 12)
"""The first torch whose torchrun takes ``--shutdown-timeout``."""

SHUTDOWN_MARGIN_S = 15
"""Seconds a pod's grace period (or a scheduler's kill wait) should exceed torchrun's shutdown
timeout, so torchrun ends its workers itself (and exits with their status) before it is killed."""


def flight_recorder_env(debug_dir: str | os.PathLike, buffer_size: int = FLIGHT_RECORDER_ENTRIES) -> dict[str, str]:
    """Environment variables that turn on torch's collective flight recorder, dumping into
    ``debug_dir`` (files ``nccl_trace_rank_<R>``; torch appends the rank).

    They are read when the process group is created, so a launcher puts them into the workers'
    environment rather than the training process setting them late. Only the current
    ``TORCH_FR_*`` names (torch >= 2.6; gloo is recorded too from 2.8): torch 2.13 warns on every
    rank for the old ``TORCH_NCCL_TRACE_*`` aliases.
    """
    return {
        "TORCH_FR_BUFFER_SIZE": str(int(buffer_size)),
        "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
        "TORCH_FR_DUMP_TEMP_FILE": str(Path(debug_dir) / "nccl_trace_rank_"),
    }


def worker_env(debug_dir: str | os.PathLike | None, gpus: bool) -> dict[str, str]:
    """The variables every launcher gives every worker: reliable restarts, NCCL errors that
    abort, the flight recorder into ``debug_dir`` (None: off), unbuffered output, and on GPU
    nodes the NCCL socket exclusions."""
    env = {**RELIABLE_RESTARTS, **NCCL_ERRORS_ABORT}
    if debug_dir is not None:
        env.update(flight_recorder_env(debug_dir))
    env["PYTHONUNBUFFERED"] = "1"
    if gpus:
        env["NCCL_SOCKET_IFNAME"] = NCCL_SOCKET_EXCLUDE
    return env


def torchrun_has_shutdown_timeout(torch_version: str | None = None) -> bool:
    """Whether torchrun of ``torch_version`` (default: the installed torch, read from its metadata
    without importing it) takes ``--shutdown-timeout``; False when no torch is installed."""
    if torch_version is None:
        try:
            torch_version = importlib.metadata.version("torch")
        except importlib.metadata.PackageNotFoundError:
            return False
    match = re.match(r"(\d+)\.(\d+)", torch_version)
    return match is not None and (int(match[1]), int(match[2])) >= SHUTDOWN_TIMEOUT_SINCE


def shutdown_timeout_s(grace_s: float) -> int:
    """torchrun's ``--shutdown-timeout`` for a run whose scheduler grants ``grace_s`` seconds
    between SIGTERM and SIGKILL: all of it goes to the workers' checkpoint (at least torchrun's
    own default of 30 s)."""
    return max(TORCHRUN_DEFAULT_SHUTDOWN_S, math.ceil(grace_s))


def kill_grace_s(grace_s: float) -> int:
    """The scheduler-side grace period (a pod's ``terminationGracePeriodSeconds``) that lets
    torchrun use all of ``shutdown_timeout_s`` and still exit by itself."""
    return shutdown_timeout_s(grace_s) + SHUTDOWN_MARGIN_S


def rdzv_conf(join_timeout: int, is_host: bool | Var | None = None) -> Word:
    """``--rdzv-conf``: the join timeout, and ``is_host`` when given (a bool, or a variable such as
    ``Var("IS_HOST")`` for scripts that decide it on the node)."""
    if is_host is None or is_host is False:
        return f"join_timeout={join_timeout}"
    return concat(f"join_timeout={join_timeout},is_host=", "1" if is_host is True else is_host)


def torchrun_flags(*, nproc: int | Var, grace_s: float, nnodes: int | Var | None = None,
                   rdzv_endpoint: Word | None = None, rdzv_id: str | Var | None = None,
                   join_timeout: int | None = None, is_host: bool | Var | None = None,
                   local_addr: str | Var | None = None, max_restarts: int | None = None,
                   log_dir: str | None = None, shutdown_flag: bool | None = None) -> list[Word]:
    """torchrun's flags for one agent, as argv items. Options left None are left to torchrun (or,
    in a PyTorchJob, to the operator's ``PET_*`` variables); values may be ``shell.Var``s for
    the scripts that render them (``shell.line``), and every flag is one ``--name=value`` item,
    so a value that starts with a dash stays the flag's value. ``--shutdown-timeout`` (from
    ``grace_s``) is passed when ``shutdown_flag`` says so, by default when the installed torch's
    torchrun has it."""
    def flag(name: str, value: Word | int) -> Word:
        return concat(f"--{name}=", value if isinstance(value, (str, Var, tuple)) else str(value))

    flags = []
    if nnodes is not None:
        flags.append(flag("nnodes", nnodes))
    flags.append(flag("nproc-per-node", nproc))
    if rdzv_endpoint is not None:
        flags += ["--rdzv-backend=c10d", flag("rdzv-endpoint", rdzv_endpoint)]
    if rdzv_id is not None:
        flags.append(flag("rdzv-id", rdzv_id))
    if join_timeout is not None:
        flags.append(flag("rdzv-conf", rdzv_conf(join_timeout, is_host)))
    if local_addr is not None:
        flags.append(flag("local-addr", local_addr))
    if max_restarts is not None:
        flags.append(flag("max-restarts", max_restarts))
    if torchrun_has_shutdown_timeout() if shutdown_flag is None else shutdown_flag:
        flags.append(flag("shutdown-timeout", shutdown_timeout_s(grace_s)))
    if log_dir is not None:
        flags += [flag("log-dir", log_dir), "--tee=3"]
    return flags


DIE_WITH_AGENT = "PODTRAIN_DIE_WITH_AGENT"
"""Set by ``launch local`` in the workers' environment to its own pid: each worker then dies with
its torchrun agent (``die_with_agent``), whose parent that pid must be."""

PARENT_DEATH_SIGNAL = signal.SIGKILL
"""What a launcher's agents and their workers get when their parent dies: a ``kill -9`` of the
launcher ends the job as a ``kill -9`` of the job would (the run resumes from its last checkpoint);
a graceful stop is the launcher's to relay (SIGINT, SIGTERM, SIGHUP), never an orphan's to guess."""

_PR_SET_PDEATHSIG = 1


def _prctl():
    """libc's ``prctl``, or None where there is none (not Linux). Resolved before a fork: the
    child of a ``preexec_fn`` should only call it (``find_library`` would start processes)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None


def set_parent_death_signal(sig: int = PARENT_DEATH_SIGNAL, prctl=None) -> bool:
    """Ask the kernel to send ``sig`` to this process when the thread that started it ends
    (``prctl(PR_SET_PDEATHSIG)``; kept across ``exec``). False where there is no ``prctl``
    or it failed: the caller then lives on as before."""
    prctl = prctl or _prctl()
    return prctl is not None and prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0) == 0


def start_with_parent_death_signal():
    """A ``preexec_fn`` for ``subprocess.Popen``: the child gets ``PARENT_DEATH_SIGNAL`` when the
    calling process (its thread: call Popen from the main thread) dies. A parent that died between
    the fork and the ``prctl`` sends nothing, so the child checks that its parent is still the
    caller and ends at once otherwise."""
    parent, prctl = os.getpid(), _prctl()

    def preexec() -> None:
        if prctl is not None and set_parent_death_signal(PARENT_DEATH_SIGNAL, prctl) \
                and os.getppid() != parent:
            os._exit(128 + PARENT_DEATH_SIGNAL)
    return preexec


def _parent_of(pid: int) -> int | None:
    """The parent pid of process ``pid`` (from ``/proc``), or None when it cannot be read."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        return int(stat.rsplit(")", 1)[1].split()[1])  # the command name may hold spaces and ")"
    except (OSError, ValueError, IndexError):
        return None


def die_with_agent(environ: dict[str, str] | None = None) -> bool:
    """In a worker, where the launcher asked for it (``DIE_WITH_AGENT`` holds the launcher's pid):
    die with the torchrun agent that started this process, which keeps its workers in sessions of
    their own, so nothing else ends them when it is SIGKILLed. An agent already gone before the
    ``prctl`` (this process was then re-parented: its parent is no longer a child of the
    launcher) ends this process at once, as the signal would have. True when the signal is set."""
    launcher = (os.environ if environ is None else environ).get(DIE_WITH_AGENT, "")
    if not launcher.isdigit():
        return False
    agent = os.getppid()
    if not set_parent_death_signal():
        return False
    if os.getppid() != agent or _parent_of(agent) not in (int(launcher), None):
        os.kill(os.getpid(), PARENT_DEATH_SIGNAL)
    return True
