"""Real engines for the cluster tests: a Slurm cluster on this host, and network namespaces.

Nothing here mocks a scheduler or a network. ``SlurmCluster`` starts Debian's munged, slurmctld and
two slurmd daemons (node names n1 and n2, one CPU each) in a scratch directory with non-default
ports, so several test sessions (or a developer's own Slurm) do not collide (three nodes, n3 too,
when a test needs a spare node to move to). ``NetnsPair`` joins two
network namespaces with a veth pair: two separate network stacks, as two hosts would have.

Both are context managers that clean up on every exit path. The pytest fixtures that use them live
in the test modules (tests/conftest.py belongs to the lead); ``python tests/cluster_fixtures.py
slurm DIR`` starts a cluster by hand for debugging and stops it on Ctrl-C.
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from podtrain.launch.local import free_port

SLURM_PACKAGES = ("slurmctld", "slurmd", "slurm-client", "munge")
SLURM_BINARIES = ("slurmctld", "slurmd", "sbatch", "scontrol", "munged")


def ensure_slurm_installed(timeout: float = 300.0) -> str | None:
    """Install Slurm and munge with apt when missing; return None when ready, else why not.

    The reason string is what a test passes to ``pytest.skip``: the only acceptable skip is a
    machine where the packages cannot be installed (no root, no apt, no package mirror).
    """
    if all(shutil.which(b) for b in SLURM_BINARIES):
        return None
    if os.geteuid() != 0:
        return "Slurm is not installed and installing it needs root (apt-get)"
    if not shutil.which("apt-get"):
        return "Slurm is not installed and this machine has no apt-get to install it"
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    # A fresh machine may be running its own apt job (apt-daily at boot) for a minute or two: wait
    # for its lock rather than skip (seen once: "Unable to acquire the dpkg frontend lock").
    wait_lock = ["-o", f"DPkg::Lock::Timeout={int(timeout)}"]
    steps = (["apt-get", *wait_lock, "update", "-qq"],
             ["apt-get", *wait_lock, "install", "-y", "-qq", "--no-install-recommends", *SLURM_PACKAGES])
    deadline = time.monotonic() + timeout
    for cmd in steps:
        while True:
            try:
                proc = subprocess.run(cmd, env=env, capture_output=True, text=True,
                                      timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                return f"`{' '.join(cmd)}` took longer than {timeout:.0f}s"
            held = "lock" in (proc.stderr or "") and proc.returncode != 0  # apt's own lock wait ran out, or an older apt
            if not held or time.monotonic() > deadline:
                break
            time.sleep(2.0)
        if proc.returncode != 0:
            last = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["(no output)"]
            return f"`{' '.join(cmd)}` failed: {last[0]}"
    missing = [b for b in SLURM_BINARIES if not shutil.which(b)]
    return f"Slurm packages installed but {', '.join(missing)} not found" if missing else None


SLURM_CONF = """\
# Written by tests/cluster_fixtures.py: a two-node Slurm cluster on one host, for tests.
ClusterName=podtrain-test
SlurmctldHost={host}(127.0.0.1)
SlurmctldPort={ctld_port}
# Each cluster numbers its jobs from its own start: a job's rendezvous port follows its id
# (distributed.env.slurm_port), and an earlier cluster's job 1 may still hold port 20001.
FirstJobId={first_job}
SlurmdPort={node_ports[0]}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
# cred_expire also sets how long a requeued job waits before it may start again (default 120 s).
AuthInfo=socket={sock}/munge.socket.2,cred_expire=10
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
MpiDefault=none
SwitchType=switch/none
ReturnToService=2
SchedulerType=sched/backfill
# Look at pending jobs every second or two (defaults: 60 s and 30 s), so a requeued job restarts
# as soon as it may.
SchedulerParameters=sched_interval=2,bf_interval=1
# Keep finished jobs visible to `scontrol show job` (there is no accounting database here).
MinJobAge=600
KillWait=5
InactiveLimit=0
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool/%n
SlurmctldPidFile={root}/run/slurmctld.pid
SlurmdPidFile={root}/run/slurmd-%n.pid
SlurmctldLogFile={root}/log/slurmctld.log
SlurmdLogFile={root}/log/slurmd-%n.log
SlurmctldDebug=info
SlurmdDebug=info
PlugStackConfig={root}/plugstack.conf
{node_lines}
PartitionName=debug Nodes={node_names} Default=YES MaxTime=INFINITE State=UP
"""


@dataclass
class SlurmCluster:
    """munged + slurmctld + slurmd n1/n2 under ``root``; use as a context manager.

    ``env`` is the environment for client commands (sbatch, scontrol): it names this cluster's
    slurm.conf, so the machine's /etc/slurm is never read or written.
    """

    root: Path
    nodes: tuple[str, ...] = ("n1", "n2")
    procs: list[subprocess.Popen] = field(default_factory=list)
    munge_dir: Path | None = None

    @property
    def conf(self) -> Path:
        """This cluster's slurm.conf."""
        return self.root / "slurm.conf"

    @property
    def env(self) -> dict[str, str]:
        """Environment for Slurm client commands and submitted jobs."""
        return dict(os.environ, SLURM_CONF=str(self.conf))

    def __enter__(self) -> "SlurmCluster":
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def start(self, timeout: float = 30.0) -> None:
        """Write the configuration, start the daemons, wait until every node is idle."""
        self._write_files()
        self._start_munge()
        log = open(self.root / "log" / "daemons.out", "ab")
        self._spawn(["slurmctld", "-D", "-i", "-f", str(self.conf)], log)
        for node in self.nodes:
            self._spawn(["slurmd", "-D", "-N", node, "-f", str(self.conf)], log)
        self._wait_idle(timeout)

    def stop(self) -> None:
        """Cancel leftover jobs, then stop the daemons this object started (and only those)."""
        ctld_alive = any(p.args[0] == "slurmctld" and p.poll() is None for p in self.procs)
        if ctld_alive:
            try:
                subprocess.run(["scancel", "--quiet", "--user", "root"], env=self.env,
                               capture_output=True, timeout=10)
            except subprocess.TimeoutExpired:
                pass
        for proc in reversed(self.procs):
            if proc.poll() is None:
                proc.terminate()
        deadline = time.monotonic() + 10
        for proc in reversed(self.procs):
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self.procs.clear()
        if self.munge_dir is not None:
            shutil.rmtree(self.munge_dir, ignore_errors=True)
            self.munge_dir = None

    def _write_files(self) -> None:
        for sub in ("state", "spool", "run", "log", "munge/key"):
            (self.root / sub).mkdir(parents=True, exist_ok=True)
        for node in self.nodes:
            (self.root / "spool" / node).mkdir(exist_ok=True)
        ports = [free_port() for _ in range(len(self.nodes) + 1)]
        node_lines = "\n".join(
            f"NodeName={node} NodeHostname=localhost NodeAddr=127.0.0.1 Port={port} CPUs=1 State=UNKNOWN"
            for node, port in zip(self.nodes, ports[1:]))
        self.conf.write_text(SLURM_CONF.format(
            host=socket.gethostname().split(".")[0], root=self.root, ctld_port=ports[0],
            first_job=1 + ports[0] % 10000,
            node_ports=ports[1:], sock=self.socket_dir, node_lines=node_lines,
            node_names=",".join(self.nodes)))
        (self.root / "plugstack.conf").write_text("")  # no SPANK plugins (pyxis) in tests

    def _start_munge(self) -> None:
        # munged insists on a private key directory, and on a socket whose every parent directory
        # is world-executable: pytest's temporary directories are not, so the socket lives in a
        # directory of its own under /tmp.
        key = self.root / "munge" / "key" / "munge.key"
        key.write_bytes(os.urandom(1024))
        os.chmod(key, 0o400)
        os.chmod(key.parent, 0o700)
        sock = self.socket_dir
        log = open(self.root / "log" / "munged.out", "ab")
        self._spawn(["munged", "-F", f"--socket={sock}/munge.socket.2", f"--key-file={key}",
                     f"--pid-file={sock}/munged.pid", f"--seed-file={key.parent}/seed",
                     f"--log-file={self.root}/log/munged.log"], log)
        munged = self.procs[-1]

        def ready() -> bool:
            if munged.poll() is not None:
                raise RuntimeError(f"munged exited with {munged.returncode}\n{self._logs()}")
            return (sock / "munge.socket.2").exists()

        _wait_for(ready, 10, "munged socket", self._logs)

    @property
    def socket_dir(self) -> Path:
        """The munge socket's directory (created on first use, removed by ``stop``)."""
        if self.munge_dir is None:
            import tempfile

            self.munge_dir = Path(tempfile.mkdtemp(prefix="podtrain-munge-", dir="/tmp"))
            os.chmod(self.munge_dir, 0o755)
        return self.munge_dir

    def _spawn(self, cmd: list[str], log) -> None:
        self.procs.append(subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                           stdin=subprocess.DEVNULL, start_new_session=True,
                                           env=self.env))

    def node_states(self) -> dict[str, str]:
        """``{node: state}`` as slurmctld reports it (idle, alloc, down*, ...)."""
        out = subprocess.run(["sinfo", "-h", "-N", "-o", "%N %T"], env=self.env,
                             capture_output=True, text=True, timeout=10)
        states = {}
        for line in out.stdout.splitlines():
            name, _, state = line.partition(" ")
            states[name] = state.strip()
        return states

    def _wait_idle(self, timeout: float) -> None:
        def ready() -> bool:
            for proc in self.procs:
                if proc.poll() is not None:
                    raise RuntimeError(f"{proc.args[0]} exited with {proc.returncode}\n{self._logs()}")
            states = self.node_states()
            return all(states.get(n, "").startswith("idle") for n in self.nodes)

        _wait_for(ready, timeout, "Slurm nodes idle", self._logs)

    def _logs(self) -> str:
        parts = []
        for path in sorted((self.root / "log").glob("*")):
            text = path.read_text(errors="replace").strip().splitlines()[-15:]
            parts.append(f"--- {path.name}\n" + "\n".join(text))
        return "\n".join(parts)

    def sbatch(self, script: Path, cwd: Path, env: dict[str, str] | None = None) -> str:
        """Submit a batch script; return the job id."""
        proc = subprocess.run(["sbatch", "--parsable", str(script)], cwd=cwd,
                              env=dict(self.env, **(env or {})), capture_output=True, text=True,
                              timeout=30)
        if proc.returncode != 0:
            raise RuntimeError(f"sbatch failed: {proc.stderr.strip()}\n{self._logs()}")
        return proc.stdout.strip().split(";")[0]

    def job(self, job_id: str) -> dict[str, str]:
        """``scontrol show job`` as a dict (JobState, ExitCode, NodeList, ...)."""
        out = subprocess.run(["scontrol", "show", "job", "-o", job_id], env=self.env,
                             capture_output=True, text=True, timeout=10).stdout
        return dict(re.findall(r"(\w+)=(\S*)", out))

    def wait_job(self, job_id: str, timeout: float) -> dict[str, str]:
        """Wait until the job leaves PENDING/RUNNING/COMPLETING; cancel it on timeout."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            info = self.job(job_id)
            if info.get("JobState") not in (None, "PENDING", "RUNNING", "COMPLETING", "CONFIGURING",
                                            "REQUEUED"):
                return info
            time.sleep(0.5)
        subprocess.run(["scancel", job_id], env=self.env, capture_output=True, timeout=10)
        raise TimeoutError(f"Slurm job {job_id} still {self.job(job_id).get('JobState')} "
                           f"after {timeout:.0f}s\n{self._logs()}")


def _wait_for(cond, timeout: float, what: str, logs) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return
        time.sleep(0.2)
    raise TimeoutError(f"{what}: not ready after {timeout:.0f}s\n{logs()}")


# --------------------------------------------------------------------------- network namespaces


@dataclass
class NetnsPair:
    """Two network namespaces joined by a veth pair: ``a`` 10.x.0.1/24, ``b`` 10.x.0.2/24.

    Names carry this process id so concurrent test sessions do not collide; ``__exit__`` deletes
    the namespaces (which also deletes the veth pair) on every exit path.
    """

    tag: str = field(default_factory=lambda: f"pt{os.getpid() % 100000}")
    subnet: int = field(default_factory=lambda: 100 + os.getpid() % 100)

    @property
    def names(self) -> tuple[str, str]:
        """The two namespace names."""
        return f"{self.tag}a", f"{self.tag}b"

    @property
    def ifaces(self) -> tuple[str, str]:
        """The veth end inside each namespace."""
        return f"{self.tag}va", f"{self.tag}vb"

    @property
    def addrs(self) -> tuple[str, str]:
        """The address of each namespace on the veth link."""
        return f"10.{self.subnet}.0.1", f"10.{self.subnet}.0.2"

    def __enter__(self) -> "NetnsPair":
        try:
            self._create()
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc) -> None:
        for name in self.names:
            subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=10)

    def _create(self) -> None:
        (a, b), (va, vb), (ipa, ipb) = self.names, self.ifaces, self.addrs
        _ip("netns", "add", a)
        _ip("netns", "add", b)
        _ip("link", "add", va, "type", "veth", "peer", "name", vb)
        _ip("link", "set", va, "netns", a)
        _ip("link", "set", vb, "netns", b)
        for ns, iface, addr in ((a, va, ipa), (b, vb, ipb)):
            _ip("-n", ns, "addr", "add", f"{addr}/24", "dev", iface)
            _ip("-n", ns, "link", "set", iface, "up")
            _ip("-n", ns, "link", "set", "lo", "up")

    def prefix(self, index: int) -> list[str]:
        """Command prefix that runs a program inside namespace ``index`` (0 or 1).

        ``nsenter --net`` rather than ``ip netns exec``: the latter remounts /sys, which some
        programs (slurmd) then fail to read.
        """
        return ["nsenter", f"--net=/run/netns/{self.names[index]}"]


def netns_unavailable() -> str | None:
    """None when network namespaces and veth pairs can be created here, else why not."""
    if not shutil.which("ip") or not shutil.which("nsenter"):
        return "the `ip` and `nsenter` commands are not installed"
    probe = NetnsPair(tag=f"ptp{os.getpid() % 100000}")
    try:
        with probe:
            pass
    except (subprocess.CalledProcessError, OSError) as exc:
        detail = getattr(exc, "stderr", "") or str(exc)
        return f"network namespaces are refused here: {str(detail).strip()[:200]}"
    return None


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True, timeout=10)


if __name__ == "__main__":  # manual use: python tests/cluster_fixtures.py slurm /tmp/slurm-dev
    if len(sys.argv) != 3 or sys.argv[1] != "slurm":
        sys.exit("usage: python tests/cluster_fixtures.py slurm DIR")
    reason = ensure_slurm_installed()
    if reason:
        sys.exit(reason)
    with SlurmCluster(Path(sys.argv[2]).resolve()) as cluster:
        print(f"export SLURM_CONF={cluster.conf}   # Ctrl-C stops the cluster", flush=True)
        try:
            while True:
                time.sleep(3600)
        except KeyboardInterrupt:
            pass


# ------------------------------------------------------------- stand-ins for Slurm's control plane

FAKE_SCONTROL = """#!/bin/bash
# Stand-in for `scontrol show hostnames|node`: node names and addresses from PODTRAIN_FAKE_NODES.
set -eu
declare -A ADDR=({pairs})
case "$1 $2" in
  "show hostnames") for n in {names}; do echo "$n"; done ;;
  "show node") echo "NodeName=$3 Arch=x86_64 CPUTot=1 NodeAddr=${{ADDR[$3]}} NodeHostName=$3 State=ALLOCATED" ;;
  "requeue "*) echo "$*" >> "$(dirname "$0")/scontrol-requeue.txt" ;;
  *) echo "fake scontrol: unsupported: $*" >&2; exit 1 ;;
