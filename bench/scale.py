"""Per-rank costs against the world size and the corpus size, measured on real ranks, fitted and
extrapolated to 512 ranks x llama-3-70B x 1T tokens (issue 27):

    .venv/bin/python bench/scale.py [--worlds 2,4,8,16,32 | --quick] [--corpus 1e5,1e7,1e9]
                                    [--parts ckpt,s3,loader] [--no-s3]

Checkpoints (``bench/scale_ckpt.py``): at each world size, forked gloo ranks shard a model with
llama-3-70B's 723 tensors (80 layers, widths / 128) under podtrain's FSDP, then one
``Checkpointer.save`` and one ``restore``; counted from outside: bytes each rank receives in the
save's collectives, metadata each rank parses at resume (JSON + unpickled objects) and the
seconds it takes, shared metadata (the step directory's files that name no rank) and per-rank
metadata (a rank's files minus their tensor bytes). Once more with a model 4x larger per tensor
(same tensors): what grows with bytes. S3 (``bench/scale_s3.py``): requests per rank, by verb, at
a restart of the real ``podtrain train`` against moto through one counting proxy per rank.
Loader (``bench/order_scale.py``'s measurement): start time and resident memory of a fresh
process's loader per corpus size (sparse shards: no disk).

Each series gets its exponent against N (or corpus size): log-log least squares; ~0 is flat,
~1 linear. Rank 0 commits the checkpoint, so it may gather what it alone needs: it is shown
apart, and the exponents are over the other ranks (the worst of them). Extrapolation to 512
ranks and 70B: the larger of a power law (fitted exponent, from the largest N) and a line
``a + c N`` (a constant plus a per-rank part looks sub-linear on log-log over 2-32 ranks), times
(70B bytes / bench bytes)^b, b from the 4x model; parse time from the extrapolated bytes at the
parse rate measured at the largest N. Parse times are CPU seconds of the parsing thread; the
save and resume wall times at 16-32 ranks (32 processes on 2 shared cores) are noise: bytes and
requests are exact, wall times are not. PASS/FAIL per target of the issue's "Done when".
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH.parent / "src"))
sys.path.insert(0, str(BENCH.parent / "tests"))
sys.path.insert(0, str(BENCH))

import torch  # noqa: E402,F401 - imported once here, not in each forked rank
import torch.distributed.fsdp  # noqa: E402,F401
import transformers.models.llama.modeling_llama  # noqa: E402,F401

import scale_ckpt  # noqa: E402
from order_scale import measure as loader_start  # noqa: E402

TARGET_N, TARGET_TOKENS, TARGET_SEQ = 512, 10**12, 4096
FLAT = 0.1
MB = 1 << 20


def exponent(xs: list[float], ys: list[float]) -> float:
    """Slope of log(y) on log(x) (least squares; y floored at 1)."""
    if len(xs) < 2:
        return float("nan")
    return float(np.polyfit(np.log(xs), np.log(np.maximum(ys, 1.0 if max(ys) >= 1 else 1e-9)), 1)[0])


def extrapolate(n: list[int], values: list[float], b: float, bytes_ratio: float) -> float:
    """``values`` carried to TARGET_N ranks, then to 70B's bytes along exponent ``b``.

    A line ``a + c N`` (least squares): a cost that is a constant plus a per-rank part (a file
    every rank appends a record to) looks sub-linear over 2-32 ranks on log-log, and (N - 1) x a
    record (an all-gather) super-linear; the line carries both. Where the last two points rise
    faster than N^1.5, the power law through them instead, if larger."""
    line = float(np.polyval(np.polyfit(n, values, 1), TARGET_N)) if len(n) > 1 else values[-1]
    local = exponent(n[-2:], values[-2:])
    power = values[-1] * (TARGET_N / n[-1]) ** local if local > 1.5 else 0.0
    return max(line, power, 0.0) * bytes_ratio ** b


def verdict(ok: bool, what: str) -> str:
    return f"{'PASS' if ok else 'FAIL'}  {what}"


# -- checkpoints ---------------------------------------------------------------------------------
def ckpt_world(world: int, root: Path, scale: int = 1, probe_rows: int = 0) -> dict:
    """One save + restore at ``world`` ranks of the llama at ``scale`` (or of the checksum-block
    probe with ``probe_rows``); the figures of that world."""
    from multirank import run_ranks

    work = Path(tempfile.mkdtemp(prefix=f"w{world}s{scale}p{probe_rows}-", dir=root))
    config = work / "config.json"
    config.write_text(json.dumps(scale_ckpt.llama_config(scale)))
    t0 = time.perf_counter()
    ranks = run_ranks(scale_ckpt.ckpt_rank, world, str(work / "run"), str(config), probe_rows, timeout=3600)
    files = scale_ckpt.file_metadata(work / "run" / "ckpt" / "step_000001", world)
    shutil.rmtree(work, ignore_errors=True)
    rest = ranks[1:] or ranks

    def worst(phase, ranks_, field):
        return max(r[phase][field] for r in ranks_)

    parsed = [r["restore"]["json_bytes"] + r["restore"]["unpickled_bytes"] for r in ranks]
    return {
        "world": world, "wall_s": time.perf_counter() - t0, "tensors": ranks[0]["tensors"],
        "recv": worst("save", rest, "recv_bytes"), "recv0": ranks[0]["save"]["recv_bytes"],
        "save_parsed": worst("save", rest, "unpickled_bytes"),
        "parsed": max(parsed[1:] or parsed), "parsed0": parsed[0],
        "parse_s": worst("restore", rest, "parse_s"), "parse0_s": ranks[0]["restore"]["parse_s"],
        "restore_recv": worst("restore", rest, "recv_bytes"),
        "shared": sum(files["shared"].values()), "shared_files": files["shared"],
        "per_rank": max(files["per_rank"]), "save_s": max(r["save_s"] for r in ranks),
        "restore_s": max(r["restore_s"] for r in ranks),
        "resume_cpu_s": max(r["restore_cpu_s"] for r in rest), "resume0_cpu_s": ranks[0]["restore_cpu_s"]}


CKPT_COLUMNS = [("recv", "save recv/rank"), ("recv0", "rank 0 recv"), ("save_parsed", "save unpickled"),
                ("parsed", "resume parsed"), ("parsed0", "rank 0 parsed"), ("shared", "shared meta"),
                ("per_rank", "per-rank meta")]


PROBE_ROWS = (1024, 4096)
"""The checksum-block probe's two sizes: 4 MB and 16 MB per matrix (16 and 64 blocks of 256 KiB)."""


