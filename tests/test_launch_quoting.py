"""Quoting by construction (``launch/shell.py``): values full of what shells and Slurm read
specially go through ``launch k8s`` and ``launch slurm``, and the generated shell is then run for
real: the pod's command by bash after the kubelet's own ``$(...)`` expansion, the batch script and
its per-node script by bash under the Slurm stand-ins, with a fake ``python3`` first on PATH that
records the argv it was started with (``FAKE_PYTHON`` of test_launch_slurm.py). Each value is
either refused in one line (exit 2, nothing written) or reaches the launched program exactly.

One field is fuzzed per case (the others stay plain), from a fixed list of classics and seeded
random mixes; no cluster, a few seconds for all.
"""

from __future__ import annotations

import json
import random
import subprocess
import sys
import unicodedata
from pathlib import Path, PurePosixPath

import pytest
import yaml

from cluster_fixtures import batch_environment, fake_slurm_bin
from podtrain.cli import main
from podtrain.distributed.env import slurm_port
from podtrain.launch.torchrun import shutdown_timeout_s, torchrun_has_shutdown_timeout
from test_launch_k8s import pod_process
from test_launch_slurm import FAKE_PYTHON

PIECES = (" ", "$", "$$", "$HOME", "${PATH}", "$(touch PWNED)", "`touch PWNED`", "$(POD_IP)", "$(", ")",
          "'", '"', "\\", "\\'", ";", "&&", "|", ">", "*", "?", "[ab]", "~", "#", "!", "%x", "{a,b}",
          "=", ":", ",", ".", "..", "é", "日本", "🚀", "\u00a0", "\u2028", "\n", "\t", "\r", "\x00",
          "\udcff", "hetJob", "x", "run", "7")
"""What a random value is made of: shell syntax, kubelet ``$(NAME)``/``$$``, sbatch's quotes,
``#`` and het-job separator, globs, unicode, control characters, undecodable bytes. No ``/``:
the values are also used as one path component under the test's directory."""

CLASSICS = ("my run", "$(touch PWNED)", "`touch PWNED`", "a'b\"c\\d", "-rf", "--log-dir=x", "日本 🚀 é",
            "$(HOME)x", "a$é", "$$", "x\ny", "x\x00y", "*;&&|", "#comment", "~", "x\ry", "%x%j")

REGISTRY = "123456789012.dkr.ecr.us-west-2.amazonaws.com"
POD_IP = "10.1.2.3"
JOB_ID = "4242"


def nasty(rng: random.Random) -> str:
    """A random value: an optional leading dash or two, then one to five pieces."""
    lead = rng.choice(("", "", "-", "--"))
    return lead + "".join(rng.choice(PIECES) for _ in range(rng.randint(1, 5)))


def cases(seed: int, fields: tuple[str, ...], rounds: int) -> list[tuple[str, str]]:
    """(field, value) pairs: every classic once, then ``rounds`` random values per field."""
    rng = random.Random(seed)
    pairs = [(fields[i % len(fields)], value) for i, value in enumerate(CLASSICS)]
    pairs += [(field, nasty(rng)) for _ in range(rounds) for field in fields]
    return pairs


SHIPPED_ONLY = ("config", "data.cache_dir")
"""Fields that reach no shell line: the config file is read here and its content shipped (in the
ConfigMap, in the script's quoted heredoc), where YAML carries any character."""


def unrepresentable(value: str) -> bool:
    """A control character or an undecodable byte: refused wherever it would reach a shell line."""
    return any(unicodedata.category(c) in ("Cc", "Cs") for c in value)


def file_name(value: str) -> str:
    """``value`` usable as a file name here (NUL is the one character no file name holds)."""
    return value.replace("\0", "0") or "empty"


def generate(capsys, argv: list[str], out: Path) -> bool:
    """Run the CLI: True when it wrote ``out``; False when it refused in exactly one line, exit
    2, with nothing written. Anything else (a traceback, two lines) fails the test."""
    code = main(argv)
    err = capsys.readouterr().err
    if code == 2:
        assert err.count("\n") == 1 and err.startswith("podtrain: error: "), err
        assert not out.exists()
        return False
    assert code == 0 and out.is_file(), err
    return True


