"""podtrain bench collectives: nccl-tests arithmetic (pure) and real gloo ranks (fork)."""

from __future__ import annotations

import json
import math

import pytest
import torch

from fault_plugin import podtrain_faults as faults
from multirank import run_ranks
from podtrain.cli import main as cli_main
from podtrain.diagnostics import busbw as B
from podtrain.diagnostics import collectives as C
from podtrain.errors import UserError

FIELDS = {"op", "bytes", "time_s", "algbw_gbps", "busbw_gbps", "wrong", "world_size"}


# --- pure ----------------------------------------------------------------------------------------

def test_bus_factors_follow_nccl_tests():
    assert B.bus_factor("all_reduce", 4) == pytest.approx(1.5)
    assert B.bus_factor("all_reduce", 2) == pytest.approx(1.0)
    for op in ("all_gather", "reduce_scatter", "all_to_all"):
        assert B.bus_factor(op, 4) == pytest.approx(0.75)
    assert B.bus_factor("broadcast", 8) == 1.0
    # 1 GB in 0.5 s on 8 ranks: algbw 2 GB/s, all_reduce busbw 2 * 2 * 7/8 = 3.5 GB/s
    assert B.algbw_gbps(10**9, 0.5) == pytest.approx(2.0)
    assert B.busbw_gbps("all_reduce", 10**9, 0.5, 8) == pytest.approx(3.5)
    with pytest.raises(UserError):
        B.bus_factor("gather", 2)


def test_sizes_and_counts():
    assert B.parse_size("1K") == 1024 and B.parse_size("64M") == 64 << 20
    assert B.parse_size("1G") == 1 << 30 and B.parse_size("512") == 512
    assert B.parse_size("4KiB") == 4096
    with pytest.raises(UserError):
        B.parse_size("lots")
    assert B.message_sizes(1024, 8192, 2) == [1024, 2048, 4096, 8192]
    assert B.message_sizes(1 << 10, 1 << 30, 2)[-1] == 1 << 30
    assert B.message_sizes(4096, 4096, 2) == [4096]
    with pytest.raises(UserError):
        B.message_sizes(8192, 1024, 2)
    # all_gather on 3 ranks: 1 KiB of fp32 = 256 elements, rounded down to 255 = 3 x 85
    assert B.element_counts("all_gather", 1024, 4, 3) == (255, 85)
    assert B.element_counts("all_reduce", 1024, 4, 3) == (256, 256)
    assert B.format_size(64 << 20) == "64M" and B.format_size(1536) == "1.5K"


def test_sum_table_and_tolerance():
    for n in (1, 2, 4, 11, 13, 30):
        brute = [sum((3 * r + k) % 11 for r in range(n)) for k in range(11)]
        assert B.sum_table(n).tolist() == brute
    assert B.tolerance("all_gather", torch.bfloat16, 64) == 0.0  # data movement is exact
    assert B.tolerance("all_reduce", torch.bfloat16, 8) == 0.0  # sums <= 80 are exact in bf16
    assert B.tolerance("all_reduce", torch.bfloat16, 64) > 0.0
    assert B.tolerance("all_reduce", torch.int32, 1000) == 0.0


def test_split_groups():
    assert B.split_groups([0, 0, 1, 1]) == {"intra": [[0, 1], [2, 3]], "inter": [[0, 2], [1, 3]]}
    # Interleaved nodes: node 0 holds ranks 0 and 3, node 1 ranks 1 and 2.
    assert B.split_groups([0, 1, 1, 0]) == {"intra": [[0, 3], [1, 2]], "inter": [[0, 1], [2, 3]]}
    assert B.split_groups([5, 5, 5]) == {"intra": [[0, 1, 2]], "inter": [[0], [1], [2]]}
    with pytest.raises(UserError):
        B.split_groups([0, 0, 1])


def test_min_busbw_uses_each_ops_largest_size():
    recs = [{"op": "all_reduce", "group": "world", "bytes": b, "busbw_gbps": bw, "wrong": 0,
             "wrong_ranks": []} for b, bw in ((1024, 0.01), (1 << 20, 5.0))]
    assert C.check_results(recs, 1.0) == []
    assert "busbw 5.000 GB/s < --min-busbw 10" in C.check_results(recs, 10.0)[0]


# --- real ranks ----------------------------------------------------------------------------------

