"""The faults tests inject into real podtrain processes, installed by ``sitecustomize`` here.

``PODTRAIN_TEST_FAULTS`` holds ``NAME:key=value,key=value;NAME:...``; each NAME is a function
registered with ``@fault`` that patches podtrain from outside (no production code reads test
variables). ``fault_env`` returns an environment that activates them in child processes.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

PLUGIN_DIR = Path(__file__).resolve().parent
VARIABLE = "PODTRAIN_TEST_FAULTS"
log = logging.getLogger("podtrain.faults")

_FAULTS: dict[str, Callable[[dict[str, str]], None]] = {}


def fault(name: str):
    """Register an installer for the fault ``name``: it receives the spec's key=value pairs."""
    def register(fn: Callable[[dict[str, str]], None]) -> Callable[[dict[str, str]], None]:
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


def install(spec: str) -> None:
    """Install every fault named in ``spec`` in this process."""
    for name, args in parse(spec):
        _FAULTS[name](args)


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
    file so the fault fires only in the first attempt of a restarted job."""

    action: str
    rank: int
    step: int
    delay_s: float = 0.0
    once: Path | None = None

    @classmethod
    def from_args(cls, action: str, args: dict[str, str]) -> "StepFault":
        """Build from ``rank=R,step=K[,delay=S][,once=PATH]``."""
        return cls(action, int(args["rank"]), int(args["step"]), float(args.get("delay", 0.0)),
                   Path(args["once"]) if args.get("once") else None)

    def maybe_fire(self, rank: int, step: int) -> bool:
        """Fire when this is the planned rank and step (and the ``once`` marker is absent)."""
        if rank != self.rank or step != self.step:
            return False
        if self.once is not None:
            try:
                os.close(os.open(self.once, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
            except FileExistsError:
                return False
        log.warning("fault injection: %s on rank %d at step %d", self.action, rank, step)
        if self.action == "kill":
            timer = threading.Timer(self.delay_s, os.kill, (os.getpid(), signal.SIGKILL))
            timer.daemon = True
            timer.start()
        else:
            os.kill(os.getppid(), signal.SIGTERM)
        return True


def _at_step_boundary(plan: StepFault) -> None:
    """Run ``plan`` where the training loop asks whether to stop (once per step boundary)."""
    from podtrain.train import loop

    original = loop.Trainer._should_stop

    def patched(self, *a, **kw):
        plan.maybe_fire(self.ctx.rank, self.step)
        return original(self, *a, **kw)

    loop.Trainer._should_stop = patched


@fault("kill")
def _kill(args: dict[str, str]) -> None:
    _at_step_boundary(StepFault.from_args("kill", args))


@fault("term-parent")
def _term_parent(args: dict[str, str]) -> None:
    _at_step_boundary(StepFault.from_args("term-parent", args))


# -- checkpoints: a slow disk -----------------------------------------------------------------
@fault("slow-save")
def _slow_save(args: dict[str, str]) -> None:
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

    writer.CheckpointWriter._write = patched
