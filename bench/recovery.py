"""Recovery after a lost node, three configurations side by side: durable tier only, today's local
tier (``ckpt.local_replicas=0``) and the local tier with peer replicas (``ckpt.local_replicas=1``).

    PYTHONPATH=src .venv/bin/python bench/recovery.py [--out DIR]

Each configuration: two torchrun agents on this host (``--nnodes 2``, one rank each, c10d
rendezvous, ``--max-restarts 1``), each "node" with its own local directory; rank 1 stalls after
step 7 (durable checkpoints every 3 steps, local ones every step); once the newest checkpoint of
the configuration is in place, node 1 (its agent and rank) is SIGKILLed and its directory deleted,
and a replacement agent joins. Printed per configuration: the step resumed from (steps redone),
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
import re
import shutil
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))

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


def _ready(name: str, run_dir: Path, survivor_dir: Path) -> bool:
    """The configuration's newest checkpoint before the kill is in place."""
    step = f"step_{KILLED_AT:06d}"
    if name == "durable only":
        latest = run_dir / "ckpt" / "latest"
        return latest.exists() and latest.read_text().strip() == "step_000006"
    if "K=0" in name:
        return bool(list(survivor_dir.glob(f"*/{step}/rank_00000.json")))
    return bool(list(survivor_dir.glob(f"*/{step}/replica_of_rank_00001/rank_00001.json")))


def one(name: str, ckpt_args: tuple[str, ...], base: Path, data: Path) -> dict:
    """Run one configuration's loss and recovery; its figures."""
    run_dir, survivor_dir, lost_dir = base / "run", base / "nodeA", base / "nodeB"
    port = free_port()
    survivor = agent(REPO, run_dir, data, port, "127.0.0.2", survivor_dir, ckpt_args=ckpt_args)
    time.sleep(1.0)
    lost = agent(REPO, run_dir, data, port, "127.0.0.3", lost_dir,
                 fault=f"stall:rank=1,step={KILLED_AT},seconds=300", ckpt_args=ckpt_args)
    deadline = time.monotonic() + 180
    while not _ready(name, run_dir, survivor_dir):
        if time.monotonic() > deadline or survivor.poll() is not None:
            for p in (survivor, lost):
                kill_node(p)
            raise SystemExit(f"{name}: the checkpoint before the kill never appeared:\n"
                             + survivor.communicate()[0][-3000:])
        time.sleep(0.05)
    killed = time.time()
    kill_node(lost)
    lost.communicate()
    shutil.rmtree(lost_dir)
    replacement = agent(REPO, run_dir, data, port, "127.0.0.3", lost_dir, ckpt_args=ckpt_args)
    results = finish_agents([survivor, replacement], timeout=300)
    out = "\n".join(text for _, text in results)
    if any(code for code, _ in results):
        raise SystemExit(f"{name}: the job failed:\n{out[-3000:]}")
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    first = next(r for r in records if r.get("kind") == "train" and isinstance(r.get("recovery"), dict))
    resumed = [int(m) for m in re.findall(r"resumed from \S+ \(step (\d+)\)", out)]
    restore = RESTORE.findall(out)
    restore_s, disk, peers, durable = (float(v) for v in restore[-1]) if restore else (0.0,) * 4
    return {"config": name, "resumed_step": resumed[-1] if resumed else 0,
            "steps_redone": KILLED_AT - (resumed[-1] if resumed else 0), **first["recovery"],
            "restore_s": restore_s, "mb_local_disk": disk, "mb_peers": peers, "mb_durable": durable,
            "kill_to_first_step_s": round(first["time"] - killed, 3) if "time" in first else None}


def main() -> int:
    """Run the three configurations and print them side by side."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None, help="keep the runs here (default: a temporary folder)")
    args = parser.parse_args()
    base = args.out or Path(tempfile.mkdtemp(prefix="podtrain-recovery-"))
    data = make_data(base / "data")
    rows = [one(name, ckpt, base / f"c{i}", data) for i, (name, ckpt) in enumerate(CONFIGS.items())]
    keys = ("resumed_step", "steps_redone", "lost_to_start_s", "start_to_group_s", "startup_s", "restore_s",
            "first_step_s", "total_s", "kill_to_first_step_s", "mb_local_disk", "mb_peers", "mb_durable")
    width = max(len(k) for k in keys)
    print(f"{'':{width}}  " + "  ".join(f"{r['config']:>20}" for r in rows))
    for key in keys:
        print(f"{key:{width}}  " + "  ".join(f"{str(r.get(key, 'n/a')):>20}" for r in rows))
    print(json.dumps(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
