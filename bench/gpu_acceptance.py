"""The one acceptance script for a GPU machine: every CUDA/NCCL path of podtrain, in one call.

    python bench/gpu_acceptance.py [--out DIR] [--budget-s 450] [--dry-run] [--plan]
    bash bench/gpu_check.sh                  # the same, choosing the interpreter that has CUDA

On a GPU it runs, in this order (most important first; a stage that would start past the time
budget is recorded as skipped, never silently dropped):

  environment    torch/CUDA/NCCL versions, the device, podtrain's peak-FLOPs entry for it
  prepare        the built-in corpus, byte-level (2 MB)
  train          `podtrain launch local` on NCCL at world size 1 (a real process group and DDP:
                 reducer, no_sync with 2 micro-batches per step, the comm hook), bf16 autocast,
                 fused AdamW, async checkpoints every 10 steps, evaluation; asserts a falling
                 loss, MFU and peak memory in metrics.jsonl, and the final checkpoint
  golden_resume  the same run stopped by SIGTERM at step 20 (checkpoint, exit 143) and resumed to
                 30: the loss at step 30 and the final weights against the uninterrupted run
  compile        train.compile=true for 20 steps
  export         `podtrain export`, then transformers' from_pretrained: logits against podtrain's
                 own model from the checkpoint (max abs difference)
  sample         `podtrain sample`: generated text
  collectives    `podtrain bench collectives` on NCCL up to 1 GiB (busbw per op)
  doctor         `podtrain doctor` on NCCL
  hang           a rank whose GPU stream stalls for 10 minutes at step 3 (a sleep kernel: the
                 next collective is enqueued and never completes, the shape of a hung NCCL
                 peer): the watchdog must end the run with exit 124 and write stack and
                 collective dumps within dist.timeout_s=20
  fsdp           dist.strategy=fsdp (FSDP2, bf16 MixedPrecisionPolicy): 20 steps to a sharded
                 checkpoint, resumed to 30 under ddp; tokens/s fsdp vs ddp on gpt2-124m
  hot_loop       20 steps under torch.cuda.set_sync_debug_mode("error") (a host sync in the loop
                 fails the run), ddp and fsdp, bf16; their losses within 2% (bench/hot_loop_check.py)
  fp8            train.fp8=tensorwise under FSDP2 (torchao Float8Linear, FP8 all-gather of weights):
                 20 steps, loss falls, checkpoint written; then bench/fp8_speed.py: FP8 against bf16
                 tokens/s on llama-8b-shaped layers at full width (target >= 1.2x) with MFU of each
  masking        data.document_masking=true with flex_attention (the loader's BlockMask): 20 steps,
                 loss falls; then bench/masking_overhead.py: the masked step against none on
                 llama-8b-shaped layers at seq 8192 (target <= 5% overhead) with MFU of each
  throughput     podtrain (defaults) against the bare DDP loop (bench/bare_ddp.py) on the same
                 GPU: tokens/s and MFU for gpt2-124m and qwen2.5-0.5b, bf16, seq 1024, eager and
                 torch.compile; prints podtrain/bare per configuration

``--dry-run`` (automatic without CUDA) runs the same stages on CPU: gloo, fp32, 2 ranks, the
tiny preset and small sizes, a host-side stall for the hang, FP8 emulated on the CPU (torchao's
float8 path runs there, slowly), masking through SDPA with a dense mask (flex_attention has no
CPU backward), the benches' tiny shapes with nothing judged, eager throughput only (add
``--dry-compile`` for the compiled runs): everything but CUDA itself. ``--plan`` prints the stages.
Results go to OUT/gpu_acceptance.json (OUT: $OUT on the device machine, else runs/gpu-acceptance),
rewritten after every stage so a timeout still leaves what was measured.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))  # this checkout's podtrain, also where it is not installed

from hot_loop_check import stage_hot_loop  # noqa: E402  (bench/ is this script's directory)
from podtrain.launch.local import free_port  # noqa: E402

FAULT_PLUGIN = REPO / "tests" / "fault_plugin"


@dataclass
class Mode:
    """What differs between a GPU run and the CPU dry run."""

    gpu: bool
    nproc: int
    precision: str
    backend: str
    preset: str
    seq_len: int
    collective_max: str
    throughput: list[tuple[str, bool]]
    budget_s: float


def mode_for(gpu: bool, budget_s: float, dry_compile: bool) -> Mode:
    """The GPU mode, or the CPU dry run's small stand-ins for it."""
    if gpu:
        runs = [(p, c) for p in ("gpt2-124m", "qwen2.5-0.5b") for c in (False, True)]
        return Mode(True, 1, "bf16", "nccl", "tiny", 256, "1G", runs, budget_s)
    runs = [("tiny", False)] + ([("tiny", True)] if dry_compile else [])
    return Mode(False, 2, "fp32", "gloo", "tiny", 128, "1M", runs, budget_s)


