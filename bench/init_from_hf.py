"""``model.init_from`` against transformers' ``from_pretrained`` followed by wrapping, side by side.

A Llama-architecture folder (bf16, sharded by ``save_pretrained``) is loaded at 1, 2 and 4 forked
gloo ranks (``tests/multirank.py``) four ways: podtrain under ddp and fsdp (``ckpt.hf_source``:
each rank reads its share), and ``from_pretrained`` on every rank then DDP or ``fully_shard``.
Per rank: bytes of the folder read, peak RSS added by the load (``/proc/self/clear_refs`` resets
the high-water mark first), seconds. ``from_pretrained`` reads every tensor on every rank.

    OMP_NUM_THREADS=1 .venv/bin/python bench/init_from_hf.py [--hidden 512 --layers 8 --vocab 32000]

The podtrain fsdp figure includes what the loop's start does: global rank 0 builds a whole fp32
copy of the model before sharding (``train.strategy.build_for_strategy``), but under
``model.init_from`` without filling it (its memory reserved, never written: only its buffers are
read), so rank 0's peak stays near the other ranks' shard.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
import torch.distributed.checkpoint.state_dict  # noqa: E402,F401  (imported once, before the forks)
import torch.distributed.fsdp  # noqa: E402,F401
import transformers.models.llama.modeling_llama  # noqa: E402,F401

from multirank import gloo_context, run_ranks  # noqa: E402


def _kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    return 0


def _rank(rank, world, folder, mode):
    from podtrain.ckpt.hf_source import load_folder
    from podtrain.model import build_model, decoder_layers, init_config
    from podtrain.train.precision import resolve_precision
    from podtrain.train.strategy import FSDPStrategy, build_for_strategy

    ctx = gloo_context()
    Path("/proc/self/clear_refs").write_text("5")  # the peak RSS starts again from now
    before = _kib("VmRSS")
    t0 = time.perf_counter()
    strategy = mode.split("-")[1]
    if mode.startswith("podtrain"):
        config = init_config(folder, None, {"vocab_size": 0}, "bench")
        if strategy == "ddp" or world == 1:
            net = build_model(config, seed=0, init="zeros")
        else:
            net, reference = build_for_strategy(config, "sdpa", 0, "fsdp", ctx, random_init=False)
            fsdp = FSDPStrategy("fsdp", (world,), ctx, resolve_precision("fp32", ctx.device), True)
            fsdp.fill_weights = False  # as the loop does under model.init_from
            fsdp.wrap(net, reference)
            del reference
        got = load_folder(folder, net, torch.optim.AdamW(net.parameters()), ctx).bytes_read
        if strategy == "ddp" and world > 1:
            from torch.nn.parallel import DistributedDataParallel as DDP

            net = DDP(net)
    else:
        from transformers import AutoModelForCausalLM

        net = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
        got = sum(f.stat().st_size for f in Path(folder).glob("model*.safetensors"))
        if world > 1 and strategy == "ddp":
            from torch.nn.parallel import DistributedDataParallel as DDP

            net = DDP(net)
        elif world > 1:
            from torch.distributed.fsdp import fully_shard

            for layer in decoder_layers(net):
                fully_shard(layer)
            fully_shard(net)
    seconds = time.perf_counter() - t0
    return got, _kib("VmHWM") - before, seconds


def main() -> None:
    """Build the folder, run every mode at every world size, print one table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--ranks", default="1,2,4")
    args = parser.parse_args()
    from transformers import AutoConfig, AutoModelForCausalLM

    with tempfile.TemporaryDirectory() as tmp:
        config = AutoConfig.for_model("llama", hidden_size=args.hidden, intermediate_size=args.hidden * 8 // 3,
                                      num_hidden_layers=args.layers, num_attention_heads=8, num_key_value_heads=4,
                                      vocab_size=args.vocab, tie_word_embeddings=False)
        model = AutoModelForCausalLM.from_config(config).to(torch.bfloat16)
        params = sum(p.numel() for p in model.parameters())
        model.save_pretrained(tmp, max_shard_size="50MB", safe_serialization=True)
        del model
        folder_bytes = sum(f.stat().st_size for f in Path(tmp).glob("model*.safetensors"))
        print(f"folder: {params / 1e6:.1f}M parameters, {folder_bytes / 1e6:.1f} MB bf16 in "
              f"{len(list(Path(tmp).glob('model-*')))} shards; fp32 model {params * 4 / 1e6:.1f} MB")
        print(f"{'mode':<22}{'ranks':>6}{'MB read/rank (max)':>20}{'x 1/N':>8}{'peak +RSS MB (max / min rank)':>32}"
              f"{'seconds':>9}")
        for world in [int(w) for w in args.ranks.split(",")]:
            for mode in ("podtrain-ddp", "podtrain-fsdp", "from_pretrained-ddp", "from_pretrained-fsdp"):
                if world == 1 and mode.endswith("fsdp"):
                    continue
                rows = run_ranks(_rank, world, tmp, mode, timeout=600)
                read = max(r[0] for r in rows)
                rss = [r[1] for r in rows]
                print(f"{mode:<22}{world:>6}{read / 1e6:>20.1f}{read / (folder_bytes / world):>8.2f}"
                      f"{max(rss) / 1e6:>20.0f} / {min(rss) / 1e6:<9.0f}{max(r[2] for r in rows):>9.2f}", flush=True)


if __name__ == "__main__":
    main()
