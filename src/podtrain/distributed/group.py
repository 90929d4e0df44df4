"""The process group: backend and device choice, init/teardown, timeouts, small collective helpers.

This is the only module that names a concrete backend or device type. Everything else asks the
``DistContext`` for ``ctx.device`` and ``ctx.backend``, so the CPU/gloo path the tests run is the
same code as the GPU/NCCL path on a cluster.
"""

from __future__ import annotations

import contextlib
import datetime
import gc
import logging
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist

from podtrain.config import CHOICES
from podtrain.distributed.env import ClusterEnv, omp_num_threads, threads_per_rank
from podtrain.distributed.recorder import CollectiveRecorder
from podtrain.errors import UserError, storage_error

log = logging.getLogger(__name__)

BACKENDS = CHOICES["dist.backend"]


def accelerator_name(device: torch.device) -> str | None:
    """The GPU's product name (e.g. "NVIDIA H100 80GB HBM3"), or None on the CPU."""
    return torch.cuda.get_device_name(device) if device.type == "cuda" else None


def accelerator_available() -> bool:
    """True when this machine has a CUDA GPU torch can use (no CUDA context is created)."""
    return torch.cuda.is_available()


def accelerator_capability(device: torch.device) -> tuple[int, int] | None:
    """The GPU's compute capability (8, 0 for an A100; 9, 0 for an H100), or None on the CPU."""
    return tuple(torch.cuda.get_device_capability(device)) if device.type == "cuda" else None


def peak_allocated_bytes(device: torch.device) -> int | None:
    """The caching allocator's peak on a GPU; None on the CPU (use the process's peak RSS)."""
    return int(torch.cuda.max_memory_allocated(device)) if device.type == "cuda" else None


def accelerator_memory_bytes(device: torch.device) -> int | None:
    """Total memory of the GPU; None on the CPU."""
    return int(torch.cuda.get_device_properties(device).total_memory) if device.type == "cuda" else None


def resolve_backend(requested: str, cuda_available: bool | None = None) -> str:
    """``auto`` becomes nccl when CUDA is available and gloo otherwise; explicit choices stay."""
    if requested not in BACKENDS:
        raise UserError(f"dist.backend={requested!r} is not one of {', '.join(BACKENDS)}")
    cuda = torch.cuda.is_available() if cuda_available is None else cuda_available
    if requested == "auto":
        return "nccl" if cuda else "gloo"
    if requested == "nccl" and not cuda:
        raise UserError("dist.backend=nccl needs CUDA GPUs, and none is visible; use gloo or auto")
    return requested


def resolve_device(backend: str, local_rank: int) -> torch.device:
    """The device this rank computes on: its own GPU (by local rank) under CUDA, else the CPU."""
    if backend == "nccl" or (backend == "gloo" and torch.cuda.is_available()):
        count = torch.cuda.device_count()
        if local_rank >= count:
            raise UserError(
                f"LOCAL_RANK={local_rank} but this node has {count} GPU(s): "
                "--nproc-per-node is larger than the GPUs per node")
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


