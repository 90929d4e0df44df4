"""`podtrain plan`'s predictions against recorded published figures (no GPU needed).

    .venv/bin/python bench/plan_published.py

Each case is a plan for the published setup, with podtrain's defaults (efficiency, busbw table),
printed next to the figure it is checked against and their ratio (target within 30%):

1. torchtitan, Llama 3.1 8B, 8 x H100, FSDP, bf16, local batch 2 x 8192 tokens, selective
   activation checkpointing: 5,762 tokens/s/GPU (6,667 with torch.compile). Source:
   github.com/pytorch/torchtitan docs/performance.md, Table 1 (their H100s: 96 GB HBM2e at 500 W).
2. 2 x p5.48xlarge AllReduce busbw ~487 GB/s at 16 GB, nccl-tests over EFA. Source:
   aws-samples/awsome-distributed-training (micro-benchmarks/nccl-tests), as quoted in podtrain's
   issue 15.
3. nanoGPT, GPT-2 124M on one 8 x A100 40GB node (DDP, bf16, torch.compile, 12 x 1024 tokens per
   micro-batch, 5 micro-batches per GPU per step): "about 4 days" for max_iters=600,000 steps of
   491,520 tokens (github.com/karpathy/nanoGPT README and config/train_gpt2.py) = 294.9B tokens
   in 96 h = 106,667 tokens/s/GPU. "About 4 days" is rounded; the figure is approximate.
"""

from pathlib import Path

from podtrain.config import load_config
from podtrain.plan.machine import instance_machine
from podtrain.plan.planner import make_plan
from podtrain.plan.shape import model_shape

REPO = Path(__file__).resolve().parents[1]


def plan(instance, nodes, *overrides):
    cfg = load_config(str(REPO / "configs/demo.yaml"), ["data.path=/nonexistent", "train.precision=bf16",
                                                        *overrides])
    return make_plan(cfg, model_shape(cfg), instance_machine(instance, "bf16", None, None), nodes, None)


def row(name, predicted, published, unit):
    ratio = predicted / published
    verdict = "within" if 0.7 <= ratio <= 1.3 else "OUTSIDE"
    print(f"{name:<46} predicted {predicted:>10,.0f} {unit:<12} published {published:>10,.0f}  "
          f"ratio {ratio:.2f} ({verdict} 30%)")


def main():
    titan = plan("p5.48xlarge", 1, "model.preset=llama-8b", "data.seq_len=8192",
                 "train.micro_batch_size=2", "train.global_batch_size=16")
    per_gpu = titan.tokens_per_s / titan.world
    ac = " + activation checkpointing" if titan.checkpointing else ""
    print(f"torchtitan case planned as {titan.strategy}{ac}: step {titan.time.step_s:.2f} s "
          f"(compute {titan.time.compute_s:.2f} s, exposed comm {titan.time.sync_wait_s:.3f} s of "
          f"{titan.time.comm_s:.3f} s)")
    row("torchtitan Llama 3.1 8B 8xH100 FSDP", per_gpu, 5762, "tokens/s/GPU")
    row("torchtitan Llama 3.1 8B 8xH100 FSDP + compile", per_gpu, 6667, "tokens/s/GPU")

    p5 = instance_machine("p5.48xlarge", "bf16", None, None)
    row("2 x p5.48xlarge AllReduce busbw, 16 GB", p5.busbw_gbps(2, 16 << 30), 487, "GB/s")

    nano = plan("p4d.24xlarge", 1, "model.preset=gpt2-124m", "data.seq_len=1024",
                "train.micro_batch_size=12", "train.global_batch_size=480")
    row("nanoGPT GPT-2 124M 8xA100 40GB DDP", nano.tokens_per_s / nano.world, 106667, "tokens/s/GPU")


if __name__ == "__main__":
    main()
