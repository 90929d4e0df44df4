"""Enumerate the checkpoint layer's fault space: every storage call of a job, failed in every mode.

    .venv/bin/python bench/faultspace.py            # everything (about an hour on 2 cores)
    .venv/bin/python bench/faultspace.py --quick    # a subset, under 10 minutes on 2 cores

The job (``tests/faultspace.py``): open the run (identity, lease), resume from the newest
checkpoint, train a step, save it (prepare, write, commit, publish, retain), close. For every
storage call ``i`` of that job and every mode (a transient fault past the retry budget, one that the
retry absorbs, access denied, no space, the process killed just before or just after the call) the
job runs in a fresh copy of the starting state with call ``i`` failed, then is resumed as a user
would, and the invariants I1-I5 are checked; then every file of the newest checkpoint is truncated
or has bytes changed, and the resume is checked again. Scenarios: POSIX with ``keep_last`` 1 and 2,
S3 (the real client against a moto server on loopback, started here) with ``keep_last`` 1, and:

- ``lease``: ``ckpt.lease_timeout_s=2``, the job held until its lease was renewed 4 times (the
  renewal thread's calls are fault points too) while a second job tries to open the run: it must be
  refused and change nothing (I3), and a failed renewal must neither stop the job nor count as a
  lost lease (I4);
- ``stop``: SIGTERM after a committed save; every call of the stop path (the current step's save,
  the writers' end, the lease's release) failed in every mode and ``hang`` (a storage that never
  answers): exit 143 within ``ckpt.grace_s`` (4 s), the previous checkpoint whole (I1, I2);
- ``peers``: 2 forked gloo ranks as 2 nodes, K=1 peer replica, node 1's local directory lost:
  every call of the restore on both ranks (rank 1's share read from node 0's replica and sent to
  it) failed in every mode, then each file of that replica truncated or changed: every resume
  restores exactly one save, bit for bit (I2).

``--quick`` runs POSIX ``keep_last=1`` in four modes, one damage mode, and a subset of each of the
three: the lease's renewal calls in the four modes, every call of the stop path in ``hang``, the
peer restore's reads of the replica refused and its files damaged (``flip``).

``--only-s3 --s3-keep-last 2`` runs the S3 scenario with ``keep_last=2`` (a save then deletes a
whole older checkpoint: its LIST and batched deletes are fault points too).

Ends with "N fault points x M modes: all invariants held" per scenario, or names every point that
broke one (and exits 1).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "tests"))

QUICK_MODES = ("transient", "denied", "kill_before", "kill_after")


def summary(lines: list[str], what: str, verdicts: list, t0: float) -> int:
    """Print and keep one scenario's verdict line; the number of points that broke an invariant."""
    broken = [v for v in verdicts if not v.held]
    line = (f"{what}: " + ("all invariants held" if not broken else f"{len(broken)} broke an invariant, first: "
                           f"{broken[0].point}: {broken[0].broken[0]}") + f" ({time.perf_counter() - t0:.0f} s)")
    print(line, flush=True)
    lines.append(line)
    return len(broken)


