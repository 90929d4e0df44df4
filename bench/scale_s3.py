"""bench/scale.py's S3 half: requests each rank sends to S3 when a job starts, and per save.

A real S3 server (moto's ``ThreadedMotoServer``, ``tests/s3_server.py``) holds a prepared dataset
and the checkpoints. Every rank talks to it through a counting proxy of its own
(``tests/s3_fault_proxy.py``, no faults: one proxy per rank, so each request is attributed to the
rank that sent it), selected by ``AWS_ENDPOINT_URL`` in that rank alone. The ranks run the real
``podtrain train`` (``loop.train``, FSDP, tiny preset, ``data.path`` and ``ckpt.dir`` on s3://):

* ``fresh``: a new run of K steps (``kept``), saved at every step and keeping them all
  (``ckpt.keep_last=K``): K checkpoints of 2N + a few objects each, so that at the larger world
  sizes a listing of the checkpoints passes S3's 1,000 keys a page;
* ``start``: the same run again with ``train.steps=K``: it resumes step K and has nothing left to
  train: what a restart sends before its first step (data manifests and listings, the lease, the
  checkpoint's choice and its share), with a cold data cache;
* ``step+save``: ``train.steps=K+1``: a restart, one step and one save (retention then deletes
  the oldest checkpoint); minus ``start``: one save.

Requests are counted by verb: LIST (GET with ``list-type``/``prefix``/``uploads``), GET, HEAD,
PUT, POST, DELETE.
"""

from __future__ import annotations

import collections
import os
import shutil
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PHASES = (("fresh", 0), ("start", 0), ("step+save", 1))
"""Each phase and its train.steps beyond the K kept checkpoints."""
OVERRIDES = ["train.micro_batch_size=1", "data.seq_len=16", "optim.warmup_steps=1", "eval.every=0",
             "ckpt.every=1", "log.every=1", "log.progress=off", "monitor.watchdog=false",
             "monitor.straggler_every=0", "dist.strategy=fsdp", "run.seed=5"]


def verb(method: str, target: str) -> str:
    """The S3 operation class of a request line (method, path with query)."""
    query = target.partition("?")[2]
    if method == "GET" and any(k in query for k in ("list-type", "prefix=", "delimiter=", "uploads")):
        return "LIST"
    return method


def _s3_rank(rank: int, world: int, endpoints: list[str], run_dir: str, data_url: str, ckpt_url: str,
             cache_dir: str, steps: int, kept: int = 1) -> int:
    """One forked rank: ``podtrain train`` through this rank's own proxy."""
    os.environ["AWS_ENDPOINT_URL"] = endpoints[rank]
    log = os.open(os.path.join(os.path.dirname(run_dir), f"rank{rank}.log"), os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    os.dup2(log, 1)  # the runs' own log lines stay out of the bench's table (a failure still comes back)
    os.dup2(log, 2)
    from podtrain.config import load_config
    from podtrain.distributed.env import ClusterEnv
    from podtrain.train import loop

    cfg = load_config(str(REPO / "configs/demo.yaml"), [
        f"run.dir={run_dir}", f"data.path={data_url}", f"ckpt.dir={ckpt_url}", f"data.cache_dir={cache_dir}",
        f"train.steps={steps}", f"train.global_batch_size={world}", f"ckpt.keep_last={kept}", *OVERRIDES])
    result = loop.train(cfg, ClusterEnv.detect())
    return result.exit_code


class S3Bench:
    """The server, one uploaded dataset, and a run per world size (see the module docstring)."""

    def __init__(self, workdir: Path, kept: int = 1):
        sys.path.insert(0, str(REPO / "tests"))
        from s3_server import S3Server, TEST_ACCESS_KEY, TEST_SECRET
        from synthetic_data import make_data_dir

        self.workdir, self.kept = workdir, kept
        self.server = S3Server()
        os.environ.update({"AWS_ACCESS_KEY_ID": TEST_ACCESS_KEY, "AWS_SECRET_ACCESS_KEY": TEST_SECRET,
                           "AWS_REGION": "us-east-1"})
        for k in ("AWS_ENDPOINT_URL_S3", "AWS_PROFILE", "AWS_SESSION_TOKEN"):
            os.environ.pop(k, None)
        self.bucket = self.server.new_bucket()
        local = make_data_dir(workdir / "s3data", shard_tokens=(4000, 4000, 4000), val_tokens=2000)
        for p in sorted(local.iterdir()):
            self.server.boto.upload_file(str(p), self.bucket, f"data/{p.name}")
        self.data_url = f"s3://{self.bucket}/data"

    def run_world(self, world: int) -> dict[str, list[dict[str, int]]]:
        """``{phase: [requests by verb, one dict per rank]}`` at ``world`` ranks, and ``{"keys":
        [[keys under the checkpoints' prefix]]}`` after the fresh run (kept checkpoints' objects)."""
        from multirank import run_ranks
        from s3_fault_proxy import S3FaultProxy

        proxies = [S3FaultProxy(self.server.endpoint) for _ in range(world)]
        run_dir = self.workdir / f"s3run{world}"
        out: dict[str, list[dict[str, int]]] = {}
        try:
            for phase, extra in PHASES:
                steps = self.kept + extra
                for p in proxies:
                    p.reset()
                cache = self.workdir / f"cache{world}_{phase}"  # cold: a restart on a fresh node
                codes = run_ranks(_s3_rank, world, [p.endpoint for p in proxies], str(run_dir), self.data_url,
                                  f"s3://{self.bucket}/ckpt{world}", str(cache), steps, self.kept, timeout=3600)
                if any(codes):
                    raise RuntimeError(f"S3 {phase} run at {world} ranks exited {codes}")
                out[phase] = [dict(collections.Counter(verb(m, t) for m, t, _ in p.history())) for p in proxies]
                if phase == "fresh":
                    pages = self.server.boto.get_paginator("list_objects_v2").paginate(
                        Bucket=self.bucket, Prefix=f"ckpt{world}/")
                    out["keys"] = [[sum(len(pg.get("Contents", [])) for pg in pages)]]
                shutil.rmtree(cache, ignore_errors=True)
        finally:
            for p in proxies:
                p.stop()
        return out

    def stop(self) -> None:
        """Stop the server."""
        self.server.stop()


def per_rank_totals(counts: list[dict[str, int]]) -> list[int]:
    """Requests each rank sent (all verbs)."""
    return [sum(c.values()) for c in counts]


def save_requests(run: dict[str, list[dict[str, int]]]) -> list[dict[str, int]]:
    """Per rank: requests of ``step+save`` beyond ``start`` (one step's save; a step sends none)."""
    return [{k: c2.get(k, 0) - c1.get(k, 0) for k in set(c1) | set(c2)}
            for c1, c2 in zip(run["start"], run["step+save"])]


def workdir() -> Path:
    """A scratch directory (removed by the caller)."""
    return Path(tempfile.mkdtemp(prefix="podtrain-scale-s3-"))