@dataclass
class DistContext:
    """What a rank knows about the job once the process group is up.

    Attributes:
        env: launcher facts (ranks, sizes, host).
        backend: "nccl" or "gloo".
        device: the device this rank computes on.
        initialized: whether a torch.distributed process group exists (world size > 1, or any
            world size under torchrun).
        recorder: this rank's last collectives, dumped by the hang watchdog.
        timeout_s: the collective timeout in force (start-up's until ``startup_done``).
        steady_timeout_s: the collective timeout after the first completed step of this process.
        subgroups: the groups this job made besides the default one (HSDP's mesh), created with
            ``timeout_s`` and switched with the default group.
    """

    env: ClusterEnv
    backend: str
    device: torch.device
    initialized: bool
    recorder: CollectiveRecorder = field(default_factory=CollectiveRecorder)
    timeout_s: float = 600.0
    steady_timeout_s: float = 1800.0
    subgroups: list = field(default_factory=list)
    _steady: bool = False

    @property
    def rank(self) -> int:
        """Global rank."""
        return self.env.rank

    @property
    def world_size(self) -> int:
        """Number of ranks."""
        return self.env.world_size

    @property
    def is_main(self) -> bool:
        """True on global rank 0."""
        return self.env.rank == 0

    @property
    def is_cuda(self) -> bool:
        """True when this rank computes on a GPU."""
        return self.device.type == "cuda"

    def barrier(self) -> None:
        """Wait for every rank (a no-op for one process)."""
        if self.initialized:
            with self.recorder.begin("barrier"):
                dist.barrier()

    def all_reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum ``tensor`` in place across ranks and return it."""
        if self.initialized:
            with self.recorder.begin("all_reduce", tensor) as pending:
                work = dist.all_reduce(tensor, op=dist.ReduceOp.SUM, async_op=True)
                work.wait()  # gloo: finished; NCCL: the current stream waits, the host does not
                pending.track(work)  # so the record says in_flight until the GPU really finished
        return tensor

    def all_reduce_max(self, values: list[float]) -> list[float]:
        """The elementwise maximum of ``values`` over the ranks (a few numbers, read on the host:
        for agreements at rare moments such as a save, not per step). O(1) bytes per rank, where
        gathering an object per rank would be O(world)."""
        tensor = torch.tensor(values, dtype=torch.float64, device=self.device)
        if self.initialized:
            with self.recorder.begin("all_reduce", tensor):
                dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
        return tensor.tolist()

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        """Rank ``src``'s ``obj`` on every rank: how a decision made by one rank reaches all."""
        if not self.initialized:
            return obj
        box = [obj if self.rank == src else None]
        with self.recorder.begin("broadcast_object"):
            dist.broadcast_object_list(box, src=src)
        return box[0]

    def all_gather_object(self, obj: Any) -> list[Any]:
        """Every rank's ``obj``, in rank order, on every rank."""
        if not self.initialized:
            return [obj]
        out: list[Any] = [None] * self.world_size
        with self.recorder.begin("all_gather_object"):
            dist.all_gather_object(out, obj)
        return out

    def gather_object(self, obj: Any, dst: int = 0) -> list[Any] | None:
        """Every rank's ``obj``, in rank order, on global rank ``dst`` alone (None on the others):
        what one rank needs from all, without sending it to every rank (every rank calls)."""
        if not self.initialized:
            return [obj]
        out: list[Any] | None = [None] * self.world_size if self.rank == dst else None
        with self.recorder.begin("gather_object"):
            dist.gather_object(obj, out, dst=dst)
        return out

    def agree(self, error: BaseException | None) -> None:
        """Every rank learns whether any rank failed, so none waits in a collective for a rank
        that stopped. Ranks without an error of their own raise one naming the failed rank and
        host (a UserError when the original was one, or a storage failure: ``storage_error``); a rank with its own error returns, for its
        caller to re-raise the original with its traceback."""
        user = error if isinstance(error, UserError) else storage_error(error) if error is not None else None
        mine = None if error is None else (user is not None, str(user or error),
                                           user.exit_code if user is not None else 1)
        reports = self.all_gather_object((self.env.hostname, mine))
        if error is not None:
            return
        for rank, (host, report) in enumerate(reports):
            if report is not None:
                is_user, message, code = report
                if not is_user:
                    raise RuntimeError(f"rank {rank} on {host}: {message}")
                failure = UserError(f"rank {rank} on {host}: {message}")
                failure.exit_code = code  # a storage outage stays retryable (203) on every rank
                raise failure

    def agree_on(self, work: Callable[[], Any]) -> Any:
        """Run ``work`` on every rank, then ``agree``: a failure on any rank raises on all of
        them (the failing rank re-raises its own error, with its traceback)."""
        try:
            result = work()
        except Exception as exc:
            self.agree(exc)
            raise
        self.agree(None)
        return result

    def new_subgroups(self, ranks_per_group: list[list[int]]) -> Any:
        """Create one group per rank list (every rank calls, with the same lists) under the
        collective timeout in force, not NCCL's default 10 minutes; returns this rank's group.
        ``set_timeout`` switches them with the default group."""
        mine, _ = dist.new_subgroups_by_enumeration(
            ranks_per_group, timeout=datetime.timedelta(seconds=self.timeout_s))
        self.subgroups.append(mine)
        return mine

    def set_timeout(self, seconds: float) -> None:
        """Change the collective timeout of the default group and of ``subgroups``.

        ``ProcessGroup.set_timeout`` where torch has it (public); older torch only has the private
        ``distributed_c10d._set_pg_timeout``, which is used then. Neither: the start-up timeout
        stays (the hang watchdog still enforces dist.timeout_s per step), with one warning.
        """
        self.timeout_s = seconds
        if not self.initialized:
            return
        from torch.distributed import distributed_c10d

        delta = datetime.timedelta(seconds=seconds)
        for group in [dist.group.WORLD, *self.subgroups]:
            if hasattr(group, "set_timeout"):
                group.set_timeout(delta)
            elif hasattr(distributed_c10d, "_set_pg_timeout"):
                distributed_c10d._set_pg_timeout(delta, group)
            else:
                log.warning("torch %s cannot change a process group's timeout: collectives keep the "
                            "start-up timeout of dist.init_timeout_s", torch.__version__)
                return

    def startup_done(self) -> None:
        """After the first completed step of this process, whatever step it started from (a
        resumed run too): the steady-state timeout, once."""
        if not self._steady:
            self._steady = True
            self.set_timeout(self.steady_timeout_s)


