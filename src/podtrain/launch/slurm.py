"""``podtrain launch slurm CONFIG --nodes N --gpus-per-node G [--submit]``: a Slurm batch script.

The script (templates/sbatch.sh) runs one torchrun agent per node under srun, with c10d
rendezvous. What it gets right, each a failure users hit on real clusters:

* The rendezvous endpoint is worked out on every node, when the step starts: the first node of the
  step, its address from ``scontrol show node`` (NodeAddr; Slurm node names need not resolve),
  and a port derived from the job id (``distributed.env.slurm_port``). After a HyperPod node replacement
  and auto-resume, it is the new allocation's address, not one computed once and gone stale.
* The per-node script is written with a quoted heredoc, so ``$SLURM_NODEID`` and friends expand on
  each node, never once in the batch shell (which would make every node claim node 0).
* ``srun --auto-resume=1`` only where ``/opt/sagemaker_cluster`` exists when the job runs.
* EFA/NCCL variables by instance type, flight-recorder dumps into RUN_DIR/debug, the gloo restart
  fix (TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1), ``--max-restarts``, ``join_timeout``.
* ``#SBATCH --gpus-per-node`` from the job's GPUs per node (``--no-gpu-request`` leaves it out for
  clusters without GPU GRES): where Slurm constrains devices, a job sees only the GPUs it asked for.
* ``--signal=USR1@120``: Slurm signals every process of the step two minutes before the time
  limit; torchrun ignores it, the workers checkpoint and exit (``ckpt.signals``), and with
  ``--requeue`` the batch script requeues the job once the step has ended, to resume from there.

Everything is validated before the script is written or submitted (``jobspec.build_spec``).
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from podtrain import __version__
from podtrain.config import signal_from_name
from podtrain.distributed.env import SLURM_PORT_BASE, SLURM_PORT_SPAN
from podtrain.errors import UserError
from podtrain.launch.shell import Var, check, concat, line, word
from podtrain.launch.torchrun import torchrun_flags, worker_env
from podtrain.launch.jobspec import (JobSpec, absolute_paths, add_job_arguments, build_spec, check_image,
                                     config_yaml, dns_label, shared_storage_warnings)

HYPERPOD_MARKER = "/opt/sagemaker_cluster"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``podtrain launch slurm``."""
    add_job_arguments(parser, "node", "the script", max_restarts=0)
    parser.add_argument("--partition", default=None, help="Slurm partition")
    parser.add_argument("--account", default=None, help="Slurm account")
    parser.add_argument("--time", default=None, help="time limit, e.g. 2-00:00:00 or 90")
    parser.add_argument("--job-name", default=None, help="job name (default: podtrain-RUN)")
    parser.add_argument("--container-image", default=None,
                        help="enroot/pyxis image for srun (a tagged name or a .sqsh file)")
    parser.add_argument("--container-mounts", default=None,
                        help="pyxis mounts SRC:DST[,...]; the run directory must be inside one")
    parser.add_argument("--venv", default=None, help="virtual environment to activate on every node")
    parser.add_argument("--signal", default="USR1@120",
                        help="preemption signal SIG@SECONDS before the time limit, or 'none' "
                             "(default USR1@120); the run checkpoints and exits on it")
    parser.add_argument("--requeue", action="store_true",
                        help="let Slurm requeue the job after preemption or node failure")
    parser.add_argument("--no-gpu-request", action="store_true",
                        help="leave out #SBATCH --gpus-per-node (only for clusters without GPU GRES, "
                             "whose sbatch refuses it)")
    parser.add_argument("--request-gpus", action="store_true", help=argparse.SUPPRESS)  # the default now
    parser.add_argument("--output", "-o", default="-",
                        help="where to write the script (default: standard output)")
    parser.add_argument("--submit", action="store_true", help="submit the script with sbatch")


@dataclass(frozen=True)
class Preemption:
    """The signal Slurm sends ``seconds`` before the time limit (``--signal=NAME@SECONDS``)."""

    name: str
    seconds: int

    @property
    def short(self) -> str:
        """``USR1`` for ``SIGUSR1``: the spelling #SBATCH and bash's trap take."""
        return self.name.removeprefix("SIG")


@dataclass(frozen=True)
class SlurmJob:
    """Everything the batch script is rendered from; built only from validated input."""

    spec: JobSpec
    run_dir: str
    config_yaml: str
    job_name: str
    sbatch_options: tuple[str, ...]
    srun_options: tuple[str, ...]
    venv: str | None
    preemption: Preemption | None
    max_restarts: int
    join_timeout: int
    requeue: bool