def _bench(rank, world, argv, node_of_rank=None):
    """Run the CLI on this rank (the group is already up); also return the records."""
    from podtrain.distributed.env import ClusterEnv
    from podtrain.distributed.group import process_group

    code = cli_main(["bench", "collectives", *argv])
    records = None
    if node_of_rank is not None:
        import argparse

        parser = argparse.ArgumentParser()
        C.add_arguments(parser)
        opts = C.options_from_args(parser.parse_args(argv))
        with process_group(ClusterEnv.detect(), "gloo") as ctx:
            records = C.run_benchmark(ctx, opts, node_of_rank=node_of_rank)
    return code, records


def _check_arithmetic(rec):
    n = rec["world_size"]
    assert rec["algbw_gbps"] == pytest.approx(rec["bytes"] / rec["time_s"] / 1e9)
    assert rec["busbw_gbps"] == pytest.approx(
        rec["bytes"] / rec["time_s"] / 1e9 * B.bus_factor(rec["op"], n))
    assert rec["time_min_s"] <= rec["time_s"] <= rec["time_max_s"]


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
def test_every_op_correct_and_json(tmp_path, world):
    out = tmp_path / "bench.jsonl"
    argv = ["--min-bytes", "1K", "--max-bytes", "64K", "--factor", "8", "--iters", "3",
            "--warmup", "1", "--backend", "gloo", "--json", str(out)]
    results = run_ranks(_bench, world, argv)
    assert [code for code, _ in results] == [0] * world
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(r["op"], r["bytes"]) for r in records] == [
        (op, B.element_counts(op, size, 4, world)[0] * 4)
        for op in B.OPS for size in (1024, 8192, 65536)]
    for rec in records:
        assert FIELDS <= set(rec)
        assert rec["wrong"] == 0 and rec["world_size"] == world and rec["group"] == "world"
        assert rec["time_s"] > 0 and math.isfinite(rec["busbw_gbps"])
        _check_arithmetic(rec)


def test_corrupted_result_is_reported_wrong(tmp_path, capfd, monkeypatch):
    out = tmp_path / "bench.jsonl"
    argv = ["--ops", "reduce_scatter,all_gather", "--min-bytes", "4K", "--max-bytes", "4K",
            "--iters", "2", "--warmup", "0", "--json", str(out)]
    faults.install("corrupt:op=reduce_scatter", patch=monkeypatch.setattr)  # forked ranks inherit
    results = run_ranks(_bench, 2, argv)
    assert [code for code, _ in results] == [1, 1]
    by_op = {r["op"]: r for r in map(json.loads, out.read_text().splitlines())}
    assert by_op["reduce_scatter"]["wrong"] == 2  # one element on each of the 2 ranks
    assert by_op["reduce_scatter"]["wrong_ranks"] == [0, 1]
    assert by_op["all_gather"]["wrong"] == 0
    assert "reduce_scatter 4K (world): 2 wrong element(s)" in capfd.readouterr().err


@pytest.mark.slow
def test_intra_inter_groups_with_a_two_node_layout(monkeypatch):
    argv = ["--ops", "all_reduce,broadcast", "--min-bytes", "16K", "--max-bytes", "16K",
            "--iters", "2", "--warmup", "0", "--groups", "intra,inter"]
    # Rank 3 sleeps 50 ms before each call: its groups ([2, 3] within nodes, [1, 3] across) are
    # the slowest by far more than a loaded machine's jitter on a 16K message.
    faults.install("slow-collective:rank=3,delay=0.05", patch=monkeypatch.setattr)
    results = run_ranks(_bench, 4, argv, [0, 0, 1, 1])
    records = results[0][1]
    assert records == results[3][1]  # every rank returns the same records
    assert [(r["group"], r["op"], r["world_size"], r["groups"]) for r in records] == [
        ("world", "all_reduce", 4, 1), ("world", "broadcast", 4, 1),
        ("intra", "all_reduce", 2, 2), ("intra", "broadcast", 2, 2),
        ("inter", "all_reduce", 2, 2), ("inter", "broadcast", 2, 2)]
    for rec in records:
        assert rec["wrong"] == 0
        _check_arithmetic(rec)
    assert [r.get("slowest_group") for r in records] == [
        None, None, [2, 3], [2, 3], [1, 3], [1, 3]]


