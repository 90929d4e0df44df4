"""``podtrain launch local CONFIG --nproc N [--nnodes M]``: torchrun on this machine.

The workers get what every launcher gives them (``launch/torchrun.py``: reliable restarts, the
flight recorder into RUN_DIR/debug, the shutdown timeout from ``ckpt.grace_s``), plus what a
single machine needs: the cores shared among all local ranks (``OMP_NUM_THREADS``), a free
rendezvous port (29500 is often taken) and a one-minute ``join_timeout``.

``--nnodes M`` starts M torchrun agents on this host, each with ``--nproc`` workers, joined by c10d
rendezvous: the same code path as M real nodes.

The terminal sees the workers' output and one closing line, never torchrun's tracebacks
(``agent_output.py``; torchrun's own log is kept in RUN_DIR/logs). The exit status is the
workers' (``exit_report.py``), even when RUN_DIR's disk fills up or turns read-only under the
job (the log is then incomplete, and says so in one line): 0, 2 with the rank's one-line reason, 124 after a hang, and after
Ctrl-C or SIGTERM (relayed once to the agents, which run in their own sessions) 130 or 143 with
"stopped by SIGINT at step N, checkpoint step_N saved; run the same command to resume" (after
SIGHUP, a closed terminal, 129 and "stopped by SIGHUP").

Nothing of the job outlives the launcher: a ``kill -9`` of it (the OOM killer, a CI timeout)
SIGKILLs the agents (a parent-death signal) and they their workers (``torchrun.die_with_agent``),
so the run's lease is free at once (its holder's pid is gone) and the same command resumes from
the last checkpoint.
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import tempfile
import uuid
from pathlib import Path
from typing import Sequence

from podtrain.config import accumulation_steps, load_config
from podtrain.distributed.env import threads_per_rank
from podtrain.errors import UserError
from podtrain.fsutil import writable_dir
from podtrain.launch.agent_output import AgentOutput
from podtrain.launch.exit_report import EXIT_REPORT_DIR, read_reports
from podtrain.launch.jobspec import add_gpu_memory_argument
from podtrain.launch.shell import plain
from podtrain.launch.supervise import job_verdict, wait_forwarding_signals
from podtrain.launch.torchrun import (DIE_WITH_AGENT, TORCHRUN_MODULE, TRAIN_MODULE,
                                      start_with_parent_death_signal, torchrun_flags, worker_env)


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
    add_gpu_memory_argument(parser)


def free_port() -> int:
    """A loopback TCP port that was free a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def usable_cores() -> int:
    """The cores this process may run on (its CPU affinity: a container's or taskset's share)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # macOS
        return os.cpu_count() or 1


def oversubscription(ranks: int, cores: int) -> str | None:
    """One line when ``ranks`` local processes outnumber ``cores``: they then take turns on the
    cores, so each step runs slower than with one rank per core (and each rank still holds its
    own model copy in memory)."""
    if ranks <= cores:
        return None
    return (f"{ranks} ranks on {cores} core(s) here: ranks beyond one per core take turns on them, so "
            f"each step is slower than with {cores} rank(s)")


def torchrun_command(config: str, overrides: Sequence[str], nproc: int, nnodes: int, port: int,
                     rdzv_id: str, max_restarts: int, join_timeout: int, host: bool,
                     grace_s: float, log_dir: str | None = None) -> list[str]:
    """The torchrun command line of one agent (pure, for tests and dry runs).

    With ``log_dir`` every rank's stdout and stderr are also kept in files under it
    (``LOG_DIR/<run>/attempt_<k>/<local_rank>/stdout.log``), besides the console.
    """
    flags = torchrun_flags(nnodes=nnodes, nproc=nproc, rdzv_endpoint=f"127.0.0.1:{port}",
                           rdzv_id=rdzv_id, join_timeout=join_timeout, is_host=host and nnodes > 1,
                           max_restarts=max_restarts, grace_s=grace_s, log_dir=log_dir)
    # An argv list, never a shell line: the config path and overrides reach the workers as typed.
    return [sys.executable, *TORCHRUN_MODULE, *plain(flags), *TRAIN_MODULE, config, *overrides]


def worker_environment(nproc: int, nnodes: int, base: dict[str, str] | None = None,
                       debug_dir: str | None = None) -> dict[str, str]:
    """The environment torchrun passes to its workers (see the module docstring); with
    ``debug_dir`` the flight recorder dumps there when a collective times out."""
    env = dict(os.environ if base is None else base)
    env.update(worker_env(debug_dir, gpus=False))
    env.setdefault("OMP_NUM_THREADS", str(threads_per_rank(nproc * nnodes)))
    return env


def run(args: argparse.Namespace) -> int:
    """Validate the config for the whole job, start the agents, wait, and end with the workers'
    own verdict (see the module docstring)."""
    if args.nproc < 1 or args.nnodes < 1:
        raise UserError(f"--nproc ({args.nproc}) and --nnodes ({args.nnodes}) must be at least 1")
    warning = oversubscription(args.nproc * args.nnodes, usable_cores())
    if warning:
        print(f"podtrain: warning: {warning}", file=sys.stderr)
    cfg = load_config(args.config, args.overrides)
    accumulation_steps(cfg.train.global_batch_size, cfg.train.micro_batch_size, args.nproc * args.nnodes)
    if args.gpu_memory is not None and args.gpu_memory <= 0:
        raise UserError(f"--gpu-memory {args.gpu_memory:g}: give the GiB of one GPU (> 0)")
    _check_before_starting(cfg, args.nproc * args.nnodes, args.nproc,  # writes nothing
                           None if args.gpu_memory is None else int(args.gpu_memory * 2**30))
    log_dir = writable_dir(Path(cfg.run.dir) / "logs")  # a read-only or full disk: one line, now
    port = args.port or free_port()
    rdzv_id = uuid.uuid4().hex[:8]
    env = worker_environment(args.nproc, args.nnodes, debug_dir=str(Path(cfg.run.dir) / "debug"))
    with tempfile.TemporaryDirectory(prefix="podtrain-exit-") as reports_dir:
        env[EXIT_REPORT_DIR] = reports_dir
        env[DIE_WITH_AGENT] = str(os.getpid())  # the workers die with their agent, and it with us
        # Own sessions: a terminal's Ctrl-C reaches only us, and we relay it once (a second
        # signal to a torchrun agent that is already shutting down cuts its workers' save short).
        # So no group kill reaches the agents either: they die with us by a parent-death signal.
        agents = [subprocess.Popen(torchrun_command(args.config, args.overrides, args.nproc, args.nnodes,
                                                    port, rdzv_id, args.max_restarts, args.join_timeout,
                                                    host=(i == 0), grace_s=cfg.ckpt.grace_s,
                                                    log_dir=str(log_dir)),
                                   env=env, start_new_session=True, stdout=subprocess.PIPE,
                                   stderr=subprocess.PIPE, text=True, errors="replace",
                                   preexec_fn=start_with_parent_death_signal())
                  for i in range(args.nnodes)]
        with AgentOutput(agents, log_dir / f"torchrun_{rdzv_id}.log") as output:
            agent_codes, received = wait_forwarding_signals(agents)
        reports = read_reports(reports_dir)
    if output.log_error is not None:  # the workers' verdict below still stands
        print(f"podtrain: warning: torchrun's log {output.log_path} is incomplete: {output.log_error}",
              file=sys.stderr)
    return job_verdict(Path(cfg.run.dir), agent_codes, received, reports, output.torchrun_text,
                       output.log_path)


def _check_before_starting(cfg, world_size: int, local_world_size: int, device_bytes: int | None) -> None:
    """The checks every rank would make at start (data, vocabulary, model, memory: ``podtrain
    plan``'s check, against ``device_bytes`` when given), made once here: a mistake is then one
    line and exit code 2, not a worker failure inside torchrun."""
    from podtrain.distributed.group import resolve_backend, resolve_device
    from podtrain.train.preflight import check_run

    device = resolve_device(resolve_backend(cfg.dist.backend), 0)
    check_run(cfg, world_size, local_world_size, device, device_bytes, shape_only=True)