def _node_venv(requested: str | None) -> str | None:
    """The virtual environment the nodes activate (--venv), resolved; without one the nodes run
    the ``python3`` on their PATH, and a user running podtrain from a venv is told so."""
    if requested:
        return str(Path(requested).resolve())
    if sys.prefix != sys.base_prefix:
        print(f"podtrain: warning: no --venv: the nodes will run the python3 on their PATH, not "
              f"this virtual environment ({sys.prefix}); pass --venv if podtrain lives there",
              file=sys.stderr)
    return None


def parse_preemption(text: str) -> Preemption | None:
    """``USR1@120`` / ``SIGUSR1@120`` / ``R:USR1@120`` -> Preemption; ``none`` -> None."""
    if text.lower() in ("none", "off", ""):
        return None
    match = re.fullmatch(r"(?:(R):)?([A-Za-z0-9]+)@(\d+)", text)
    if not match:
        if text.startswith("B:"):
            raise UserError(f"--signal {text}: 'B:' signals only the batch shell, which does not "
                            "reach the training processes; drop the 'B:'")
        raise UserError(f"--signal {text!r} must look like USR1@120 (signal@seconds) or 'none'")
    sig = signal_from_name(match[2], f"--signal {text}")
    return Preemption(sig.name, int(match[3]))


def parse_time(text: str) -> int | None:
    """Slurm time limit -> seconds (``90``, ``1:30:00``, ``2-00:00:00``...); None = unlimited."""
    if text.upper() in ("UNLIMITED", "INFINITE"):
        return None
    match = re.fullmatch(r"(?:(\d+)-)?(\d+)(?::(\d+))?(?::(\d+))?", text)
    if not match:
        raise UserError(f"--time {text!r} is not a Slurm time (MM, HH:MM:SS, D-HH:MM:SS ...)")
    days, a, b, c = (int(g) if g else None for g in match.groups())
    if days is not None:  # D-HH, D-HH:MM, D-HH:MM:SS
        return days * 86400 + a * 3600 + (b or 0) * 60 + (c or 0)
    if c is not None:  # HH:MM:SS
        return a * 3600 + b * 60 + c
    if b is not None:  # MM:SS
        return a * 60 + b
    return a * 60  # minutes


def build_job(args: argparse.Namespace, cwd: Path | None = None) -> SlurmJob:
    """Validate every flag and the training config; raise UserError before anything is written."""
    cwd = cwd or Path.cwd()
    if args.request_gpus and args.no_gpu_request:
        raise UserError("--request-gpus (the default now) and --no-gpu-request contradict each other")
    for flag, value in (("--venv", args.venv), ("--container-image", args.container_image),
                        ("--container-mounts", args.container_mounts)):
        if value:
            check(value, flag)  # each reaches a line of the script (shell.py); --job-name: job_name()
    spec = build_spec(args.config, args.overrides, args.nodes, args.gpus_per_node,
                      args.nproc_per_node, args.instance_type, gpu_memory_gib=args.gpu_memory)
    preemption = parse_preemption(args.signal)
    _check_preemption(preemption, spec, args.time)
    if args.max_restarts < 0 or args.join_timeout < 1:
        raise UserError("--max-restarts must be >= 0 and --join-timeout >= 1")
    if args.container_image:
        _check_container(args.container_image, args.container_mounts)
    if args.submit:
        _check_submit_host(args.venv)
    paths = absolute_paths(spec.cfg, cwd)
    updates: dict[str, object] = dict(paths)
    if preemption:
        updates["ckpt.grace_s"] = float(preemption.seconds)  # the save is timed against it
    run_dir = paths["run.dir"]
    if any(c.isspace() for c in run_dir):
        raise UserError(f"run.dir {run_dir!r} contains white space, which the job's log path cannot "
                        "take (scontrol prints it space-separated)")
    if "\\" in run_dir:
        raise UserError(f"run.dir {run_dir!r} contains a backslash, which makes sbatch take the job's "
                        "log path (RUN_DIR/logs/%x-%j.out) literally, without the job's name and id")
    if args.container_image:
        _check_in_mounts(run_dir, args.container_mounts)
    return SlurmJob(
        spec=spec, run_dir=run_dir, config_yaml=config_yaml(spec.cfg, updates),
        job_name=job_name(args.job_name) if args.job_name else dns_label(f"podtrain-{Path(run_dir).name}"),
        sbatch_options=_sbatch_options(args, spec, preemption),
        srun_options=_srun_options(args), venv=_node_venv(args.venv),
        preemption=preemption, max_restarts=args.max_restarts, join_timeout=args.join_timeout,
        requeue=args.requeue)


