"""The soak's S3 round: checkpoints on a real S3 server (moto) behind a fault proxy that answers
503 SlowDown, with the same config as the soak's reference run (``bench/soak.py --s3-outage-s``).

Two launches of ``podtrain launch local`` with ``ckpt.dir=s3://...``:

* outage   throttling (a fraction of requests fails all along) and, from a step in the first third,
           an outage of every request for ``--s3-outage-s`` seconds (150 by default): the run must
           keep training through it (steps logged during the outage), save again after it, and end
           with exit 0, the reference's losses and bit-identical weights;
* budget   an outage that does not end, with ``ckpt.max_outage_s`` shorter than it: the run must
           stop with exit 203 (retryable); once the storage is back, a rerun must resume from the
           last good checkpoint and end as the reference.

The server and the proxy are the test suite's own (tests/s3_server.py, tests/s3_fault_proxy.py).
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))

from s3_fault_proxy import OutageDirector, S3FaultProxy  # noqa: E402
from s3_server import restore_env, start_with_env  # noqa: E402
from outage_recovery import records  # noqa: E402

OUTAGE_EXIT_CODE = 203


def s3_round(soak, data: Path, ref: dict, outage_s: float) -> dict:
    """Run both S3 launches; return the round's verdicts (``problems`` lists what failed)."""
    args = soak.args
    server, saved_env = start_with_env()
    proxy = S3FaultProxy(server.endpoint)
    os.environ["AWS_ENDPOINT_URL"] = proxy.endpoint  # the launches inherit it
    result: dict = {"round": "s3"}
    try:
        result.update(_outage_launch(soak, data, ref, server, proxy, outage_s))
        result.update(_budget_launch(soak, data, ref, server, proxy))
    finally:
        proxy.stop()
        server.stop()
        restore_env(saved_env)
    result["problems"] = result.pop("problems_outage") + result.pop("problems_budget")
    return result


def _outage_launch(soak, data, ref, server, proxy, outage_s: float) -> dict:
    run_dir = soak.work / "s3_outage"
    url = f"s3://{server.new_bucket()}/ckpt"
    proxy.fail_fraction(0.05, seed=soak.args.seed)
    director = OutageDirector(proxy, run_dir, max(2, soak.args.steps // 3), min_s=outage_s)
    soak.args.set.append(f"ckpt.dir={url}")
    try:
        director.start()
        t0 = time.monotonic()
        proc, log = soak.launch(run_dir, data, "s3_outage")
        code = soak.wait(proc, "the S3 outage launch")
        wall = time.monotonic() - t0
    finally:
        director.finish()
        soak.args.set.pop()
    train = records(run_dir, "train")
    during = [r["step"] for r in train if director.began and director.began <= r["time"] <= (director.ended or 0)]
    out = {"outage_s": outage_s, "outage_exit": code, "outage_wall_s": round(wall, 1),
           "steps_during_outage": len(during), "requests_failed": proxy.stats()["failed"]}
    problems = []
    if director.began is None:
        problems.append("the outage never started (the run logged no step past the first third)")
    if code != 0:
        problems.append(f"the outage launch ended with {code}, not 0 (see {log})")
    elif not during and director.began is not None:
        problems.append("no step was logged during the outage: the step loop waited for S3")
    if code == 0:
        attempt = soak.compare("s3_outage", run_dir, [_attempt(train, code)], ref)
        out["outage_weights"], out["outage_losses"] = attempt["weights"], attempt["losses"]
        if attempt["weights"] != "identical" or attempt["losses"] != "identical":
            problems.append(f"outage launch: weights {attempt['weights']}, losses {attempt['losses']}")
    out["problems_outage"] = problems
    return out


def _budget_launch(soak, data, ref, server, proxy) -> dict:
    run_dir = soak.work / "s3_budget"
    url = f"s3://{server.new_bucket()}/ckpt"
    proxy.fail_fraction(0.0)
    director = OutageDirector(proxy, run_dir, max(2, soak.args.steps // 3))  # never ends by itself
    soak.args.set.extend([f"ckpt.dir={url}", "ckpt.max_outage_s=10"])
    problems = []
    try:
        director.start()
        proc, log = soak.launch(run_dir, data, "s3_budget")
        first = soak.wait(proc, "the S3 budget launch")
        director.finish()  # the storage is back
        proc, log2 = soak.launch(run_dir, data, "s3_budget_rerun")
        second = soak.wait(proc, "the rerun after the outage")
    finally:
        director.finish()
        del soak.args.set[-2:]
    if first != OUTAGE_EXIT_CODE:
        problems.append(f"an outage past ckpt.max_outage_s ended with {first}, not {OUTAGE_EXIT_CODE} (see {log})")
    out = {"budget_exit": first, "rerun_exit": second}
    if second != 0:
        problems.append(f"the rerun ended with {second}, not 0 (see {log2})")
    else:
        attempt = soak.compare("s3_budget", run_dir, [_attempt(records(run_dir, "train"), second)], ref)
        out["budget_weights"], out["budget_losses"] = attempt["weights"], attempt["losses"]
        if attempt["weights"] != "identical" or attempt["losses"] != "identical":
            problems.append(f"budget rerun: weights {attempt['weights']}, losses {attempt['losses']}")
    out["problems_budget"] = problems
    return out


def _attempt(records: list[dict], code: int):
    """The launches' logged losses as one attempt (the last record of a step wins)."""
    from soak import Attempt

    losses = {r["step"]: r["loss"] for r in records}
    return Attempt(fault=None, code=code, wall_s=0.0, steps=sorted(losses), losses=losses)
