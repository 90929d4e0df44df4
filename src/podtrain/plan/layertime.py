"""What one training step really does on this host, timed at the run's shapes (``plan --instance-type local``).

The FLOP path (``plan/calibrate.py``) times the step's matmuls and estimates the rest; on a 2-core
host it planned 0.68-0.78 of the measured step, the gap being the norms, activation functions,
rotary embeddings, residual adds, the loss and the optimizer, which a FLOP count does not see. So
here the real pieces of the step run, built by the code training uses, at the run's micro-batch,
seq_len and precision, on the device training would use (CUDA when this host has a GPU):

* **one decoder layer**, forward and backward: the model is built from the run's config with one
  layer (``podtrain.model.build_model``, the run's attention implementation); one forward of it
  captures the layer's real inputs (hidden states, rotary position embeddings, mask arguments),
  which are then replayed through the layer alone with a gradient of its output's shape;
* **its attention** alone (``scaled_dot_product_attention`` at the layer's heads and head width,
  causal, or with the run's document mask), so the attention share of the layer is known
  (FP8 and document masking change the two parts differently: ``plan/published.py``);
* **the ends**: the same model with its layer list emptied runs the training loss
  (``train.loss.micro_batch_loss_sum``: embedding, final norm, LM head over the vocabulary, the
  fp32 cross-entropy) forward and backward;
* **the optimizer** over one layer's parameters and over the ends' (``train.optim.build_optimizer``,
  the run's AdamW implementation, after the step's clipping: a total norm and a scale).

The step's compute is then ``layers x layer + ends`` per micro-batch (activation checkpointing adds
one more forward of each layer, taken as a third of its forward + backward) and the optimizer
``layers x layer's + ends'``; communication stays the ring model of ``plan/steptime.py``. Each piece
is the best of a few trials (``calibrate._best``: a trial shorter than a time slice measures the
core, not the other processes sharing it).

A micro-batch too large to time quickly is timed on fewer sequences (at least one) and scaled
linearly. A shape whose one sequence, or whose weights, are beyond this host (``measurable``: a
70B layer planned on a laptop) is not built: the plan then takes the FLOP path and says so.
"""

from __future__ import annotations

import copy
import time
from typing import Any

import torch

from podtrain.plan.memory import ModelShape
from podtrain.plan.steptime import LayerTiming, decoder_matmul_params

# Largest forward + backward timed at full size (FLOPs of one layer, or of the ends): above it
# fewer sequences are timed and scaled. ~1 s on one CPU core; a few ms on a GPU.
MAX_TIMED_FLOPS = 4e10
# Beyond this many FLOPs for ONE sequence of a layer (or of the ends), or this many bytes of the
# one-layer model's fp32 weights, gradients and AdamW state, the host is not asked: FLOP path.
MAX_SEQUENCE_FLOPS = 2e11
MAX_MODEL_BYTES = 4 << 30
TRIALS = 5


def _sequence_flops(shape: ModelShape, seq_len: int) -> tuple[float, float]:
    """Training FLOPs of one sequence through one layer and through the ends (LM head)."""

    layer = 6.0 * seq_len * decoder_matmul_params(shape) + 12.0 * shape.attn_width * seq_len * seq_len / 2
    return layer, 6.0 * seq_len * shape.hidden * shape.vocab


def measurable(shape: ModelShape, seq_len: int) -> str | None:
    """None when a layer and the ends of ``shape`` can be timed here; else why not (for the plan)."""
    layer, ends = _sequence_flops(shape, seq_len)
    worst = max(layer, ends)
    if worst > MAX_SEQUENCE_FLOPS:
        return (f"one sequence through a layer or the LM head is {worst:.3g} FLOPs, beyond the "
                f"{MAX_SEQUENCE_FLOPS:.0e} this host is asked to time")
    model_params = shape.layer_params + shape.embedding_params + shape.hidden * shape.vocab
    if 16 * model_params > MAX_MODEL_BYTES:
        return (f"a one-layer copy of the model with its state is {16 * model_params / 2**30:.1f} GiB, "
                f"beyond the {MAX_MODEL_BYTES / 2**30:.0f} GiB this host is asked to build")
    return None


