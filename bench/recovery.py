"""Recovery after a lost node, three configurations side by side: durable tier only, today's local
tier (``ckpt.local_replicas=0``) and the local tier with peer replicas (``ckpt.local_replicas=1``).

    PYTHONPATH=src .venv/bin/python bench/recovery.py [--nodes 2,4] [--out DIR]

Each configuration: N torchrun agents on this host (``--nnodes N``, one rank each, c10d
rendezvous, ``--max-restarts 1``), each "node" with its own local directory; the last node's rank
stalls after step 7 (durable checkpoints every 3 steps, local ones every step); once the newest
checkpoint of the configuration is in place, that node (its agent and rank) is SIGKILLed and its
directory deleted, and a replacement agent joins at its address. Printed per configuration: the step resumed from (steps redone),
the recovery budget the restarted run wrote (``recovery`` in metrics.jsonl: the lost attempt's last
line to the new process's start, to the process group, start-up, first step; seconds), the
restore's own seconds and bytes by source from its log line, and the harness's wall time from
the kill to the first new train line. Same tiny model and data as tests/test_node_loss.py; the
figures are this machine's (2 CPU cores, loopback), the shape is the point: which source and how
many steps are lost.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO / "tests"), str(REPO / "bench")]

from test_node_loss import KILLED_AT, LOCAL_TIER, agent, finish_agents, kill_node  # noqa: E402
from test_resume import make_data  # noqa: E402

from podtrain.launch.local import free_port  # noqa: E402

CONFIGS = {
    "durable only": (),
    "local tier (K=0)": (*LOCAL_TIER, "ckpt.local_replicas=0"),
    "local + peers (K=1)": (*LOCAL_TIER, "ckpt.local_replicas=1"),
}
RESTORE = re.compile(r"restore took ([\d.]+) s: ([\d.]+) MB read from local disks.*?, ([\d.]+) MB received "
                     r"from peers, ([\d.]+) MB read from the durable tier")


def _ready(name: str, run_dir: Path, first_dir: Path, lost_rank: int) -> bool:
    """The configuration's newest checkpoint before the kill is in place (the ring puts the last
    node's replica on the first node)."""
    step = f"step_{KILLED_AT:06d}"
    if name == "durable only":
        latest = run_dir / "ckpt" / "latest"
        return latest.exists() and latest.read_text().strip() == "step_000006"
    if "K=0" in name:
        return bool(list(first_dir.glob(f"*/{step}/rank_00000.json")))
    return bool(list(first_dir.glob(f"*/{step}/replica_of_rank_{lost_rank:05d}/rank_{lost_rank:05d}.json")))