@dataclass
class Session:
    """One acceptance run: where things go, the clock, and the results so far."""

    mode: Mode
    out: Path
    python: str
    started: float = field(default_factory=time.monotonic)
    results: dict[str, Any] = field(default_factory=dict)

    @property
    def data(self) -> Path:
        return self.out / "data"

    def run_dir(self, name: str) -> Path:
        return self.out / "runs" / name

    def env(self, faults: str | None = None) -> dict[str, str]:
        """Children import this checkout's podtrain (and, for a fault, the test plugin)."""
        paths = [str(REPO / "src")] + ([str(FAULT_PLUGIN)] if faults else [])
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(paths + [os.environ.get("PYTHONPATH", "")]),
                   PYTHONUNBUFFERED="1")
        if not self.mode.gpu:
            env["OMP_NUM_THREADS"] = "1"
        if faults:
            env["PODTRAIN_TEST_FAULTS"] = faults
        return env

    def podtrain(self, *args: str, timeout: float = 300, faults: str | None = None) -> subprocess.CompletedProcess:
        """``python -m podtrain.cli ARGS`` with output captured."""
        return subprocess.run([self.python, "-m", "podtrain.cli", *args], capture_output=True, text=True,
                              timeout=timeout, env=self.env(faults), cwd=REPO)

    def torchrun(self, *args: str, nproc: int | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
        """A single-node torchrun of ``args`` (a script or ``-m module ...``)."""
        cmd = [self.python, "-m", "torch.distributed.run", f"--nproc-per-node={nproc or self.mode.nproc}",
               "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{free_port()}", *args]
        return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=self.env(), cwd=REPO)

    def train_args(self, run: str, steps: int, *extra: str) -> list[str]:
        """``launch local`` arguments of a training run in this mode."""
        m = self.mode
        return ["launch", "local", "configs/demo.yaml", "--nproc", str(m.nproc),
                f"run.dir={self.run_dir(run)}", f"data.path={self.data}", f"model.preset={m.preset}",
                f"data.seq_len={m.seq_len}", "train.micro_batch_size=8",
                f"train.global_batch_size={16 * m.nproc}", f"train.steps={steps}",
                f"train.precision={m.precision}", f"dist.backend={m.backend}", "log.every=5",
                "eval.every=15", "eval.max_batches=4", "ckpt.every=10", "log.progress=plain",
                "optim.warmup_steps=5", *extra]

    def over_budget(self) -> bool:
        """True once the run is past its time budget: no new stage (or throughput run) starts."""
        return time.monotonic() - self.started > self.mode.budget_s

    def save(self) -> None:
        self.out.mkdir(parents=True, exist_ok=True)
        tmp = self.out / "gpu_acceptance.json.tmp"
        tmp.write_text(json.dumps(self.results, indent=2, default=str))
        tmp.replace(self.out / "gpu_acceptance.json")


def _tail(proc: subprocess.CompletedProcess, n: int = 1500) -> str:
    return (proc.stdout + proc.stderr)[-n:]


def _metrics(run_dir: Path, kind: str = "train") -> list[dict[str, Any]]:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [r for r in rows if r.get("kind") == kind]


def _expect(cond: bool, what: str, failures: list[str]) -> None:
    if not cond:
        failures.append(what)