HETJOB_WORDS = ("hetjob", "packjob")
"""sbatch reads an ``#SBATCH`` line holding one of these, anywhere and in any case, as the start
of a heterogeneous job's next component."""


def job_name(name: str) -> str:
    """``--job-name NAME`` checked for what Slurm does with it: ``%x`` in the log's file name
    (no ``/``), ``scontrol``'s space-separated job record (no white space), ``#SBATCH`` lines
    (``sbatch_option``). Quotes, ``$``, backquotes, ``#`` and unicode are kept exactly."""
    check(name, "--job-name")
    if "/" in name:
        raise UserError(f"--job-name {name!r} contains a '/', which the job's log file name "
                        "(%x-%j.out, %x: the job name) cannot take")
    if any(c.isspace() for c in name):
        raise UserError(f"--job-name {name!r} contains white space, which the job's log path cannot "
                        "take (scontrol prints it space-separated)")
    return _no_hetjob(name, "--job-name")


def _no_hetjob(value: str, flag: str) -> str:
    found = next((w for w in HETJOB_WORDS if w in value.lower()), None)
    if found:
        raise UserError(f"{flag} {value!r} contains {found!r}, which sbatch reads on an #SBATCH line "
                        "as the start of another job component; choose another name")
    return value


def sbatch_option(option: str) -> str:
    """``option`` written so that sbatch reads it back exactly from an ``#SBATCH`` line. Slurm
    splits those lines itself (``_get_argument`` in sbatch's opt.c), not with a shell: white
    space separates arguments, quotes group, an unescaped ``#`` starts a comment, and a backslash
    makes the next character literal; so each of those characters gets a backslash."""
    assert not any(c.isspace() and c != " " for c in option), option  # refused by shell.check
    return re.sub(r"""([ \\'"#])""", r"\\\1", option)


def _check_preemption(pre: Preemption | None, spec: JobSpec, time_limit: str | None) -> None:
    if pre is None:
        return
    if pre.name not in {signal_from_name(n).name for n in spec.cfg.ckpt.signals}:
        raise UserError(f"--signal {pre.short}@{pre.seconds}: the training config's ckpt.signals "
                        f"({', '.join(spec.cfg.ckpt.signals)}) does not include {pre.name}, so the "
                        "run would die without a checkpoint; add it or change --signal")
    limit = parse_time(time_limit) if time_limit else None
    if limit is not None and pre.seconds >= limit:
        raise UserError(f"--signal {pre.short}@{pre.seconds} fires before the job starts: "
                        f"--time {time_limit} is only {limit} s")


def _check_container(image: str, mounts: str | None) -> None:
    if not (image.endswith(".sqsh") or image.startswith(("/", "./"))):
        check_image(image, "--container-image")
    if mounts and any(":" not in m for m in mounts.split(",")):
        raise UserError(f"--container-mounts {mounts!r}: each mount must be SRC:DST")


def _check_in_mounts(run_dir: str, mounts: str | None) -> None:
    """Inside a container the run directory must be a mounted (shared) path, or nothing persists."""
    targets = [m.split(":")[1] for m in (mounts or "").split(",") if ":" in m]
    if not any(Path(run_dir).is_relative_to(t) for t in targets):
        raise UserError(f"run.dir {run_dir} is not inside any --container-mounts destination "
                        f"({', '.join(targets) or 'none given'}): checkpoints would vanish with "
                        "the container")


def _check_submit_host(venv: str | None) -> None:
    if not shutil.which("sbatch"):
        raise UserError("--submit needs sbatch, which is not on PATH here (run on a Slurm login "
                        "node, or write the script with --output and submit it there)")
    if venv and not (Path(venv) / "bin" / "activate").is_file():
        raise UserError(f"--venv {venv} has no bin/activate")


def _sbatch_options(args: argparse.Namespace, spec: JobSpec, pre: Preemption | None) -> tuple[str, ...]:
    opts = []
    for flag, value in (("partition", args.partition), ("account", args.account), ("time", args.time)):
        if value:
            if not re.fullmatch(r"[\w.:@+-]+", value):
                raise UserError(f"--{flag} {value!r} has characters Slurm does not take")
            _no_hetjob(value, f"--{flag}")
            opts.append(f"--{flag}={value}")
    if spec.gpus_per_node and not args.no_gpu_request:
        # Clusters that constrain devices (cgroup ConstrainDevices) show a job only the GPUs it
        # requested: --exclusive alone gives the node, not its GPUs, and a step gets the GPUs
        # its job requested.
        opts.append(f"--gpus-per-node={spec.gpus_per_node}")
    if pre:
        opts.append(f"--signal={pre.short}@{pre.seconds}")
    if args.requeue:
        opts += ["--requeue", "--open-mode=append"]  # a requeued job appends to the same log
    return tuple(opts)