def block_probe(worlds: list[int], root: Path) -> dict:
    """Metadata bytes per checksum block, per metric, at two world sizes: the probe (4 matrices,
    pieces of many blocks) at 4x its bytes against itself. The llama at bench widths has pieces
    of one block at most, so whatever grows per block shows only here."""
    from podtrain.ckpt.plan import BLOCK_BYTES

    out = {"block": BLOCK_BYTES, "worlds": worlds, "per_block": {}, "small": {}, "large": {}}
    for w in worlds:
        small, large = (ckpt_world(w, root, probe_rows=r) for r in PROBE_ROWS)
        blocks = [scale_ckpt.probe_blocks(r, w, BLOCK_BYTES) for r in PROBE_ROWS]
        out["small"][w], out["large"][w] = small, large
        out["per_block"][w] = {k: max(0.0, (large[k] - small[k]) / (blocks[1] - blocks[0]))
                               for k, _ in CKPT_COLUMNS}
    return out


def per_block_at_target(probe: dict, key: str) -> float:
    """Bytes per checksum block of metric ``key`` at TARGET_N: ``alpha + beta / N`` through the
    probe's worlds (least squares). A rank sees a fraction of all blocks: all of them (alpha),
    all but its own ((N-1)/N: beta < 0), or its own share (1/N: alpha ~ 0), so per block the cost
    is bounded; a power law through 2 and 4 ranks would overshoot it at 512."""
    worlds = probe["worlds"]
    values = [probe["per_block"][w][key] for w in worlds]
    if len(worlds) < 2:
        return values[0]
    beta, alpha = np.polyfit([1 / w for w in worlds], values, 1)
    return max(0.0, float(alpha + beta / TARGET_N))


