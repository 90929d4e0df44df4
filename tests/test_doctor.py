"""podtrain doctor: pure checks, and real gloo ranks with one slowed or blind on purpose."""

from __future__ import annotations

import json

from fault_plugin import podtrain_faults as faults
from multirank import run_ranks
from podtrain.cli import main as cli_main
from podtrain.diagnostics import checks as D
from podtrain.distributed.env import ClusterEnv

HOST = ClusterEnv.detect().hostname
FAST = ["--allreduce-bytes", "64K", "--matmul-size", "256", "--backend", "gloo"]


def _fact(rank, host, **kw):
    base = {"rank": rank, "host": host, "local_rank": rank % 2, "local_world_size": 2,
            "torch": "2.13.0", "cuda": "12.8", "nccl": "2.27.3", "gpus": 8,
            "efa": {"devices": ["rdmap0"], "fi_info_efa": True}, "fi_provider": "efa",
            "socket_ifnames": {}, "interfaces": [{"name": "eth0", "state": "up", "mtu": "9001",
                                                 "speed_mbps": None, "ipv4": "10.0.0.1"}],
            "run_dir": {"error": None, "seen": [0, 1, 2, 3]},
            "matmul_s": 1.0, "matmul_flops": 2e12}
    base.update(kw)
    return base


def test_pure_checks_name_the_host_and_rank():
    facts = [_fact(0, "a"), _fact(1, "a"), _fact(2, "b", matmul_s=1.2), _fact(3, "b")]
    slow = D.check_compute(facts, 0.10)
    assert slow.status == D.FAIL and slow.culprits == [{"rank": 2, "host": "b"}]
    assert "rank 2 on host b is 20% slower than the median" in slow.detail
    assert D.check_compute(facts, 0.25).status == D.OK

    facts[3]["torch"] = "2.12.0"
    versions = D.check_versions(facts)
    assert versions.status == D.FAIL and "rank 3 on host b has torch 2.12.0" in versions.detail

    facts[2]["gpus"] = 7
    gpus = D.check_gpus(facts, 8, "nccl")
    assert gpus.status == D.FAIL and gpus.culprits == [{"rank": 2, "host": "b"}]
    assert D.check_gpus([_fact(0, "a", gpus=1)], None, "nccl").status == D.FAIL  # 2 local ranks

    facts[2]["efa"] = {"devices": [], "fi_info_efa": None}
    efa = D.check_efa(facts, expect_efa=False)  # FI_PROVIDER=efa without the device
    assert efa.status == D.FAIL and efa.culprits == [{"rank": 2, "host": "b"}]

    facts[1]["socket_ifnames"] = {"NCCL_SOCKET_IFNAME": "ens5"}
    net = D.check_network(facts)
    assert net.status == D.FAIL and "NCCL_SOCKET_IFNAME=ens5 but host a" in net.detail

    facts[3]["run_dir"] = {"error": None, "seen": [2, 3]}
    shared = D.check_run_dir(facts, "/fsx/run", 4)
    assert shared.status == D.FAIL and shared.culprits == [{"rank": 3, "host": "b"}]


def _doctor(rank, world, argv, own_dir=False):
    if own_dir:  # a node-local path: each rank gets a directory the other cannot see
        i = argv.index("--run-dir") + 1
        argv = argv[:i] + [f"{argv[i]}/rank{rank}"] + argv[i + 1:]
    return cli_main(["doctor", *argv])


def test_healthy_two_ranks_pass(tmp_path, capfd):
    report = tmp_path / "doctor.json"
    # Two ranks timing matmuls on a busy shared machine can differ by more than the default 10%:
    # a 50% limit still fails a rank over 3x slower than the other (above the 2-rank median).
    argv = ["--run-dir", str(tmp_path / "run"), "--json", str(report), *FAST,
            "--slow-threshold", "0.5"]
    assert run_ranks(_doctor, 2, argv) == [0, 0]
    out = capfd.readouterr().out
    assert "doctor: OK" in out and "2 rank(s) on 1 host(s)" in out
    checks = {c["name"]: c for c in json.loads(report.read_text())["checks"]}
    assert checks["run dir"]["status"] == D.OK and checks["all_reduce"]["status"] == D.OK
    assert checks["compute"]["status"] == D.OK and checks["rendezvous"]["status"] == D.OK
    assert "(limit 50%)" in checks["compute"]["detail"]
    assert list((tmp_path / "run").iterdir()) == []  # the probe files are cleaned up


def test_slow_rank_is_named_and_fails(tmp_path, capfd, monkeypatch):
    # The slowed rank reports 3x its best matmul trial: against the 2-rank median that is +50%
    # when the other rank measures its device well. A 5% limit still names it when the other
    # rank's best trial is up to ~2.7x slow from sharing the cores (at 1.5x, a full-suite run
    # once measured the other rank more than 35% slow and named no one).
    argv = ["--run-dir", str(tmp_path), *FAST, "--slow-threshold", "0.05"]
    faults.install("slow-rank:rank=1,factor=3", patch=monkeypatch.setattr)  # ranks inherit it
    assert run_ranks(_doctor, 2, argv) == [1, 1]
    out = capfd.readouterr().out
    assert f"[FAIL] compute    rank 1 on host {HOST} is " in out
    assert f"doctor: FAIL (1 check(s)): compute: rank 1 on host {HOST}" in out


def test_run_dir_not_shared_fails(tmp_path, capfd):
    argv = ["--run-dir", str(tmp_path), *FAST]
    assert run_ranks(_doctor, 2, argv, True) == [1, 1]
    out = capfd.readouterr().out
    assert f"rank 1 on host {HOST} sees only ranks [1]" in out


def test_one_process(tmp_path, capsys):
    assert cli_main(["doctor", "--run-dir", str(tmp_path), "--matmul-size", "128"]) == 0
    out = capsys.readouterr().out
    assert "1 rank(s) on 1 host(s)" in out and "one process: no rendezvous" in out
    assert "doctor: OK" in out
