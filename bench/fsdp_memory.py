"""dist.strategy=fsdp against ddp: memory per rank for a ~100M-parameter model, tokens/s on tiny.

    .venv/bin/python bench/fsdp_memory.py [--ranks 2 4] [--steps 2] [--tput-steps 30] [--rounds 3]

1. Memory: a ~110M-parameter Llama (hidden 768, 12 layers, 32k vocabulary) trained for a few
   steps (2 micro-batches each) under each strategy at each rank count (torchrun, podtrain's
   strategy + Stepper + AdamW at their defaults). Per rank, the largest over ranks:
     state    parameters + gradients + AdamW state this rank holds (its shards' bytes, counted
              from the tensors after the last backward): DDP ~16 B/param, FSDP ~16/N B/param
     peak     GPU: max_memory_allocated during the steps; CPU: the highest resident set size
              sampled every 2 ms during the steps, minus the RSS before the model was built
              (libraries and interpreter excluded; activations, buffers included)
   "fsdp" accumulates unsharded between micro-batches (the default where it fits: faster, full
   gradients held meanwhile); "fsdp-reshard" reduce-scatters every micro-batch (what a model
   that does not fit gets). Printed ratios: fsdp state / ddp state, target ~1/N; peaks.
2. Throughput: ``podtrain train`` at its defaults on the tiny preset at 2 ranks, ddp and fsdp
   alternating (ddp, fsdp, ddp, fsdp...) so drift hits both alike; steady-state tokens/s from
   metrics.jsonl, the median over the rounds.
"""

import argparse
import json
import statistics
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PY = sys.executable
SEQ, MICRO, GLOBAL_PER_RANK = 128, 1, 2


def torchrun(nproc, *args, env_extra=None):
    from podtrain.launch.local import free_port

    env = dict(os.environ, OMP_NUM_THREADS="1", TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1", **(env_extra or {}))
    cmd = [PY, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}", "--rdzv-backend=c10d",
           f"--rdzv-endpoint=127.0.0.1:{free_port()}", *args]
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1800, cwd=REPO)
    if out.returncode:
        sys.exit(f"{' '.join(args[:4])} failed:\n{out.stdout[-2000:]}\n{out.stderr[-3000:]}")
    return out


def local_bytes(t):
    if t is None:
        return 0
    t = t.to_local() if hasattr(t, "to_local") else t
    return t.numel() * t.element_size()


class RssSampler:
    """The highest resident set size seen by a thread polling /proc/self/statm."""

    def __init__(self, period_s=0.002):
        import threading

        self.period_s, self.peak = period_s, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    @staticmethod
    def rss():
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    def _run(self):
        while not self._stop.wait(self.period_s):
            self.peak = max(self.peak, self.rss())

    def __enter__(self):
        self.peak = self.rss()
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self.rss())


def memory_worker(strategy, steps):
    """One rank of the memory measurement; rank 0 prints a JSON line."""
    import torch
    from transformers import LlamaConfig

    from podtrain.config_sections import DistSection, OptimSection
    from podtrain.distributed.env import ClusterEnv
    from podtrain.distributed.group import process_group
    from podtrain.train.optim import build_optimizer
    from podtrain.train.precision import resolve_precision
    from podtrain.train.step import Stepper
    from podtrain.train.strategy import build_for_strategy, build_strategy

    config = LlamaConfig(hidden_size=768, intermediate_size=2048, num_hidden_layers=12,
                         num_attention_heads=12, num_key_value_heads=12, vocab_size=32000,
                         max_position_embeddings=SEQ, tie_word_embeddings=True, use_cache=False)
    with process_group(ClusterEnv.detect(), "auto") as ctx:
        base_rss = RssSampler.rss()
        precision = resolve_precision("auto", ctx.device)
        name = strategy.split("-")[0]
        model, reference = build_for_strategy(config, "sdpa", 0, name, ctx)  # as the loop builds it
        params = sum(p.numel() for p in model.parameters())
        chosen = build_strategy(DistSection(strategy=name), ctx, precision, SEQ,
                                accumulate_unsharded=strategy != "fsdp-reshard")
        wrapped = chosen.wrap(model, reference)
        del reference
        opt = build_optimizer(model, OptimSection(), ctx.device)
        world = ctx.world_size
        stepper = Stepper(wrapped, chosen, opt, chosen.forward_precision(precision), 1.0, world,
                          GLOBAL_PER_RANK * world * SEQ, ctx.device)
        if ctx.is_cuda:
            torch.cuda.reset_peak_memory_stats(ctx.device)
        g = torch.Generator().manual_seed(ctx.rank)
        state = 0
        with RssSampler() as sampler:
            for _ in range(steps):
                rows = torch.randint(0, config.vocab_size, (GLOBAL_PER_RANK, SEQ + 1), generator=g)
                stepper.accumulate(list(rows.split(MICRO)))
                state = (sum(local_bytes(p) + local_bytes(p.grad) for p in model.parameters())
                         + sum(local_bytes(v) for s in opt.state.values() for v in s.values()
                               if isinstance(v, torch.Tensor)))
                stepper.apply()
        peak = (torch.cuda.max_memory_allocated(ctx.device) if ctx.is_cuda
                else sampler.peak - base_rss)
        packed = torch.tensor([float(state), float(peak)], dtype=torch.float64, device=ctx.device)
        torch.distributed.all_reduce(packed, op=torch.distributed.ReduceOp.MAX)
        chosen.release()
        if ctx.is_main:
            print(json.dumps({"strategy": strategy, "ranks": world, "params": params,
                              "state_bytes": packed[0].item(), "peak_bytes": packed[1].item(),
                              "peak_kind": "gpu_allocated" if ctx.is_cuda else "host_rss_during_steps"}), flush=True)