def marginal_cpu(rows: list[dict], parsed: str, cpu: str, target_bytes: float) -> float:
    """The resume's extra CPU seconds (main thread: parsing, indexing, everything but the tensor
    reads' threads) at ``target_bytes`` parsed beyond the largest N's: the marginal cost per
    parsed byte measured across N (least squares) times the extra bytes."""
    xs, ys = [r[parsed] for r in rows], [r[cpu] for r in rows]
    slope = max(0.0, float(np.polyfit(xs, ys, 1)[0])) if len(rows) > 1 and max(xs) > min(xs) else 0.0
    return slope * max(0.0, target_bytes - xs[-1])


def report_ckpt(rows: list[dict], big: dict, params: tuple[int, int], probe: dict) -> list[str]:
    """Print the checkpoint table, fits and extrapolations; return the verdict lines."""
    n = [r["world"] for r in rows]
    base = next(r for r in rows if r["world"] == big["world"])
    bench_params, big_params = params
    p70 = scale_ckpt.llama_params(scale_ckpt.LLAMA_70B)
    ratio = p70 / bench_params
    print(f"\ncheckpoint: FSDP, {rows[0]['tensors']} tensors (llama-3-70B's list, widths / {scale_ckpt.SHRINK}: "
          f"{bench_params / 1e6:.1f}M params + AdamW); bytes per rank (worst rank but rank 0, unless said)")
    print("parse s: CPU seconds parsing metadata at resume (JSON + unpickling); resume CPU s: the resume's main "
          "thread (parsing, indexing, applying); save s / resume s: wall, the slowest rank (noise past 8 ranks)")
    print(f"{'N':>4} | " + " | ".join(f"{label:>14}" for _, label in CKPT_COLUMNS) +
          f" | {'parse s':>8} {'rank 0 s':>8} | {'resume CPU s':>12} {'rank 0':>7} | {'save s':>7} {'resume s':>8}")
    for r in rows:
        print(f"{r['world']:>4} | " + " | ".join(f"{r[k]:>14,}" for k, _ in CKPT_COLUMNS) +
              f" | {r['parse_s']:>8.3f} {r['parse0_s']:>8.3f} | {r['resume_cpu_s']:>12.2f} {r['resume0_cpu_s']:>7.2f} | "
              f"{r['save_s']:>7.2f} {r['restore_s']:>8.2f}")
    print("shared files at N=%d: %s" % (rows[-1]["world"], ", ".join(
        f"{k} {v:,}" for k, v in rows[-1]["shared_files"].items())))
    keys = [k for k, _ in CKPT_COLUMNS] + ["parse_s", "parse0_s", "resume_cpu_s"]
    exps = {k: exponent(n, [r[k] for r in rows]) for k in keys}
    growth = {k: math.log(max(big[k], 1) / max(base[k], 1)) / math.log(big_params / bench_params) for k in keys}
    print(f"4x per tensor ({big_params / 1e6:.1f}M params) at N={big['world']}: shared {big['shared']:,} B "
          f"({big['shared'] / base['shared'] - 1:+.1%}), per-rank meta {big['per_rank']:,} "
          f"({big['per_rank'] / max(base['per_rank'], 1) - 1:+.1%}), resume parsed {big['parsed']:,} "
          f"({big['parsed'] / max(base['parsed'], 1) - 1:+.1%}), save recv {big['recv']:,} "
          f"({big['recv'] / max(base['recv'], 1) - 1:+.1%})")
    print("fitted exponent vs N (%s): " % ",".join(map(str, n)) +
          ", ".join(f"{label} {exps[k]:+.2f}" for k, label in CKPT_COLUMNS) +
          f", parse time {exps['parse_s']:+.2f} (rank 0 {exps['parse0_s']:+.2f}), resume CPU {exps['resume_cpu_s']:+.2f}")
    w0 = probe["worlds"][0]
    small, large = probe["small"][w0], probe["large"][w0]
    probe_growth = large["shared"] / small["shared"] - 1
    print(f"checksum-block probe ({scale_ckpt.PROBE_TENSORS} matrices of {PROBE_ROWS[0]} then {PROBE_ROWS[1]} x "
          f"{scale_ckpt.PROBE_COLS}, pieces of many {probe['block'] >> 10} KiB blocks) at N={w0}: shared "
          f"{small['shared']:,} -> {large['shared']:,} B ({probe_growth:+.1%}); bytes per block: " + "; ".join(
              f"N={w}: " + ", ".join(f"{label} {probe['per_block'][w][k]:.1f}" for k, label in CKPT_COLUMNS
                                     if probe["per_block"][w][k] > 0.05) for w in probe["worlds"]))
    blocks70 = scale_ckpt.llama_blocks(scale_ckpt.LLAMA_70B, TARGET_N, probe["block"])
    by_tensor = {k: extrapolate(n, [r[k] for r in rows], growth[k], ratio) for k in keys if not k.endswith("_s")}
    by_block = {k: per_block_at_target(probe, k) * blocks70 for k in by_tensor}
    at = {k: by_tensor[k] + by_block[k] for k in by_tensor}
    # A 70B-shaped model 4x larger per tensor, at TARGET_N: the tensor part along b, 4x the blocks.
    shared_4x = by_tensor["shared"] * 4 ** growth["shared"] + 4 * by_block["shared"]
    growth_70b = shared_4x / at["shared"] - 1
    rate = max(rows[-1]["parsed"] / max(rows[-1]["parse_s"], 1e-6), 1.0)
    rate0 = max(rows[-1]["parsed0"] / max(rows[-1]["parse0_s"], 1e-6), 1.0)
    cpu_s = rows[-1]["parse_s"] + marginal_cpu(rows, "parsed", "resume_cpu_s", at["parsed"])
    cpu0_s = rows[-1]["parse0_s"] + marginal_cpu(rows, "parsed0", "resume0_cpu_s", at["parsed0"])
    parse_s, parse0_s = max(at["parsed"] / rate, cpu_s), max(at["parsed0"] / rate0, cpu0_s)
    print(f"extrapolated to {TARGET_N} ranks x llama-3-70B ({p70 / 1e9:.1f}B params, x{ratio:,.0f} the bench's "
          f"bytes, {blocks70:,} checksum blocks): shared metadata {at['shared'] / MB:,.1f} MB, per-rank metadata {at['per_rank'] / MB:,.2f} MB, "
          f"received per rank per save {at['recv'] / MB:,.2f} MB (rank 0 {at['recv0'] / MB:,.2f} MB), parsed per "
          f"rank at resume {at['parsed'] / MB:,.1f} MB in ~{parse_s:,.2f} s (rank 0 {at['parsed0'] / MB:,.1f} MB "
          f"in ~{parse0_s:,.2f} s: the larger of the bytes at the parse rate measured at N={n[-1]} ({rate / MB:,.0f} / "
          f"{rate0 / MB:,.0f} MB/s of CPU) and the parse at N={n[-1]} plus the resume's CPU seconds per extra byte "
          f"parsed as measured across N ({cpu_s:,.2f} / {cpu0_s:,.2f} s: indexing included)")
    print(f"  (each: the part that follows the tensors, from the llama's fits, + the part per checksum block, from "
          f"the probe; shared metadata {by_tensor['shared'] / MB:,.1f} + {by_block['shared'] / MB:,.1f} MB; a 70B "
          f"model 4x larger per tensor: {shared_4x / MB:,.1f} MB, {growth_70b:+.0%})")
    return [
        verdict(exps["recv"] <= FLAT, f"per-rank bytes received per save flat in N (exponent {exps['recv']:+.2f} <= {FLAT})"),
        verdict(exps["parsed"] <= FLAT, f"per-rank metadata parsed at resume flat in N (exponent {exps['parsed']:+.2f} <= {FLAT})"),
        verdict(exps["per_rank"] <= FLAT, f"per-rank metadata flat in N (exponent {exps['per_rank']:+.2f} <= {FLAT})"),
        verdict(exps["shared"] <= FLAT, f"shared metadata flat in N (exponent {exps['shared']:+.2f} <= {FLAT})"),
        verdict(big["shared"] <= 1.1 * base["shared"] and growth_70b <= 0.1,
                f"shared metadata of a model 4x larger per tensor <= +10% (measured at bench widths "
                f"{big['shared'] / base['shared'] - 1:+.1%}, whose pieces are one checksum block or less; "
                f"at 70B/{TARGET_N} with the probe's bytes per block {growth_70b:+.1%})"),
        verdict(at["shared"] <= 16 * MB, f"extrapolated 70B/{TARGET_N}: shared metadata <= 16 MB ({at['shared'] / MB:,.1f} MB)"),
        verdict(max(parse_s, parse0_s) <= 1.0,
                f"extrapolated 70B/{TARGET_N}: per-rank metadata parse <= 1 s (~{max(parse_s, parse0_s):,.2f} s)"),
        verdict(max(at["recv"], at["recv0"]) <= MB, f"extrapolated 70B/{TARGET_N}: <= 1 MB received per rank per "
                f"save ({max(at['recv'], at['recv0']) / MB:,.2f} MB, rank 0 included)"),
    ]


