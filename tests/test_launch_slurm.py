"""``podtrain launch slurm``: the generated batch script, run by bash with Slurm's control plane
(srun, scontrol) played by small stand-ins, and the bad-input checks.

The real Slurm cluster runs in test_cluster_slurm.py; here a fake ``python3`` records what torchrun
would have been started with on each node, so each check costs milliseconds.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from cluster_fixtures import batch_environment, fake_slurm_bin
from podtrain.cli import main
from podtrain.config import load_config
from podtrain.distributed.env import slurm_port
from podtrain.launch import instances, slurm

REPO = Path(__file__).resolve().parents[1]
DEMO = str(REPO / "configs" / "demo.yaml")

FAKE_PYTHON = """#!/bin/bash
# Records `python3 -m {module} ...` (args, environment, ignored signals) instead of running it
# (torch.distributed.run: instead of training); every other python3 call goes to the real
# interpreter.
if [ "$1 $2" = "-m {module}" ]; then
  if [ -n "${{FAKE_PREEMPT:-}}" ]; then  # Slurm signals the step; the workers stop: agent fails
    kill -USR1 $PPID; sleep 0.2; exit 1
  fi
  exec {python} -c 'import json, os, sys
status = open("/proc/self/status").read()
ignored = int(next(l.split()[1] for l in status.splitlines() if l.startswith("SigIgn")), 16)
print(json.dumps({{"argv": sys.argv[1:], "env": dict(os.environ), "ignored": ignored}}))' "$@" \
    > {record}/$$.json  # one file per node: concurrent appends to one file can interleave