esac
"""

FAKE_SRUN = """#!/bin/bash
# Stand-in for srun: run the node script once per node, each with that node's own SLURM_* values
# (the batch shell's SLURM_NODEID=0 must not leak into them), optionally in its network namespace.
echo "$*" >> "{record}"
script="${{@: -1}}"
nodes=({names})
netns=({netns})
pids=()
for i in "${{!nodes[@]}}"; do
  prefix=()
  if [ -n "${{netns[$i]:-}}" ]; then prefix=(nsenter --net=/run/netns/${{netns[$i]}}); fi
  SLURM_NODEID=$i SLURMD_NODENAME=${{nodes[$i]}} SLURM_PROCID=$i SLURM_LOCALID=0 \\
    SLURM_STEP_NODELIST="$SLURM_JOB_NODELIST" "${{prefix[@]}}" bash "$script" &
  pids+=($!)
done
rc=0
for p in "${{pids[@]}}"; do wait "$p" || rc=$?; done
exit $rc
"""


def fake_slurm_bin(bindir: Path, nodes: dict[str, str], netns: tuple[str, ...] = ()) -> Path:
    """Write fake ``scontrol`` and ``srun`` into ``bindir``; return the file srun records args in.

    ``nodes`` maps node names to addresses (in order). With ``netns``, node i's script runs in
    namespace ``netns[i]``: a real separate network stack, only the scheduler is a stand-in.
    """
    bindir.mkdir(parents=True, exist_ok=True)
    record = bindir / "srun-args.txt"
    names = " ".join(nodes)
    pairs = " ".join(f"[{n}]={a}" for n, a in nodes.items())
    files = {"scontrol": FAKE_SCONTROL.format(pairs=pairs, names=names),
             "srun": FAKE_SRUN.format(record=record, names=names, netns=" ".join(netns))}
    for name, text in files.items():
        (bindir / name).write_text(text)
        (bindir / name).chmod(0o755)
    return record


def batch_environment(job_id: str, nodes: list[str], bindir: Path, base: dict[str, str] | None = None
                      ) -> dict[str, str]:
    """What sbatch gives a batch shell on the first node (SLURM_NODEID=0 included, on purpose)."""
    env = dict(os.environ if base is None else base)
    env.update({
        "PATH": f"{bindir}:{env.get('PATH', '')}", "SLURM_JOB_ID": job_id,
        "SLURM_JOB_NODELIST": ",".join(nodes), "SLURM_JOB_NUM_NODES": str(len(nodes)),
        "SLURM_NNODES": str(len(nodes)), "SLURM_NODEID": "0", "SLURM_PROCID": "0",
        "SLURMD_NODENAME": nodes[0], "SLURM_SUBMIT_DIR": os.getcwd(),
    })
    return env


def prepare_data(out: Path, timeout: float = 120) -> Path:
    """``podtrain prepare builtin --out OUT`` (the built-in corpus, under a second)."""
    if not (out / "manifest.json").exists():
        subprocess.run([sys.executable, "-m", "podtrain.cli", "prepare", "builtin", "--out", str(out)],
                       check=True, capture_output=True, timeout=timeout)
    return out


# A training run small enough for a test: tiny Llama, short sequences, no evaluation.
TINY_TRAINING = ("model.preset=tiny", "data.seq_len=64", "train.micro_batch_size=4",
                 "train.global_batch_size=8", "eval.every=0", "log.every=1",
                 "optim.warmup_steps=1", "log.progress=plain")


def read_metrics(run_dir: Path) -> list[dict]:
    """The training records (kind=train) of RUN_DIR/metrics.jsonl in file order, without the
    attempts' segment markers, save, eval and goodput lines (empty when the file is missing)."""
    import json

    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [r for r in records if r.get("kind") == "train"]
