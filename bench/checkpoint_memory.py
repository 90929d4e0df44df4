"""Host memory of a checkpoint save and a resume, per rank, for a gpt2-124m-sized model on CPU.

    .venv/bin/python bench/checkpoint_memory.py [--preset gpt2-124m] [--rounds 2] [--budgets-mb 64,256]

Every measurement runs in a fresh forked process: it builds the model and its AdamW state, notes
its RSS, resets the kernel's peak-RSS counter (``/proc/self/clear_refs``), does one save (waiting
for the background write) or one resume, and reads the peak (``VmHWM``). "extra" = peak - RSS
before: the host memory the operation itself added. Rounds alternate the variants:

  save, podtrain default budget   (here larger than the state: the whole share is staged at once)
  save, ckpt.host_staging_mb=B    for each B in --budgets-mb (streamed through B MB of slabs)
  load, podtrain resume           (tensor by tensor into the parameters and optimizer state)
  load, whole-file read           (the previous resume: read every file, then load_state_dict)

Printed ratios: save extra / fp32 weights, against the target extra <= 1.25 x weights + budget
(on a GPU the weights live on the device, so the host pays only the extra); load extra / checkpoint
size. Both loads end by writing the optimizer state in place (what the first step does), so a
loader that maps the files pays for it inside the measurement. On the CPU a resume must allocate AdamW's two moments (2 x weights): that part is printed
separately, the rest is the loader's own overhead.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from podtrain.ckpt import layout  # noqa: E402
from podtrain.ckpt.checkpointer import Checkpointer  # noqa: E402
from podtrain.ckpt.reader import load_weights, read_checkpoint  # noqa: E402
from podtrain.ckpt.store import open_store  # noqa: E402
from podtrain.config_sections import CkptSection  # noqa: E402
from podtrain.distributed.env import ClusterEnv  # noqa: E402
from podtrain.distributed.group import DistContext  # noqa: E402
from podtrain.model import build_model, preset_config  # noqa: E402

MB = 1 << 20
STATE = {"step": 1, "tokens_seen": 0, "loader": {"epoch": 0, "consumed": 0}, "run_id": "bench", "config": {}}


def status_bytes(key: str) -> int:
    """A ``/proc/self/status`` field (kB) in bytes."""
    for line in open("/proc/self/status"):
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(key)


def status_fields(*keys: str) -> dict[str, int]:
    """Several ``/proc/self/status`` fields (kB) in bytes."""
    out = {}
    for line in open("/proc/self/status"):
        key = line.split(":", 1)[0]
        if key in keys:
            out[key] = int(line.split()[1]) * 1024
    return out


def measure(fn) -> tuple[int, int, int, float]:
    """``(RSS before, peak RSS during, peak file-mapped RSS during, seconds)`` of ``fn()``.

    The peak is the larger of the kernel's ``VmHWM`` and a 2 ms sampler of ``VmRSS``: the kernel
    updates ``VmHWM`` lazily, and a file mapping (safetensors' ``load_file`` maps the file)
    counts in RSS while mapped. The sampler also records the file-mapped part (``RssFile``:
    page cache, reclaimable, shared by the ranks that map the same file).
    """
    import threading

    before = status_bytes("VmRSS")
    with open("/proc/self/clear_refs", "w") as fh:
        fh.write("5")  # VmHWM := current RSS
    peak = {"VmRSS": before, "RssFile": 0}
    done = threading.Event()

    def sample():
        while not done.wait(0.002):
            now = status_fields("VmRSS", "RssFile")
            for key in peak:
                peak[key] = max(peak[key], now.get(key, 0))

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    t0 = time.perf_counter()
    fn()
    took = time.perf_counter() - t0
    done.set()
    sampler.join()
    return before, max(status_bytes("VmHWM"), peak["VmRSS"]), peak["RssFile"], took


def model_and_optimizer(preset: str, seed: int):
    """The model with a full AdamW state (one step on random gradients, then gradients dropped)."""
    model = build_model(preset_config(preset), seed=seed)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    for p in model.parameters():
        p.grad = torch.randn_like(p) * 1e-3
    opt.step()
    opt.zero_grad(set_to_none=True)
    release_free_heap()
    return model, opt


def release_free_heap() -> None:
    """Return freed malloc memory to the OS, so "RSS before" holds only live data (the dropped
    gradients would otherwise stay resident and be reused by the save, hiding its cost)."""
    import ctypes

    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: the figures are then upper bounds of "before"
        pass


def touch_in_place(opt: torch.optim.Optimizer) -> None:
    """Write every optimizer state tensor in place, as the first step after a resume will: a
    loader that leaves them mapped from the file pays their memory here, not at load time."""
    with torch.no_grad():
        for state in opt.state.values():
            for v in state.values():
                if isinstance(v, torch.Tensor) and v.dim() > 0:
                    v.mul_(1)


def ctx() -> DistContext:
    return DistContext(env=ClusterEnv.detect({}), backend="gloo", device=torch.device("cpu"), initialized=False)


def run_save(preset: str, run_dir: str, budget_mb: float | None, out) -> None:
    model, opt = model_and_optimizer(preset, 0)
    ck = Checkpointer(Path(run_dir), CkptSection(host_staging_mb=budget_mb, keep_last=1), ctx())
    stall = []

    def save():
        t0 = time.perf_counter()
        ck.save(1, model, opt, None, STATE)
        stall.append(time.perf_counter() - t0)
        ck.wait()

    before, peak, file_peak, took = measure(save)
    ck.close()
    out.put({"before": before, "peak": peak, "file": file_peak, "seconds": took, "stall": stall[0],
             "budget": ck._pool.budget_bytes, "pool": ck._pool.allocated_bytes})


def run_load(preset: str, run_dir: str, whole: bool, out) -> None:
    model = build_model(preset_config(preset), seed=1)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    release_free_heap()
    if whole:
        def load():
            store = open_store(str(Path(run_dir) / layout.CKPT_SUBDIR))
            choice = layout.find_latest(store)
            data = read_checkpoint(store, choice.name, choice.manifest)  # every tensor whole
            load_weights(model, data.model_state, data.path)
            params = dict(model.named_parameters())
            for key, value in data.optimizer.items():  # state.<param>.<key>
                fqn, leaf = key[len("state."):].rsplit(".", 1)
                opt.state[params[fqn]][leaf] = value
            del data
            touch_in_place(opt)
    else:
        ck = Checkpointer(Path(run_dir), CkptSection(), ctx())

        def load():
            ck.restore(model, opt, None)
            touch_in_place(opt)
    before, peak, file_peak, took = measure(load)
    moments = sum(v.numel() * v.element_size() for s in opt.state.values() for v in s.values()
                  if isinstance(v, torch.Tensor) and v.dim() > 0)
    out.put({"before": before, "peak": peak, "file": file_peak, "seconds": took, "moments": moments})


def in_fresh_process(target, *args) -> dict:
    """Run ``target(*args, queue)`` in a forked process; its one result."""
    mpc = mp.get_context("fork")
    queue = mpc.Queue()
    proc = mpc.Process(target=target, args=(*args, queue))
    proc.start()
    result = queue.get(timeout=1800)
    proc.join()
    return result


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="gpt2-124m")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--budgets-mb", default="64,256", help="comma-separated ckpt.host_staging_mb values")
    ap.add_argument("--dir", default=None, help="where to write (default: the system temp dir)")
    args = ap.parse_args()
    budgets = [float(b) for b in args.budgets_mb.split(",") if b]

    model = build_model(preset_config(args.preset), seed=0)
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    print(f"model {args.preset}: {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters, "
          f"fp32 weights {weights / MB:.0f} MB")
    del model

    base = Path(tempfile.mkdtemp(prefix="podtrain-ckpt-mem-", dir=args.dir))
    variants = [("save", None)] + [("save", b) for b in budgets] + [("load", False), ("load", True)]
    results: dict[tuple, list[dict]] = {v: [] for v in variants}
    try:
        ckpt_dir = str(base / "run")
        for r in range(args.rounds):
            for kind, arg in variants:
                if kind == "save":
                    res = in_fresh_process(run_save, args.preset, ckpt_dir, arg)
                else:
                    res = in_fresh_process(run_load, args.preset, ckpt_dir, arg)
                results[(kind, arg)].append(res)
                print(f"round {r + 1} {kind} {_label(kind, arg):<24} peak RSS {res['peak'] / MB:7.0f} MB, "
                      f"before {res['before'] / MB:7.0f} MB, extra {(res['peak'] - res['before']) / MB:7.0f} MB "
                      f"(file-mapped peak {res['file'] / MB:5.0f} MB), "
                      f"{res['seconds']:.1f} s", flush=True)
        ckpt_bytes = sum(p.stat().st_size for p in (base / "run" / "ckpt").rglob("*")
                         if p.is_file() and not p.parent.name.startswith(layout.ABANDONED))
    finally:
        shutil.rmtree(base, ignore_errors=True)

    def mean(key, variant):
        return statistics.mean(r[key] for r in results[variant])

    def extra(variant):
        return statistics.mean(r["peak"] - r["before"] for r in results[variant])

    print(f"\ncheckpoint on disk {ckpt_bytes / MB:.0f} MB; fp32 weights {weights / MB:.0f} MB")
    print("save (one rank writes everything)      extra MB  extra/weights  target(1.25w+B)  met  stall s")
    for variant in variants:
        if variant[0] != "save":
            continue
        budget = mean("budget", variant)
        target = 1.25 * weights + budget
        e = extra(variant)
        print(f"  {_label(*variant):<36} {e / MB:8.0f}  {e / weights:13.2f}  {target / MB:13.0f} MB  "
              f"{'yes' if e <= target else 'NO':>4}  {mean('stall', variant):6.2f}")
    print("load                                   extra MB  extra/ckpt  AdamW moments MB  overhead/ckpt"
          "  file-mapped peak MB")
    for variant in variants:
        if variant[0] != "load":
            continue
        e, moments = extra(variant), mean("moments", variant)
        print(f"  {_label(*variant):<36} {e / MB:8.0f}  {e / ckpt_bytes:10.2f}  {moments / MB:16.0f}  "
              f"{(e - moments) / ckpt_bytes:13.2f}  {mean('file', variant) / MB:19.0f}")
    return 0


def _label(kind: str, arg) -> str:
    if kind == "save":
        return "default budget" if arg is None else f"host_staging_mb={arg:g}"
    return "whole-file read (old)" if arg else "podtrain resume"


if __name__ == "__main__":
    raise SystemExit(main())