def _srun_options(args: argparse.Namespace) -> tuple[str, ...]:
    if not args.container_image:
        return ()
    opts = [f"--container-image={args.container_image}"]
    if args.container_mounts:
        opts.append(f"--container-mounts={args.container_mounts}")
    return tuple(opts)


def render_script(job: SlurmJob) -> str:
    """The batch script for ``job`` (pure: the same job gives the same text). Every value goes
    into a shell line through ``shell.word``/``shell.line`` and into an ``#SBATCH`` line through
    ``sbatch_option``; the node script refers to the batch shell's variables by name."""
    template = resources.files("podtrain.launch").joinpath("templates/sbatch.sh").read_text()
    flags = torchrun_flags(nnodes=Var("SLURM_JOB_NUM_NODES"), nproc=Var("NPROC"),
                           rdzv_endpoint=concat(Var("HEAD_ADDR"), ":", Var("PORT")),
                           rdzv_id=Var("SLURM_JOB_ID"), join_timeout=job.join_timeout,
                           is_host=Var("IS_HOST"), local_addr=Var("SELF_ADDR"),
                           max_restarts=job.max_restarts, grace_s=job.spec.cfg.ckpt.grace_s)
    for delimiter in ("PODTRAIN_CONFIG_END", "PODTRAIN_NODE_END"):  # YAML indents every value
        assert delimiter not in job.config_yaml.splitlines(), f"{delimiter} would end the heredoc early"
    values = {
        "VERSION": __version__,
        "JOB_NAME": job.job_name,  # comments only
        "JOB_NAME_SBATCH": sbatch_option(job.job_name),
        "JOB_NAME_SHELL": word(job.job_name),
        "NODES": str(job.spec.nodes),
        "LOG_DIR": f"{job.run_dir}/logs",  # comments only
        "SBATCH_EXTRA": "".join(f"#SBATCH {sbatch_option(o)}\n" for o in job.sbatch_options),
        "RUN_DIR": word(job.run_dir),
        "VENV": f"{line('source', job.venv + '/bin/activate')}\n" if job.venv else "",
        "CONFIG_YAML": job.config_yaml,
        "WORKER_ENV": _exports(worker_env(f"{job.run_dir}/debug", gpus=bool(job.spec.gpus_per_node))),
        "FABRIC_ENV": _exports(job.spec.fabric_env()),
        "NPROC": str(job.spec.nproc_per_node),
        "PORT_EXPR": f"$(( {SLURM_PORT_BASE} + SLURM_JOB_ID % {SLURM_PORT_SPAN} ))",
        "TORCHRUN_FLAGS": line(*flags),
        "NOTE_SIGNAL": _note_signal(job.preemption),
        "RUN_TORCHRUN": _run_torchrun(job.preemption),
        "AFTER_PREEMPTION": _after_preemption(job.requeue),
        "SRUN_EXTRA": f"{line(*job.srun_options)} " if job.srun_options else "",
    }
    missing = set(re.findall(r"@@([A-Z_]+)@@", template)) - set(values)
    assert not missing, f"sbatch template placeholders without values: {missing}"
    for key, value in values.items():
        template = template.replace(f"@@{key}@@", value)
    return template


SITE_CHOICE = ("NCCL_SOCKET_IFNAME",)
"""Variables a site's own environment sets better than podtrain's default."""


def _exports(variables: dict[str, str]) -> str:
    """``export K=V`` lines, V quoted (``shell.word``); a ``SITE_CHOICE`` keeps the value the
    node's environment already has."""
    lines = []
    for key, value in variables.items():
        export = f"export {key}={word(value)}"
        lines.append(f'[ -n "${{{key}:-}}" ] || {export}\n' if key in SITE_CHOICE else f"{export}\n")
    return "".join(lines)


def _handles(pre: Preemption | None) -> bool:
    """Whether the node script must shield torchrun from the signal (it relays TERM/INT itself)."""
    return pre is not None and pre.name not in ("SIGTERM", "SIGINT")