def config_file(folder: Path, name: str, lr: float) -> Path:
    """A small training config named ``name``; ``optim.lr`` marks it in what the job ships."""
    path = folder / "cfg" / f"{name}.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump({"optim": {"lr": lr}, "train": {"global_batch_size": 8,
                                                                   "micro_batch_size": 4}}))
    return path


def fake_bin(folder: Path, record: Path, module: str) -> Path:
    """A bin directory whose ``python3`` records ``python3 -m MODULE ...`` into ``record``."""
    bindir = folder / "bin"
    bindir.mkdir(parents=True, exist_ok=True)
    record.mkdir(parents=True, exist_ok=True)
    (bindir / "python3").write_text(FAKE_PYTHON.format(python=sys.executable, record=record, module=module))
    (bindir / "python3").chmod(0o755)
    return bindir


def only_record(record: Path) -> dict:
    files = list(record.glob("*.json"))
    assert len(files) == 1, files
    return json.loads(files[0].read_text())


# -- Kubernetes: the pod's `bash -c`, after the kubelet's expansion ----------------------------

K8S_FIELDS = ("run.dir", "run.dir-on-claim", "--mount", "config", "data.cache_dir", "--image")


@pytest.mark.slow
def test_k8s_pod_command_hands_every_value_over_exactly_or_refuses_it(tmp_path, capsys):
    accepted = set()
    for i, (field, value) in enumerate(cases(26, K8S_FIELDS, rounds=3)):
        case = tmp_path / f"case{i}"
        case.mkdir()
        kind = ("pytorchjob", "hyperpodpytorchjob")[i % 2]
        lr = 1e-3 + i * 1e-6
        config = config_file(case, file_name(value) if field == "config" else "plain", lr)
        mount = f"/mnt/{value}" if field == "--mount" else "/fsx"
        run_dir = {"run.dir": value, "run.dir-on-claim": f"runs/{value}"}.get(field, "runs/plain")
        cache = value if field == "data.cache_dir" else "/cache"
        image = f"{REGISTRY}/team{value}/podtrain:0.1.0" if field == "--image" else f"{REGISTRY}/podtrain:0.1.0"
        claim = [] if field == "run.dir" else ["--pvc", "claim", f"--mount={mount}"]
        out = case / "job.yaml"
        argv = ["launch", "k8s", str(config), f"run.dir={run_dir}", f"data.cache_dir={cache}",
                "--nodes", "1", "--gpus-per-node", "0", "--nproc-per-node", "1", f"--image={image}",
                "--kind", kind, *claim, "--output", str(out)]
        if not generate(capsys, argv, out):
            continue
        assert field in SHIPPED_ONLY or not unrepresentable(value), f"{field} {value!r} was accepted"
        accepted.add(field)
        config_map, job = yaml.safe_load_all(out.read_text())
        shipped = yaml.safe_load(config_map["data"]["config.yaml"])
        pod_run_dir = str(PurePosixPath(mount) / run_dir) if claim else run_dir
        assert shipped["run"]["dir"] == pod_run_dir and shipped["data"]["cache_dir"] == cache, (field, value)
        assert shipped["optim"]["lr"] == lr
        template = job["spec"]["pytorchReplicaSpecs"]["Worker"]["template"] if kind == "pytorchjob" \
            else job["spec"]["replicaSpecs"][0]["template"]
        (container,) = template["spec"]["containers"]
        assert container["image"] == image and container.get("workingDir", mount) == mount

        # The pod: the kubelet expands the command and env, bash runs the command.
        record = case / "record"
        bindir = fake_bin(case, record, "podtrain.launch.agent")
        (bindir / "getent").write_text("#!/bin/bash\nexit 0\n")  # the rendezvous host resolves
        (bindir / "getent").chmod(0o755)
        pod_config = case / "etc" / "config.yaml"
        command, env = pod_process(container, {
            "PODTRAIN_CONFIG": str(pod_config), "POD_IP": POD_IP, "PET_RDZV_ENDPOINT": "head:29400",
            "PATH": f"{bindir}:/usr/bin:/bin", "HOME": str(case)})
        proc = subprocess.run(command, cwd=case, env=env, capture_output=True, text=True, timeout=30)
        assert proc.returncode == 0, (field, value, proc.stderr)
        got = only_record(record)
        train = [f"--log-dir={pod_run_dir}/logs", "--tee=3", "-m", "podtrain.cli", "train", str(pod_config)]
        if kind == "pytorchjob":
            launcher = ["python3", "-m", "torch.distributed.run", "--nproc-per-node=1", f"--local-addr={POD_IP}"]
        else:
            launcher = ["hyperpodrun", "--nnodes=1", "--nproc-per-node=1", "--shutdown-signal=SIGTERM",
                        f"--shutdown-timeout={shutdown_timeout_s(shipped['ckpt']['grace_s'])}"]
        assert got["argv"] == ["-m", "podtrain.launch.agent", *launcher, *train], (field, value)
        assert got["env"]["TORCH_FR_DUMP_TEMP_FILE"] == f"{pod_run_dir}/debug/nccl_trace_rank_", (field, value)
        assert not list(case.rglob("PWNED")), f"{field} {value!r} ran a command"
    assert accepted == set(K8S_FIELDS), f"no value was accepted for {set(K8S_FIELDS) - accepted}"


