"""A real Slurm cluster on this machine runs the batch script `podtrain launch slurm` wrote.

munged, slurmctld and three slurmd (nodes n1, n2, n3, one CPU each; the jobs use two) start in a scratch directory with
their own ports (tests/cluster_fixtures.py). The script is submitted with `--submit` (real sbatch),
srun starts one torchrun agent per node, they meet by c10d rendezvous at the address each node
looked up with scontrol, and 2 ranks train the tiny model; midway one rank is SIGKILLed (torchrun
restarts the group), then the job gets the preemption signal (checkpoint, requeue, resume) and
completes. A second job shows the blame going back to the scheduler: a node the straggler monitor
named in the first allocation is excluded from the requeued one. Skipped only where Slurm cannot
be installed.
"""

from __future__ import annotations

import json
import math
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest

from fault_plugin.podtrain_faults import fault_env

from cluster_fixtures import TINY_TRAINING, SlurmCluster, ensure_slurm_installed, prepare_data, read_metrics
from podtrain.cli import main

pytestmark = pytest.mark.cluster

REPO = Path(__file__).resolve().parents[1]
JOB_TIMEOUT = 150


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """A running three-node Slurm cluster, stopped after the module (also on failure)."""
    reason = ensure_slurm_installed()
    if reason:
        pytest.skip(f"no Slurm: {reason}")
    with SlurmCluster(tmp_path_factory.mktemp("slurm"), nodes=("n1", "n2", "n3")) as c:
        yield c


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """The built-in corpus, prepared once for this module."""
    return prepare_data(tmp_path_factory.mktemp("data") / "builtin")


def submit(cluster, monkeypatch, capsys, run_dir: Path, data: Path, *extra: str,
           overrides: tuple[str, ...] = (), by_hand: Path | None = None) -> str:
    """`podtrain launch slurm ... --submit` against this cluster; returns the job id. With
    ``by_hand`` (a directory), the script is written without --submit (--output job.sh) and
    submitted with a plain `sbatch job.sh` run in that directory, as a user would."""
    monkeypatch.setenv("SLURM_CONF", str(cluster.conf))
    monkeypatch.chdir(run_dir.parent)
    how = ["--output", str(by_hand / "job.sh")] if by_hand else ["--submit"]
    code = main(["launch", "slurm", str(REPO / "configs" / "demo.yaml"), f"run.dir={run_dir}",
                 f"data.path={data}", *TINY_TRAINING, *overrides,
                 "--nodes", "2", "--gpus-per-node", "0", "--nproc-per-node", "1",
                 "--venv", str(REPO / ".venv"), "--join-timeout", "60", *how, *extra])
    err = capsys.readouterr().err
    assert code == 0, err
    if by_hand:
        assert not run_dir.exists(), "writing the script must create nothing but the script"
        proc = subprocess.run(["sbatch", "job.sh"], cwd=by_hand, env=dict(os.environ), capture_output=True,
                              text=True, timeout=30)
        assert proc.returncode == 0, proc.stderr
        return re.search(r"Submitted batch job (\d+)", proc.stdout)[1]
    return re.search(r"submitted job (\d+)", err)[1]


def finish(cluster, job_id: str, run_dir: Path) -> str:
    """Wait for the job; return its log; fail with the log when it did not complete."""
    info = cluster.wait_job(job_id, JOB_TIMEOUT)
    logs = sorted((run_dir / "logs").glob(f"*-{job_id}.out"))
    log = logs[0].read_text() if logs else "(no job log)"
    assert (info.get("JobState"), info.get("ExitCode")) == ("COMPLETED", "0:0"), log[-4000:]
    return log


