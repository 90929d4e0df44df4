"""Two hosts with separate network stacks: network namespaces joined by a veth pair.

The batch script `podtrain launch slurm` wrote runs with Slurm's control plane played by stand-ins
(``srun`` starts the node script in namespace A for n1 and B for n2; ``scontrol`` reports their
veth addresses as NodeAddr). Everything else is real: one torchrun agent per namespace, c10d
rendezvous across the veth link at the address the node script looked up, gloo pinned to the veth
interface the script found, a few training steps. This is where the classic traps bite: the
machine's hostname resolves to 127.0.0.1 in both namespaces, so a launcher that hands out
hostnames or lets torchrun guess who hosts the store hangs or splits into two jobs.
"""

from __future__ import annotations

import math
import re
import subprocess
from pathlib import Path

import pytest

from cluster_fixtures import (TINY_TRAINING, NetnsPair, batch_environment, fake_slurm_bin,
                              netns_unavailable, prepare_data, read_metrics)
from podtrain.cli import main

pytestmark = pytest.mark.cluster

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def netns():
    """Two joined namespaces, deleted afterwards (also on failure)."""
    reason = netns_unavailable()
    if reason:
        pytest.skip(reason)
    with NetnsPair() as pair:
        yield pair


def test_two_namespaces_rendezvous_across_veth_and_train(netns, tmp_path, capsys):
    data = prepare_data(tmp_path / "data")
    run_dir, script = tmp_path / "run", tmp_path / "job.sbatch"
    assert main(["launch", "slurm", str(REPO / "configs" / "demo.yaml"), f"run.dir={run_dir}",
                 f"data.path={data}", *TINY_TRAINING, "train.steps=4",
                 "--nodes", "2", "--gpus-per-node", "0", "--nproc-per-node", "1",
                 "--venv", str(REPO / ".venv"), "--join-timeout", "60", "--output", str(script)]) == 0
    capsys.readouterr()
    (a, b), (ia, ib) = netns.addrs, netns.ifaces
    bindir = tmp_path / "bin"
    fake_slurm_bin(bindir, {"n1": a, "n2": b}, netns=netns.names)
    env = batch_environment("7001", ["n1", "n2"], bindir)
    try:
        proc = subprocess.run(["bash", str(script)], env=env, capture_output=True, text=True,
                              timeout=150)
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"training across namespaces hung:\n{(exc.stderr or b'')[-3000:]!r}")
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    # Each node found its own veth address and interface, and both met at n1's address.
    nodes = sorted(re.findall(r"podtrain: node (\d) of 2 \((n\d) (\S+) (\S+)\) rendezvous (\S+) host=(\d)", out))
    endpoint = f"{a}:{20000 + 7001 % 20000}"
    assert nodes == [("0", "n1", a, ia, endpoint, "1"), ("1", "n2", b, ib, endpoint, "0")], out[-3000:]
    records = read_metrics(run_dir)
    assert [r["step"] for r in records] == [1, 2, 3, 4] and all(r["world_size"] == 2 for r in records)
    assert all(math.isfinite(r["loss"]) for r in records)