# -- stages --------------------------------------------------------------------------------------
def stage_environment(s: Session) -> dict[str, Any]:
    probe = ("import json, torch, transformers\n"
             "from podtrain.observe.hardware import peak_flops\n"
             "d = torch.device('cuda' if torch.cuda.is_available() else 'cpu')\n"
             "nccl = '.'.join(map(str, torch.cuda.nccl.version())) if d.type == 'cuda' else None\n"
             "name = torch.cuda.get_device_name(0) if d.type == 'cuda' else 'cpu'\n"
             "print(json.dumps({'torch': torch.__version__, 'cuda': torch.version.cuda, 'nccl': nccl,\n"
             "  'transformers': transformers.__version__, 'device': name,\n"
             "  'peak_flops_bf16': peak_flops(d, 'bf16', None) if d.type == 'cuda' else None}))")
    proc = subprocess.run([s.python, "-c", probe], capture_output=True, text=True, env=s.env(), timeout=120)
    facts = json.loads(proc.stdout.strip().splitlines()[-1]) if proc.returncode == 0 else {"error": _tail(proc)}
    ok = proc.returncode == 0 and (not s.mode.gpu or facts.get("peak_flops_bf16") is not None)
    return {"ok": ok, **facts}


def stage_prepare(s: Session) -> dict[str, Any]:
    proc = s.podtrain("prepare", "builtin", "--out", str(s.data), "--builtin-bytes", "2000000", "--no-progress")
    return {"ok": proc.returncode == 0 and (s.data / "manifest.json").exists(), "log": _tail(proc, 400)}


def stage_train(s: Session) -> dict[str, Any]:
    proc = s.podtrain(*s.train_args("train", 30), timeout=600)
    rows, evals = _metrics(s.run_dir("train")), _metrics(s.run_dir("train"), "eval")
    failures: list[str] = []
    _expect(proc.returncode == 0, f"exit code {proc.returncode}", failures)
    _expect(len(rows) >= 5, f"{len(rows)} train records", failures)
    if rows:
        _expect(rows[-1]["loss"] < rows[0]["loss"], "loss did not fall", failures)
        _expect(all(r.get("mfu") for r in rows), "MFU missing", failures)
    _expect(bool(evals), "no evaluation record", failures)
    _expect((s.run_dir("train") / "ckpt" / "step_000030").is_dir(), "no step_000030 checkpoint", failures)
    _expect(f"backend {s.mode.backend}" in proc.stdout + proc.stderr, f"backend {s.mode.backend} not logged",
            failures)
    if s.mode.gpu:
        _expect(bool(rows) and rows[-1]["max_mem_bytes"] > 0, "no peak memory", failures)
    return {"ok": not failures, "failures": failures, "first_loss": rows[0]["loss"] if rows else None,
            "last_loss": rows[-1]["loss"] if rows else None, "tokens_per_s": rows[-1]["tokens_per_s"] if rows else None,
            "mfu": rows[-1]["mfu"] if rows else None, "val_loss": evals[-1]["val_loss"] if evals else None,
            "log": "" if not failures else _tail(proc)}


def stage_golden_resume(s: Session) -> dict[str, Any]:
    # Stopped at step 20 by a SIGTERM to the torchrun agent (a preemption: checkpoint, exit 143),
    # then the same command resumes; the schedule is the same 30-step one as the golden run's.
    first = s.podtrain(*s.train_args("resumed", 30), timeout=600, faults="term-parent:rank=0,step=20")
    second = s.podtrain(*s.train_args("resumed", 30), timeout=600)
    golden = {r["step"]: r["loss"] for r in _metrics(s.run_dir("train"))}
    resumed = {r["step"]: r["loss"] for r in _metrics(s.run_dir("resumed"))}
    compare = ("import json, sys\nfrom podtrain.ckpt.reader import load_latest_weights\n"
               "_, a, sa = load_latest_weights(sys.argv[1]); _, b, sb = load_latest_weights(sys.argv[2])\n"
               "d = max(float((a[k].float() - b[k].float()).abs().max()) for k in a)\n"
               "print(json.dumps({'steps': [sa, sb], 'max_abs_weight_diff': d}))")
    proc = subprocess.run([s.python, "-c", compare, str(s.run_dir("train")), str(s.run_dir("resumed"))],
                          capture_output=True, text=True, env=s.env(), timeout=300)
    weights = json.loads(proc.stdout.strip().splitlines()[-1]) if proc.returncode == 0 else {"error": _tail(proc)}
    loss_diff = abs(golden.get(30, float("nan")) - resumed.get(30, float("nan")))
    resumed_log = "resumed from" in second.stdout + second.stderr
    # CPU is bitwise deterministic; on GPU atomics in some kernels may differ in the last bits.
    tol = 1e-3 if s.mode.gpu else 0.0
    ok = (first.returncode == 143 and second.returncode == 0 and resumed_log and loss_diff <= tol
          and weights.get("steps") == [30, 30] and weights.get("max_abs_weight_diff", 1.0) <= (1e-2 if s.mode.gpu else 0.0))
    return {"ok": ok, "stop_exit_code": first.returncode, "loss_at_30": [golden.get(30), resumed.get(30)],
            "loss_diff": loss_diff,
            "resumed_logged": resumed_log, **weights, "log": "" if ok else _tail(second)}


