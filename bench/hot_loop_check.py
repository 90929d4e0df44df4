"""The hot loop makes no host sync, and bf16 FSDP trains as bf16 DDP does: one stage of the GPU check.

Worker (every rank, under torchrun; podtrain's own ``train``, defaults on)::

    torchrun --nproc-per-node N bench/hot_loop_check.py --warmup 5 --steps 20 --json OUT CONFIG [k=v ...]

trains ``warmup + steps`` steps; after the warm-up (compilation, the first all-gathers, the
start-up timeout switch) every step runs under ``torch.cuda.set_sync_debug_mode("error")``, so any
host sync in the loop (an ``.item()``, a ``bool`` of a device tensor, a blocking copy) raises and
the run fails naming it. Only the log line's read of the interval's losses, once per
``log.every`` (set to ``warmup``; by design), runs with the mode off.
On the CPU (the dry run) the steps run unchecked: there is no device to sync with.

``stage_hot_loop`` (bench/gpu_acceptance.py's ``hot_loop`` stage) runs it under ddp and under fsdp
and compares their losses at the two logged steps: within 2% in bf16 (8 significant bits, over
``warmup + steps`` steps of drift), 1e-4 in the dry run's fp32.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))


def _sync_debug(mode: str | int) -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.set_sync_debug_mode(mode)


def _watch(trainer, warmup: int, checked: list[int]) -> None:
    """From step ``warmup + 1`` on, error on any host sync except inside the log read."""
    step, log_interval = trainer.stepper.step, trainer._log_interval

    def checked_step(micro_batches):
        if trainer.progress.step >= warmup:
            _sync_debug("error")
            checked.append(trainer.progress.step + 1)
        step(micro_batches)

    def logged(interval):
        _sync_debug(0)  # the interval's one read, by design
        log_interval(interval)

    trainer.stepper.step, trainer._log_interval = checked_step, logged


def main(argv: list[str] | None = None) -> int:
    """One rank's run; rank 0 writes the JSON."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--json", type=Path, required=True)
    parser.add_argument("config")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args(argv)
    import torch

    from podtrain.config import load_config
    from podtrain.distributed.env import ClusterEnv
    from podtrain.train import loop

    cfg = load_config(args.config, [*args.overrides, f"train.steps={args.warmup + args.steps}",
                                    f"log.every={args.warmup}", "eval.every=0", "ckpt.every=0"])
    checked: list[int] = []
    real_setup = loop.Trainer.setup

    def setup(self):
        real_setup(self)
        _watch(self, args.warmup, checked)

    loop.Trainer.setup = setup
    env = ClusterEnv.detect()
    result = loop.train(cfg, env)
    if env.rank == 0:
        facts: dict[str, Any] = {"exit_code": result.exit_code, "steps": result.step,
                                 "sync_checked_steps": len(checked) if torch.cuda.is_available() else 0,
                                 "matmul_precision": torch.get_float32_matmul_precision()}
        if torch.cuda.is_available() and hasattr(torch._C, "_accelerator_getAllocatorSettings"):
            facts["allocator_settings"] = torch._C._accelerator_getAllocatorSettings()
        args.json.write_text(json.dumps(facts))
    return result.exit_code


def stage_hot_loop(s) -> dict[str, Any]:
    """bench/gpu_acceptance.py's stage: ddp and fsdp runs of ``main``; see the module docstring."""
    runs: dict[str, Any] = {}
    failures: list[str] = []
    for strategy in ("ddp", "fsdp"):
        run, out = s.run_dir(f"hot-loop-{strategy}"), s.out / f"hot_loop_{strategy}.json"
        out.unlink(missing_ok=True)
        precision = "bf16" if s.mode.gpu else s.mode.precision
        proc = s.torchrun(str(REPO / "bench" / "hot_loop_check.py"), "--json", str(out), "configs/demo.yaml",
                          f"run.dir={run}", f"data.path={s.data}", f"model.preset={s.mode.preset}",
                          f"data.seq_len={s.mode.seq_len}", "train.micro_batch_size=8",
                          f"train.global_batch_size={16 * s.mode.nproc}", f"train.precision={precision}",
                          f"dist.backend={s.mode.backend}", f"dist.strategy={strategy}", "log.progress=plain",
                          timeout=600)
        facts = json.loads(out.read_text()) if out.is_file() else {}
        rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()] \
            if (run / "metrics.jsonl").is_file() else []
        losses = {r["step"]: r["loss"] for r in rows if r.get("kind") == "train"}
        start = next((x for x in (proc.stdout + proc.stderr).splitlines() if "| " in x and "strategy" in x), "")
        runs[strategy] = {**facts, "losses": losses, "start_line": start[-300:]}
        if proc.returncode != 0:
            failures.append(f"{strategy}: exit {proc.returncode}: {(proc.stdout + proc.stderr)[-1200:]}")
        elif s.mode.gpu and facts.get("sync_checked_steps", 0) < 20:
            failures.append(f"{strategy}: only {facts.get('sync_checked_steps')} steps ran under the sync check")
        if s.mode.gpu and "expandable_segments:True" not in facts.get("allocator_settings", "expandable_segments:True"):
            failures.append(f"{strategy}: allocator settings {facts.get('allocator_settings')!r}")
    tol = 0.02 if s.mode.gpu else 1e-4
    ddp, fsdp = runs["ddp"]["losses"], runs["fsdp"]["losses"]
    common = sorted(set(ddp) & set(fsdp))
    diffs = {k: abs(fsdp[k] - ddp[k]) / abs(ddp[k]) for k in common}
    if not common or any(d > tol for d in diffs.values()):
        failures.append(f"fsdp vs ddp losses beyond {tol:.0e} (relative): {diffs or 'no common step'}")
    return {"ok": not failures, "failures": failures, "relative_loss_diff": diffs, "tolerance": tol,
            "runs": runs}


if __name__ == "__main__":
    sys.exit(main())