def worker_pids(job_id: str, run_dir: Path) -> dict[int, int]:
    """``{global rank: pid}`` of this job's training processes: torchrun sets TORCHELASTIC_RUN_ID
    (the job id; another test cluster may reuse the number, hence the run directory check)."""
    found = {}
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            env = dict(item.split("=", 1) for item in
                       (proc / "environ").read_bytes().decode(errors="replace").split("\0") if "=" in item)
        except OSError:
            continue
        if (env.get("TORCHELASTIC_RUN_ID") == job_id and "RANK" in env
                and env.get("PODTRAIN_CONFIG", "").startswith(str(run_dir))):
            found[int(env["RANK"])] = int(proc.name)
    return found


def wait_until(cond, what: str, cluster, job_id: str, timeout: float = JOB_TIMEOUT):
    """Poll ``cond()`` until it returns something truthy; fail if the job ends first."""
    deadline = time.monotonic() + timeout
    while not (value := cond()):
        info = cluster.job(job_id)
        assert info.get("JobState") in ("PENDING", "RUNNING", "CONFIGURING", "COMPLETING",
                                        "REQUEUED"), (what, info)
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)
    return value


def test_two_node_job_trains_survives_a_killed_rank_and_a_preemption(
        cluster, data, tmp_path, monkeypatch, capsys):
    """One job, three starts (each costs ~10 s of imports here), everything a cluster run needs:

    * it trains: 2 nodes x 1 rank, world_size 2 in the metrics, finite and falling loss, and each
      node ran the node script with its own identity (not every node node 0);
    * a rank SIGKILLed mid-run is restarted by torchrun (--max-restarts 1) on both nodes and the
      workers resume from the last checkpoint (TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 in the script
      is what makes gloo restarts reliable, MACHINE-NOTES.md);
    * the preemption signal, sent to the step as `--signal=USR1@120` would, makes the workers
      checkpoint and exit; the batch script requeues the job (--requeue), which resumes and ends.
    """
    run_dir, steps = tmp_path / "run", 10
    job_id = submit(cluster, monkeypatch, capsys, run_dir, data, "--max-restarts", "1",
                    "--requeue", overrides=(f"train.steps={steps}", "ckpt.every=2"))
    last_step = lambda: max([r["step"] for r in read_metrics(run_dir)], default=0)  # noqa: E731
    wait_until(lambda: last_step() >= 3, "step 3", cluster, job_id)
    first = worker_pids(job_id, run_dir)
    assert sorted(first) == [0, 1], first
    os.kill(first[1], signal.SIGKILL)

    # torchrun restarts both workers; once they log a step they have their signal handlers.
    wait_until(lambda: (p := worker_pids(job_id, run_dir)) and len(p) == 2
               and not set(p.values()) & set(first.values()), "restarted workers", cluster, job_id)
    restarted = time.time()
    wait_until(lambda: any(r["time"] > restarted for r in read_metrics(run_dir)),
               "a step after the restart", cluster, job_id)
    subprocess.run(["scancel", "--signal=USR1", job_id], env=cluster.env, check=True, timeout=10)
    # A requeued job may start again after cred_expire (10 s in the test cluster's slurm.conf).
    log = finish(cluster, job_id, run_dir)
    assert cluster.job(job_id).get("Restarts") == "1"

    # The node script ran once per node and start (torchrun restarts workers, not srun), as itself.
    nodes = re.findall(r"podtrain: node (\d) of 2 \((n\d) \S+ \S+\) rendezvous (\S+) host=(\d)", log)
    assert sorted(n[:2] for n in nodes) == [("0", "n1"), ("0", "n1"), ("1", "n2"), ("1", "n2")], log[-3000:]
    assert len({n[2] for n in nodes}) == 1 and sorted(n[3] for n in nodes) == ["0", "0", "1", "1"]
    assert "exitcode: -9" in log, log[-3000:]  # the agent saw the kill
    assert "stopped by the preemption signal after a checkpoint" in log, log[-3000:]
    records = [r for r in read_metrics(run_dir) if r.get("kind", "train") == "train"]
    assert records[-1]["step"] == steps, [r["step"] for r in records]  # and training went on
    assert all(r["world_size"] == 2 for r in records)
    losses = [r["loss"] for r in records]
    assert all(math.isfinite(x) for x in losses) and losses[-1] < losses[0], losses


