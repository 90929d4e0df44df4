"""``python -m podtrain.launch.agent LAUNCHER...``: a container's entry point around torchrun or
hyperpodrun, so that Kubernetes sees the workers' exit status.

A pod's status is its container's, and a container that ``exec``s torchrun ends with torchrun's:
1 after any worker failure and after a signal-driven save alike, so ``restartPolicy: ExitCode``
can tell neither a preemption (143, retry) nor a user mistake (2, do not) from a crash. This entry
point runs the launcher command it is given (``python3 -m torch.distributed.run ... -m
podtrain.cli train CONFIG`` or ``hyperpodrun ...``) as its child and ends exactly as ``launch
local`` does (``supervise``): 0, 2 with the rank's one-line reason, 124 after a hang, 130/143 after
a stop signal with the checkpoint saved, or the crash's code.

* The config (``CONFIG [overrides]`` after ``-m podtrain.cli train``) is loaded first: a mistake
  in the ConfigMap is one line and exit 2 before torchrun starts.
* It is PID 1 in the container (the pod script ``exec``s it). SIGTERM (the kubelet's, on
  eviction or preemption), SIGINT, SIGUSR1 and SIGHUP are relayed once to the launcher, which runs
  in its own session and passes them to the workers; we then wait for the launcher to finish its
  own shutdown (its ``--shutdown-timeout``; the pod's grace period is longer, see
  ``torchrun.kill_grace_s``), never cutting it short.
* ``--shutdown-timeout``: torchrun has it from torch 2.12. Where the image's torchrun has it and
  the command does not pass it, it is added from ``ckpt.grace_s``; an older torchrun SIGKILLs
  its workers 30 s after SIGTERM, which a warning says when ``ckpt.grace_s`` asks for more.
* The launcher dies with this process (a parent-death signal, SIGKILL): where the agent is not
  the container's PID 1 (a shared process namespace), a ``kill -9`` of it leaves nothing running.
* The workers' lines pass through (``--tee 3`` prefixes them); torchrun's own lines go to
  ``RUN_DIR/logs/torchrun_<host>.log``, as under ``launch local``.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Sequence

from podtrain.config import load_config
from podtrain.errors import UserError
from podtrain.launch.agent_output import AgentOutput
from podtrain.launch.exit_report import EXIT_REPORT_DIR, read_reports
from podtrain.launch.supervise import job_verdict, wait_forwarding_signals
from podtrain.launch.torchrun import (TORCHRUN_MODULE, TRAIN_MODULE, TORCHRUN_DEFAULT_SHUTDOWN_S,
                                      shutdown_timeout_s, start_with_parent_death_signal,
                                      torchrun_has_shutdown_timeout)

USAGE = "python -m podtrain.launch.agent LAUNCHER [ARGS...] -m podtrain.cli train CONFIG [OVERRIDES...]"


def train_arguments(command: Sequence[str]) -> tuple[str, list[str]]:
    """``(CONFIG, overrides)`` of the ``-m podtrain.cli train`` the launcher command runs."""
    size = len(TRAIN_MODULE)
    for i in range(len(command) - size + 1):
        if tuple(command[i:i + size]) == TRAIN_MODULE and i + size < len(command):
            return command[i + size], list(command[i + size + 1:])
    raise UserError(f"the launcher command must run `{' '.join(TRAIN_MODULE)} CONFIG`; usage: {USAGE}")


def with_shutdown_timeout(command: list[str], grace_s: float, supported: bool) -> list[str]:
    """``command`` with torchrun's ``--shutdown-timeout`` from ``grace_s`` where this torchrun has
    the flag and the command does not already give it (hyperpodrun commands are left as they are)."""
    if tuple(command[1:3]) != TORCHRUN_MODULE or not supported:
        return command
    if any(arg.startswith(("--shutdown-timeout", "--shutdown_timeout")) for arg in command):
        return command
    return [*command[:3], f"--shutdown-timeout={shutdown_timeout_s(grace_s)}", *command[3:]]


def run(command: list[str]) -> int:
    """Check the config, run the launcher command, relay stop signals, return the job's code."""
    if not command:
        raise UserError(f"no launcher command; usage: {USAGE}")
    config, overrides = train_arguments(command)
    cfg = load_config(config, overrides)
    supported = torchrun_has_shutdown_timeout()
    if (tuple(command[1:3]) == TORCHRUN_MODULE and not supported
            and cfg.ckpt.grace_s > TORCHRUN_DEFAULT_SHUTDOWN_S):
        print(f"podtrain: warning: this torch's torchrun has no --shutdown-timeout (torch >= 2.12): it "
              f"SIGKILLs the workers {TORCHRUN_DEFAULT_SHUTDOWN_S} s after SIGTERM, not the "
              f"ckpt.grace_s={cfg.ckpt.grace_s:g} s a checkpoint may need", file=sys.stderr)
    command = with_shutdown_timeout(command, cfg.ckpt.grace_s, supported)
    run_dir = Path(cfg.run.dir)
    log_dir = run_dir / "logs"
    try:
        log_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise UserError(f"cannot create {log_dir} ({exc.strerror or exc}): run.dir must be writable "
                        "from every pod") from None
    env = dict(os.environ)
    with tempfile.TemporaryDirectory(prefix="podtrain-exit-") as reports_dir:
        env[EXIT_REPORT_DIR] = reports_dir
        try:
            launcher = subprocess.Popen(command, env=env, start_new_session=True, stdout=subprocess.PIPE,
                                        stderr=subprocess.PIPE, text=True, errors="replace",
                                        preexec_fn=start_with_parent_death_signal())
        except OSError as exc:  # e.g. hyperpodrun not installed in the image
            hint = (" (a HyperPodPyTorchJob image needs pip install 'hyperpod-elastic-agent>=1.1.3')"
                    if Path(command[0]).name == "hyperpodrun" else "")
            raise UserError(f"cannot start {command[0]}: {exc.strerror or exc}{hint}") from None
        with AgentOutput([launcher], log_dir / f"torchrun_{socket.gethostname()}.log") as output:
            codes, received = wait_forwarding_signals([launcher])
        reports = read_reports(reports_dir)
    return job_verdict(run_dir, codes, received, reports, output.torchrun_text, output.log_path)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point: a ``UserError`` is one line on stderr and exit 2, as in ``podtrain``."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--"]:
        argv = argv[1:]
    try:
        return run(argv)
    except UserError as exc:
        print(f"podtrain: error: {exc}", file=sys.stderr)
        return exc.exit_code


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