@pytest.mark.slow
def test_min_busbw_fails_the_run(capfd):
    argv = ["--ops", "all_reduce", "--min-bytes", "4K", "--max-bytes", "4K", "--iters", "2"]
    assert [code for code, _ in run_ranks(_bench, 2, argv)] == [0, 0]  # control: same run passes
    capfd.readouterr()
    assert [code for code, _ in run_ranks(_bench, 2, [*argv, "--min-busbw", "1e6"])] == [1, 1]
    err = capfd.readouterr().err
    assert "FAIL: all_reduce 4K" in err and "< --min-busbw 1e+06" in err, err


def test_memory_short_on_one_rank_stops_every_rank(capfd, monkeypatch):
    argv = ["--ops", "all_reduce", "--min-bytes", "4K", "--max-bytes", "4K", "--iters", "1"]
    faults.install("low-memory:rank=1", patch=monkeypatch.setattr)
    results = run_ranks(_bench, 2, argv, timeout=60)
    assert [code for code, _ in results] == [2, 2]  # rank 0 stops too: no hang in a collective
    err = capfd.readouterr().err
    assert err.count("more than rank 1 on host ") == 2 and "rank 0 on host" not in err


def test_one_process_is_a_user_error(capsys):
    assert cli_main(["bench", "collectives", "--max-bytes", "4K"]) == 2
    assert "needs at least 2 ranks" in capsys.readouterr().err


def _stream(rank, world, json_path):
    """Rank 0 streams through RecordStream; each call checks what is on disk at that moment."""
    import time

    from podtrain.distributed.env import ClusterEnv
    from podtrain.distributed.group import process_group

    opts = C.BenchOptions(ops=["all_reduce", "broadcast"], sizes=[1024, 8192], iters=2, warmup=0)
    seen = []
    with process_group(ClusterEnv.detect(), "gloo") as ctx:
        stream = C.RecordStream("title", json_path) if rank == 0 else None

        def on_record(record, done, total):
            if stream is not None:
                stream(record, done, total)
                on_disk = len(open(json_path).read().splitlines())
                seen.append((done, total, on_disk, time.monotonic()))

        records = C.run_benchmark(ctx, opts, on_record=on_record)
        if stream is not None:
            stream.close()
    return seen, time.monotonic(), len(records)


def test_rows_and_json_lines_stream_as_measured(tmp_path, capfd):
    out = tmp_path / "bench.jsonl"
    (seen, finished, n), _ = run_ranks(_stream, 2, str(out))
    assert n == 4 and [(d, t, disk) for d, t, disk, _ in seen] == [(k, 4, k) for k in range(1, 5)]
    assert seen[0][3] < finished  # the first line was on disk before the benchmark ended
    rows = [line for line in capfd.readouterr().out.splitlines() if "/4  " in line]
    assert [row.split()[0] for row in rows] == ["1/4", "2/4", "3/4", "4/4"]
    assert rows[0].split()[1:4] == ["all_reduce", "world", "1K"]


def test_default_largest_message_follows_the_backend():
    import argparse

    parser = argparse.ArgumentParser()
    C.add_arguments(parser)
    args = parser.parse_args([])
    assert C.options_from_args(args, "gloo").sizes[-1] == 16 << 20
    assert C.options_from_args(args, "nccl").sizes[-1] == 1 << 30
    assert C.options_from_args(parser.parse_args(["--max-bytes", "2M"]), "gloo").sizes[-1] == 2 << 20


class _OneRank:
    """A one-rank context on a (mocked) device: all the memory check reads."""

    def __init__(self, device: str, local_world_size: int):
        import types

        self.device = torch.device(device)
        self.world_size = 1
        self.env = types.SimpleNamespace(local_world_size=local_world_size, hostname="node-a")

    def all_gather_object(self, obj):
        return [obj]


def test_memory_check_gives_each_gpu_its_own_free_memory_on_a_mocked_cuda_device(monkeypatch):
    from podtrain.diagnostics import collectives as C

    monkeypatch.setattr(C, "available_bytes", lambda device: 8 * 2**30)  # free memory, per device
    opts = C.BenchOptions(ops=["all_reduce"], sizes=[1 << 30])  # needs ~1 GiB per rank
    C.check_memory(_OneRank("cuda", 8), opts)  # 8 ranks on 8 GPUs: each has its own 8 GiB
    with pytest.raises(UserError, match="per rank available"):
        C.check_memory(_OneRank("cpu", 8), opts)  # 8 ranks share one host's 8 GiB: 1 GiB each