# -- S3 ------------------------------------------------------------------------------------------
def report_s3(runs: dict[int, dict]) -> list[str]:
    """Print requests per rank at a restart and per save; return the verdict line."""
    from scale_s3 import per_rank_totals, save_requests

    n = sorted(runs)
    print("\nS3 requests per rank (podtrain train, FSDP, data and checkpoints on moto; one proxy per rank)")
    print(f"{'N':>4} | {'start: rank 0':>44} | {'start: busiest other rank':>28} | {'LIST all ranks':>14} | "
          f"{'per save: busiest rank':>44}")
    start_max, lists = [], []
    for w in n:
        start = runs[w]["start"]
        totals = per_rank_totals(start)
        others = start[1:] or start
        worst = max(others, key=lambda c: sum(c.values()))
        saves = save_requests(runs[w])
        wsave = max(saves, key=lambda c: sum(c.values()))
        fmt = lambda c: " ".join(f"{k}:{v}" for k, v in sorted(c.items()) if v)  # noqa: E731
        start_max.append(max(totals))
        lists.append(sum(c.get("LIST", 0) for c in start))
        print(f"{w:>4} | {fmt(start[0]):>44} | {fmt(worst):>28} | {lists[-1]:>14} | {fmt(wsave):>44}")
    e, el = exponent(n, start_max), exponent(n, lists)
    print(f"fitted exponent vs N: requests of the busiest rank at start {e:+.2f}; LISTs of all ranks together {el:+.2f}")
    return [verdict(e <= FLAT, f"S3 requests per rank at start flat in N (busiest rank: exponent {e:+.2f} <= {FLAT})"),
            verdict(el <= FLAT, f"S3 LISTs at start, all ranks together, flat in N (exponent {el:+.2f} <= {FLAT}; "
                    f"the issue's test: equal at 1 and 4 ranks)")]