def stage_compile(s: Session) -> dict[str, Any]:
    proc = s.podtrain(*s.train_args("compiled", 20, "train.compile=true", "ckpt.every=0", "eval.every=0"),
                      timeout=900)
    rows = _metrics(s.run_dir("compiled"))
    ok = proc.returncode == 0 and bool(rows) and rows[-1]["loss"] < rows[0]["loss"]
    return {"ok": ok, "tokens_per_s": rows[-1]["tokens_per_s"] if rows else None, "log": "" if ok else _tail(proc)}


def stage_export(s: Session) -> dict[str, Any]:
    folder = s.out / "export"
    shutil.rmtree(folder, ignore_errors=True)
    proc = s.podtrain("export", str(s.run_dir("train")), str(folder))
    check = ("import json, sys, torch\nfrom transformers import AutoModelForCausalLM\n"
             "from podtrain.ckpt.reader import build_model_from_checkpoint, load_latest, run_config_of\n"
             "ck = load_latest(sys.argv[1]); ours = build_model_from_checkpoint(ck, run_config_of(sys.argv[1], ck))\n"
             "hf = AutoModelForCausalLM.from_pretrained(sys.argv[2]).eval()\n"
             "x = torch.randint(0, 256, (2, 64))\n"
             "with torch.no_grad(): d = float((ours(x).logits - hf(x).logits).abs().max())\n"
             "print(json.dumps({'max_abs_logit_diff': d}))")
    probe = subprocess.run([s.python, "-c", check, str(s.run_dir("train")), str(folder)], capture_output=True,
                           text=True, env=s.env(), timeout=300)
    diff = json.loads(probe.stdout.strip().splitlines()[-1]) if probe.returncode == 0 else {"error": _tail(probe)}
    ok = proc.returncode == 0 and diff.get("max_abs_logit_diff", 1.0) <= 1e-4
    return {"ok": ok, **diff, "log": "" if ok else _tail(proc) + _tail(probe)}


def stage_sample(s: Session) -> dict[str, Any]:
    proc = s.podtrain("sample", str(s.run_dir("train")), "--prompt", "def ", "--max-new-tokens", "60")
    return {"ok": proc.returncode == 0 and len(proc.stdout.strip()) > 4, "text": proc.stdout[-400:],
            "log": "" if proc.returncode == 0 else _tail(proc)}


def stage_collectives(s: Session) -> dict[str, Any]:
    out = s.out / "collectives.jsonl"
    proc = s.torchrun("-m", "podtrain.cli", "bench", "collectives", "--max-bytes", s.mode.collective_max,
                      "--backend", s.mode.backend, "--json", str(out), timeout=400)
    rows = [json.loads(line) for line in out.read_text().splitlines()] if out.exists() else []
    best: dict[str, float] = {}
    for r in rows:
        best[r["op"]] = max(best.get(r["op"], 0.0), float(r["busbw_gbps"]))
    return {"ok": proc.returncode == 0 and bool(rows), "best_busbw_GBps": best,
            "log": "" if proc.returncode == 0 else _tail(proc)}


def stage_doctor(s: Session) -> dict[str, Any]:
    out = s.out / "doctor.json"
    proc = s.torchrun("-m", "podtrain.cli", "doctor", "--backend", s.mode.backend, "--slow-threshold", "0.5",
                      "--json", str(out), timeout=300)
    return {"ok": proc.returncode == 0, "report": _tail(proc, 1200)}