@contextlib.contextmanager
def process_group(
    env: ClusterEnv | None = None,
    backend: str = "auto",
    init_timeout_s: float = 600.0,
    timeout_s: float = 1800.0,
) -> Iterator[DistContext]:
    """Set up the device and process group for this rank; tear it down on every exit path.

    The device is bound from LOCAL_RANK *before* the group is created (NCCL picks the current
    device). ``init_timeout_s`` bounds the rendezvous and the first collectives (start-up can be
    slow on a big cluster); ``timeout_s`` is the steady-state collective timeout switched to by
    ``DistContext.startup_done`` once this process's first step completes.
    """
    env = env or ClusterEnv.detect()
    name = resolve_backend(backend)
    device = resolve_device(name, env.local_rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    initialized = False
    if needs_process_group(env) and not dist.is_initialized():
        timeout = datetime.timedelta(seconds=init_timeout_s)
        if env.launcher == "torchrun":
            # torchrun hosts the store; env:// joins it instead of starting a second one.
            dist.init_process_group(name, init_method="env://", timeout=timeout,
                                    rank=env.rank, world_size=env.world_size)
        else:
            dist.init_process_group(
                name, init_method=f"tcp://{_bracket_ipv6(env.master_addr)}:{env.master_port}",
                rank=env.rank, world_size=env.world_size, timeout=timeout)
        initialized = True
    ctx = DistContext(env=env, backend=name, device=device, initialized=initialized or dist.is_initialized(),
                      timeout_s=init_timeout_s, steady_timeout_s=timeout_s)
    try:
        yield ctx
    finally:
        if initialized:
            teardown()


def needs_process_group(env: ClusterEnv) -> bool:
    """A group for more than one rank, and for one rank under torchrun too: a one-GPU job then
    runs the same path as a cluster's (NCCL, DDP's reducer, no_sync). A plain ``podtrain train``
    without a launcher stays one process without a group."""
    return env.world_size > 1 or env.launcher == "torchrun"


def teardown() -> None:
    """Destroy the default process group, collecting garbage first.

    DDP's reducer can deadlock at interpreter exit while joining a gloo thread (seen in ~1 of 4 runs);
    callers delete their DDP module before leaving the context, and collecting here makes sure the
    reducer is gone before the group it uses.
    """
    gc.collect()
    if dist.is_initialized():
        try:
            dist.destroy_process_group()
        except Exception as exc:  # teardown must never mask the error that brought us here
            log.warning("destroy_process_group failed: %s", exc)


def _bracket_ipv6(addr: str) -> str:
    return f"[{addr}]" if ":" in addr and not addr.startswith("[") else addr


def collective_timeout(watchdog_s: float) -> float:
    """The process group's timeout for a watchdog limit: longer, so that on a hang the watchdog
    fires first and writes its stack and collective dumps before torch raises its own error."""
    return watchdog_s * 1.25 + 60.0


def cap_cpu_threads(local_world_size: int, requested: int | None = None) -> int:
    """Give each rank its share of the CPU cores so ranks do not oversubscribe them.

    An explicit ``requested`` wins, then OMP_NUM_THREADS (torchrun sets it to 1 per worker;
    launch local and the Slurm script set the cores' share), else cores / local ranks.
    """
    threads = requested or omp_num_threads() or threads_per_rank(local_world_size)
    torch.set_num_threads(threads)
    return threads