def one(name: str, ckpt_args: tuple[str, ...], base: Path, data: Path, nodes: int) -> dict:
    """Run one configuration's loss and recovery on ``nodes`` simulated nodes; its figures."""
    run_dir, lost = base / "run", nodes - 1
    dirs = [base / f"node{i}" for i in range(nodes)]
    addrs = [f"127.0.0.{i + 2}" for i in range(nodes)]  # the rendezvous orders nodes by address
    port = free_port()
    agents = []
    for i in range(nodes):
        fault = f"stall:rank={lost},step={KILLED_AT},seconds=300" if i == lost else None
        agents.append(agent(REPO, run_dir, data, port, addrs[i], dirs[i], fault=fault, ckpt_args=ckpt_args,
                            nnodes=nodes))
        if i == 0:
            time.sleep(1.0)  # node 0 hosts the rendezvous
    survivors = agents[:lost]
    deadline = time.monotonic() + 240
    while not _ready(name, run_dir, dirs[0], lost):
        if time.monotonic() > deadline or any(p.poll() is not None for p in survivors):
            for p in agents:
                kill_node(p)
            raise SystemExit(f"{name}: the checkpoint before the kill never appeared:\n"
                             + agents[0].communicate()[0][-3000:])
        time.sleep(0.05)
    killed = time.time()
    kill_node(agents[lost])
    agents[lost].communicate()
    shutil.rmtree(dirs[lost])
    replacement = agent(REPO, run_dir, data, port, addrs[lost], dirs[lost], ckpt_args=ckpt_args, nnodes=nodes)
    results = finish_agents([*survivors, replacement], timeout=300 * max(1, nodes // 2))
    out = "\n".join(text for _, text in results)
    if any(code for code, _ in results):
        raise SystemExit(f"{name}: the job failed:\n{out[-3000:]}")
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    first = next(r for r in records if r.get("kind") == "train" and isinstance(r.get("recovery"), dict))
    resumed = [int(m) for m in re.findall(r"resumed from \S+ \(step (\d+)\)", out)]
    restore = RESTORE.findall(out)
    restore_s, disk, peers, durable = (float(v) for v in restore[-1]) if restore else (0.0,) * 4
    return {"config": name, "nodes": nodes, "resumed_step": resumed[-1] if resumed else 0,
            "steps_redone": KILLED_AT - (resumed[-1] if resumed else 0), **first["recovery"],
            "restore_s": restore_s, "mb_local_disk": disk, "mb_peers": peers, "mb_durable": durable,
            "kill_to_first_step_s": round(first["time"] - killed, 3) if "time" in first else None}


STATE_BYTES_PER_PARAM = 12
"""What a restore reads per parameter: fp32 weights and AdamW's two moments (the planner's state)."""
NVME_GBPS_PER_RANK = 2.0
"""Assumed: a rank reads its own share back from the node's NVMe at 2 GB/s (p5: 8 x 3.84 TB NVMe)."""
FSX_GBPS_PER_NODE = 1.0
"""Assumed: one FSx for Lustre client (a node) reads at 1 GB/s (the planner's figure), if the file
system delivers 64 GB/s in aggregate."""
S3_GBPS_PER_NODE = 2.5
"""Assumed: one node reads checkpoint objects from S3 at 2.5 GB/s (20 Gbit/s of CRT connections)."""


STREAM_MB = 256
"""The file sent once between two forked ranks to measure one peer stream's rate."""


def _stream_rank(rank: int, world: int, base: str) -> float:
    """Rank 0 sends a ``STREAM_MB`` file to rank 1 through ``replicas.exchange`` (podtrain's own
    path: read, send over gloo, receive, write, fsync, commit); the seconds rank 1 took."""
    import torch.distributed as dist

    from podtrain.ckpt import replicas
    from podtrain.storage import open_store

    store = open_store(f"{base}/node{rank}")
    if rank == 0:
        with store.open_write("step/rank_00000.bin") as fh:
            fh.write(os.urandom(STREAM_MB << 20))
    dist.barrier()
    t0 = time.perf_counter()
    replicas.exchange(store, "step" if rank == 0 else None, ["rank_00000.bin"], 1 if rank == 0 else None,
                      "replica" if rank == 1 else None, 0 if rank == 1 else None, dist.group.WORLD)
    return time.perf_counter() - t0


def peer_stream_gbps() -> float:
    """One peer stream's rate on this machine, GB/s (two forked ranks over loopback gloo)."""
    from multirank import run_ranks

    base = tempfile.mkdtemp(prefix="podtrain-stream-")
    try:
        seconds = run_ranks(_stream_rank, 2, base, timeout=300)[1]
    finally:
        shutil.rmtree(base, ignore_errors=True)
    return (STREAM_MB << 20) / 1e9 / seconds


def paper_70b(rows: list[dict], stream_gbps: float) -> list[str]:
    """llama-3-70B on 64 p5.48xlarge after one node loss, on paper: the measured per-stream peer
    rate, the planner's step time, and the assumptions above."""
    from scale_ckpt import LLAMA_70B

    from podtrain.config import load_config
    from podtrain.plan.machine import instance_machine
    from podtrain.plan.planner import make_plan
    from podtrain.plan.shape import vocab_shape

    peer = max((r for r in rows if r["mb_peers"] > 0), key=lambda r: r["nodes"], default=rows[-1])
    config = Path(tempfile.mkdtemp(prefix="podtrain-70b-")) / "config.json"
    config.write_text(json.dumps({"model_type": "llama", "max_position_embeddings": 8192, **LLAMA_70B}))
    cfg = load_config(str(REPO / "configs/demo.yaml"), [
        f"model.preset={config}", "data.seq_len=8192", "dist.strategy=fsdp", "train.activation_checkpointing=full",
        "train.micro_batch_size=1", "train.global_batch_size=1024", "data.path=/nonexistent", "eval.every=0"])
    plan = make_plan(cfg, vocab_shape(cfg, None), instance_machine("p5.48xlarge", "auto", None, None), 64, None)
    step_s = next(r["step_s"] for r in plan.scaling if r["nodes"] == 64)  # the planner's step at 64 nodes
    per_rank = plan.shape.params * STATE_BYTES_PER_PARAM / plan.world / 1e9
    per_node = per_rank * plan.machine.devices_per_node
    from_peers = per_rank / stream_gbps + per_rank / NVME_GBPS_PER_RANK
    lines = [f"70B on paper (64 p5.48xlarge, 512 ranks; {plan.shape.params / 1e9:.1f}B params x "
             f"{STATE_BYTES_PER_PARAM} B = {per_rank:.2f} GB per rank, {per_node:.1f} GB per node; the planner's "
             f"step {step_s:.1f} s at 8M tokens):"]
    for label, restore in (("local + peers (K=1)", from_peers),
                           ("durable on FSx", per_node / FSX_GBPS_PER_NODE),
                           ("durable on S3", per_node / S3_GBPS_PER_NODE)):
        total = restore + step_s
        lines.append(f"  {label:20} restore {restore:5.1f} s + first step {step_s:4.1f} s = {total:5.1f} s of "
                     f"podtrain's time ({'under' if total < 60 else 'OVER'} the 60 s target); durable bytes read "
                     f"{0 if 'peers' in label else per_node * 64:,.0f} GB")
    lines.append(f"  (peer stream {stream_gbps:.2f} GB/s measured here: {STREAM_MB} MB through replicas.exchange "
                 f"between two ranks, 2-core VM, loopback; NVMe {NVME_GBPS_PER_RANK} GB/s per rank, FSx {FSX_GBPS_PER_NODE} GB/s and "
                 f"S3 {S3_GBPS_PER_NODE} GB/s per node assumed; torchrun's detection and rendezvous, "
                 f"{peer['lost_to_start_s'] + peer['start_to_group_s']:.1f} s here, not extrapolated)")
    return lines


def main() -> int:
    """Run the three configurations and print them side by side."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", default="2", help="simulated node counts, comma-separated (e.g. 2,4)")
    parser.add_argument("--out", type=Path, default=None, help="keep the runs here (default: a temporary folder)")
    args = parser.parse_args()
    base = args.out or Path(tempfile.mkdtemp(prefix="podtrain-recovery-"))
    data = make_data(base / "data")
    rows = [one(name, ckpt, base / f"n{nodes}c{i}", data, nodes) for nodes in map(int, args.nodes.split(","))
            for i, (name, ckpt) in enumerate(CONFIGS.items())]
    keys = ("nodes", "resumed_step", "steps_redone", "lost_to_start_s", "start_to_group_s", "startup_s", "restore_s",
            "first_step_s", "total_s", "kill_to_first_step_s", "mb_local_disk", "mb_peers", "mb_durable")
    width = max(len(k) for k in keys)
    print(f"{'':{width}}  " + "  ".join(f"{r['config']:>20}" for r in rows))
    for key in keys:
        print(f"{key:{width}}  " + "  ".join(f"{str(r.get(key, 'n/a')):>20}" for r in rows))
    print(json.dumps(rows))
    print("\n".join(paper_70b(rows, peer_stream_gbps())))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
