"""Per-rank costs against the world size and the corpus size, measured on real ranks, fitted and
extrapolated to 512 ranks x llama-3-70B x 1T tokens (issue 27):

    .venv/bin/python bench/scale.py [--worlds 2,4,8,16,32 | --quick] [--corpus 1e5,1e7,1e9]
                                    [--parts ckpt,s3,loader] [--no-s3] [--kept K]

Every series it computes is printed and judged: fitted as ``a + c N^k`` (issue 37: a constant
plus a small per-rank part passes a log-log exponent test over 2-32 ranks while growing 6x by
512), carried to 512 ranks and compared with a stated target, PASS or FAIL each; the closing
table lists them all. Besides the save and resume at N ranks: the same checkpoint restored at
another world size (N/2; 4 from 2), HSDP (groups of 2) saving to and restoring from the
node-local tier, S3 runs keeping enough checkpoints that their listing passes 1,000 keys at the
largest N (``--kept``), and corpora whose shard count grows with them (4 to 20,000 shards),
their loader started as rank 0 of 2 and of 8 ranks with its shard files' stats and opens counted.
It measures the code as it is: a series that grows FAILs until the code stops growing.

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
import os
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
from order_scale import GLOBAL as LOADER_BATCH, measure as loader_start  # noqa: E402

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


def fit_curve(xs: list[float], ys: list[float]) -> tuple[float, float, float]:
    """``(a, c, k)`` of ``a + c x^k`` (a, c >= 0; k on a grid over [0, 1.5]), least squares. A
    constant plus a small growing part (a + cN) passes a log-log exponent test over 2-32 ranks
    while growing 6x by 512; this fit carries it. Of fits within 1% of the best error, the one
    whose k is nearest 1 (two points fit every k exactly: then the line, a per-rank record, is
    the reading; N^2 through two nearly equal values would turn a few bytes of noise into MBs)."""
    x, y = np.asarray(xs, float), np.asarray(ys, float)
    fits = []
    for k in np.linspace(0.0, 1.5, 31):
        basis = x ** k
        if len(x) > 1 and np.ptp(basis) > 0:
            c, a = np.polyfit(basis, y, 1)
        else:
            c, a = 0.0, float(y.mean())
        if c < 0:
            a, c = float(y.mean()), 0.0
        elif a < 0:
            a, c = 0.0, float(basis @ y / (basis @ basis))
        fits.append((float(((a + c * basis - y) ** 2).sum()), float(a), float(c), float(k)))
    best = min(f[0] for f in fits)
    close = [f for f in fits if f[0] <= best * 1.01 + 1e-12 * max(1.0, float((y ** 2).sum()))]
    _, a, c, k = min(close, key=lambda f: abs(f[3] - 1.0))
    return a, c, k


SERIES: list[dict] = []
"""Every series the bench computed: its values, fit, value at TARGET_N and target (``series``)."""


def _fmt(value: float, unit: str) -> str:
    if unit == "B":
        return f"{value / MB:,.3f} MB" if value >= 1024 else f"{value:,.0f} B"
    return f"{value:,.3f} {unit}" if unit else f"{value:,.1f}"


def series(name: str, n: list[float], values: list[float], target: float, unit: str = "B",
           scale: float = 1.0, add: float = 0.0, at: float | None = None, where: str = "") -> str:
    """Judge one series: fit ``a + c N^k`` over ``n``, carry it to TARGET_N (or take ``at``, a value
    at TARGET_N computed otherwise, when larger), times ``scale`` plus ``add`` (the model's bytes,
    checksum blocks), against ``target``; record it for the closing table, return the verdict."""
    a, c, k = fit_curve(n, values)
    local = exponent(n[-2:], values[-2:])  # faster than N^1.5 at the end: the power law through the last two
    power = values[-1] * (TARGET_N / n[-1]) ** local if local > 1.5 else 0.0
    fitted = max(a + c * TARGET_N ** k, power) * scale + add
    value = max(fitted, at if at is not None else 0.0)
    exp = exponent(n, values)
    SERIES.append({"name": name, "n": n, "values": values, "unit": unit, "exp": exp, "at": value, "target": target,
                   "ok": value <= target, "where": where, "fit": f"{a:.3g} + {c:.3g} N^{k:.2f}"})
    return verdict(value <= target, f"{name}: at {TARGET_N} ranks{where} {_fmt(value, unit)} <= "
                   f"{_fmt(target, unit)} (fit {a:.3g} + {c:.3g} N^{k:.2f}; log-log exponent {exp:+.2f})")


def report_series() -> None:
    """The closing table: every series measured, its values, fit and value at TARGET_N, target."""
    print(f"\nevery series: values per N (or shard count), fit a + c N^k, log-log exponent, value at {TARGET_N} "
          "ranks (the 70B/1T scenario where said) against its target")
    for s in SERIES:
        vals = ", ".join(f"{x}: {_fmt(v, s['unit'])}" for x, v in zip(s["n"], s["values"]))
        print(f"  {'PASS' if s['ok'] else 'FAIL'} {s['name']}{s['where']}: [{vals}] -> fit {s['fit']}, "
              f"exponent {s['exp']:+.2f}; at {TARGET_N}: {_fmt(s['at'], s['unit'])} "
              f"(target <= {_fmt(s['target'], s['unit'])})")


# -- checkpoints ---------------------------------------------------------------------------------
def reshard_world(world: int) -> int:
    """The world size a checkpoint saved at ``world`` ranks is restored at: half (a job restarted
    on fewer nodes), or 4 from 2."""
    return world // 2 if world >= 4 else 4


def ckpt_world(world: int, root: Path, scale: int = 1, probe_rows: int = 0, strategy: str = "fsdp",
               local: bool = False, reshard: bool = False) -> dict:
    """One save + restore at ``world`` ranks of the llama at ``scale`` (or of the checksum-block
    probe with ``probe_rows``) under ``strategy`` (fsdp; hsdp: groups of 2), to the node-local
    tier with ``local``; with ``reshard`` also a restore of that checkpoint at
    ``reshard_world(world)`` ranks; the figures of that world."""
    from multirank import run_ranks

    work = Path(tempfile.mkdtemp(prefix=f"w{world}s{scale}p{probe_rows}{strategy}{int(local)}-", dir=root))
    config = work / "config.json"
    config.write_text(json.dumps(scale_ckpt.llama_config(scale)))
    t0 = time.perf_counter()
    local_dir = str(work / "local") if local else ""
    ranks = run_ranks(scale_ckpt.ckpt_rank, world, str(work / "run"), str(config), probe_rows, "save,restore",
                      strategy, local_dir, timeout=3600)
    step_dir = work / "run" / "ckpt" / "step_000001"
    files = scale_ckpt.file_metadata(step_dir, world) if step_dir.is_dir() else {"shared": {}, "per_rank": [0]}
    again = (run_ranks(scale_ckpt.ckpt_rank, reshard_world(world), str(work / "run"), str(config), probe_rows,
                       "restore", strategy, "", timeout=3600) if reshard else None)
    shutil.rmtree(work, ignore_errors=True)
    rest = ranks[1:] or ranks

    def worst(phase, ranks_, field):
        return max(r[phase][field] for r in ranks_)

    parsed = [r["restore"]["json_bytes"] + r["restore"]["unpickled_bytes"] for r in ranks]
    extra = {}
    if again is not None:
        parsed_again = [r["restore"]["json_bytes"] + r["restore"]["unpickled_bytes"] for r in again]
        extra = {"reshard_world": len(again), "reshard_parsed": max(parsed_again[1:] or parsed_again),
                 "reshard_parsed0": parsed_again[0], "reshard_recv": worst("restore", again[1:] or again, "recv_bytes"),
                 "reshard_recv0": again[0]["restore"]["recv_bytes"],
                 "reshard_cpu_s": max(r["restore_cpu_s"] for r in again)}
    return {**extra,
        "world": world, "wall_s": time.perf_counter() - t0, "tensors": ranks[0]["tensors"],
        "recv": worst("save", rest, "recv_bytes"), "recv0": ranks[0]["save"]["recv_bytes"],
        "save_parsed": worst("save", rest, "unpickled_bytes"),
        "parsed": max(parsed[1:] or parsed), "parsed0": parsed[0],
        "parse_s": worst("restore", rest, "parse_s"), "parse0_s": ranks[0]["restore"]["parse_s"],
        "restore_recv": worst("restore", rest, "recv_bytes"),
        "shared": sum(files["shared"].values()), "shared_files": files["shared"],
        "per_rank": max(files["per_rank"]), "save_s": max(r["save_s"] for r in ranks),
        "restore_s": max(r["restore_s"] for r in ranks), "save_cpu_s": max(r["save_cpu_s"] for r in ranks),
        "restore_recv0": ranks[0]["restore"]["recv_bytes"],
        "resume_cpu_s": max(r["restore_cpu_s"] for r in rest), "resume0_cpu_s": ranks[0]["restore_cpu_s"]}


CKPT_COLUMNS = [("recv", "save recv/rank"), ("recv0", "rank 0 recv"), ("save_parsed", "save unpickled"),
                ("parsed", "resume parsed"), ("parsed0", "rank 0 parsed"), ("shared", "shared meta"),
                ("per_rank", "per-rank meta"), ("restore_recv", "restore recv"), ("restore_recv0", "rank 0 rst recv")]
CKPT_TARGETS = {"recv": MB, "recv0": MB, "save_parsed": MB, "parsed": 16 * MB, "parsed0": 16 * MB, "shared": 16 * MB,
                "per_rank": 4 * MB, "restore_recv": MB, "restore_recv0": MB}
"""Each bytes series' target at TARGET_N ranks x llama-3-70B (issue 27's: 1 MB received per rank per
save, shared metadata <= 16 MB; parsed at resume: the shared metadata's bound; a rank's own
metadata: its pieces' block CRCs follow its ~1.6 GB of state, 4 MB is 0.25% of it)."""
CPU_TARGET_S = 5.0
"""A save's or a resume's main-thread CPU seconds at TARGET_N x 70B, beyond the tensor bytes."""


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
    keys = [k for k, _ in CKPT_COLUMNS] + ["parse_s", "parse0_s", "resume_cpu_s", "resume0_cpu_s", "save_cpu_s"]
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
    where = " x llama-3-70B"
    out = [series(f"checkpoint {label}", n, [r[k] for r in rows], CKPT_TARGETS[k], "B", scale=ratio ** growth[k],
                  add=by_block[k], at=at[k], where=where) for k, label in CKPT_COLUMNS]
    out.append(verdict(big["shared"] <= 1.1 * base["shared"] and growth_70b <= 0.1,
                       f"shared metadata of a model 4x larger per tensor <= +10% (measured at bench widths "
                       f"{big['shared'] / base['shared'] - 1:+.1%}, whose pieces are one checksum block or less; "
                       f"at 70B/{TARGET_N} with the probe's bytes per block {growth_70b:+.1%})"))
    out.append(series("resume parse CPU s (worst rank but 0)", n, [r["parse_s"] for r in rows], 1.0, "s",
                      at=parse_s, where=where))
    out.append(series("resume parse CPU s, rank 0", n, [r["parse0_s"] for r in rows], 1.0, "s", at=parse0_s, where=where))
    for k, label in (("resume_cpu_s", "resume main-thread CPU s"), ("resume0_cpu_s", "resume main-thread CPU s, rank 0"),
                     ("save_cpu_s", "save main-thread CPU s (slowest rank)")):
        out.append(series(label, n, [r[k] for r in rows], CPU_TARGET_S, "s", scale=ratio ** max(growth[k], 0.0),
                          where=where))
    cores = max(1, os.cpu_count() or 1)
    for k, label in (("save_s", "save wall s"), ("restore_s", "resume wall s")):
        # N processes on `cores` cores: the wall time of one rank's work is about wall x cores / N
        out.append(series(f"{label} x min(N, {cores} cores) / N (slowest rank)", n,
                          [r[k] * min(r["world"], cores) / r["world"] for r in rows], 2 * CPU_TARGET_S, "s",
                          where=" (bench model)"))
    return out