fi
exec {python} "$@"
"""


def generate(tmp_path: Path, *flags: str, overrides: tuple[str, ...] = ()) -> Path:
    """Run `podtrain launch slurm` and return the written script."""
    out = tmp_path / "job.sbatch"
    args = ["launch", "slurm", DEMO, f"run.dir={tmp_path / 'run'}", "train.global_batch_size=32",
            "train.micro_batch_size=4", *overrides, "--nodes", "2", "--output", str(out), *flags]
    assert main(args) == 0
    return out


def run_batch(tmp_path: Path, script: Path, job_id: str = "4242", env_extra: dict | None = None,
              text: str | None = None) -> tuple[list[dict], str, str]:
    """Run the batch script under the stand-ins; return (torchrun records, stdout, srun args)."""
    bindir = tmp_path / "bin"
    srun_record = fake_slurm_bin(bindir, {"n1": "10.9.0.1", "n2": "10.9.0.2"})
    record = tmp_path / "torchrun"
    shutil.rmtree(record, ignore_errors=True)
    record.mkdir()
    (bindir / "python3").write_text(FAKE_PYTHON.format(python=sys.executable, record=record,
                                                       module="torch.distributed.run"))
    (bindir / "python3").chmod(0o755)
    if text is not None:
        script = tmp_path / "mutated.sbatch"
        script.write_text(text)
    env = batch_environment(job_id, ["n1", "n2"], bindir)
    env.update(env_extra or {})
    proc = subprocess.run(["bash", str(script)], env=env, capture_output=True, text=True, timeout=60)
    if env.get("FAKE_PREEMPT"):
        return [], proc.stdout, str(proc.returncode)
    assert proc.returncode == 0, proc.stderr
    records = [json.loads(path.read_text()) for path in sorted(record.glob("*.json"))]
    return records, proc.stdout, srun_record.read_text()


def flag(argv: list[str], name: str) -> str:
    """The value of ``--name=value`` in argv."""
    values = [a.split("=", 1)[1] for a in argv if a.startswith(f"--{name}=")]
    assert len(values) == 1, (name, argv)
    return values[0]


def check_nodes(records: list[dict], stdout: str, job_id: str) -> None:
    """What must hold on every node: same endpoint, own node id, one rendezvous host."""
    assert len(records) == 2
    endpoints = {flag(r["argv"], "rdzv-endpoint") for r in records}
    assert endpoints == {f"10.9.0.1:{slurm_port(job_id)}"}, "nodes disagree on the rendezvous"
    hosts = sorted(flag(r["argv"], "rdzv-conf") for r in records)
    assert hosts == ["join_timeout=600,is_host=0", "join_timeout=600,is_host=1"], hosts
    node_lines = sorted(re.findall(r"podtrain: node (\d) of 2 \((n\d) ", stdout))
    assert node_lines == [("0", "n1"), ("1", "n2")], stdout


def test_script_runs_one_torchrun_per_node_with_its_own_identity(tmp_path):
    script = generate(tmp_path, "--gpus-per-node", "0", "--nproc-per-node", "2")
    subprocess.run(["bash", "-n", str(script)], check=True)
    records, stdout, srun_args = run_batch(tmp_path, script)
    check_nodes(records, stdout, "4242")
    for r in records:
        argv, env = r["argv"], r["env"]
        assert flag(argv, "nnodes") == "2" and flag(argv, "nproc-per-node") == "2"
        assert flag(argv, "rdzv-backend") == "c10d" and flag(argv, "rdzv-id") == "4242"
        assert flag(argv, "max-restarts") == "0"
        assert argv[-4:] == ["-m", "podtrain.cli", "train", env["PODTRAIN_CONFIG"]]
        assert env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] == "1"
        assert env["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "1"
        assert env["TORCH_FR_DUMP_TEMP_FILE"].startswith(str(tmp_path / "run" / "debug"))
        assert env["GLOO_SOCKET_IFNAME"] and env["OMP_NUM_THREADS"] == "1"
        assert "FI_PROVIDER" not in env, "no EFA variables on a CPU partition"
        # torchrun ignores the preemption signal (the workers act on it), so it survives it.
        assert r["ignored"] & (1 << (signal.SIGUSR1 - 1))
    assert "--auto-resume" not in srun_args, "not on HyperPod: srun would reject the option"
    # The config that runs is the validated one, shipped inside the script.
    cfg = load_config(records[0]["env"]["PODTRAIN_CONFIG"])
    assert cfg.run.dir == str(tmp_path / "run") and cfg.train.global_batch_size == 32
    assert cfg.ckpt.grace_s == 120.0


def test_variables_expanded_by_the_batch_shell_are_caught(tmp_path):
    """The classic bug: per-node variables expanded once, by the batch shell on the first node
    (SLURM_NODEID=0, SLURMD_NODENAME=n1), so every node claims node 0 and hosts the rendezvous.
    Substituting those batch-shell values into the node script must fail the checks above."""
    script = generate(tmp_path, "--gpus-per-node", "0", "--nproc-per-node", "1")
    text = script.read_text()
    head, node, tail = re.split(r"(?<=<<'PODTRAIN_NODE_END'\n)|(?=\nPODTRAIN_NODE_END\n)", text)
    for var, batch_value in (("$SLURM_NODEID", "0"), ("${SLURMD_NODENAME:-}", "n1"),
                             ("${SLURMD_NODENAME:-?}", "n1")):
        assert var in node
        node = node.replace(var, batch_value)
    records, stdout, _ = run_batch(tmp_path, script, text=head + node + tail)
    with pytest.raises(AssertionError):
        check_nodes(records, stdout, "4242")


def test_auto_resume_only_where_hyperpod_marker_exists(tmp_path):
    script = generate(tmp_path, "--gpus-per-node", "0", "--nproc-per-node", "1")
    marker = tmp_path / "sagemaker_cluster"
    marker.mkdir()
    _, _, srun_args = run_batch(tmp_path, script, env_extra={"PODTRAIN_HYPERPOD_MARKER": str(marker)})
    assert srun_args.split()[0] == "--auto-resume=1"


def test_instance_preset_fills_gpus_and_efa(tmp_path):
    script = generate(tmp_path, "--instance-type", "ml.p5.48xlarge", "--partition", "gpu",
                      "--account", "ml", "--time", "2-00:00:00", "--requeue",
                      overrides=("train.global_batch_size=64",))
    text = script.read_text()
    for line in ("#SBATCH --nodes=2", "#SBATCH --ntasks-per-node=1", "#SBATCH --exclusive",
                 "#SBATCH --wait-all-nodes=1", "#SBATCH --partition=gpu", "#SBATCH --account=ml",
                 "#SBATCH --time=2-00:00:00", "#SBATCH --signal=USR1@120", "#SBATCH --requeue",
                 "#SBATCH --gpus-per-node=8",  # the GPUs, where Slurm binds them to the request
                 "#SBATCH --output=%x-%j.out"):  # sbatch's directory: it exists wherever it runs
        assert line + "\n" in text, line
    records, stdout, _ = run_batch(tmp_path, script)
    # The log (in SLURM_SUBMIT_DIR here: the stand-in scontrol knows no jobs) is linked from RUN_DIR/logs.
    log = Path(os.getcwd()) / "podtrain-run-4242.out"
    assert f"podtrain: job 4242 log {log}\n" in stdout
    assert os.readlink(tmp_path / "run" / "logs" / "podtrain-run-4242.out") == str(log)
    env = records[0]["env"]
    assert flag(records[0]["argv"], "nproc-per-node") == "8"
    assert (env["FI_PROVIDER"], env["FI_EFA_USE_DEVICE_RDMA"], env["FI_EFA_FORK_SAFE"]) == ("efa", "1", "1")
    assert env["NCCL_SOCKET_IFNAME"] == "^lo,docker,veth"


def test_gpus_are_requested_unless_opted_out(tmp_path):
    assert "#SBATCH --gpus-per-node=4\n" in generate(tmp_path, "--gpus-per-node", "4").read_text()
    opted_out = generate(tmp_path, "--gpus-per-node", "4", "--no-gpu-request").read_text()
    cpu = generate(tmp_path, "--gpus-per-node", "0", "--nproc-per-node", "2").read_text()
    assert "--gpus-per-node" not in opted_out and "--gpus-per-node" not in cpu


def test_container_venv_and_signal_options(tmp_path):
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    script = generate(tmp_path, "--gpus-per-node", "8", "--container-image",
                      "nvcr.io#nvidia/pytorch:24.07-py3", "--container-mounts",
                      f"{tmp_path}:{tmp_path}", "--venv", str(venv), "--signal", "TERM@300",
                      overrides=("train.global_batch_size=64",))
    text = script.read_text()
    assert f"source {venv}/bin/activate" in text
    assert "--container-image=nvcr.io#nvidia/pytorch:24.07-py3" in text
    assert "#SBATCH --signal=TERM@300" in text and "trap ''" not in text


def test_instance_presets():
    p5 = instances.lookup("ml.p5.48xlarge")
    assert (p5.gpus, p5.efa, p5.gpudirect_rdma) == (8, 32, True)
    assert instances.lookup("g5.48xlarge").fabric_env()["FI_EFA_USE_DEVICE_RDMA"] == "0"
    assert instances.resolve_gpus(p5, None) == 8


def test_time_and_signal_parsing():
    assert [slurm.parse_time(t) for t in ("90", "1:30", "2:00:00", "1-00", "1-2:03:04")] == [
        5400, 90, 7200, 86400, 93784]
    assert slurm.parse_preemption("SIGUSR1@90") == slurm.Preemption("SIGUSR1", 90)
    assert slurm.parse_preemption("none") is None


BAD_INPUT = [
    (["--nodes", "0", "--gpus-per-node", "8"], [], "--nodes must be at least 1"),
    (["--gpus-per-node", "8"], [], "podtrain launch slurm: missing --nodes: nodes to run (one torchrun each)"),
    (["--nodes", "2", "--gpus-per-node", "eight"], [], "argument --gpus-per-node: invalid int value: 'eight'"),
    (["--nodes", "2", "--gpus-per-node", "8", "--request-gpus", "--no-gpu-request"], [],
     "--request-gpus (the default now) and --no-gpu-request contradict each other"),
    (["--nodes", "2", "--instance-type", "p4d.24xlarge", "--gpus-per-node", "16"], [],
     "--gpus-per-node 16 does not fit --instance-type p4d.24xlarge"),
    (["--nodes", "2", "--instance-type", "p9.48xlarge"], [], "not a known preset"),
    (["--nodes", "2", "--gpus-per-node", "0"], [], "needs --nproc-per-node"),
    (["--nodes", "2", "--gpus-per-node", "8"], ["train.stepz=3"], "unknown config key 'train.stepz'"),
    (["--nodes", "3", "--gpus-per-node", "1"], [], "not divisible"),
    (["--nodes", "2", "--gpus-per-node", "8", "--container-image", "nvcr.io#nvidia/pytorch"], [],
     "has no tag"),
    (["--nodes", "2", "--gpus-per-node", "8", "--container-image", "repo/img:1"], [],
     "not inside any --container-mounts"),
    (["--nodes", "2", "--gpus-per-node", "8", "--signal", "B:USR1@60"], [], "'B:' signals only"),
    (["--nodes", "2", "--gpus-per-node", "8"], ["ckpt.signals=[SIGTERM]"],
     "does not include SIGUSR1"),
    (["--nodes", "2", "--gpus-per-node", "8", "--time", "1", "--signal", "USR1@120"], [],
     "fires before the job starts"),
    # What no line of the script can carry, or Slurm reads otherwise (see test_launch_quoting.py):
    (["--nodes", "2", "--gpus-per-node", "8", "--job-name", "a\nb"], [], "--job-name 'a\\nb' contains a newline"),
    (["--nodes", "2", "--gpus-per-node", "8", "--job-name", "team/a"], [], "contains a '/'"),
    (["--nodes", "2", "--gpus-per-node", "8", "--job-name", "x-HetJob"], [], "contains 'hetjob'"),
    (["--nodes", "2", "--gpus-per-node", "8", "--partition", "packjob"], [], "contains 'packjob'"),
    (["--nodes", "2", "--gpus-per-node", "8"], ["run.dir=/fsx/a\\b"], "contains a backslash"),
    (["--nodes", "2", "--gpus-per-node", "8"], ["data.path=/fsx/a\tb"], "data.path '/fsx/a\\tb' contains a tab"),
    (["--nodes", "2", "--gpus-per-node", "8", "--container-image", "repo/img:1;id"], [],
     "'1;id' is not an image tag"),
]


@pytest.mark.parametrize("flags,overrides,message", BAD_INPUT, ids=[m for *_, m in BAD_INPUT])
def test_bad_input_is_one_line_before_anything_is_written(tmp_path, capsys, flags, overrides, message):
    out, run_dir = tmp_path / "job.sbatch", tmp_path / "run"
    code = main(["launch", "slurm", DEMO, f"run.dir={run_dir}", "train.global_batch_size=64",
                 "train.micro_batch_size=4", *overrides, *flags, "--output", str(out)])
    err = capsys.readouterr().err
    assert code == 2
    assert err.count("\n") == 1 and err.startswith("podtrain: error: ") and message in err, err
    assert not out.exists() and not run_dir.exists()


def test_submit_without_sbatch_fails_before_writing(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    run_dir = tmp_path / "run"
    code = main(["launch", "slurm", DEMO, f"run.dir={run_dir}", "train.global_batch_size=64",
                 "train.micro_batch_size=4", "--nodes", "2", "--gpus-per-node", "8", "--submit"])
    err = capsys.readouterr().err
    assert code == 2 and "--submit needs sbatch" in err and err.count("\n") == 1
    assert not run_dir.exists()


def test_submit_calls_sbatch_with_the_written_script(tmp_path, capsys, monkeypatch):
    bindir = tmp_path / "bin"
    bindir.mkdir()
    (bindir / "sbatch").write_text(f"#!/bin/bash\necho \"$@\" > {tmp_path}/sbatch-args\necho 77\n")
    (bindir / "sbatch").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bindir}:{os.environ['PATH']}")
    run_dir = tmp_path / "run_100%j"  # sbatch would expand a % of the directory's own: it goes as %%
    assert main(["launch", "slurm", DEMO, f"run.dir={run_dir}", "train.global_batch_size=64",
                 "train.micro_batch_size=4", "--nodes", "2", "--gpus-per-node", "8", "--submit"]) == 0
    args = (tmp_path / "sbatch-args").read_text().split()
    assert args[1] == f"--output={tmp_path}/run_100%%j/logs/%x-%j.out", args
    script = Path(args[-1])
    assert script.parent == run_dir / "logs" and script.read_text().startswith("#!/bin/bash")
    assert "submitted job 77" in capsys.readouterr().err


def test_documented_argument_order(tmp_path, capsys):
    """`podtrain launch slurm CONFIG --nodes N --gpus-per-node G [section.key=value ...]`."""
    assert main(["launch", "slurm", DEMO, "--nodes", "2", "--gpus-per-node", "0",
                 "--nproc-per-node", "1", f"run.dir={tmp_path / 'run'}", "train.micro_batch_size=4",
                 "train.global_batch_size=8"]) == 0
    assert "#SBATCH --nodes=2\n" in capsys.readouterr().out


def test_placement_line():
    from types import SimpleNamespace

    from podtrain.distributed.env import ClusterEnv
    from podtrain.distributed.placement import placement_line, route_to

    assert route_to("127.0.0.1") == ("127.0.0.1", "lo")
    env = ClusterEnv.detect({"RANK": "3", "LOCAL_RANK": "1", "WORLD_SIZE": "4",
                             "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "1", "MASTER_ADDR": "127.0.0.1",
                             "MASTER_PORT": "29400", "PODTRAIN_HOSTNAME": "node-b"})
    line = placement_line(SimpleNamespace(env=env, backend="gloo", device="cpu"))
    assert line.startswith("placement: host=node-b addr=127.0.0.1 iface=")
    for part in ("node=1/2", "local_world_size=2", "ranks=2-3/4", "backend=gloo", "device=cpu",
                 "master=127.0.0.1:29400", "launcher=torchrun"):
        assert part in line, line


@pytest.mark.parametrize("requeue", [True, False])
def test_preemption_signal_is_noted_and_requeues(tmp_path, requeue):
    """Slurm signals every process of the step; the node script notes it, and once the step has
    ended the batch script requeues the job (--requeue) so it resumes from the checkpoint."""
    script = generate(tmp_path, "--gpus-per-node", "0", "--nproc-per-node", "1",
                      *(["--requeue"] if requeue else []))
    _, stdout, rc = run_batch(tmp_path, script, env_extra={"FAKE_PREEMPT": "1"})
    assert "stopped by the preemption signal" in stdout
    requeued = tmp_path / "bin" / "scontrol-requeue.txt"
    if requeue:
        assert rc == "0" and requeued.read_text().split() == ["requeue", "4242"]
    else:
        assert rc == "1" and not requeued.exists() and "submit the script again" in stdout


def test_without_submit_nothing_is_created_and_unshared_paths_are_warned_about(tmp_path, capsys):
    run_dir = tmp_path / "run"  # under /tmp: node-local
    assert main(["launch", "slurm", DEMO, "--nodes", "2", "--gpus-per-node", "8",
                 "train.global_batch_size=64", "train.micro_batch_size=4", f"run.dir={run_dir}",
                 "--venv", sys.prefix]) == 0
    assert not run_dir.exists(), "a script written to stdout must leave no trace on this machine"
    err = capsys.readouterr().err.splitlines()
    assert err == [f"podtrain: warning: run.dir {run_dir} is node-local storage: other nodes cannot see it",
                   f"podtrain: warning: data.path data/builtin is relative: the job uses "
                   f"{Path.cwd() / 'data/builtin'} on every node; is that on storage every node mounts?"]


def test_shared_storage_warnings_name_home_directories_and_accept_shared_paths(tmp_path):
    from podtrain.launch.jobspec import shared_storage_warnings

    cfg = load_config(DEMO, ["run.dir=/fsx/runs/a", "data.path=/home/me/data"])
    (line,) = shared_storage_warnings(cfg, tmp_path, home=Path("/home/me"))
    assert line.startswith("data.path /home/me/data is in a home directory")
    cfg = load_config(DEMO, ["run.dir=/fsx/runs/a", "data.path=/fsx/data"])
    assert shared_storage_warnings(cfg, tmp_path, home=Path("/home/me")) == []


LLAMA_8B = ("model.preset=llama-8b", "model.vocab_size=128256", "data.seq_len=4096",
            "train.micro_batch_size=1", "train.global_batch_size=16")


def test_slurm_and_k8s_refuse_a_job_that_plan_says_cannot_fit_naming_fsdp(tmp_path, capsys):
    """The launchers run `podtrain plan`'s memory check (plan.fit) for the job's GPUs: llama-8b
    under ddp needs ~163 GiB per 80 GiB p5 GPU at 4096 tokens (or a GPU of --gpu-memory 80): one line naming
    fsdp, exit 2, nothing written; under fsdp the job is written."""
    slurm_job = ["launch", "slurm", DEMO, f"run.dir={tmp_path / 'run'}", *LLAMA_8B, "--nodes", "1"]
    k8s_job = ["launch", "k8s", DEMO, "run.dir=/fsx/run", "data.path=/fsx/data", *LLAMA_8B, "--nodes", "1",
               "--image", "repo/podtrain:1", "--pvc", "fsx"]
    for job, devices in ((slurm_job, ["--instance-type", "p5.48xlarge"]),
                         (k8s_job, ["--instance-type", "p5.48xlarge"]),
                         (slurm_job, ["--gpus-per-node", "8", "--gpu-memory", "80"])):
        out = tmp_path / "job.out"
        code = main([*job, *devices, "dist.strategy=ddp", "--output", str(out)])
        err = capsys.readouterr().err
        assert code == 2 and err.count("\n") == 1 and not out.exists(), err
        assert re.search(r"under dist.strategy=ddp needs 1\d\d\.\d GiB per device .* more than the 80\.0 GiB "
                         r"of .*: set dist.strategy=fsdp train.activation_checkpointing=none \(\d+\.\d GiB", err), err
        assert main([*job, *devices, "dist.strategy=fsdp", "--output", str(out)]) == 0, capsys.readouterr().err
        assert out.stat().st_size > 0
        out.unlink()
        capsys.readouterr()
    assert main([*slurm_job, "--gpus-per-node", "0", "--nproc-per-node", "1", "--gpu-memory", "80"]) == 2
    assert "--gpu-memory 80: give the GiB of one GPU (> 0) of GPU nodes" in capsys.readouterr().err