# -- loader --------------------------------------------------------------------------------------
def report_loader(sizes: list[int], root: Path) -> list[str]:
    """Loader start per corpus size in a fresh process each; print, fit, return the verdicts."""
    from loader_scale import make_sparse_data_dir

    rows = []
    for s in sizes:
        data = make_sparse_data_dir(root / f"corpus{s}", s, 16)
        rows.append(loader_start(data, "feistel-1"))
        shutil.rmtree(data, ignore_errors=True)
    print("\nloader start (rank 0 of 8, a fresh process each, sparse shards): seconds and resident memory peak "
          "above the process's before, until its first batch's ids are known (ready) and its first batch is read")
    print(f"{'samples':>14} | {'ready s':>8} {'ready MB':>8} | {'start s':>8} {'start MB':>8}")
    for s, r in zip(sizes, rows):
        r["start_s"] = r["ready_s"] + r["batch_s"]
        print(f"{s:>14,} | {r['ready_s']:>8.3f} {r['ready_rss'] / MB:>8.1f} | {r['start_s']:>8.3f} "
              f"{r['start_rss'] / MB:>8.1f}")
    et = exponent(sizes, [r["start_s"] for r in rows])
    em = exponent(sizes, [max(r["start_rss"], 4096) for r in rows])
    target = TARGET_TOKENS // TARGET_SEQ
    print(f"fitted exponent vs corpus size: start time {et:+.2f}, memory {em:+.2f}; at 1T tokens / seq "
          f"{TARGET_SEQ} ({target:.2e} samples): ~{rows[-1]['start_s'] * (target / sizes[-1]) ** et:.3f} s, "
          f"~{max(rows[-1]['start_rss'], 4096) * (target / sizes[-1]) ** em / MB:.1f} MB")
    dm, dt = (rows[-1]["start_rss"] - rows[0]["start_rss"]) / MB, rows[-1]["start_s"] - rows[0]["start_s"]
    return [verdict(dm <= 32 and dt <= 2.0, f"loader at {sizes[-1]:.0e} samples within 32 MB and 2 s of "
                    f"{sizes[0]:.0e} ({dm:+.1f} MB, {dt:+.3f} s)")]


