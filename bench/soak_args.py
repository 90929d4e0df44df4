"""The command line of ``bench/soak.py``: its options and their checks."""

from __future__ import annotations

import argparse
import importlib.util
import random
from pathlib import Path

from soak_verdict import KINDS


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The soak's options."""
    p = argparse.ArgumentParser(description="Soak: a 2-rank run survives kill -9, SIGTERM, a corrupted "
                                "checkpoint and a full disk, bit-exactly.")
    p.add_argument("--minutes", type=float, default=10.0,
                   help="time budget: new rounds start while one more fits (the first always runs)")
    p.add_argument("--steps", type=int, default=32, help="train.steps of every run (default 32)")
    p.add_argument("--ckpt-every", type=int, default=4, help="ckpt.every (default 4)")
    p.add_argument("--nproc", type=int, default=2, help="ranks (default 2)")
    p.add_argument("--seed", type=int, default=None,
                   help="seed of the fault plan (default: random, printed; timings vary regardless)")
    p.add_argument("--data", type=Path, help="a prepared data directory (default: prepare a small one)")
    p.add_argument("--attempt-timeout", type=float, default=300.0,
                   help="seconds any one launch, export or wait may take before it counts as a hang")
    p.add_argument("--json", type=Path, help="also write the figures to this file")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="one more config override of every run (repeatable), e.g. run.seed=5")
    p.add_argument("--reference", type=Path, metavar="RUN_DIR",
                   help="a finished uninterrupted run of the same config (--steps, --ckpt-every, --set; "
                        "ckpt.keep_last aside) to compare with, instead of running one")
    p.add_argument("--s3-outage-s", type=float, default=150.0,
                   help="after the rounds, the S3 round (bench/soak_s3.py): checkpoints on a local S3 server "
                        "behind a fault proxy, throttled, with an outage of this many seconds, then an outage "
                        "past ckpt.max_outage_s (exit 203) and a rerun; 0 skips it (default 150)")
    p.add_argument("--keep", action="store_true", help="keep the work directory (logs, exports)")
    p.add_argument("--kinds", default=",".join(KINDS),
                   help=f"comma-separated fault kinds of every round (default {','.join(KINDS)})")
    args = p.parse_args(argv)
    if args.s3_outage_s > 0:
        # The S3 round runs a real S3 server (moto) in this process and talks to it as training does.
        missing = [m for m in ("moto", "s3torchconnector", "boto3") if importlib.util.find_spec(m) is None]
        if missing:
            p.error(f"--s3-outage-s: the S3 round needs {', '.join(missing)} (pip install -e '.[test]'), "
                    "or pass --s3-outage-s 0 to skip it")
    if args.seed is None:
        args.seed = random.randrange(1 << 31)
    chosen = set(filter(None, args.kinds.split(",")))
    unknown = chosen - set(KINDS)
    args.kinds = [k for k in KINDS if k in chosen]
    if unknown or not args.kinds:
        p.error(f"--kinds: choose from {', '.join(KINDS)} (got {', '.join(sorted(unknown)) or 'none'})")
    if args.kinds == ["corrupt"]:
        p.error("--kinds: corrupt needs another kind (a checkpoint is corrupted between launches)")
    # kill and term move the resume point at most 2 x ckpt.every - 1 steps each, and the last
    # one must land 2 x ckpt.every before the end; an enospc launch moves it at most ckpt.every.
    need = (2 * len([k for k in args.kinds if k in ("kill", "term")]) + 2 + ("enospc" in args.kinds)) * args.ckpt_every
    if args.steps < need:
        p.error(f"--steps must be at least {need} (2 x --ckpt-every per kill/term, + 1 for enospc, + 2) "
                "to fit a round's faults")
    return args
