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
S3 (the real client against a moto server on loopback, started here) with ``keep_last`` 1.

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


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="POSIX keep_last=1, four modes, one damage mode")
    ap.add_argument("--no-s3", action="store_true", help="skip the S3 scenario")
    ap.add_argument("--only-s3", action="store_true", help="only the S3 scenario")
    ap.add_argument("--only-local", action="store_true", help="only the POSIX scenario with a node-local tier")
    ap.add_argument("--modes", default="", help="comma-separated modes instead of every one (" +
                    ", ".join(("transient", "once", "denied", "nospace", "kill_before", "kill_after")) + ")")
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
    if not args.quick and not args.no_s3:
        from s3_server import start_with_env

        server, saved = start_with_env()
        bucket = server.new_bucket()
        scenarios.append((fs.Scenario("s3 keep_last=1", lambda root: f"s3://{bucket}/shared", keep_last=1, s3=True),
                          fs.S3Snapshots(server.boto)))
    if args.only_local:
        scenarios = [(fs.Scenario("posix + local tier", lambda root: str(root / "shared"), keep_last=1, local=True), None)]
    modes = tuple(args.modes.split(",")) if args.modes else QUICK_MODES if args.quick else fs.CALL_MODES
    unknown = set(modes) - set(fs.CALL_MODES)
    if unknown:
        ap.error(f"--modes: unknown {', '.join(sorted(unknown))}")
    failures, lines = 0, []
    t_all = time.perf_counter()
    try:
        for i, (scenario, s3) in enumerate(scenarios):
            t0 = time.perf_counter()
            space = fs.prepare_space(scenario, work / f"s{i}", s3)
            n, verdicts = fs.enumerate_calls(space, modes=modes, say=lambda m: print(m, flush=True))
            failures += summary(lines, f"{scenario.name}: {n} fault points x {len(modes)} modes", verdicts, t0)
            if s3 is None and (not args.quick or i == 0):
                t0 = time.perf_counter()
                damage_modes = ("flip",) if args.quick else fs.DAMAGE_MODES
                if scenario.keep_last >= 2 or args.quick:
                    space2 = space if scenario.keep_last >= 2 else fs.prepare_space(
                        fs.Scenario(scenario.name.replace("1", "2"), scenario.ckpt_dir, keep_last=2), work / f"d{i}")
                    files, verdicts = fs.enumerate_damage(space2, modes=damage_modes, say=lambda m: print(m, flush=True))
                    failures += summary(lines, f"{space2.scenario.name}: {files} damaged files x "
                                               f"{len(damage_modes)} modes", verdicts, t0)
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
