"""The soak's verdicts and report (``bench/soak.py``): how a faulted launch should end, the steps
and losses metrics.jsonl logged, bit-identity of two ``podtrain export`` folders, the summary."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

KINDS = ("kill", "term", "corrupt", "enospc")
"""Every fault kind, in the report's order."""


def outcome_problem(kind: str, code: int, output: str) -> tuple[bool | None, str]:
    """(False, why) when the faulted launch did not end as documented; (None, "") otherwise
    (its survival is then decided by the next launch's resume)."""
    if code == -1:
        return False, "the launch hung (killed by the soak's timeout)"
    if kind == "term" and code != 143:
        return False, f"exit {code} after SIGTERM, expected 143"
    if kind == "kill" and code in (0, 2, 124):
        return False, f"exit {code} after a rank was killed"
    if kind == "enospc":
        if code != 2:
            return False, f"exit {code} on a full disk, expected 2 (a one-line error)"
        if "no space left on device" not in output.lower():
            return False, "no line says the disk is full"
    return None, ""


def metrics_lines(run_dir: Path) -> int:
    """How many lines metrics.jsonl holds now (0 when absent)."""
    path = run_dir / "metrics.jsonl"
    return len(path.read_bytes().splitlines()) if path.exists() else 0


def read_metrics(run_dir: Path, offset: int) -> tuple[list[int], dict[int, float]]:
    """The training steps logged after line ``offset`` and their losses (a torn last line is
    skipped: it is being written)."""
    path = run_dir / "metrics.jsonl"
    steps, losses = [], {}
    if path.exists():
        for line in path.read_bytes().splitlines()[offset:]:
            try:
                rec = json.loads(line)
            except ValueError:
                continue
            if rec.get("kind") == "train":
                steps.append(rec["step"])
                losses[rec["step"]] = rec["loss"]
    return steps, losses


def weights_verdict(ref_dir: Path, got_dir: Path) -> str:
    """"identical" when every tensor of both exports is bit-identical, else what differs."""
    from safetensors.torch import load_file

    ref = {k: v for p in sorted(ref_dir.glob("*.safetensors")) for k, v in load_file(p).items()}
    got = {k: v for p in sorted(got_dir.glob("*.safetensors")) for k, v in load_file(p).items()}
    if not ref or ref.keys() != got.keys():
        return f"different tensors: {sorted(set(ref) ^ set(got))[:5]}"
    differ = [k for k in ref if ref[k].dtype != got[k].dtype or ref[k].shape != got[k].shape
              or not ref[k].view(-1).view(dtype=_int_of(ref[k])).equal(got[k].view(-1).view(dtype=_int_of(got[k])))]
    if not differ:
        return "identical"
    worst = max(float((ref[k].double() - got[k].double()).abs().max()) for k in differ
                if ref[k].shape == got[k].shape)
    return f"{len(differ)}/{len(ref)} tensors differ (max abs diff {worst:.3g}), e.g. {differ[0]}"


def _int_of(t):
    import torch

    return {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]


# -- the report ------------------------------------------------------------------------------
def summary(soak, ref: dict, elapsed: float) -> tuple[dict, list[str]]:
    """The figures (for --json) and the problems that make the soak fail."""
    by_kind = {}
    for kind in soak.args.kinds:
        mine = [f for f in soak.faults if f.kind == kind]
        by_kind[kind] = {"occurred": len(mine), "survived": sum(bool(f.survived) for f in mine),
                         "steps_redone": sum(f.redone for f in mine)}
    problems = [f"round {f.round}: {f.kind} at step {f.at_step} not survived: {f.reason}"
                for f in soak.faults if not f.survived]
    problems += [f"no {k} fault occurred" for k, v in by_kind.items() if not v["occurred"]]
    for r in soak.rounds:
        if r["weights"] != "identical":
            problems.append(f"round {r['round']}: final weights: {r['weights']}")
        if r["losses"] != "identical":
            problems.append(f"round {r['round']}: losses: {r['losses']}")
    figures = {"ok": not problems, "seed": soak.args.seed, "problems": problems, "elapsed_s": elapsed, "reference_s": ref["wall_s"],
               "steps": soak.args.steps, "ckpt_every": soak.args.ckpt_every, "by_kind": by_kind,
               "rounds": soak.rounds, "faults": [asdict(f) for f in soak.faults]}
    return figures, problems


def print_table(figures: dict) -> None:
    """Faults by kind, then rounds."""
    print(f"\nsoak (--seed {figures['seed']}): {len(figures['rounds'])} round(s) of {figures['steps']} steps (ckpt.every="
          f"{figures['ckpt_every']}) in {figures['elapsed_s']:.0f} s; reference run {figures['reference_s']:.1f} s")
    print(f"{'fault':<9}{'occurred':>9}{'survived':>9}{'steps redone':>14}")
    for kind, v in figures["by_kind"].items():
        print(f"{kind:<9}{v['occurred']:>9}{v['survived']:>9}{v['steps_redone']:>14}")
    print(f"{'round':<6}{'launches':>9}{'job s':>8}{'lost s':>8}  weights / losses vs reference")
    for r in figures["rounds"]:
        print(f"{r['round']:<6}{r['attempts']:>9}{r['job_s']:>8.1f}{r['lost_s']:>8.1f}  "
              f"{r['weights']} / {r['losses']}")
    for r in figures["rounds"]:
        print(f"round {r['round']} launches: " + ", ".join(
            f"{x['ended_by']} (exit {x['code']}, steps {'-'.join(map(str, x['steps'])) or 'none'}, {x['wall_s']} s)"
            for x in r["launches"]))
    for p in figures["problems"]:
        print(f"FAILED: {p}")
    print("soak: PASSED" if figures["ok"] else "soak: FAILED", flush=True)