# -- Slurm: the batch script and the per-node script, under the stand-ins -----------------------

SLURM_FIELDS = ("run.dir", "config", "data.cache_dir", "--job-name", "--container-image",
                "--container-mounts", "--venv")

SRUN_RECORDER = """#!/bin/bash
# Records srun's exact argv (NUL-separated: no argument holds a NUL), then runs the stand-in srun
# of cluster_fixtures.
printf '%s\\0' "$@" > {record}
exec "$(dirname "$0")/srun.stand-in" "$@"
"""


def sbatch_arguments(script: str) -> list[str]:
    """The options sbatch reads from a script, split as Slurm itself does (``_opt_batch_script``
    and ``_get_argument`` in src/sbatch/opt.c): only lines starting ``#SBATCH``, up to the first
    line that is not a comment; C white space separates, quotes group, a backslash makes the
    next character literal, an unescaped ``#`` ends the line; a line naming a het-job separator
    starts another job component (never expected here)."""
    args: list[str] = []
    for text in script.split("\n"):
        if not text.startswith("#SBATCH"):
            if text.strip() and not text.lstrip().startswith("#"):
                break
            continue
        assert "hetjob" not in text.lower() and "packjob" not in text.lower(), text
        rest, i = text[len("#SBATCH"):], 0
        while True:
            while i < len(rest) and rest[i] in " \t\v\f\r":
                i += 1
            if i == len(rest) or rest[i] == "#":
                break
            arg, quote, escaped = [], "", False
            while i < len(rest) and (quote or rest[i] not in " \t\v\f\r"):
                char, i = rest[i], i + 1
                if escaped:
                    escaped = False
                elif char == "\\":
                    escaped = True
                    continue
                elif quote:
                    if char == quote:
                        quote = ""
                        continue
                elif char in "'\"":
                    quote = char
                    continue
                elif char == "#":
                    i = len(rest)
                    break
                arg.append(char)
            assert not quote, f"sbatch: unmatched {quote} in {text!r}"
            if arg:
                args.append("".join(arg))
    return args


def run_batch_script(case: Path, script: Path) -> tuple[subprocess.CompletedProcess, Path, Path]:
    """Run the batch script on one stand-in node (address 127.0.0.1); returns the process, the
    folder of torchrun records and srun's recorded argv file."""
    record = case / "record"
    bindir = fake_bin(case, record, "torch.distributed.run")
    fake_slurm_bin(bindir, {"n1": "127.0.0.1"})
    (bindir / "srun").rename(bindir / "srun.stand-in")
    srun_argv = case / "srun-argv"
    (bindir / "srun").write_text(SRUN_RECORDER.format(record=srun_argv))
    (bindir / "srun").chmod(0o755)
    env = batch_environment(JOB_ID, ["n1"], bindir)
    env.update(HOME=str(case), SLURM_SUBMIT_DIR=str(case), VENV_RECORD=str(case / "sourced"))
    proc = subprocess.run(["bash", str(script)], cwd=case, env=env, capture_output=True, text=True, timeout=30)
    return proc, record, srun_argv


def fake_venv(folder: Path) -> Path:
    """A folder whose bin/activate records the path it was sourced from."""
    (folder / "bin").mkdir(parents=True, exist_ok=True)
    (folder / "bin" / "activate").write_text('printf %s "${BASH_SOURCE[0]}" > "$VENV_RECORD"\n')
    return folder


