"""The share of S3 checkpoint saves that commit when a fraction of requests is refused, by world size.

On S3 every rank uploads its own file as a multipart upload; a part that fails all of the CRT
client's attempts aborts that upload. If nothing sends it again, one such part among all the
ranks' parts abandons the whole save, so the chance that a save commits falls with the world size
as ``(1 - p) ** N`` (``p``: a rank's chance to lose its file). podtrain sends a failed file again,
within the store's retry budget (``CheckpointWriter._write_own``, ``podtrain.ckpt.staging``).

Real parts: moto's S3 server (``tests/s3_server.py``) behind the tests' fault proxy
(``tests/s3_fault_proxy.py``), which refuses a seeded fraction of the saves' requests (those under
a ``step_`` directory: the piece files, sidecars, small files and manifest; the run's start, its
lease and ``latest`` are left alone); N forked ranks joined by gloo (``tests/multirank.py``), each
saving the tiny preset model and its AdamW state through podtrain's ``Checkpointer`` and
s3torchconnector's CRT client, ``--saves`` times, one after another.

``before``: the re-send turned off (``podtrain.ckpt.staging.REPLAY = False``, an internal switch:
each file written once, as main did; the classification of the CRT's "request has already
completed" as transient, fixed with the re-send, stays on); ``after``: the defaults.

Printed per world size and mode: saves committed, requests and refusals, uploads of rank files
(``creates``: CreateMultipartUpload requests answered, vs saves x ranks), multipart uploads left
incomplete, the per-rank failure ``p = 1 - share ** (1 / N)``; then ``p`` pooled over the world
sizes and carried to ``--paper-ranks`` (512) on paper: ``(1 - p) ** 512`` (with no failure seen,
the 95% upper bound of ``p``, 3 / rank-saves, is carried instead).

    .venv/bin/python bench/s3_save_faults.py                          # 5% 503 SlowDown, 2/8/16 ranks, 20 saves
    .venv/bin/python bench/s3_save_faults.py --status 502 --modes before,after   # 502: not retried by the CRT

503 is S3's throttling answer: the CRT retries it (5 attempts per request), so a part is lost only
when it is refused 5 times. 502 (a load balancer's answer) is never retried by the CRT: each
refused part loses its upload at once, the case a part whose attempts are all spent stands for.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))
VOCAB = 320


def _rank(rank: int, world: int, run_dir: str, url: str, saves: int, replay: bool) -> dict:
    """One forked rank: ``saves`` saves of the tiny model, each waited for; which committed."""
    import logging

    import torch

    from multirank import gloo_context
    from podtrain.ckpt import staging
    from podtrain.ckpt.checkpointer import Checkpointer
    from podtrain.config_sections import CkptSection
    from podtrain.model import build_model, preset_config

    logging.disable(logging.WARNING)  # an abandoned save's warning per save and rank: the table says it
    staging.REPLAY = replay
    torch.manual_seed(0)
    model = build_model(preset_config("tiny", VOCAB), seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    opt.step()
    ck = Checkpointer(Path(run_dir), CkptSection(dir=url, keep_last=0), gloo_context())
    committed, share = [], 0
    try:
        for step in range(1, saves + 1):
            ck.save(step, model, opt, None, {"step": step, "tokens_seen": step})
            job = ck._pending
            share = job.stream.nbytes if job.stream is not None else 0
            ck.wait()
            committed.append(job.error is None)
    finally:
        ck.close()
    return {"committed": committed, "share_bytes": share}


def _left_uploads(server, bucket: str, prefix: str, settle_s: float = 3.0) -> int:
    """Multipart uploads under ``prefix`` neither completed nor aborted (after the CRT's aborts settle)."""
    deadline = time.monotonic() + settle_s
    while True:
        left = server.boto.list_multipart_uploads(Bucket=bucket, Prefix=prefix).get("Uploads", [])
        if not left or time.monotonic() >= deadline:
            return len(left)
        time.sleep(0.1)


def run_one(server, proxy, bucket: str, workdir: Path, world: int, saves: int, replay: bool,
            fraction: float, status: int, seed: int, timeout: float) -> dict:
    """``saves`` saves on ``world`` ranks with ``fraction`` of the saves' requests refused."""
    from multirank import run_ranks

    mode = "after" if replay else "before"
    prefix = f"n{world}-{mode}"
    proxy.reset()
    proxy.fail_with(status, {503: "SlowDown", 502: "BadGateway", 500: "InternalError"}.get(status, "Refused"),
                    "refused by bench/s3_save_faults.py")
    proxy.fail_only("/step_")
    proxy.fail_fraction(fraction, seed=seed)
    t0 = time.perf_counter()
    results = run_ranks(_rank, world, str(workdir / prefix), f"s3://{bucket}/{prefix}", saves, replay,
                        timeout=timeout)
    wall = time.perf_counter() - t0
    history = proxy.history()
    stats = proxy.stats()
    proxy.reset()
    outcomes = results[0]["committed"]
    assert all(r["committed"] == outcomes for r in results), "the ranks disagree on which saves committed"
    creates = sum(1 for m, p, failed in history if m == "POST" and "rank_" in p and ".safetensors?uploads" in p
                  and not failed)
    share = sum(outcomes) / len(outcomes)
    return {"world": world, "mode": mode, "saves": len(outcomes), "committed": sum(outcomes), "share": share,
            "p": 1 - share ** (1 / world) if share > 0 else 1.0, "requests": stats["requests"],
            "refused": stats["failed"], "creates": creates, "expected_creates": len(outcomes) * world,
            "left": _left_uploads(server, bucket, prefix + "/"), "wall_s": wall,
            "share_mb": max(r["share_bytes"] for r in results) / 1e6, "history_full": len(history) >= 10_000}


def pooled(rows: list[dict], paper: int) -> tuple[float, str, float]:
    """``p`` pooled over ``rows`` (one mode), how it was found, and the commit share at ``paper`` ranks."""
    rank_saves = sum(r["world"] * r["saves"] for r in rows)
    failed = sum(r["saves"] - r["committed"] for r in rows)
    if failed == 0:
        p, how = 3.0 / rank_saves, f"< {3.0 / rank_saves:.2e} (no failure in {rank_saves} rank-saves; 95% bound)"
    else:
        # maximum likelihood of (1 - p) ** N per save over every world size's saves
        lo, hi = 0.0, 1.0
        for _ in range(100):
            p = (lo + hi) / 2
            # d/dp of sum over saves: committed * N * log(1-p) + failed * log(1 - (1-p)**N)
            grad = sum(-r["committed"] * r["world"] / (1 - p)
                       + (r["saves"] - r["committed"]) * r["world"] * (1 - p) ** (r["world"] - 1)
                       / max(1 - (1 - p) ** r["world"], 1e-300) for r in rows)
            lo, hi = (p, hi) if grad > 0 else (lo, p)
        p, how = (lo + hi) / 2, f"{(lo + hi) / 2:.2e} (maximum likelihood over {rank_saves} rank-saves)"
    return p, how, (1 - p) ** paper


def main(argv: list[str] | None = None) -> int:
    """Run the bench (see the module docstring); prints one table and the figure at ``--paper-ranks``."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ranks", default="2,8,16", help="world sizes, comma-separated")
    ap.add_argument("--saves", type=int, default=20, help="saves per world size and mode")
    ap.add_argument("--fraction", type=float, default=0.05, help="share of the saves' requests refused")
    ap.add_argument("--status", type=int, default=503, help="HTTP status of a refusal (503: SlowDown)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--modes", default="before,after", help="before (no re-send), after (the default)")
    ap.add_argument("--paper-ranks", type=int, default=512)
    ap.add_argument("--timeout", type=float, default=1800.0, help="seconds one world size and mode may take")
    args = ap.parse_args(argv)

    from s3_fault_proxy import S3FaultProxy
    from s3_server import restore_env, start_with_env

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    server, saved = start_with_env()
    proxy = S3FaultProxy(server.endpoint, lifetime_s=6 * 3600.0)
    os.environ["AWS_ENDPOINT_URL"] = proxy.endpoint  # the forked ranks talk to the proxy
    bucket = server.new_bucket()
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    rows = []
    print(f"{args.fraction:.0%} of the saves' requests refused with HTTP {args.status}, {args.saves} saves each")
    print(f"{'ranks':>5} {'mode':>6} {'committed':>9} {'share':>7} {'p/rank':>9} {'requests':>8} {'refused':>7} "
          f"{'creates':>11} {'left':>4} {'MB/rank':>7} {'wall s':>6}")
    try:
        with tempfile.TemporaryDirectory(prefix="s3_save_faults-") as tmp:
            for world in [int(n) for n in args.ranks.split(",")]:
                for mode in modes:
                    r = run_one(server, proxy, bucket, Path(tmp), world, args.saves, mode == "after",
                                args.fraction, args.status, args.seed + world, args.timeout)
                    rows.append(r)
                    print(f"{r['world']:>5} {r['mode']:>6} {r['committed']:>4}/{r['saves']:<4} {r['share']:>7.1%} "
                          f"{r['p']:>9.2e} {r['requests']:>8} {r['refused']:>7} "
                          f"{r['creates']:>5}/{r['expected_creates']:<5} {r['left']:>4} {r['share_mb']:>7.2f} "
                          f"{r['wall_s']:>6.0f}" + ("  (history truncated: creates undercounted)"
                                                     if r["history_full"] else ""), flush=True)
    finally:
        proxy.stop()
        server.stop()
        restore_env(saved)
    print(f"carried to {args.paper_ranks} ranks on paper: (1 - p) ** {args.paper_ranks}, target >= 99%")
    for mode in modes:
        mine = [r for r in rows if r["mode"] == mode]
        p, how, share = pooled(mine, args.paper_ranks)
        print(f"  {mode:>6}: p per rank {how}; saves that commit at {args.paper_ranks} ranks: {share:.2%}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