def timed_sequences(shape: ModelShape, micro_batch: int, seq_len: int) -> int:
    """How many of the micro-batch's sequences to time: all within MAX_TIMED_FLOPS, else fewer."""
    per = max(_sequence_flops(shape, seq_len))
    return max(1, min(micro_batch, int(MAX_TIMED_FLOPS // per)))


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _best(fn, device: torch.device, trials: int = TRIALS) -> float:
    """The fastest of ``trials`` runs of ``fn`` after a warm-up (fewer once a second is spent)."""
    fn()
    _sync(device)
    best, spent = float("inf"), 0.0
    for done in range(trials):
        if done >= 2 and spent >= 1.0:
            break
        start = time.perf_counter()
        fn()
        _sync(device)
        took = time.perf_counter() - start
        best, spent = min(best, took), spent + took
    return best


def _detached(value: Any) -> Any:
    """``value`` with every tensor detached (captured inputs replayed without the model's graph)."""
    if isinstance(value, torch.Tensor):
        return value.detach()
    if isinstance(value, tuple):
        return tuple(_detached(v) for v in value)
    if isinstance(value, list):
        return [_detached(v) for v in value]
    if isinstance(value, dict):
        return {k: _detached(v) for k, v in value.items()}
    return value


def document_mask(seq_len: int, mean_document: float, device: torch.device) -> torch.Tensor:
    """A [seq_len, seq_len] boolean mask: causal inside documents of ``mean_document`` tokens."""
    length = max(1, min(seq_len, round(mean_document)))
    doc = torch.arange(seq_len, device=device) // length
    pos = torch.arange(seq_len, device=device)
    return (doc[:, None] == doc[None, :]) & (pos[:, None] >= pos[None, :])


def _attention_s(shape: ModelShape, sequences: int, seq_len: int, dtype: torch.dtype, device: torch.device,
                 mask: torch.Tensor | None, gen: torch.Generator) -> float:
    """SDPA forward + backward of one layer's heads over ``sequences`` sequences."""
    head_dim = shape.attn_width // shape.heads
    q, k, v = (torch.randn(sequences, shape.heads, seq_len, head_dim, generator=gen).to(device, dtype)
               .requires_grad_() for _ in range(3))

    def run() -> None:
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None)
        out.sum().backward()

    return _best(run, device)


def time_step_pieces(config: Any, shape: ModelShape, cfg: Any, device: torch.device, threads: int,
                     mean_document: float | None = None) -> LayerTiming:
    """Time the pieces of one step of ``cfg``'s model (a transformers ``config``) on ``device``
    with ``threads`` CPU threads. ``mean_document``: document masking on, documents of this many
    tokens on average (None: causal attention over the whole sequence)."""
    from podtrain.model import build_model, decoder_layers
    from podtrain.train.loss import micro_batch_loss_sum
    from podtrain.train.precision import resolve_precision

    micro_batch, seq_len = cfg.train.micro_batch_size, cfg.data.seq_len
    sequences = timed_sequences(shape, micro_batch, seq_len)
    one = copy.deepcopy(config)
    for name in ("num_hidden_layers", "n_layer"):
        if hasattr(one, name):
            setattr(one, name, 1)
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    rng = torch.get_rng_state()  # the global RNG belongs to training (build_model seeds it)
    try:
        precision = resolve_precision(cfg.train.precision, device)
        gen = torch.Generator().manual_seed(0)
        model = build_model(one, getattr(cfg.model, "attn_implementation", "sdpa"), seed=0, device=device)
        model.train()
        layer = decoder_layers(model)[0]
        captured: dict[str, Any] = {}

        def capture(_module, args, kwargs):
            captured["args"], captured["kwargs"] = _detached(args), _detached(kwargs)

        hook = layer.register_forward_pre_hook(capture, with_kwargs=True)
        rows = torch.randint(0, shape.vocab, (sequences, seq_len + 1), generator=gen).to(device)
        with torch.no_grad():
            micro_batch_loss_sum(model, rows, precision)
        hook.remove()
        args, kwargs = captured["args"], captured["kwargs"]
        hidden = (args[0] if args else kwargs.pop("hidden_states")).detach().requires_grad_()
        args = args[1:]
        # Replayed many times: no KV cache may grow across trials (training builds none either).
        for key in ("past_key_values", "past_key_value", "cache", "layer_past"):
            if key in kwargs:
                kwargs[key] = None
        if "use_cache" in kwargs:
            kwargs["use_cache"] = False
        grad = torch.randn(hidden.shape, generator=gen).to(device, hidden.dtype)

        def layer_step() -> None:
            with precision.autocast():
                out = layer(hidden, *args, **kwargs)
            out = out[0] if isinstance(out, (tuple, list)) else out
            out.backward(grad.to(out.dtype))

        layer_s = _best(layer_step, device)
        dtype = precision.autocast_dtype if precision.autocast_enabled and precision.autocast_dtype else torch.float32
        # On a CPU the run masks through SDPA with an explicit mask: time that. On a GPU it runs
        # flex_attention, which this does not build: the published model applies instead.
        masked = mean_document is not None and device.type == "cpu"
        mask = document_mask(seq_len, mean_document, device) if masked else None
        attention = _attention_s(shape, sequences, seq_len, dtype, device, mask, gen)
        if mask is not None:
            # The layer above ran causal attention; the run's runs masked: swap the difference in.
            layer_s += attention - _attention_s(shape, sequences, seq_len, dtype, device, None, gen)

        optimizer_layer = _optimizer_s(layer, cfg, device)
        parent = next(m for m in model.modules() if isinstance(m, torch.nn.ModuleList) and layer in list(m))
        for index in range(len(parent)):
            del parent[0]
        ends = _best(lambda: micro_batch_loss_sum(model, rows, precision).backward(), device)
        optimizer_ends = _optimizer_s(model, cfg, device)
    finally:
        torch.set_num_threads(previous)
        torch.set_rng_state(rng)
    scale = micro_batch / sequences
    return LayerTiming(layer_s=layer_s * scale, attention_s=attention * scale, ends_s=ends * scale,
                       optimizer_layer_s=optimizer_layer, optimizer_ends_s=optimizer_ends,
                       layers=shape.layers, timed_sequences=sequences, micro_batch=micro_batch,
                       device=device.type, dtype=str(dtype).removeprefix("torch."),
                       masked=mask is not None)


def _optimizer_s(module: torch.nn.Module, cfg: Any, device: torch.device) -> float:
    """The step's clipping and AdamW over ``module``'s parameters, gradients present."""
    from podtrain.train.optim import build_optimizer

    params = [p for p in module.parameters() if p.requires_grad]
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    optimizer = build_optimizer(module, cfg.optim, device)

    def step() -> None:
        norm = torch.nn.utils.get_total_norm([p.grad for p in params])
        torch.nn.utils.clip_grads_with_norm_(params, max(cfg.train.grad_clip, 1e-6), norm)
        optimizer.step()

    return _best(step, device)
