"""The faults tests inject into real podtrain processes, installed by ``sitecustomize`` here.

``PODTRAIN_TEST_FAULTS`` holds ``NAME:key=value,key=value;NAME:...``; each NAME is a function
registered with ``@fault`` that patches podtrain from outside (no production code reads test
variables). ``fault_env`` returns an environment that activates them in child processes.

Tests whose ranks are forked from the pytest process (``multirank.run_ranks``) install the same
faults in that process with ``install(spec, patch=monkeypatch.setattr)``: the forked ranks inherit
the patch, and pytest undoes it after the test. A fault that targets one rank reads the rank when
it fires, so the patch may be installed before the ranks exist.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

PLUGIN_DIR = Path(__file__).resolve().parent
VARIABLE = "PODTRAIN_TEST_FAULTS"
log = logging.getLogger("podtrain.faults")

# How a fault replaces an attribute: setattr in a child process, monkeypatch.setattr in pytest.
Patch = Callable[[Any, str, Any], None]
Installer = Callable[[dict[str, str], Patch], None]
_FAULTS: dict[str, Installer] = {}


def fault(name: str):
    """Register an installer for the fault ``name``: it receives the spec's key=value pairs and
    the function that sets an attribute (``patch(owner, name, value)``)."""
    def register(fn: Installer) -> Installer:
        _FAULTS[name] = fn
        return fn
    return register


def parse(spec: str) -> list[tuple[str, dict[str, str]]]:
    """``"kill:rank=1,step=6;slow:rank=0"`` -> [("kill", {"rank": "1", "step": "6"}), ...]."""
    out = []
    for part in filter(None, (p.strip() for p in spec.split(";"))):
        name, _, args = part.partition(":")
        if name not in _FAULTS:
            raise ValueError(f"{VARIABLE}: unknown fault {name!r} (known: {', '.join(sorted(_FAULTS))})")
        out.append((name, dict(kv.split("=", 1) for kv in args.split(",") if kv.strip())))
    return out


def install(spec: str, patch: Patch = setattr) -> None:
    """Install every fault named in ``spec`` in this process, setting attributes with ``patch``."""
    for name, args in parse(spec):
        _FAULTS[name](args, patch)


def fault_env(spec: str, base: dict[str, str] | None = None) -> dict[str, str]:
    """An environment (a copy of ``base`` or os.environ) in which children install ``spec``."""
    env = dict(os.environ if base is None else base)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(PLUGIN_DIR), env.get("PYTHONPATH")]))
    env[VARIABLE] = spec
    return env


def _rank() -> int:
    return int(os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0")))


# -- training: die or stop at a step boundary --------------------------------------------------
@dataclass(frozen=True)
class StepFault:
    """At the boundary after ``step`` completed steps on ``rank``: SIGKILL this rank ``delay``
    seconds later (mid-step) or SIGTERM its parent (the torchrun agent). ``once`` names a marker
    file so the fault fires only in the first attempt of a restarted job. ``durable``: first wait
    until the checkpoint in flight is committed (``Checkpointer.wait``: this rank's writer learns
    rank 0's commit), so that a test knows which checkpoint the restart must find, however slow
    the machine or the storage (a background save of step 3 may otherwise still be writing when
    step 5 ends)."""

    action: str
    rank: int
    step: int
    delay_s: float = 0.0
    once: Path | None = None
    durable: bool = False

    @classmethod
    def from_args(cls, action: str, args: dict[str, str]) -> "StepFault":
        """Build from ``rank=R,step=K[,delay=S][,once=PATH][,durable=1]``."""
        return cls(action, int(args["rank"]), int(args["step"]), float(args.get("delay", 0.0)),
                   Path(args["once"]) if args.get("once") else None,
                   args.get("durable", "0").lower() in ("1", "true", "yes"))

    def maybe_fire(self, rank: int, step: int, checkpointer: Any = None) -> bool:
        """Fire when this is the planned rank and step (and the ``once`` marker is absent)."""
        if rank != self.rank or step != self.step:
            return False
        if self.once is not None:
            try:
                os.close(os.open(self.once, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
            except FileExistsError:
                return False
        if self.durable and checkpointer is not None:
            checkpointer.wait()  # every rank's writer returns only after rank 0 committed the save
        log.warning("fault injection: %s on rank %d at step %d", self.action, rank, step)
        if self.action == "kill":
            timer = threading.Timer(self.delay_s, os.kill, (os.getpid(), signal.SIGKILL))
            timer.daemon = True
            timer.start()
        else:
            os.kill(os.getppid(), signal.SIGTERM)
        return True


def _at_step_boundary(plan: StepFault, patch: Patch) -> None:
    """Run ``plan`` where the training loop asks whether to stop (once per step boundary)."""
    from podtrain.train import loop

    original = loop.Trainer._should_stop

    def patched(self, *a, **kw):
        plan.maybe_fire(self.ctx.rank, self.progress.step, getattr(self, "checkpointer", None))
        return original(self, *a, **kw)

    patch(loop.Trainer, "_should_stop", patched)


@fault("kill")
def _kill(args: dict[str, str], patch: Patch) -> None:
    _at_step_boundary(StepFault.from_args("kill", args), patch)


@fault("term-parent")
def _term_parent(args: dict[str, str], patch: Patch) -> None:
    _at_step_boundary(StepFault.from_args("term-parent", args), patch)


@fault("stall")
def _stall(args: dict[str, str], patch: Patch) -> None:
    """``stall:rank=R,step=K,seconds=S``: at the boundary of step K, rank R stalls for S seconds,
    the shape of a hang. On CUDA the GPU stream stalls (a sleep kernel: the host runs ahead and
    the next collective is enqueued but never completes, as with a hung NCCL peer); on CPU the
    host sleeps, so the other ranks wait in their next collective."""
    from podtrain.train import loop

    rank, step, seconds = int(args["rank"]), int(args["step"]), float(args["seconds"])
    original = loop.Trainer._should_stop

    def patched(self, *a, **kw):
        if self.ctx.rank == rank and self.progress.step == step:
            log.warning("fault injection: stall of %.0f s on rank %d at step %d", seconds, rank, step)
            if self.ctx.device.type == "cuda":
                import torch

                torch.cuda._sleep(int(seconds * 2e9))  # ~2 GHz SM clock: cycles for S seconds
            else:
                import time

                time.sleep(seconds)
        return original(self, *a, **kw)

    patch(loop.Trainer, "_should_stop", patched)


# -- diagnostics: a wrong collective result, a rank short of memory, a slow rank ----------------
@fault("corrupt")
def _corrupt(args: dict[str, str], patch: Patch) -> None:
    """``corrupt:op=OP[+OP...]`` (or ``op=all``): the result check of those ops in ``podtrain
    bench collectives`` sees one element that no pattern produces, on every rank."""
    from podtrain.diagnostics import cases

    ops = set(filter(None, args.get("op", "all").split("+")))
    original = cases.Case.check

    def check(self, tol):
        if self.op in ops or "all" in ops:
            self.output.view(-1)[0] = -7  # the pattern's values are 0..10 and their sums
        return original(self, tol)

    patch(cases.Case, "check", check)


@fault("low-memory")
def _low_memory(args: dict[str, str], patch: Patch) -> None:
    """``low-memory:rank=R``: rank R's device reports no free memory to the collectives
    benchmark's memory check."""
    from podtrain.diagnostics import collectives

    rank = int(args["rank"])
    original = collectives.available_bytes

    def available_bytes(device):
        return 0 if _rank() == rank else original(device)

    patch(collectives, "available_bytes", available_bytes)


@fault("slow-collective")
def _slow_collective(args: dict[str, str], patch: Patch) -> None:
    """``slow-collective:rank=R[,delay=S]``: rank R sleeps S (0.05) seconds before every call of
    every collective ``podtrain bench collectives`` measures, as behind a slow link; the ranks
    of its groups wait for it."""
    import time

    from podtrain.diagnostics import collectives

    rank, delay = int(args["rank"]), float(args.get("delay", 0.05))
    original = collectives.build_case

    def build_case(*a, **kw):
        case = original(*a, **kw)
        if _rank() == rank:
            call = case.call

            def slow_call():
                time.sleep(delay)
                return call()

            case.call = slow_call
        return case

    patch(collectives, "build_case", build_case)


@fault("slow-rank")
def _slow_rank(args: dict[str, str], patch: Patch) -> None:
    """``slow-rank:rank=R[,factor=F]``: the doctor's matmul timer on rank R reports F (1.5) times
    the time it measured, as a device that much slower would."""
    from podtrain.diagnostics import doctor

    rank, factor = int(args["rank"]), float(args.get("factor", 1.5))
    original = doctor.matmul_seconds

    def matmul_seconds(ctx, *a, **kw):
        seconds, flops = original(ctx, *a, **kw)
        return (seconds * factor if ctx.rank == rank else seconds), flops

    patch(doctor, "matmul_seconds", matmul_seconds)



# -- slowness in training: for `podtrain report` ----------------------------------------------
@fault("slow-loader")
def _slow_loader(args: dict[str, str], patch: Patch) -> None:
    """``slow-loader:seconds=S[,rank=R]``: every batch build sleeps S seconds (in the loader
    thread or worker process; on rank R only when given), so the step waits for data."""
    import time

    from podtrain.data import loader

    seconds, only = float(args["seconds"]), args.get("rank")
    original = loader.ShardedLoader.build

    def build(self, *a, **kw):
        if only is None or int(only) == self.rank:
            time.sleep(seconds)
        return original(self, *a, **kw)

    patch(loader.ShardedLoader, "build", build)


@fault("slow-step")
def _slow_step(args: dict[str, str], patch: Patch) -> None:
    """``slow-step:rank=R,seconds=S`` (or ``delay=S``): rank R sleeps S seconds after every micro-batch's forward,
    as a slower device would (after DDP's forward-time buffer broadcast, which would otherwise
    absorb the delay); the other ranks wait for it in the gradient sync."""
    import time

    from podtrain.train import step

    seconds, rank = float(args.get("seconds", args.get("delay", 0.3))), int(args["rank"])
    original = step.micro_batch_loss_sum

    def slowed(*a, **kw):
        loss = original(*a, **kw)
        if _rank() == rank:
            time.sleep(seconds)
        return loss

    patch(step, "micro_batch_loss_sum", slowed)


# -- checkpoints: a slow disk -----------------------------------------------------------------
@fault("slow-save")
def _slow_save(args: dict[str, str], patch: Patch) -> None:
    """Every checkpoint write takes ``seconds`` longer (a slow shared file system): the sleep
    runs inside the writer, before the manifest that makes the checkpoint complete."""
    import time

    from podtrain.ckpt import writer

    seconds = float(args.get("seconds", 35))
    original = writer.CheckpointWriter._write

    def patched(self, job, *a, **kw):
        log.warning("fault injection: checkpoint write of step %s sleeps %.0f s", job.step, seconds)
        time.sleep(seconds)
        return original(self, job, *a, **kw)

    patch(writer.CheckpointWriter, "_write", patched)