def run_kind(fs, kind: str, work: Path, quick: bool, modes_arg: str, lines: list[str]) -> int:
    """One of the lease, stop-path and peer-restore scenarios (``tests/faultspace.py``'s kinds),
    whole or (``quick``) its subset; the number of points that broke an invariant."""
    t0 = time.perf_counter()
    scenario = fs.Scenario(f"posix {kind}", lambda root: str(root / "shared"), keep_last=1, kind=kind)
    space = fs.prepare_space(scenario, work / kind)
    job = fs.count_calls(space)
    points = fs.fault_points(space, job)
    full = fs.STOP_MODES if kind == "stop" else fs.CALL_MODES
    modes = tuple(modes_arg.split(",")) if modes_arg else full
    if quick and not modes_arg:
        if kind == "lease":  # the renewal thread's calls
            points, modes = [p for p in points if p[0] == "lease"], QUICK_MODES
        elif kind == "stop":  # every call of the stop path, the storage never answering
            modes = (fs.HANG,)
        else:  # the restore's reads of node 0's replica of rank 1
            points = [p for p in points if "replica_of_rank" in job["calls"][p[1] - 1]]
            modes = ("denied",)
    modes = tuple(m for m in modes if m in full)
    say = lambda m: print(m, flush=True)  # noqa: E731
    what = {"lease": "calls of the job and its lease renewals", "stop": "calls of the stop path after SIGTERM",
            "peers": "calls of the restore from a peer (both ranks)"}[kind]
    n, verdicts = fs.enumerate_calls(space, modes=modes, points=points, say=say, counted=job)
    broken = summary(lines, f"{scenario.name} ({what}): {len(points)} fault points x {len(modes)} modes", verdicts, t0)
    if kind == "peers":
        t0 = time.perf_counter()
        damage = ("flip",) if quick else fs.DAMAGE_MODES
        files, verdicts = fs.enumerate_replica_damage(space, modes=damage, say=say)
        broken += summary(lines, f"{scenario.name}: {files} damaged replica files x {len(damage)} modes", verdicts, t0)
    return broken


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="POSIX keep_last=1, four modes, one damage mode; "
                    "a subset of the lease, stop-path and peer-restore scenarios")
    ap.add_argument("--no-s3", action="store_true", help="skip the S3 scenario")
    ap.add_argument("--only-s3", action="store_true", help="only the S3 scenario")
    ap.add_argument("--s3-keep-last", type=int, default=1, help="ckpt.keep_last of the S3 scenario (default 1; "
                    "2: retention deletes a whole older checkpoint on S3 at each save)")
    ap.add_argument("--only-local", action="store_true", help="only the POSIX scenario with a node-local tier")
    ap.add_argument("--only", default="", help="comma-separated among lease, stop, peers: only these of the "
                    "lease, stop-path and peer-restore scenarios (and none of the others)")
    ap.add_argument("--no-new", action="store_true", help="skip the lease, stop-path and peer-restore scenarios")
    ap.add_argument("--modes", default="", help="comma-separated modes instead of every one (" +
                    ", ".join(("transient", "once", "denied", "nospace", "kill_before", "kill_after")) +
                    "; hang: the stop path's only)")
    args = ap.parse_args()
    import faultspace as fs

    work = Path(tempfile.mkdtemp(prefix="podtrain-faultspace-"))
    scenarios = [] if args.only_s3 else [(fs.Scenario("posix keep_last=1", lambda root: str(root / "shared"),
                                                      keep_last=1), None)]
    if not args.quick and not args.only_s3:
        scenarios.append((fs.Scenario("posix keep_last=2", lambda root: str(root / "shared"), keep_last=2), None))
        scenarios.append((fs.Scenario("posix + local tier", lambda root: str(root / "shared"), keep_last=1,
                                      local=True), None))
    server = saved = None
    if not args.quick and not args.no_s3 and not args.only:
        from s3_server import start_with_env

        server, saved = start_with_env()
        bucket = server.new_bucket()
        kept = args.s3_keep_last
        scenarios.append((fs.Scenario(f"s3 keep_last={kept}", lambda root: f"s3://{bucket}/shared", keep_last=kept,
                                      s3=True), fs.S3Snapshots(server.boto)))
    if args.only_local:
        scenarios = [(fs.Scenario("posix + local tier", lambda root: str(root / "shared"), keep_last=1, local=True), None)]
    kinds = [k for k in args.only.split(",") if k] if args.only else [] if args.no_new or args.only_s3 or \
        args.only_local else ["lease", "stop", "peers"]
    if set(kinds) - {"lease", "stop", "peers"}:
        ap.error(f"--only: unknown {', '.join(sorted(set(kinds) - {'lease', 'stop', 'peers'}))}")
    if args.only:
        scenarios = []
    modes = tuple(args.modes.split(",")) if args.modes else QUICK_MODES if args.quick else fs.CALL_MODES
    unknown = set(modes) - set(fs.STOP_MODES)
    if unknown:
        ap.error(f"--modes: unknown {', '.join(sorted(unknown))}")
    failures, lines = 0, []
    t_all = time.perf_counter()
    try:
        for i, (scenario, s3) in enumerate(scenarios):
            t0 = time.perf_counter()
            space = fs.prepare_space(scenario, work / f"s{i}", s3)
            call_modes = tuple(m for m in modes if m != fs.HANG)  # a storage that never answers: the stop path's
            n, verdicts = fs.enumerate_calls(space, modes=call_modes, say=lambda m: print(m, flush=True))
            failures += summary(lines, f"{scenario.name}: {n} fault points x {len(call_modes)} modes", verdicts, t0)
            if s3 is None and (not args.quick or i == 0):
                t0 = time.perf_counter()
                damage_modes = ("flip",) if args.quick else fs.DAMAGE_MODES
                if scenario.keep_last >= 2 or args.quick:
                    space2 = space if scenario.keep_last >= 2 else fs.prepare_space(
                        fs.Scenario(scenario.name.replace("1", "2"), scenario.ckpt_dir, keep_last=2), work / f"d{i}")
                    files, verdicts = fs.enumerate_damage(space2, modes=damage_modes, say=lambda m: print(m, flush=True))
                    failures += summary(lines, f"{space2.scenario.name}: {files} damaged files x "
                                               f"{len(damage_modes)} modes", verdicts, t0)
        for kind in kinds:
            failures += run_kind(fs, kind, work, args.quick, args.modes, lines)
    finally:
        if server is not None:
            from s3_server import restore_env

            restore_env(saved)
            server.stop()
    print(f"\nfault space ({time.perf_counter() - t_all:.0f} s in all):")
    for line in lines:
        print("  " + line)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