def test_a_node_blamed_in_the_first_allocation_is_not_in_the_second(
        cluster, data, tmp_path, monkeypatch, capsys):
    """Rank 1 is slow (a test fault sleeps in its steps): the straggler monitor writes verdicts
    naming its node to RUN_DIR/health/; the preemption signal stops the job after a checkpoint and
    the batch script excludes that node before it requeues; the job resumes on the other two.

    This job's script is written without --submit and submitted by hand, with a plain `sbatch
    job.sh` in another directory: it runs (RUN_DIR did not exist), and its log is where the
    script's header says (sbatch's directory), linked from RUN_DIR/logs/."""
    run_dir, elsewhere = tmp_path / "run", tmp_path / "elsewhere"
    elsewhere.mkdir()
    faults = fault_env("slow-step:rank=1,delay=0.4")
    for key in ("PYTHONPATH", "PODTRAIN_TEST_FAULTS"):
        monkeypatch.setenv(key, faults[key])
    job_id = submit(cluster, monkeypatch, capsys, run_dir, data, "--requeue", by_hand=elsewhere,
                    overrides=("train.steps=14", "ckpt.every=2", "monitor.straggler_every=2",
                               "monitor.straggler_threshold=0.2"))
    first_nodes = wait_until(lambda: _allocation(cluster, job_id), "an allocation", cluster, job_id)
    wait_until(lambda: len(list((run_dir / "health").glob("*-straggler-*.json"))) >= 2,
               "two straggler verdicts", cluster, job_id)
    wait_until(lambda: len(worker_pids(job_id, run_dir)) == 2, "workers", cluster, job_id)
    subprocess.run(["scancel", "--signal=USR1", job_id], env=cluster.env, check=True, timeout=10)
    log = finish(cluster, job_id, run_dir)
    # What the batch script excluded when it requeued (verdicts of the second allocation, whose
    # slow rank 1 may sit on another node, came later and do not count).
    excluded = set(re.search(r"the requeued job excludes the blamed node\(s\) (\S+)", log)[1].split(","))
    verdicts = sorted((json.loads(p.read_text()) for p in (run_dir / "health").glob("*.json")),
                      key=lambda v: v["time"])
    starts = re.findall(r"podtrain: node (\d) of 2 \((n\d) ", log)
    first, second = {n for _, n in starts[:2]}, {n for _, n in starts[2:]}
    assert first == set(first_nodes) and excluded < first, (excluded, starts)
    assert verdicts[0]["kind"] == "straggler" and verdicts[0]["rank"] == 1 and {verdicts[0]["node"]} == excluded
    assert len(second) == 2 and not excluded & second, (f"excluded {excluded} but the second "
                                                        f"allocation was {second}", log[-3000:])
    records = [r for r in read_metrics(run_dir) if r.get("kind") == "train"]
    assert records[-1]["step"] == 14 and records[-1]["goodput_s"]["restarts"] > 0
    # The log is where the header says: NAME-JOBID.out in sbatch's directory, linked from RUN_DIR/logs.
    header = re.search(r"Log: (\S+)-JOBID\.out in the directory you run sbatch in",
                       (elsewhere / "job.sh").read_text().replace("\n# ", " "))
    log_file = elsewhere / f"{header[1]}-{job_id}.out"
    assert log_file.is_file() and log_file.read_text() == log
    assert (run_dir / "logs" / log_file.name).resolve() == log_file.resolve()


def _allocation(cluster, job_id: str) -> list[str]:
    """The nodes the job runs on (empty while pending)."""
    nodelist = cluster.job(job_id).get("NodeList", "")
    if not nodelist or nodelist == "(null)":
        return []
    out = subprocess.run(["scontrol", "show", "hostnames", nodelist], env=cluster.env,
                         capture_output=True, text=True, timeout=10).stdout.split()
    return out
