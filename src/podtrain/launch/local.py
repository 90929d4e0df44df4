"""``podtrain launch local CONFIG --nproc N [--nnodes M]``: torchrun on this machine.

What makes torchrun reliable here (see MACHINE-NOTES.md), set for every worker:

* ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``: after a restart (``--max-restarts``) workers build a
  fresh store instead of reusing the rendezvous one that still names the dead rank's old port.
* ``OMP_NUM_THREADS``: the cores divided among all local ranks (no oversubscription).
* a free rendezvous port (29500 is often taken) and ``join_timeout`` so a missing agent fails in
  a minute instead of ten.

``--nnodes M`` starts M torchrun agents on this host, each with ``--nproc`` workers, joined by c10d
rendezvous: the same code path as M real nodes.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Sequence

from podtrain.config import accumulation_steps, load_config
from podtrain.errors import UserError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``podtrain launch local``."""
    parser.add_argument("config", help="YAML config file")
    parser.add_argument("overrides", nargs="*", help="section.key=value overrides")
    parser.add_argument("--nproc", type=int, default=1, help="processes per node (default 1)")
    parser.add_argument("--nnodes", type=int, default=1, help="torchrun agents to start here (default 1)")
    parser.add_argument("--max-restarts", type=int, default=0,
                        help="restarts of the worker group after a failure (default 0)")
    parser.add_argument("--port", type=int, default=0, help="rendezvous port (default: a free one)")
    parser.add_argument("--join-timeout", type=int, default=60,
                        help="seconds an agent waits for the others at rendezvous (default 60)")


def free_port() -> int:
    """A loopback TCP port that was free a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun_command(config: str, overrides: Sequence[str], nproc: int, nnodes: int, port: int,
                     rdzv_id: str, max_restarts: int, join_timeout: int, host: bool,
                     log_dir: str | None = None) -> list[str]:
    """The torchrun command line of one agent (pure, for tests and dry runs).

    With ``log_dir`` every rank's stdout and stderr are also kept in files under it
    (``LOG_DIR/<run>/attempt_<k>/<local_rank>/stdout.log``), besides the console.
    """
    conf = f"join_timeout={join_timeout}" + (",is_host=1" if host and nnodes > 1 else "")
    logs = ["--log-dir", log_dir, "--tee", "3"] if log_dir else []
    return [
        sys.executable, "-m", "torch.distributed.run",
        f"--nnodes={nnodes}", f"--nproc-per-node={nproc}",
        "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}", f"--rdzv-id={rdzv_id}",
        f"--rdzv-conf={conf}", f"--max-restarts={max_restarts}", *logs,
        "-m", "podtrain.cli", "train", config, *overrides,
    ]


def worker_environment(nproc: int, nnodes: int, base: dict[str, str] | None = None,
                       debug_dir: str | None = None) -> dict[str, str]:
    """The environment torchrun passes to its workers (see the module docstring); with
    ``debug_dir`` the flight recorder dumps there when a collective times out."""
    env = dict(os.environ if base is None else base)
    if debug_dir:
        from podtrain.distributed.watchdog import flight_recorder_env

        env.update(flight_recorder_env(debug_dir))
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // (nproc * nnodes))))
    env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    env["PYTHONUNBUFFERED"] = "1"
    return env


def run(args: argparse.Namespace) -> int:
    """Validate the config for the whole job, then start the agents and wait for them."""
    if args.nproc < 1 or args.nnodes < 1:
        raise UserError(f"--nproc ({args.nproc}) and --nnodes ({args.nnodes}) must be at least 1")
    cfg = load_config(args.config, args.overrides)
    accumulation_steps(cfg.train.global_batch_size, cfg.train.micro_batch_size, args.nproc * args.nnodes)
    _check_before_starting(cfg, args.nproc * args.nnodes, args.nproc)
    port = args.port or free_port()
    rdzv_id = uuid.uuid4().hex[:8]
    env = worker_environment(args.nproc, args.nnodes, debug_dir=str(Path(cfg.run.dir) / "debug"))
    log_dir = Path(cfg.run.dir) / "logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    agents = [subprocess.Popen(torchrun_command(args.config, args.overrides, args.nproc, args.nnodes,
                                                port, rdzv_id, args.max_restarts, args.join_timeout,
                                                host=(i == 0), log_dir=str(log_dir)), env=env)
              for i in range(args.nnodes)]
    return _wait_forwarding_signals(agents)


def _check_before_starting(cfg, world_size: int, local_world_size: int) -> None:
    """The checks every rank would make at start (data, vocabulary, model, memory), made once
    here: a mistake is then one line and exit code 2, not a worker failure inside torchrun."""
    from podtrain.distributed.group import resolve_backend, resolve_device
    from podtrain.train.loop import check_run

    device = resolve_device(resolve_backend(cfg.dist.backend), 0)
    check_run(cfg, world_size, local_world_size, device)


def _wait_forwarding_signals(agents: list[subprocess.Popen]) -> int:
    """Wait for every agent; SIGTERM/SIGINT/SIGUSR1 to us go to them (torchrun relays to workers)."""
    def forward(signum, _frame):
        for agent in agents:
            if agent.poll() is None:
                agent.send_signal(signum)

    previous = {s: signal.signal(s, forward) for s in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)}
    try:
        codes = [agent.wait() for agent in agents]
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    failed = [c for c in codes if c != 0]
    return failed[0] if failed else 0
