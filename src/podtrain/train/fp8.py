"""``train.fp8``: the decoder's linear layers trained in FP8 through torchao's ``Float8Linear``.

torchao's ``convert_to_float8_training`` swaps ``nn.Linear`` modules for ``Float8Linear``: their
matmuls (forward, and both of backward's) cast inputs, weights and output gradients to FP8 with a
dynamic scale (``tensorwise``: one scale per tensor; ``rowwise``: one per row, scales rounded to
powers of 2) and run ``torch._scaled_mm``. What changes is the arithmetic of those matmuls only:

* the weights stay fp32 master weights under the same parameter names (``Float8Linear`` is an
  ``nn.Linear``), so checkpoints, resume, the offline reader and ``podtrain export`` see the same
  tensors as without FP8, and an export is plain Hugging Face weights;
* everything else (embedding, norms, attention's softmax, the LM head, the loss) stays in the run's
  ``train.precision``. Under autocast (DDP, one process) a converted layer returns autocast's
  dtype as ``F.linear`` would: torchao casts its input to CUDA autocast's dtype, and autocast's
  own cast of the FP8 operands (on the CPU too) only relabels their output dtype (torchao's
  ``_to_copy`` of a ``Float8TrainingTensor``), so the matmul stays FP8. Under FSDP/HSDP the
  weights are gathered in ``MixedPrecisionPolicy``'s dtype as before, or, with ``tensorwise``,
  already in FP8 (torchao's FP8 all-gather of weights: half of bf16's bytes), their scales
  computed for all layers in one all-reduce after each optimizer step (``precompute_scales``);
* the embedding and the LM head are never converted (the LM head's logits feed the loss directly:
  FP8 there costs accuracy for little speed), nor is any linear whose dimensions are not multiples
  of 16, which ``torch._scaled_mm`` requires.

Where FP8 cannot run, training is refused in one line before any collective of the model:
torchao is missing, or the GPU has no FP8 units (compute capability below 8.9: Ada, Hopper and
newer have them). On a CPU the same code runs (``_scaled_mm`` has a CPU kernel, slowly), so the
tests train FP8 on gloo ranks.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from podtrain.distributed.group import accelerator_capability
from podtrain.errors import UserError
from podtrain.model import decoder_layers

RECIPES = ("tensorwise", "rowwise")
"""The ``train.fp8`` values that turn FP8 on (torchao's ``Float8LinearRecipeName``s); ``off``
keeps every matmul in ``train.precision``."""
MIN_CAPABILITY = (8, 9)
"""FP8 tensor cores: Ada (8.9), Hopper (9.0) and newer."""
MULTIPLE = 16
"""``torch._scaled_mm`` needs both dimensions of an FP8 weight to be multiples of 16."""
INSTALL = "pip install 'podtrain[fp8]'"


def import_float8():
    """``torchao.float8``, imported quietly; a one-line ``UserError`` when torchao is missing."""
    try:
        import torchao.float8 as float8
    except ImportError:
        raise UserError(f"train.fp8 needs torchao: {INSTALL}") from None
    return float8


def check_supported(recipe: str, device: torch.device) -> None:
    """Refuse, in one line, a ``train.fp8`` that cannot run here: torchao missing, or a GPU
    without FP8 units. ``off`` is always fine; the CPU runs FP8 (slowly: tests, not training)."""
    if recipe == "off":
        return
    import_float8()
    capability = accelerator_capability(device)
    if capability is not None and tuple(capability) < MIN_CAPABILITY:
        name = torch.cuda.get_device_name(device)
        raise UserError(f"train.fp8={recipe} needs a GPU with FP8 units (compute capability >= "
                        f"{MIN_CAPABILITY[0]}.{MIN_CAPABILITY[1]}: L4, L40S, H100, H200, B200), but "
                        f"{name} has {capability[0]}.{capability[1]}: set train.fp8=off")


def float8_config(recipe: str, fp8_all_gather: bool):
    """torchao's ``Float8LinearConfig`` for ``recipe``; ``fp8_all_gather``: FSDP2 gathers the
    weights already cast to FP8 (tensorwise only: torchao has no row-wise FP8 all-gather)."""
    float8 = import_float8()
    config = float8.Float8LinearConfig.from_recipe_name(recipe)
    if fp8_all_gather and recipe == "tensorwise":
        import dataclasses

        config = dataclasses.replace(config, enable_fsdp_float8_all_gather=True)
    return config


def linear_filter(model: nn.Module) -> Callable[[nn.Module, str], bool]:
    """torchao's ``module_filter_fn``: the ``nn.Linear`` layers inside the decoder blocks whose
    dimensions are multiples of 16 (``_scaled_mm``'s requirement; a layer that is not stays in
    ``train.precision``). The LM head and the embedding are outside the blocks, so never chosen."""
    inside = {id(m) for layer in decoder_layers(model) for m in layer.modules()}

    def keep(module: nn.Module, fqn: str) -> bool:
        if not isinstance(module, nn.Linear) or id(module) not in inside:
            return False
        out_features, in_features = module.weight.shape
        return out_features % MULTIPLE == 0 and in_features % MULTIPLE == 0

    return keep


def convert(model: nn.Module, recipe: str, fp8_all_gather: bool = False) -> int:
    """Swap the decoder's linear layers (``linear_filter``) for ``Float8Linear`` in place, before
    any wrapper or compile (on the meta device too: FSDP's empty model); returns how many."""
    if recipe == "off":
        return 0
    float8 = import_float8()
    keep = linear_filter(model)
    float8.convert_to_float8_training(model, module_filter_fn=keep,
                                      config=float8_config(recipe, fp8_all_gather))
    return len(float8_linears(model))


def float8_linears(model: nn.Module) -> list[nn.Module]:
    """The model's ``Float8Linear`` layers (none when torchao was never imported)."""
    import sys

    module = sys.modules.get("torchao.float8.float8_linear")
    if module is None:
        return []
    return [m for m in model.modules() if isinstance(m, module.Float8Linear)]


def fp8_all_gather(model: nn.Module) -> bool:
    """Whether any layer's weight is gathered by FSDP2 in FP8 (torchao's weight subclass)."""
    import sys

    fsdp_utils = sys.modules.get("torchao.float8.fsdp_utils")
    if fsdp_utils is None:
        return False
    from torch.distributed.tensor import DTensor

    return any(isinstance(m.weight, DTensor)
               and isinstance(m.weight._local_tensor, fsdp_utils.WeightWithDynamicFloat8CastTensor)
               for m in float8_linears(model))


def precompute_scales(model: nn.Module) -> None:
    """After the optimizer step (every rank): the FP8 scales of every FSDP-sharded FP8 weight in
    one all-reduce (torchao's ``precompute_float8_dynamic_scale_for_fsdp``), instead of one
    all-reduce per weight at its next all-gather."""
    import_float8().precompute_float8_dynamic_scale_for_fsdp(model)


def forget_scales(model: nn.Module) -> None:
    """Drop the precomputed scales: the weights were replaced (a checkpoint restored, a rollback),
    so the next all-gather computes each weight's scale from its new values (torchao's dynamic
    path) until the next optimizer step precomputes them again. No collective."""
    from torch.distributed.tensor import DTensor

    for module in float8_linears(model):
        weight = module.weight
        local = weight._local_tensor if isinstance(weight, DTensor) else weight
        if hasattr(local, "_precomputed_scale"):
            local._precomputed_scale = None


def describe(recipe: str, converted: int, fp8_all_gather: bool) -> str:
    """The start-up line's phrase: ``fp8 tensorwise on 28 linear layers (FP8 all-gather)``."""
    if recipe == "off":
        return ""
    return f"fp8 {recipe} on {converted} linear layers" + (" (FP8 weight all-gather)" if fp8_all_gather else "")