@pytest.mark.slow
def test_slurm_scripts_hand_every_value_over_exactly_or_refuse_it(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    accepted = set()
    for i, (field, value) in enumerate(cases(27, SLURM_FIELDS, rounds=2)):
        case = tmp_path / f"case{i}"
        case.mkdir()
        lr = 1e-3 + i * 1e-6
        config = config_file(case, file_name(value) if field == "config" else "plain", lr)
        run_dir = case / "runs" / (value if field == "run.dir" else "plain")
        cache = value if field == "data.cache_dir" else "/cache"
        flags = [f"--job-name={value}"] if field == "--job-name" else []
        image = mounts = None
        if field in ("--container-image", "--container-mounts"):
            image = (f"/images/{value}.sqsh" if i % 2 else f"nvcr.io#nvidia/{value}pytorch:24.01") \
                if field == "--container-image" else "/images/plain.sqsh"
            mounts = f"{case}:{case},/data/{value}:/data" if field == "--container-mounts" else f"{case}:{case}"
            flags += [f"--container-image={image}", f"--container-mounts={mounts}"]
        venv = None
        if field == "--venv":
            venv = case / "venvs" / file_name(value)
            if "\0" not in value:
                fake_venv(venv)
            flags.append(f"--venv={case / 'venvs' / value}")
        out = case / "job.sbatch"
        argv = ["launch", "slurm", str(config), f"run.dir={run_dir}", f"data.cache_dir={cache}",
                "--nodes", "1", "--gpus-per-node", "0", "--nproc-per-node", "1", *flags, "--output", str(out)]
        if not generate(capsys, argv, out):
            continue
        assert field in SHIPPED_ONLY or not unrepresentable(value), f"{field} {value!r} was accepted"
        accepted.add(field)
        script = out.read_text()
        directives = sbatch_arguments(script)
        if field == "--job-name":
            assert directives[0] == f"--job-name={value}", (value, directives)
        assert directives[1:] == ["--nodes=1", "--ntasks-per-node=1", "--exclusive", "--wait-all-nodes=1",
                                  "--output=%x-%j.out", "--signal=USR1@120"], (field, value)
        job_name = directives[0].removeprefix("--job-name=")

        proc, record, srun_argv = run_batch_script(case, out)
        assert proc.returncode == 0, (field, value, proc.stderr)
        rundir = str(run_dir.resolve())
        got = only_record(record)
        pod_config = f"{rundir}/logs/config-{JOB_ID}.yaml"
        shutdown = ["--shutdown-timeout=120"] if torchrun_has_shutdown_timeout() else []
        assert got["argv"] == ["-m", "torch.distributed.run", "--nnodes=1", "--nproc-per-node=1",
                               "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{slurm_port(JOB_ID)}",
                               f"--rdzv-id={JOB_ID}", "--rdzv-conf=join_timeout=600,is_host=1",
                               "--local-addr=127.0.0.1", "--max-restarts=0", *shutdown,
                               "-m", "podtrain.cli", "train", pod_config], (field, value)
        assert got["env"]["PODTRAIN_CONFIG"] == pod_config
        assert got["env"]["TORCH_FR_DUMP_TEMP_FILE"] == f"{rundir}/debug/nccl_trace_rank_", (field, value)
        shipped = yaml.safe_load(Path(pod_config).read_text())
        assert shipped["run"]["dir"] == rundir and shipped["data"]["cache_dir"] == cache, (field, value)
        assert shipped["optim"]["lr"] == lr
        # The job's log, linked from RUN_DIR/logs under the job's name (SLURM_JOB_NAME unset here).
        link = Path(rundir) / "logs" / f"{job_name}-{JOB_ID}.out"
        assert link.is_symlink() and str(link.readlink()) == f"{case}/{job_name}-{JOB_ID}.out", (field, value)
        srun = srun_argv.read_bytes().decode("utf-8", "surrogateescape").split("\0")[:-1]
        extra = [f"--container-image={image}", f"--container-mounts={mounts}"] if image else []
        assert srun == ["--kill-on-bad-exit=1", "--cpu-bind=none", *extra, "bash",
                        f"{rundir}/logs/node-{JOB_ID}.sh"], (field, value)
        if venv is not None:
            assert (case / "sourced").read_text() == f"{venv.resolve()}/bin/activate", value
        assert not list(case.rglob("PWNED")), f"{field} {value!r} ran a command"
    assert accepted == set(SLURM_FIELDS), f"no value was accepted for {set(SLURM_FIELDS) - accepted}"