def stage_hang(s: Session) -> dict[str, Any]:
    stalled = 0 if s.mode.gpu else 1
    t0 = time.monotonic()
    proc = s.podtrain(*s.train_args("hang", 10, "dist.timeout_s=20", "ckpt.every=0", "eval.every=0"),
                      timeout=300, faults=f"stall:rank={stalled},step=3,seconds=600")
    seconds = time.monotonic() - t0
    debug = s.run_dir("hang") / "debug"
    files = sorted(p.name for p in debug.glob("*")) if debug.is_dir() else []
    stacks = [f for f in files if f.startswith("stacks_rank")]
    collectives = [f for f in files if f.startswith("collectives_rank")]
    codes = sorted(set(int(c) for c in re.findall(r"exitcode\s*:\s*(-?\d+)", proc.stdout + proc.stderr)))
    ok = proc.returncode != 0 and bool(stacks) and bool(collectives) and (proc.returncode == 124 or 124 in codes)
    return {"ok": ok, "exit_code": proc.returncode, "worker_exit_codes": codes, "seconds": round(seconds, 1),
            "debug_files": files, "log": "" if ok else _tail(proc)}


def stage_throughput(s: Session) -> dict[str, Any]:
    rows = []
    for preset, compiled in s.mode.throughput:
        if s.over_budget():
            rows.append({"preset": preset, "compile": compiled, "skipped": "time budget"})
            continue
        seq, micro = (1024, 8) if s.mode.gpu else (s.mode.seq_len, 8)
        global_batch = micro * s.mode.nproc * 2
        ours = _podtrain_throughput(s, preset, compiled, seq, micro, global_batch)
        bare = s.torchrun(str(REPO / "bench" / "bare_ddp.py"), "--data", str(s.data), "--preset", preset,
                          "--steps", "25", "--seq-len", str(seq), "--micro", str(micro),
                          "--global-batch", str(global_batch), *(["--compile"] if compiled else []), timeout=900)
        lines = [json.loads(x) for x in bare.stdout.splitlines() if x.startswith("{")]
        bare_tps = lines[-1]["tokens_per_s"] if bare.returncode == 0 and lines else None
        row = {"preset": preset, "compile": compiled, **ours, "bare_tokens_per_s": bare_tps}
        if ours.get("tokens_per_s") and bare_tps:
            row["podtrain_over_bare"] = round(ours["tokens_per_s"] / bare_tps, 3)
            if ours.get("mfu"):
                row["bare_mfu"] = ours["mfu"] * bare_tps / ours["tokens_per_s"]  # same FLOPs per token
        if bare_tps is None:
            row["bare_log"] = _tail(bare)
        rows.append(row)
        print(f"  throughput {preset} compile={compiled}: {row}", flush=True)
    ok = all(r.get("podtrain_over_bare") for r in rows if "skipped" not in r)
    return {"ok": ok, "runs": rows}


def stage_fsdp(s: Session) -> dict[str, Any]:
    # dist.strategy=fsdp on this device (FSDP2 with bf16 MixedPrecisionPolicy on a GPU): 20 steps
    # written as a sharded checkpoint, continued to 30 under ddp; then tokens/s fsdp vs ddp.
    first = s.podtrain(*s.train_args("fsdp", 20, "dist.strategy=fsdp", "eval.every=0"), timeout=600)
    layout = None
    manifest = s.run_dir("fsdp") / "ckpt" / "step_000020" / "manifest.json"
    if manifest.is_file():
        layout = json.loads(manifest.read_text()).get("layout")
    second = s.podtrain(*s.train_args("fsdp", 30, "dist.strategy=ddp", "eval.every=0"), timeout=600)
    rows = _metrics(s.run_dir("fsdp"))
    failures: list[str] = []
    _expect(first.returncode == 0, f"fsdp run exit code {first.returncode}", failures)
    _expect(layout == "sharded", f"checkpoint layout {layout}", failures)
    _expect("strategy fsdp" in first.stdout + first.stderr, "strategy fsdp not logged", failures)
    _expect(second.returncode == 0 and "resumed from" in second.stdout + second.stderr,
            f"ddp resume of the fsdp checkpoint: exit code {second.returncode}", failures)
    _expect(bool(rows) and rows[-1]["step"] == 30 and rows[-1]["loss"] < rows[0]["loss"],
            "loss did not fall over fsdp then ddp", failures)
    preset = "gpt2-124m" if s.mode.gpu else s.mode.preset
    seq, micro = (1024, 8) if s.mode.gpu else (s.mode.seq_len, 8)
    rates = {}
    if not s.over_budget():
        for strategy in ("ddp", "fsdp"):
            got = _podtrain_throughput(s, preset, False, seq, micro, micro * s.mode.nproc * 2,
                                       f"dist.strategy={strategy}")
            rates[strategy] = got.get("tokens_per_s")
            _expect(bool(rates[strategy]), f"{strategy} throughput run: {got.get('podtrain_log', '')[-300:]}",
                    failures)
    ratio = round(rates["fsdp"] / rates["ddp"], 3) if rates.get("fsdp") and rates.get("ddp") else None
    return {"ok": not failures, "failures": failures, "layout": layout, "preset": preset,
            "tokens_per_s": rates, "fsdp_over_ddp": ratio,
            "log": "" if not failures else _tail(first) + _tail(second)}