def report_more(rows: list[dict], hsdp: list[dict]) -> list[str]:
    """Restore at another world size, and HSDP to the node-local tier: print and judge each
    series (at the bench model's widths, times 70B's bytes where a series follows them)."""
    n = [r["world"] for r in rows]
    print("\nrestore at another world size: the checkpoint saved at N ranks restored at N' ranks (FSDP); "
          "bytes per rank (worst rank but rank 0, unless said)")
    print(f"{'N':>4} {'N_':>4} | {'parsed':>12} {'rank 0':>12} | {'recv':>12} {'rank 0':>12} | {'CPU s':>7}")
    for r in rows:
        print(f"{r['world']:>4} {r['reshard_world']:>4} | {r['reshard_parsed']:>12,} {r['reshard_parsed0']:>12,} | "
              f"{r['reshard_recv']:>12,} {r['reshard_recv0']:>12,} | {r['reshard_cpu_s']:>7.2f}")
    out = [series("resharded restore parsed/rank", n, [r["reshard_parsed"] for r in rows], 16 * MB, where=" (bench model)"),
           series("resharded restore rank 0 parsed", n, [r["reshard_parsed0"] for r in rows], 16 * MB, where=" (bench model)"),
           series("resharded restore recv/rank", n, [r["reshard_recv"] for r in rows], MB, where=" (bench model)"),
           series("resharded restore rank 0 recv", n, [r["reshard_recv0"] for r in rows], MB, where=" (bench model)"),
           series("resharded restore main-thread CPU s", n, [r["reshard_cpu_s"] for r in rows], CPU_TARGET_S, "s",
                  where=" (bench model)")]
    nh = [r["world"] for r in hsdp]
    print("\nHSDP (shard groups of 2) saving to and restoring from the node-local tier (ckpt.local_dir)")
    print(f"{'N':>4} | {'save recv':>12} {'rank 0':>12} | {'parsed':>12} {'rank 0':>12} | {'restore recv':>12} | "
          f"{'save CPU s':>10} {'resume CPU s':>12}")
    for r in hsdp:
        print(f"{r['world']:>4} | {r['recv']:>12,} {r['recv0']:>12,} | {r['parsed']:>12,} {r['parsed0']:>12,} | "
              f"{r['restore_recv']:>12,} | {r['save_cpu_s']:>10.2f} {r['resume_cpu_s']:>12.2f}")
    for k, label, target in (("recv", "save recv/rank", MB), ("recv0", "save rank 0 recv", MB),
                             ("parsed", "resume parsed/rank", 16 * MB), ("parsed0", "resume rank 0 parsed", 16 * MB),
                             ("restore_recv", "restore recv/rank", MB), ("restore_recv0", "restore rank 0 recv", MB)):
        out.append(series(f"hsdp+local {label}", nh, [r[k] for r in hsdp], target, where=" (bench model)"))
    for k, label in (("save_cpu_s", "save main-thread CPU s"), ("resume_cpu_s", "resume main-thread CPU s")):
        out.append(series(f"hsdp+local {label}", nh, [r[k] for r in hsdp], CPU_TARGET_S, "s", where=" (bench model)"))
    return out


