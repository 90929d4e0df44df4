"""A bare, hand-written DDP training loop: the baseline podtrain's overhead is measured against.

DistributedSampler over packed windows of the same shards, DataLoader, DDP, AdamW (fused), gradient
accumulation with no_sync, the same model and batch. Run under torchrun; prints one JSON line with
steady-state tokens/s (steps after the warm-up).
"""

import argparse
import contextlib
import json
import os
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
    for step in range(args.steps):
        if step == args.warmup:
            if cuda:
                torch.cuda.synchronize()
            dist.barrier()
            t0 = time.perf_counter()
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
    if cuda:
        torch.cuda.synchronize()
    dist.barrier()
    elapsed = time.perf_counter() - t0
    tokens = (args.steps - args.warmup) * args.global_batch * args.seq_len
    if rank == 0:
        print(json.dumps({"tokens_per_s": tokens / elapsed}), flush=True)
    del ddp, fwd
    import gc

    gc.collect()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