def _bench_script(s: Session, script: str, timeout: float = 420) -> dict[str, Any]:
    """``bench/SCRIPT`` (``--dry-run`` on a CPU): its exit code is the verdict, its lines the figures."""
    proc = subprocess.run([s.python, str(REPO / "bench" / script), *([] if s.mode.gpu else ["--dry-run"])],
                          capture_output=True, text=True, timeout=timeout, env=s.env(), cwd=REPO)
    name = script.removesuffix(".py")
    lines = [x for x in proc.stdout.splitlines() if x.startswith(name)]
    return {"ok": proc.returncode == 0 and bool(lines), "lines": lines, "log": "" if lines else _tail(proc)}


def _short_training(s: Session, run: str, *extra: str) -> tuple[subprocess.CompletedProcess, list[str]]:
    """A 20-step run with ``extra``; the failures of its checks (exit code, a falling loss)."""
    proc = s.podtrain(*s.train_args(run, 20, "eval.every=0", *extra), timeout=600)
    rows = _metrics(s.run_dir(run))
    failures: list[str] = []
    _expect(proc.returncode == 0, f"{run} run exit code {proc.returncode}", failures)
    _expect(bool(rows) and rows[-1]["loss"] < rows[0]["loss"], f"{run}: loss did not fall", failures)
    _expect((s.run_dir(run) / "ckpt" / "step_000020").is_dir(), f"{run}: no step_000020 checkpoint", failures)
    return proc, failures


def stage_fp8(s: Session) -> dict[str, Any]:
    # The training path (FSDP2 with FP8 all-gathered weights where the GPU has FP8), then the speed.
    proc, failures = _short_training(s, "fp8", "train.fp8=tensorwise", "dist.strategy=fsdp")
    bench = _bench_script(s, "fp8_speed.py") if not s.over_budget() else {"ok": False, "skipped": "time budget"}
    _expect(bench["ok"], f"fp8_speed: {bench.get('lines') or bench.get('skipped') or bench.get('log', '')[-300:]}",
            failures)
    return {"ok": not failures, "failures": failures, "bench": bench.get("lines"),
            "log": "" if not failures else _tail(proc)}


def stage_masking(s: Session) -> dict[str, Any]:
    attn = "flex_attention" if s.mode.gpu else "sdpa"  # flex_attention has no CPU backward
    proc, failures = _short_training(s, "masking", "data.document_masking=true", f"model.attn_implementation={attn}")
    bench = _bench_script(s, "masking_overhead.py") if not s.over_budget() else {"ok": False, "skipped": "time budget"}
    _expect(bench["ok"], f"masking_overhead: {bench.get('lines') or bench.get('skipped') or bench.get('log', '')[-300:]}",
            failures)
    return {"ok": not failures, "failures": failures, "bench": bench.get("lines"),
            "log": "" if not failures else _tail(proc)}