# -- S3 ------------------------------------------------------------------------------------------
def report_s3(runs: dict[int, dict], kept: int) -> list[str]:
    """Print requests per rank at a restart and per save; judge each series at TARGET_N."""
    from scale_s3 import per_rank_totals, save_requests

    n = sorted(runs)
    print(f"\nS3 requests per rank (podtrain train, FSDP, data and checkpoints on moto; one proxy per rank; "
          f"{kept} checkpoints kept)")
    print(f"{'N':>4} {'keys':>6} | {'start: rank 0':>44} | {'start: busiest other rank':>28} | {'LIST all':>8} | "
          f"{'per save: rank 0':>40} | {'per save: busiest other':>30}")
    fmt = lambda c: " ".join(f"{k}:{v}" for k, v in sorted(c.items()) if v)  # noqa: E731
    cols: dict[str, list[float]] = {k: [] for k in ("start0", "start", "lists", "save0", "save", "list0", "keys")}
    for w in n:
        start = runs[w]["start"]
        others = start[1:] or start
        worst = max(others, key=lambda c: sum(c.values()))
        saves = save_requests(runs[w])
        wsave = max(saves[1:] or saves, key=lambda c: sum(c.values()))
        cols["start0"].append(per_rank_totals(start)[0])
        cols["start"].append(max(per_rank_totals(others)))
        cols["lists"].append(sum(c.get("LIST", 0) for c in start))
        cols["list0"].append(start[0].get("LIST", 0) + saves[0].get("LIST", 0))
        cols["save0"].append(sum(saves[0].values()))
        cols["save"].append(sum(wsave.values()))
        cols["keys"].append(runs[w]["keys"][0][0])
        print(f"{w:>4} {cols['keys'][-1]:>6} | {fmt(start[0]):>44} | {fmt(worst):>28} | {cols['lists'][-1]:>8} | "
              f"{fmt(saves[0]):>40} | {fmt(wsave):>30}")
    where = f" ({kept} checkpoints kept)"
    out = [series("S3 requests at start, rank 0", n, cols["start0"], 64, "", where=where),
           series("S3 requests at start, busiest other rank", n, cols["start"], 32, "", where=where),
           series("S3 LISTs at start, all ranks together", n, cols["lists"], 8, "", where=where),
           series("S3 LISTs of rank 0 at start + one save", n, cols["list0"], 8, "", where=where),
           series("S3 requests per save, rank 0", n, cols["save0"], 64, "", where=where),
           series("S3 requests per save, busiest other rank", n, cols["save"], 16, "", where=where)]
    paged = [w for w, k in zip(n, cols["keys"]) if k > 1000]
    out.append(verdict(bool(paged), f"S3 listings paged: more than 1,000 keys under the checkpoints' prefix at "
                       f"N = {', '.join(map(str, paged)) or 'none'} (keys: {', '.join(f'{k:,.0f}' for k in cols['keys'])})"))
    return out