def memory(nproc, strategy, steps):
    # A fixed mmap threshold: glibc's dynamic one would keep freed multi-MB tensors in the heap,
    # and the resident set would then count memory torch has released (FSDP frees its
    # all-gathered layers after use).
    out = torchrun(nproc, str(Path(__file__).resolve()), "--worker", strategy, "--steps", str(steps),
                   env_extra={"MALLOC_MMAP_THRESHOLD_": "65536"})
    return json.loads([line for line in out.stdout.splitlines() if line.startswith("{")][-1])


def tokens_per_s(data, strategy, steps, warmup=5):
    with tempfile.TemporaryDirectory() as run_dir:
        torchrun(2, "-m", "podtrain.cli", "train", str(REPO / "configs/demo.yaml"), f"data.path={data}",
                 f"run.dir={run_dir}", f"train.steps={steps}", f"log.every={warmup}", "eval.every=0",
                 "ckpt.every=0", "log.progress=off", "monitor.watchdog=false", f"dist.strategy={strategy}")
        records = [json.loads(x) for x in Path(run_dir, "metrics.jsonl").read_text().splitlines()]
        steady = [r for r in records if r.get("kind") == "train" and r["step"] > warmup]
        tokens = sum(r["tokens_per_s"] * r["step_time_s"] * warmup for r in steady)
        return tokens / sum(r["step_time_s"] * warmup for r in steady)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    p.add_argument("--steps", type=int, default=2, help="steps of the memory runs")
    p.add_argument("--tput-steps", type=int, default=30, help="steps of each throughput run (0: skip)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--data", default=str(REPO / "data/builtin"), help="prepared corpus (tiny preset)")
    args = p.parse_args()
    if args.worker:
        memory_worker(args.worker, args.steps)
        return
    gib = 2**30
    for nproc in args.ranks:
        runs = {name: memory(nproc, name, args.steps) for name in ("ddp", "fsdp", "fsdp-reshard")}
        for r in runs.values():
            print(f"{nproc} ranks {r['strategy']:>12}: {r['params'] / 1e6:.0f}M params | state "
                  f"{r['state_bytes'] / gib:.3f} GiB/rank ({r['state_bytes'] / r['params']:.2f} B/param) | "
                  f"peak {r['peak_kind']} {r['peak_bytes'] / gib:.2f} GiB/rank", flush=True)
        ddp = runs["ddp"]
        for name in ("fsdp", "fsdp-reshard"):
            print(f"{nproc} ranks: {name}/ddp state {runs[name]['state_bytes'] / ddp['state_bytes']:.3f} "
                  f"(1/N = {1 / nproc:.3f}), peak {runs[name]['peak_bytes'] / ddp['peak_bytes']:.3f}",
                  flush=True)
    if args.tput_steps:
        if not (Path(args.data) / "manifest.json").is_file():
            subprocess.run([PY, "-m", "podtrain.cli", "prepare", "builtin", "--out", args.data], check=True)
        rates = {"ddp": [], "fsdp": []}
        for _ in range(args.rounds):
            for strategy in rates:
                rates[strategy].append(tokens_per_s(args.data, strategy, args.tput_steps))
                print(f"tiny, 2 ranks, {strategy}: {rates[strategy][-1]:.0f} tokens/s", flush=True)
        ddp, fsdp = (statistics.median(v) for v in rates.values())
        print(f"tokens/s fsdp/ddp on tiny at 2 ranks: {fsdp / ddp:.3f} ({fsdp:.0f} vs {ddp:.0f})")


if __name__ == "__main__":
    main()