def _podtrain_throughput(s: Session, preset: str, compiled: bool, seq: int, micro: int, global_batch: int,
                         *extra: str) -> dict[str, Any]:
    run = f"tput-{preset}-{'compiled' if compiled else 'eager'}" + "".join(f"-{e.split('=')[-1]}" for e in extra)
    args = ["train", "configs/demo.yaml", f"run.dir={s.run_dir(run)}", f"data.path={s.data}",
            f"model.preset={preset}", f"data.seq_len={seq}", f"train.micro_batch_size={micro}",
            f"train.global_batch_size={global_batch}", "train.steps=25", "log.every=5", "eval.every=0",
            "ckpt.every=0", "log.progress=off", f"train.precision={s.mode.precision}",
            f"dist.backend={s.mode.backend}", f"train.compile={'true' if compiled else 'false'}", *extra]
    proc = s.torchrun("-m", "podtrain.cli", *args, timeout=900)
    steady = [r for r in _metrics(s.run_dir(run)) if r["step"] > 5]
    if proc.returncode or not steady:
        return {"podtrain_log": _tail(proc)}
    seconds = sum(r["step_time_s"] for r in steady)
    tokens = sum(r["tokens_per_s"] * r["step_time_s"] for r in steady)
    return {"tokens_per_s": tokens / seconds, "mfu": steady[-1]["mfu"],
            "max_mem_GiB": steady[-1]["max_mem_bytes"] / 2**30}


STAGES: list[tuple[str, Callable[[Session], dict[str, Any]]]] = [
    ("environment", stage_environment), ("prepare", stage_prepare), ("train", stage_train),
    ("golden_resume", stage_golden_resume), ("compile", stage_compile), ("export", stage_export),
    ("sample", stage_sample), ("collectives", stage_collectives), ("doctor", stage_doctor),
    ("hang", stage_hang), ("fsdp", stage_fsdp), ("hot_loop", stage_hot_loop), ("fp8", stage_fp8),
    ("masking", stage_masking), ("throughput", stage_throughput),
]
NEEDS = {"train": "prepare", "golden_resume": "train", "compile": "prepare", "export": "train",
         "sample": "train", "hang": "prepare", "hot_loop": "prepare", "fp8": "prepare", "masking": "prepare",
         "throughput": "prepare"}


def main(argv: list[str] | None = None) -> int:
    """Run the stages, write the JSON, print a summary; exit 1 if a stage failed."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=os.environ.get("OUT") or str(REPO / "runs" / "gpu-acceptance"))
    parser.add_argument("--budget-s", type=float, default=450.0, help="start no stage after this (default 450)")
    parser.add_argument("--dry-run", action="store_true", help="CPU stand-ins for every stage")
    parser.add_argument("--dry-compile", action="store_true", help="with --dry-run: also the compiled runs")
    parser.add_argument("--stages", default="", help="comma-separated subset (default all)")
    parser.add_argument("--plan", action="store_true", help="print what each stage measures and exit")
    args = parser.parse_args(argv)
    if args.plan:
        print(__doc__)
        return 0
    import torch

    gpu = torch.cuda.is_available() and not args.dry_run
    session = Session(mode_for(gpu, args.budget_s, args.dry_compile), Path(args.out), sys.executable)
    shutil.rmtree(session.out / "runs", ignore_errors=True)
    session.results = {"mode": "gpu" if gpu else "cpu-dry-run", "stages": {}}
    wanted = [n for n in args.stages.split(",") if n] or [n for n, _ in STAGES]
    print(f"gpu acceptance ({session.results['mode']}): stages {', '.join(wanted)}; results in "
          f"{session.out / 'gpu_acceptance.json'}", flush=True)
    for name, fn in STAGES:
        if name not in wanted:
            continue
        need = NEEDS.get(name)
        if need and not session.results["stages"].get(need, {}).get("ok"):
            result = {"ok": False, "skipped": f"needs {need}"}
        elif session.over_budget():
            result = {"ok": False, "skipped": "time budget"}
        else:
            t0 = time.monotonic()
            try:
                result = fn(session)
            except Exception as exc:  # a stage's crash is a result, the next stage still runs
                result = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
            result["seconds"] = round(time.monotonic() - t0, 1)
        session.results["stages"][name] = result
        session.save()
        brief = {k: v for k, v in result.items() if k not in ("log", "runs", "report", "text")}
        print(f"[{'PASS' if result.get('ok') else 'FAIL'}] {name}: {json.dumps(brief, default=str)[:400]}",
              flush=True)
    failed = [n for n, r in session.results["stages"].items() if not r.get("ok")]
    print(f"done in {time.monotonic() - session.started:.0f} s: "
          f"{len(session.results['stages']) - len(failed)} passed, {len(failed)} failed {failed or ''}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
