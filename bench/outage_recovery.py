"""After a storage outage the newest state wins (issue 34, defect 7), measured in the issue's full form.

Each run: two real ranks (forked, gloo) train with checkpoints on a real S3 server (moto) behind the
tests' fault proxy; an outage (503 SlowDown on every request) begins while a save is in flight and
lasts ``--outage-s`` seconds (150 by default); once a save of a step after the outage's end has
committed, SIGTERM reaches both ranks ``--after-steps`` steps later. The scenario is
tests/outage_recovery.py (the suite's test_stop_deadline.py runs it with a 4 s outage).

    python bench/outage_recovery.py                       # 5 runs of a 150 s outage
    python bench/outage_recovery.py --runs 1 --outage-s 30

Prints per run: steps trained during the outage, the step logged at its end, the step of the first
checkpoint committed after it and the steps (and seconds) from the end until that commit was seen,
each rank's exit code, the step stopped at and the newest committed step (the step saved at SIGTERM
when they are equal), seconds from SIGTERM to the ranks' end; then whether every run met the bar:
the first save committed after the outage is of a step within ``ckpt.every`` of its end (the
newest state, not a stale one), exit 143 on every rank, the SIGTERM step saved. Exit status 0 when
every run did, 1 otherwise.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))

from outage_recovery import run_once  # noqa: E402
from s3_fault_proxy import S3FaultProxy  # noqa: E402
from s3_server import restore_env, start_with_env  # noqa: E402
from synthetic_data import make_data_dir  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--outage-s", type=float, default=150.0)
    parser.add_argument("--every", type=int, default=3, help="ckpt.every")
    parser.add_argument("--after-steps", type=int, default=3, help="steps after the first committed save to SIGTERM")
    parser.add_argument("--grace-s", type=float, default=120.0, help="ckpt.grace_s")
    parser.add_argument("--deadline-s", type=float, default=180.0, help="longest wait of each phase")
    args = parser.parse_args(argv)

    from podtrain.model import preset_config

    preset_config("tiny", 320)  # transformers' model code imported once, before the ranks fork
    work = Path(tempfile.mkdtemp(prefix="outage_recovery_"))
    server, saved_env = start_with_env()
    proxy = S3FaultProxy(server.endpoint, lifetime_s=args.runs * (args.outage_s + 4 * args.deadline_s) + 600)
    os.environ["AWS_ENDPOINT_URL"] = proxy.endpoint  # the forked ranks inherit it
    data = make_data_dir(work / "data", shard_tokens=(6000,), val_tokens=300)
    print(f"outage {args.outage_s:g} s, ckpt.every={args.every}, SIGTERM {args.after_steps} steps after the "
          f"first committed save, ckpt.grace_s={args.grace_s:g}, 2 ranks (gloo, CPU)", flush=True)
    print(f"{'run':>3} {'outage steps':>12} {'end step':>8} {'saved':>5} {'steps to save':>13} {'s to save':>9} {'exit codes':>10} "
          f"{'stopped at':>10} {'saved step':>10} {'stop s':>6}  verdict", flush=True)
    good = 0
    try:
        for i in range(1, args.runs + 1):
            proxy.reset()
            t0 = time.monotonic()
            try:
                out = run_once(REPO, data, work / f"run{i}", server, server.new_bucket(), proxy, args.outage_s,
                               args.every, args.after_steps, args.grace_s, args.deadline_s)
            except AssertionError as exc:  # a rank failed or hung: run_ranks says which
                print(f"{i:>3} failed after {time.monotonic() - t0:.0f} s: {str(exc)[-2000:]}", flush=True)
                continue
            codes = [code for _, code in out.results]
            stopped = sorted({step for step, _ in out.results})
            ok = (out.problem is None and out.newest_state_won(args.every) and codes == [143, 143]
                  and len(stopped) == 1 and out.newest == stopped[0])
            good += ok
            commit_s = f"{out.commit_s:.1f}" if out.commit_s is not None else "-"
            stop_s = f"{out.stop_s:.1f}" if out.stop_s is not None else "-"
            print(f"{i:>3} {out.outage_steps:>12} {out.end_step:>8} {str(out.first_commit):>5} "
                  f"{str(out.steps_to_commit):>13} {commit_s:>9} "
                  f"{','.join(map(str, codes)):>10} {','.join(map(str, stopped)):>10} {str(out.newest):>10} "
                  f"{stop_s:>6}  {'ok' if ok else 'FAILED'}{'' if out.problem is None else ': ' + out.problem}",
                  flush=True)
    finally:
        proxy.stop()
        server.stop()
        restore_env(saved_env)
        shutil.rmtree(work, ignore_errors=True)
    print(f"{good} of {args.runs} run(s): the first save committed after the outage of a step within "
          f"ckpt.every={args.every} of its end, exit 143 on every rank, the SIGTERM step saved", flush=True)
    return 0 if good == args.runs else 1


if __name__ == "__main__":
    sys.exit(main())
