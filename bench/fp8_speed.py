"""FP8 (``train.fp8``) against bf16: training tokens/s of the same decoder, side by side in one run (issue 36).

    python bench/fp8_speed.py             # a GPU: llama-8b-shaped layers, seq 8192, compiled blocks
    python bench/fp8_speed.py --dry-run   # the CPU stand-in at tiny shapes (nothing judged)

What it times, per round and in alternation (so the machine's drift hits both alike), one full
training step of the same model on the same tokens: forward, backward and a fused AdamW step.

* ``bf16``: the run's precision as podtrain trains on a GPU (bf16 autocast over fp32 master
  weights), every decoder block compiled (``train.compile=true``);
* ``fp8``: the same, with the decoder's linear layers converted first by podtrain's own
  ``podtrain.train.fp8.convert`` (``--recipe``: tensorwise, or rowwise), exactly what
  ``train.fp8`` runs; then compiled (torchao's casts only pay off fused by the compiler).

The shapes: Llama 3.1 8B's layers at full width (hidden 4096, 32 heads, 8 KV heads, MLP 14336),
``--layers`` of them (4), seq 8192, one sequence per step. The vocabulary is cut to 4096 so the LM
head (bf16 in both: never converted) does not dilute the linear layers' share as a 128k head on 4
layers would. Both models start from the same seed.

The verdict line (``bench/gpu_check.sh`` judges it): ``fp8_speed: ... -> PASS`` when FP8's
tokens/s is at least 1.2x bf16's (median of the rounds' ratios; torchtitan measured 1.28x on
Llama 3.1 8B, 8x H100), with each mode's MFU (podtrain's FLOPs accounting,
``model.model_size``; both against the GPU's dense bf16 peak, so the MFUs compare). ``--dry-run``
runs the same code on the CPU (fp32, no compile, ``_scaled_mm``'s CPU kernel) at tiny shapes and
prints what it would assert on a GPU.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import torch  # noqa: E402

from podtrain.model import build_model, model_size, preset_config  # noqa: E402
from podtrain.train import fp8  # noqa: E402  (before transformers: it mutes torchao's import lines)
from podtrain.train.gpu_defaults import compile_blocks  # noqa: E402

TARGET = 1.2
"""FP8's least tokens/s against bf16's on H100/H200 (issue 36)."""


def build(config, recipe: str, device: torch.device, compiled: bool):
    """The model (converted when ``recipe`` is not off, then compiled) and its fused AdamW."""
    model = build_model(config, "sdpa", seed=0, device=device).train()
    converted = fp8.convert(model, recipe)
    if compiled:
        compile_blocks(model)
    fused = device.type == "cuda"
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=fused, foreach=not fused)
    return model, optimizer, converted


def step(model, optimizer, rows: torch.Tensor, dtype: torch.dtype) -> None:
    """One training step: forward (autocast), the loss, backward, the optimizer."""
    with torch.autocast(rows.device.type, dtype=dtype, enabled=dtype != torch.float32):
        logits = model(input_ids=rows[:, :-1]).logits
    loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), rows[:, 1:].flatten())
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def timed(model, optimizer, rows, dtype, steps: int) -> float:
    """Seconds per step over ``steps`` steps (synchronised at both ends)."""
    sync = torch.cuda.synchronize if rows.device.type == "cuda" else (lambda: None)
    sync()
    t0 = time.perf_counter()
    for _ in range(steps):
        step(model, optimizer, rows, dtype)
    sync()
    return (time.perf_counter() - t0) / steps


def main(argv: list[str] | None = None) -> int:
    """Run the comparison; exit 0 when it passes (or on a dry run), 1 when FP8 is under target."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true", help="CPU, tiny shapes, nothing judged")
    parser.add_argument("--recipe", choices=fp8.RECIPES, default="tensorwise")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--seq", type=int, default=8192)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=3, help="steps per mode per round")
    parser.add_argument("--no-compile", action="store_true", help="eager blocks (FP8's casts unfused: slower)")
    args = parser.parse_args(argv)
    dry = args.dry_run or not torch.cuda.is_available()
    device = torch.device("cpu" if dry else "cuda")
    if not dry:
        fp8.check_supported(args.recipe, device)  # one line on a GPU without FP8 units
    if dry:
        config = preset_config("tiny", 512)
        config.num_hidden_layers, seq, dtype, rounds, steps, compiled = 2, 256, torch.float32, 3, 2, False
    else:
        config = preset_config("llama-8b", 4096)
        config.num_hidden_layers, seq, dtype = args.layers, args.seq, torch.bfloat16
        rounds, steps, compiled = args.rounds, args.steps, not args.no_compile
    config.max_position_embeddings = max(config.max_position_embeddings, seq)
    rows = torch.randint(0, config.vocab_size, (1, seq + 1), generator=torch.Generator().manual_seed(0)).to(device)
    base = "fp32" if dry else "bf16"  # the CPU has no fast bf16: its stand-in is fp32
    modes = {base: "off", "fp8": args.recipe}
    built = {name: build(config, recipe, device, compiled) for name, recipe in modes.items()}
    for model, optimizer, _ in built.values():  # warm up: compile, allocator, autotuning
        for _ in range(2):
            step(model, optimizer, rows, dtype)
    per_round: dict[str, list[float]] = {name: [] for name in built}
    for r in range(rounds):
        order = list(built) if r % 2 == 0 else list(reversed(built))  # drift hits both alike
        for name in order:
            model, optimizer, _ = built[name]
            per_round[name].append(timed(model, optimizer, rows, dtype, steps))
    speedup = statistics.median(b / f for b, f in zip(per_round[base], per_round["fp8"]))
    size = model_size(built[base][0], config, seq)
    from podtrain.observe.hardware import peak_flops

    peak = peak_flops(device, "fp32" if dry else "bf16", None)  # a CPU's is measured
    shown = []
    for name, ts in per_round.items():
        t = statistics.median(ts)
        mfu = f", MFU {size.flops_per_token * seq / t / peak:.1%}" if peak else ""
        shown.append(f"{name} {seq / t:,.0f} tokens/s ({t * 1e3:.1f} ms/step{mfu})")
    where = (f"{'CPU dry run' if dry else torch.cuda.get_device_name()}: {config.num_hidden_layers} layers of "
             f"hidden {config.hidden_size}, MLP {config.intermediate_size}, seq {seq}, "
             f"{built['fp8'][2]} FP8 linear layers ({args.recipe}), {'compiled' if compiled else 'eager'}")
    print(f"fp8_speed: {where}; {'; '.join(shown)}; fp8/{base} {speedup:.2f}x")
    if dry:
        print(f"fp8_speed: dry run, nothing judged; on a GPU it asserts fp8/bf16 tokens/s >= {TARGET:.2f} "
              f"(here the CPU's fp32 against its _scaled_mm kernel: {speedup:.2f}x)")
        return 0
    ok = speedup >= TARGET
    print(f"fp8_speed: fp8/bf16 tokens/s {speedup:.2f}x (target >= {TARGET:.2f}) -> {'PASS' if ok else 'FAIL'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