def _note_signal(pre: Preemption | None) -> str:
    if not _handles(pre):
        return ""
    return ("# The preemption signal reaches every process of the step (Slurm signals them all): the\n"
            "# workers checkpoint and exit. This shell only notes it, for the batch script to requeue.\n"
            f"trap 'touch \"$PODTRAIN_PREEMPT_MARKER\"' {pre.short}\n")


def _run_torchrun(pre: Preemption | None) -> str:
    if not _handles(pre):
        return 'exec "${TORCHRUN[@]}"\n'
    return (f"# torchrun ignores {pre.name} (it would die of it and take the workers along).\n"
            f"(trap '' {pre.short}; exec \"${{TORCHRUN[@]}}\") &\n"
            "AGENT=$!\n"
            "# `wait` returns early each time the trap runs: wait until torchrun has really exited.\n"
            "while true; do\n"
            '  rc=0; wait "$AGENT" || rc=$?\n'
            '  kill -0 "$AGENT" 2>/dev/null || exit "$rc"\n'
            "done\n")


def _after_preemption(requeue: bool) -> str:
    if requeue:
        return ("  # Queue the job again (same id, same log): it resumes from that checkpoint, without\n"
                "  # the nodes the run's health verdicts blame (RUN_DIR/health/, podtrain.distributed.health).\n"
                '  BLAMED=$(python3 -m podtrain.distributed.health exclude "$RUN_DIR" || true)\n'
                "  trap '' TERM  # the requeue signals this script: the exclusion below must still run\n"
                '  if scontrol requeue "$SLURM_JOB_ID"; then\n'
                '    if [ -n "$BLAMED" ]; then\n'
                "      # Slurm changes a job's excluded nodes only while it is pending: after the requeue.\n"
                '      echo "podtrain: the requeued job excludes the blamed node(s) $BLAMED (see $RUN_DIR/health/)"\n'
                '      scontrol update jobid="$SLURM_JOB_ID" ExcNodeList="$BLAMED" \\\n'
                '        || echo "podtrain: could not exclude $BLAMED from job $SLURM_JOB_ID" >&2\n'
                "    fi\n"
                "    exit 0\n"
                "  fi\n")
    return '  echo "podtrain: submit the script again to resume (--requeue does it by itself)"\n'


def submit(script: Path, log_dir: Path | None = None) -> str:
    """``sbatch SCRIPT``, with the job's log in ``log_dir`` when given (the script's own
    ``#SBATCH --output`` is sbatch's directory); returns the job id. UserError with sbatch's
    message when it refuses."""
    # sbatch expands %x, %j... in the path: a % of the directory's own is written %%.
    output = [f"--output={str(log_dir).replace('%', '%%')}/%x-%j.out"] if log_dir else []
    proc = subprocess.run(["sbatch", "--parsable", *output, str(script)], capture_output=True, text=True,
                          timeout=120)
    if proc.returncode != 0:
        msg = (proc.stderr or proc.stdout).strip().splitlines()
        raise UserError(f"sbatch refused {script}: {msg[-1] if msg else f'exit {proc.returncode}'}")
    return proc.stdout.strip().split(";")[0]


def run(args: argparse.Namespace) -> int:
    """Validate, then write the script (stdout or --output) and, with --submit, submit it."""
    job = build_job(args)
    script = render_script(job)
    for line in shared_storage_warnings(job.spec.cfg, Path.cwd()):
        print(f"podtrain: warning: {line}", file=sys.stderr)
    target = None if args.output == "-" else Path(args.output)
    if target is None and args.submit:
        target = Path(job.run_dir) / "logs" / f"{job.job_name}-{time.strftime('%Y%m%d-%H%M%S')}.sbatch"
    if target is None:
        sys.stdout.write(script)
        return 0
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(script)
    except OSError as exc:
        raise UserError(f"--output {target}: cannot write it ({exc.strerror})") from None
    target.chmod(0o755)
    print(f"podtrain: wrote {target}", file=sys.stderr)
    if not args.submit:
        print(f"podtrain: submit it with `sbatch {target}` from any directory; the log is "
              f"{job.job_name}-JOBID.out in that directory, linked from {job.run_dir}/logs/", file=sys.stderr)
        return 0
    # sbatch cannot create the directory of --output: without it the job fails with no log.
    log_dir = Path(job.run_dir) / "logs"
    try:
        log_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise UserError(f"run.dir {job.run_dir}: cannot create {log_dir} for the job's log ({exc.strerror})") from None
    job_id = submit(target, log_dir)
    print(f"podtrain: submitted job {job_id}; log {log_dir}/{job.job_name}-{job_id}.out", file=sys.stderr)
    return 0