# -- loader --------------------------------------------------------------------------------------
SHARD_SAMPLES = 50_000
"""Samples per shard of the bench's corpora: their shard count grows with them (4 .. 20,000)."""
TARGET_SHARDS = 20_000
"""The 512-rank scenario's corpus: 20,000 shards (issue 37: 512 ranks x 20,000 shards)."""
LOADER_WORLDS = (2, 8)
"""The loader is rank 0 of each of these world sizes: what grows with the shards a rank does not read."""


def shards_for(samples: int) -> int:
    """The shard count of a bench corpus of ``samples`` samples."""
    return min(TARGET_SHARDS, max(4, samples // SHARD_SAMPLES))


def fit_loader(rows: list[dict], key: str) -> tuple[np.ndarray, float]:
    """``value = a + b S + c S / W + d B / W`` (S shards, W ranks, B the global batch: B / W the
    samples a rank reads per step, each maybe in another shard; a, b, c, d >= 0), least squares
    over the rows: a rank's own share (S / W) and reads (B / W) against what every rank pays per
    shard (S). Its coefficients and its value at TARGET_SHARDS x TARGET_N."""
    x = np.array([[1.0, r["shards"], r["shards"] / r["world"], LOADER_BATCH / r["world"]] for r in rows])
    y = np.array([float(r[key]) for r in rows])
    keep = [0, 1, 2, 3]
    while True:
        coef = np.zeros(4)
        coef[keep] = np.linalg.lstsq(x[:, keep], y, rcond=None)[0]
        neg = [i for i in keep if coef[i] < 0]
        if not neg:
            break
        keep.remove(min(neg, key=lambda i: coef[i]))
    return coef, float(coef @ [1.0, TARGET_SHARDS, TARGET_SHARDS / TARGET_N, LOADER_BATCH / TARGET_N])


def report_loader(sizes: list[int], root: Path) -> list[str]:
    """Loader start per corpus size (its shard count growing with it) as rank 0 of 2 and of 8 ranks,
    in a fresh process each; print, fit, return the verdicts."""
    from loader_scale import make_sparse_data_dir

    rows = []
    for s in sizes:
        shards = shards_for(s)
        data = make_sparse_data_dir(root / f"corpus{s}", s, 16, shards=shards)
        for w in LOADER_WORLDS:
            r = loader_start(data, "feistel-1", w)
            r.update(samples=s, shards=shards, world=w, start_s=r["ready_s"] + r["batch_s"])
            rows.append(r)
        shutil.rmtree(data, ignore_errors=True)
    print("\nloader start (rank 0 of W, a fresh process each, sparse shards): seconds and resident memory peak "
          "above the process's before, until its first batch's ids are known (ready) and its first batch is read; "
          "shard ops: stat + open calls on shard files (metadata-server requests on Lustre/FSx)")
    print(f"{'samples':>14} {'shards':>7} {'W':>3} | {'ready s':>8} {'ready MB':>8} | {'start s':>8} {'start MB':>8} | "
          f"{'stats':>6} {'opens':>6}")
    for r in rows:
        print(f"{r['samples']:>14,} {r['shards']:>7,} {r['world']:>3} | {r['ready_s']:>8.3f} {r['ready_rss'] / MB:>8.1f} | "
              f"{r['start_s']:>8.3f} {r['start_rss'] / MB:>8.1f} | {r['shard_stats']:>6,} {r['shard_opens']:>6,}")
    out = []
    share = -(-TARGET_SHARDS // TARGET_N)
    where = f" x {TARGET_SHARDS:,} shards"
    for key, label, unit, target in (("shard_ops", "loader shard stats + opens per rank", "", 2 * share + 16),
                                     ("start_s", "loader start s", "s", 2.0),
                                     ("start_rss", "loader start memory", "B", 64 * MB)):
        coef, value = fit_loader(rows, key)
        labels = [f"S={r['shards']},W={r['world']}" for r in rows]
        values = [float(r[key]) for r in rows]
        SERIES.append({"name": label, "n": labels, "values": values, "unit": unit,
                       "exp": exponent([r["shards"] for r in rows], values), "at": value, "target": target,
                       "ok": value <= target, "where": where,
                       "fit": f"{coef[0]:.3g} + {coef[1]:.3g} S + {coef[2]:.3g} S/W + {coef[3]:.3g} B/W"})
        out.append(verdict(value <= target, f"{label}: at {TARGET_N} ranks{where} {_fmt(value, unit)} <= "
                           f"{_fmt(target, unit)} (fit {SERIES[-1]['fit']}; S/W: the rank's own shards, B/W its samples a step)"))
    return out


def kept_for(worlds: list[int]) -> int:
    """Checkpoints to keep so that, at the largest world size, their objects (2 per rank and a
    few) pass 1,100 keys: a listing of them needs more than one page."""
    return -(-1100 // (2 * max(worlds) + 4))


def run_s3(worlds: list[int], kept: int) -> list[str]:
    """The S3 part: one server, a run of ``podtrain train`` per world size."""
    import scale_s3

    work = scale_s3.workdir()
    bench = scale_s3.S3Bench(work, kept)
    try:
        runs = {}
        for w in worlds:
            runs[w] = bench.run_world(w)
            print(f"  [S3 at {w} ranks done]", file=sys.stderr, flush=True)
    finally:
        bench.stop()
        shutil.rmtree(work, ignore_errors=True)
    return report_s3(runs, kept)


def run_ckpt(worlds: list[int], root: Path) -> list[str]:
    """The checkpoint part: the llama at each world (and restored at another world size), under
    HSDP to the node-local tier, its 4x variant and the block probe."""
    rows, hsdp = [], []
    for w in worlds:
        rows.append(ckpt_world(w, root, reshard=True))
        print(f"  [checkpoint at {w} ranks (+ restore at {reshard_world(w)}): {rows[-1]['wall_s']:.0f} s]",
              file=sys.stderr, flush=True)
    for w in worlds:
        hsdp.append(ckpt_world(w, root, strategy="hsdp", local=True))
        print(f"  [hsdp, local tier, at {w} ranks: {hsdp[-1]['wall_s']:.0f} s]", file=sys.stderr, flush=True)
    big = ckpt_world(worlds[0], root, scale=2)
    probe = block_probe(worlds[:2], root)
    params = tuple(scale_ckpt.llama_params(scale_ckpt.llama_config(s)) for s in (1, 2))
    return report_ckpt(rows, big, params, probe) + report_more(rows, hsdp)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--worlds", default="2,4,8,16,32", help="world sizes (gloo ranks, forked)")
    ap.add_argument("--quick", action="store_true", help="worlds 2,4,8")
    ap.add_argument("--corpus", default="1e5,1e7,1e9", help="corpus sizes in samples (sparse shards)")
    ap.add_argument("--parts", default="ckpt,s3,loader", help="which parts to run (ckpt, s3, loader)")
    ap.add_argument("--no-s3", action="store_true", help="skip the S3 part (moto)")
    ap.add_argument("--kept", type=int, default=0,
                    help="checkpoints kept in the S3 part (0: enough for > 1,000 keys at the largest N)")
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
            verdicts += run_s3(worlds, args.kept or kept_for(worlds))
        if "loader" in parts:
            verdicts += report_loader(sizes, root)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    report_series()
    print("\n" + "\n".join(verdicts))
    failed = sum(v.startswith("FAIL") for v in verdicts)
    print(f"\n{len(verdicts) - failed} PASS, {failed} FAIL")


if __name__ == "__main__":
    main()
