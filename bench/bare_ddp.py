"""A bare, hand-written DDP training loop: the baseline podtrain's overhead is measured against.

DistributedSampler over packed windows of the same shards, DataLoader, DDP, AdamW (fused), gradient
accumulation with no_sync, the same model and batch. Run under torchrun; each rank prints one JSON line
(``RankTimer``): steady-state tokens/s (steps after the warm-up) and its CPU seconds per step.
"""

import argparse
import contextlib
import json
import os
import resource
import sys
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, DistributedSampler


class Windows(Dataset):
    def __init__(self, path, seq_len):
        self.tokens = np.memmap(path, dtype=np.uint16, mode="r")
        self.seq_len = seq_len

    def __len__(self):
        return (len(self.tokens) - 1) // self.seq_len

    def __getitem__(self, i):
        start = i * self.seq_len
        return torch.from_numpy(self.tokens[start:start + self.seq_len + 1].astype(np.int64))


class RankTimer:
    """The one clock of ``train_throughput.py``, for every contender alike: wall time between two
    barriers (after the same warm-up steps, to the end of the last step), and this rank's CPU time
    over the same window (user + sys of every thread of the process: what load on a shared
    machine distorts far less than wall time). ``stop`` prints one JSON line per rank."""

    def __init__(self, name: str, tokens_per_step: int):
        self.name, self.tokens_per_step = name, tokens_per_step
        self.t0 = self.cpu0 = self.faults0 = None

    @staticmethod
    def _sync():
        if torch.cuda.is_available():
            torch.cuda.synchronize()  # the GPU's queued work belongs to the window it was issued in
        if dist.is_initialized():
            dist.barrier()

    def start(self):
        """After the warm-up steps, on every rank."""
        self._sync()
        self.t0, self.cpu0 = time.perf_counter(), time.process_time()
        self.faults0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt

    def stop(self, steps: int):
        """After the last of ``steps`` timed steps, on every rank: the JSON line."""
        self._sync()
        wall, cpu = time.perf_counter() - self.t0, time.process_time() - self.cpu0
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - self.faults0
        rank = dist.get_rank() if dist.is_initialized() else 0
        line = json.dumps({"timed": self.name, "rank": rank, "steps": steps, "wall_s": wall,
                           "tokens_per_s": steps * self.tokens_per_step / wall, "cpu_s_per_step": cpu / steps,
                           "minor_faults_per_step": faults / steps})
        sys.stdout.flush()
        os.write(sys.stdout.fileno(), (line + "\n").encode())  # one write: the ranks share the pipe


def tiny_model(preset: str = "tiny"):
    """A preset's architecture with the byte-level data's vocabulary (257 rounded up to 320), as
    podtrain builds it, so both loops do the same FLOPs per token (seeded by the caller)."""
    from transformers import AutoModelForCausalLM

    from podtrain.model import preset_config

    return AutoModelForCausalLM.from_config(preset_config(preset, 320), attn_implementation="sdpa")


def workload_parser() -> argparse.ArgumentParser:
    """The flags every baseline shares: data, steps, warm-up, sequence length, batch sizes."""
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--micro", type=int, default=8)
    p.add_argument("--global-batch", type=int, default=32)
    return p


def main():
    p = workload_parser()
    p.add_argument("--compile", action="store_true")
    p.add_argument("--preset", default="tiny")
    args = p.parse_args()
    # On a GPU: NCCL, this rank's GPU, bf16 autocast (what a user writes); on CPU: gloo, fp32.
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    autocast = (lambda: torch.autocast("cuda", dtype=torch.bfloat16)) if cuda else contextlib.nullcontext
    torch.manual_seed(0)
    model = tiny_model(args.preset).to(device)
    ddp = DDP(model, device_ids=[device.index] if cuda else None, gradient_as_bucket_view=True)
    fwd = torch.compile(ddp) if args.compile else ddp
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    ds = Windows(os.path.join(args.data, "train_00000.bin"), args.seq_len)
    sampler = DistributedSampler(ds, num_replicas=world, rank=rank, shuffle=True, seed=0)
    # num_workers=0: on 2 cores a worker process would steal CPU from the ranks (the harder baseline).
    loader = iter(DataLoader(ds, batch_size=args.micro, sampler=sampler, num_workers=0, drop_last=True,
                             pin_memory=cuda))
    accum = args.global_batch // (args.micro * world)
    timer = RankTimer("bare", args.global_batch * args.seq_len)
    for step in range(args.steps):
        if step == args.warmup:
            timer.start()
        for i in range(accum):
            rows = next(loader).to(device, non_blocking=True)
            ctx = contextlib.nullcontext() if i == accum - 1 else ddp.no_sync()
            with ctx, autocast():
                logits = fwd(input_ids=rows[:, :-1]).logits
                loss = F.cross_entropy(logits.flatten(0, 1), rows[:, 1:].flatten()) / accum
                loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
    timer.stop(args.steps - args.warmup)
    del ddp, fwd
    import gc

    gc.collect()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