def run_s3(worlds: list[int]) -> list[str]:
    """The S3 part: one server, a run of ``podtrain train`` per world size."""
    import scale_s3

    work = scale_s3.workdir()
    bench = scale_s3.S3Bench(work)
    try:
        runs = {}
        for w in worlds:
            runs[w] = bench.run_world(w)
            print(f"  [S3 at {w} ranks done]", file=sys.stderr, flush=True)
    finally:
        bench.stop()
        shutil.rmtree(work, ignore_errors=True)
    return report_s3(runs)


def run_ckpt(worlds: list[int], root: Path) -> list[str]:
    """The checkpoint part: the llama at each world, its 4x variant and the block probe."""
    rows = []
    for w in worlds:
        rows.append(ckpt_world(w, root))
        print(f"  [checkpoint at {w} ranks: {rows[-1]['wall_s']:.0f} s]", file=sys.stderr, flush=True)
    big = ckpt_world(worlds[0], root, scale=2)
    probe = block_probe(worlds[:2], root)
    params = tuple(scale_ckpt.llama_params(scale_ckpt.llama_config(s)) for s in (1, 2))
    return report_ckpt(rows, big, params, probe)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--worlds", default="2,4,8,16,32", help="world sizes (gloo ranks, forked)")
    ap.add_argument("--quick", action="store_true", help="worlds 2,4,8")
    ap.add_argument("--corpus", default="1e5,1e7,1e9", help="corpus sizes in samples (sparse shards)")
    ap.add_argument("--parts", default="ckpt,s3,loader", help="which parts to run (ckpt, s3, loader)")
    ap.add_argument("--no-s3", action="store_true", help="skip the S3 part (moto)")
    args = ap.parse_args()
    worlds = [2, 4, 8] if args.quick else [int(w) for w in args.worlds.split(",")]
    sizes = [int(float(s)) for s in args.corpus.split(",")]
    parts = set(args.parts.split(",")) - ({"s3"} if args.no_s3 else set())
    unknown = parts - {"ckpt", "s3", "loader"}
    if unknown:
        sys.exit(f"--parts: unknown part(s) {', '.join(sorted(unknown))} (ckpt, s3, loader)")
    verdicts: list[str] = []
    root = Path(tempfile.mkdtemp(prefix="podtrain-scale-"))
    try:
        if "ckpt" in parts:
            verdicts += run_ckpt(worlds, root)
        if "s3" in parts:
            verdicts += run_s3(worlds)
        if "loader" in parts:
            verdicts += report_loader(sizes, root)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print("\n" + "\n".join(verdicts))


if __name__ == "__main__":
    main()
