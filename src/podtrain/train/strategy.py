"""How the model is spread over the ranks: ``dist.strategy`` = ddp, fsdp or hsdp, in one place.

* ``ddp``: every rank holds the whole model; gradients are all-reduced (DistributedDataParallel,
  bucketed and overlapped with backward; micro-batches but the last under ``no_sync``).
* ``fsdp``: FSDP2 (``torch.distributed.fsdp.fully_shard``) on each decoder layer and on the root:
  weights, gradients and optimizer state are sharded over all ranks; a layer's weights are
  all-gathered just before its forward and its backward and freed after; gradients are
  reduce-scattered layer by layer during backward.
* ``hsdp``: the same on a 2-D mesh (replicate, shard): sharded within groups of
  ``dist.shard_size`` ranks (default: the node's ranks, so the all-gathers stay on NVLink),
  replicated across the groups (one gradient all-reduce per step crosses the network).

The loop asks ``build_strategy`` for one and calls ``wrap`` once; the ``Stepper`` then calls
``micro_batch(last)`` around every micro-batch and ``clip`` once per step without knowing which
strategy runs. ``train.activation_checkpointing=full`` recomputes each decoder layer's activations
in backward, under every strategy (``checkpoint_activations``). ``train.fp8`` converts the decoder's
linear layers to torchao's ``Float8Linear`` in ``wrap``, before compile and before DDP or
``fully_shard`` (``podtrain.train.fp8``); under fsdp/hsdp with ``tensorwise`` the weights are then
all-gathered in FP8, their scales precomputed after each optimizer step (``after_optimizer_step``).
"""

from __future__ import annotations

import contextlib
import functools

import torch
from torch import nn

from podtrain.config_sections import DistSection
from podtrain.distributed.group import DistContext
from podtrain.errors import UserError
from podtrain.plan.fit import accumulation_phrase
from podtrain.model import build_model, decoder_layers
from podtrain.train import fp8 as fp8_training
from podtrain.train.gpu_defaults import compile_blocks
from podtrain.train.precision import Precision
from podtrain.train.replicas import buffers_need_forward_sync, ddp_buffer_arguments


def checkpoint_activations(model: nn.Module) -> int:
    """Recompute each decoder layer's activations in backward instead of keeping them.

    The layer's own ``forward`` is wrapped (non-reentrant ``torch.utils.checkpoint``), so its
    parameter names stay those of the checkpoints, and FSDP's hooks around the layer still run
    outside the recomputed region (a layer's weights are gathered once for its forward and once
    for its backward, recomputation included). Returns the number of layers wrapped.
    """
    from torch.utils.checkpoint import checkpoint

    layers = decoder_layers(model)
    for layer in layers:
        layer.forward = functools.partial(checkpoint, layer.forward, use_reentrant=False)
    return len(layers)


def build_for_strategy(config, attn_implementation: str, seed: int, strategy: str,
                       ctx: DistContext, random_init: bool = True) -> tuple[nn.Module, nn.Module | None]:
    """``(model, reference)``: this rank's model before ``Strategy.wrap``.

    ddp (and one process): the model itself, initialised from ``seed`` on the CPU (the same
    weights for a seed under every strategy and on every GPU model), then moved to the device.
    fsdp/hsdp: an empty model on the meta device, and on global rank 0 a whole CPU copy
    initialised from ``seed`` (None elsewhere): ``FSDPStrategy.wrap`` shards the empty model and
    fills every rank's shards from rank 0's copy, so no device ever holds the whole model.

    ``random_init=False`` (``model.init_from``: every weight is loaded after the wrap): no random
    initialisation; ddp's weights are zeros, and rank 0's fsdp copy is ``empty`` (its weights'
    memory never touched): ``FSDPStrategy.wrap`` takes only its buffers
    (``fill_weights=False``), so no rank holds the whole model.
    """
    if strategy == "ddp" or not ctx.initialized:
        return build_model(config, attn_implementation, seed=seed,
                           init="random" if random_init else "zeros").to(ctx.device), None
    reference = build_model(config, attn_implementation, seed=seed, device="cpu",
                            init="random" if random_init else "empty") if ctx.is_main else None
    return build_model(config, attn_implementation, device="meta"), reference


def copy_weights(model: nn.Module, reference: nn.Module | None, sharded: bool) -> None:
    """Copy ``reference``'s weights into ``model``'s live tensors in place (every rank calls).
    ``sharded``: only global rank 0 holds a ``reference`` and each rank keeps its shards of it
    (collective); else every rank copies its own (an unwrapped model, no collective)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    if sharded:
        set_model_state_dict(model, reference.state_dict() if reference is not None else {},
                             options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    else:
        model.load_state_dict(reference.state_dict())


def shard_group_size(cfg: DistSection, world_size: int, local_world_size: int) -> int:
    """hsdp's shard dimension: ``dist.shard_size``, else the node's ranks; it must divide the world."""
    size = cfg.shard_size or local_world_size
    if size < 1 or world_size % size:
        raise UserError(f"config key 'dist.shard_size' ({size}) must divide the world size {world_size} "
                        "(hsdp shards within groups of dist.shard_size ranks and replicates across them)")
    return size


class Strategy:
    """One process: no wrapper, no communication. The base of the distributed strategies.

    Attributes:
        name: ddp, fsdp or hsdp.
        sharded: the parameters are DTensor shards (every rank then writes its part of a checkpoint).
        sync_op: the collective that synchronises gradients (for the collective record), or None.
        grads_to_none: ``zero_grad(set_to_none=...)``; DDP's bucket views are zeroed in place.
        module: the wrapped module, once ``wrap`` ran.
        compile_blocks: ``train.compile``: ``wrap`` compiles each decoder block before wrapping
            (``podtrain.train.gpu_defaults.compile_blocks``); ``compiled`` says how many.
        fp8: ``train.fp8``: off, tensorwise or rowwise; ``wrap`` converts the decoder's linear
            layers first (``podtrain.train.fp8.convert``); ``fp8_layers`` says how many, and
            ``fp8_all_gather`` whether FSDP2 gathers their weights in FP8.
    """

    name = "ddp"
    sharded = False
    sync_op: str | None = None
    compile_blocks = False
    compiled = 0
    fp8 = "off"
    fp8_layers = 0
    fp8_all_gather = False

    def __init__(self) -> None:
        self.grads_to_none = True
        self.module: nn.Module | None = None

    def wrap(self, model: nn.Module, reference: nn.Module | None = None) -> nn.Module:
        """Prepare ``model`` for training (every rank calls); returns the module to call forward on.
        ``reference``: see ``build_for_strategy`` (sharded strategies only)."""
        self._prepare(model)
        self.module = model
        return model

    def _prepare(self, model: nn.Module) -> None:
        """FP8 linear layers, then compiled decoder blocks, when asked (before any wrapper, after
        any inspecting forward): the compiled graphs then hold the FP8 casts and matmuls."""
        self.fp8_layers = fp8_training.convert(model, self.fp8, fp8_all_gather=self.sharded)
        self.fp8_all_gather = self.sharded and self.fp8 == "tensorwise"
        if self.compile_blocks:
            self.compiled = compile_blocks(model)

    def after_optimizer_step(self) -> None:
        """Called by the ``Stepper`` after every optimizer step (every rank): nothing here."""

    def micro_batch(self, last: bool) -> contextlib.AbstractContextManager:
        """Context for one micro-batch's forward and backward; gradients are synchronised on ``last``."""
        return contextlib.nullcontext()

    def clip(self, params: list[torch.Tensor], max_norm: float,
             scale: torch.Tensor | None = None) -> torch.Tensor:
        """Clip the gradients to ``max_norm`` (inf: only measure, touch no gradient); returns
        the global norm as a device tensor (no host sync). ``scale``: the gradients are the true
        ones times it (fp16's loss scale): the norm returned and clipped against is divided by it."""
        grads = [p.grad for p in params if p.grad is not None]
        norm = torch.nn.utils.get_total_norm(grads)
        if scale is not None:
            norm = norm / scale
        if max_norm != float("inf"):
            torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm)
        return norm

    def forward_precision(self, precision: Precision) -> Precision:
        """The precision the step's forward runs under (autocast, unless the strategy casts)."""
        return precision

    def describe(self) -> str:
        """One phrase for the start-up line."""
        return self.name + self._compiled_phrase()

    def _compiled_phrase(self) -> str:
        phrase = fp8_training.describe(self.fp8, self.fp8_layers, self.fp8_all_gather)
        return (f", {phrase}" if phrase else "") + (
            f", torch.compile per decoder block ({self.compiled})" if self.compiled else "")

    def release(self) -> None:
        """Drop the wrapper (DDP's reducer must go before the process group is destroyed)."""
        self.module = None


class DDPStrategy(Strategy):
    """DistributedDataParallel; every micro-batch but the last under ``no_sync``."""

    sync_op = "all_reduce"

    def __init__(self, cfg: DistSection, ctx: DistContext, seq_len: int) -> None:
        super().__init__()
        self.cfg, self.ctx, self.seq_len = cfg, ctx, seq_len
        self.grads_to_none = not cfg.gradient_as_bucket_view

    @classmethod
    def of(cls, ddp: nn.Module, gradient_as_bucket_view: bool = False) -> "DDPStrategy":
        """The strategy of an already built DDP module (tests and benchmarks build their own)."""
        strategy = cls.__new__(cls)
        Strategy.__init__(strategy)
        strategy.module = ddp
        strategy.grads_to_none = not gradient_as_bucket_view
        return strategy

    def wrap(self, model: nn.Module, reference: nn.Module | None = None) -> nn.Module:
        """DDP around the model; buffers are broadcast before every forward only when they must be."""
        from torch.nn.parallel import DistributedDataParallel as DDP

        cfg, ctx = self.cfg, self.ctx
        sync_buffers = buffers_need_forward_sync(model, ctx, self.seq_len)  # a forward: before compiling
        self._prepare(model)
        self.module = DDP(model, device_ids=[ctx.device.index] if ctx.is_cuda else None,
                          **ddp_buffer_arguments(sync_buffers), bucket_cap_mb=cfg.bucket_cap_mb,
                          gradient_as_bucket_view=cfg.gradient_as_bucket_view,
                          static_graph=cfg.static_graph, find_unused_parameters=cfg.find_unused_parameters)
        return self.module

    def micro_batch(self, last: bool) -> contextlib.AbstractContextManager:
        """All-reduce only after the last micro-batch (overlapped with its backward)."""
        return contextlib.nullcontext() if last else self.module.no_sync()


class FSDPStrategy(Strategy):
    """FSDP2 on a 1-D (fsdp) or 2-D (hsdp: replicate x shard) device mesh.

    Args:
        name: fsdp or hsdp.
        mesh_shape: ``(world,)`` for fsdp, ``(replica groups, shard_size)`` for hsdp.
        ctx: the process group's context (device type for the mesh).
        precision: bf16 runs the forward and backward in the parameters' compute dtype through
            ``MixedPrecisionPolicy`` (gradients reduced in fp32, fp32 master weights sharded),
            so autocast is not needed on top.
        accumulate_unsharded: between micro-batches keep the weights gathered and the gradients
            unsharded and local (no reduce-scatter, no re-gather per micro-batch: faster), at the
            cost of full gradients and weights on every rank; the memory check decides
            (``podtrain.plan.fit.accumulates_unsharded``, as ``podtrain plan`` does).
    """

    sharded = True
    sync_op = "reduce_scatter"

    def __init__(self, name: str, mesh_shape: tuple[int, ...], ctx: DistContext, precision: Precision,
                 accumulate_unsharded: bool) -> None:
        super().__init__()
        self.name, self.mesh_shape, self.ctx = name, mesh_shape, ctx
        self.precision = precision
        self.accumulate_unsharded = accumulate_unsharded
        self.mesh = None
        self.fill_weights = True
        """False: ``wrap`` fills only the buffers from the reference; the weights are loaded after
        (``model.init_from``, or the checkpoint a resume restores)."""

    def wrap(self, model: nn.Module, reference: nn.Module | None = None) -> nn.Module:
        """``fully_shard`` each decoder layer, then the root (embeddings, final norm, LM head), of
        ``build_for_strategy``'s empty (meta-device) model; then the shards are filled from rank
        0's whole ``reference``, so every rank trains the same model.
        """
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        if not all(p.is_meta for p in model.parameters()):
            raise ValueError("FSDPStrategy.wrap takes build_for_strategy's empty (meta-device) model")
        self.mesh = device_mesh(self.ctx, self.mesh_shape)
        dtype = self.precision.autocast_dtype
        policy = (MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32) if dtype
                  else MixedPrecisionPolicy())
        # With room for the gathered weights (accumulate_unsharded), a layer gathered for the
        # forward stays gathered through its backward: one all-gather per layer per step.
        keep = self.accumulate_unsharded
        self._prepare(model)  # before fully_shard: FSDP's hooks and collectives stay outside the graphs
        for layer in decoder_layers(model):
            fully_shard(layer, mesh=self.mesh, mp_policy=policy, reshard_after_forward=not keep)
        fully_shard(model, mesh=self.mesh, mp_policy=policy)  # the root: FSDP keeps it gathered
        if self.fp8_all_gather:
            # Every load of weights (the fill below, a resume, a rollback, model.init_from) goes
            # through load_state_dict (torch's set_state_dict): scales precomputed from the
            # weights before it must not be used for the new ones.
            model.register_load_state_dict_post_hook(lambda module, keys: fp8_training.forget_scales(module))
        self._fill_from_rank0(model, reference)
        self.module = model
        return model

    def after_optimizer_step(self) -> None:
        """FP8 all-gather: the scales of all FP8 weights from their new values in one all-reduce
        (torchao's ``precompute_float8_dynamic_scale_for_fsdp``, where torchao says: after the
        optimizer step), instead of one all-reduce per weight in the next step's all-gathers."""
        if self.fp8_all_gather:
            fp8_training.precompute_scales(self.module)

    def _fill_from_rank0(self, model: nn.Module, reference: nn.Module | None) -> None:
        """Allocate this rank's shards and buffers on its device and fill them from global rank
        0's whole ``reference``: one tensor at a time, each rank keeping its shard of it."""
        import torch.distributed as dist

        model.to_empty(device=self.ctx.device)
        if self.fill_weights:
            copy_weights(model, reference, sharded=True)
        # Buffers (rotary inv_freq: not in the state dict) are replicated, not sharded.
        whole = dict(reference.named_buffers()) if reference is not None else {}
        with torch.no_grad():
            for name, buffer in model.named_buffers():
                if name in whole:
                    buffer.copy_(whole[name])
                dist.broadcast(buffer, src=0)

    def micro_batch(self, last: bool) -> contextlib.AbstractContextManager:
        """With ``accumulate_unsharded``, the micro-batches before the last keep the weights
        gathered (``wrap`` keeps them after forward, this after backward: one all-gather per
        layer per step) and their gradients local (no reduce-scatter); the last reduces the
        accumulated gradient once and reshards."""
        if self.accumulate_unsharded:
            self.module.set_requires_gradient_sync(last)
            self.module.set_reshard_after_backward(last)
        return contextlib.nullcontext()

    def clip(self, params: list[torch.Tensor], max_norm: float,
             scale: torch.Tensor | None = None) -> torch.Tensor:
        """The norm of the sharded gradients: each rank's partial norm, reduced over the mesh
        (``full_tensor``); every shard is then scaled by the same factor. (``scale``: as
        ``Strategy.clip``; fp16 is refused under fsdp/hsdp, so it is None here.)"""
        from torch.distributed.tensor import DTensor

        grads = [p.grad for p in params if p.grad is not None]
        norm = torch.nn.utils.get_total_norm(grads)
        if isinstance(norm, DTensor):
            norm = norm.full_tensor()
        if scale is not None:
            norm = norm / scale
        if max_norm != float("inf"):
            torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm)
        return norm

    def forward_precision(self, precision: Precision) -> Precision:
        """FSDP already casts the weights (``MixedPrecisionPolicy``): no autocast on top."""
        return Precision(name=precision.name, device_type=precision.device_type, autocast_enabled=False)

    def describe(self) -> str:
        """``fsdp over 8 ranks`` or ``hsdp 2 x 4 (replicas x shard)``, and the accumulation mode."""
        shape = (f"over {self.mesh_shape[0]} ranks" if len(self.mesh_shape) == 1
                 else f"{self.mesh_shape[0]} x {self.mesh_shape[1]} (replicas x shard)")
        return (f"{self.name} {shape}, gradient accumulation "
                f"{accumulation_phrase(self.accumulate_unsharded)}{self._compiled_phrase()}")


def device_mesh(ctx: DistContext, shape: tuple[int, ...]):
    """The ``DeviceMesh`` of fsdp (1-D over the default group) or hsdp (2-D: replicate x shard).

    hsdp's subgroups are made by ``ctx.new_subgroups`` (podtrain's collective timeout, switched
    to the steady-state one with the default group), not by ``init_device_mesh``, whose subgroups
    would keep the backend's default (NCCL: 10 minutes) whatever dist.timeout_s says.
    """
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh

    if len(shape) == 1:
        return DeviceMesh.from_group(dist.group.WORLD, ctx.device.type, mesh_dim_names=("shard",))
    layout = torch.arange(ctx.world_size).view(shape)
    replicate = ctx.new_subgroups(layout.t().tolist())  # same shard index, one per replica group
    shard = ctx.new_subgroups(layout.tolist())  # consecutive ranks: a node's, by default
    return DeviceMesh.from_group([replicate, shard], ctx.device.type, mesh=layout,
                                 mesh_dim_names=("replicate", "shard"))


def build_strategy(cfg: DistSection, ctx: DistContext, precision: Precision, seq_len: int,
                   accumulate_unsharded: bool = True, compile_blocks: bool = False,
                   fp8_recipe: str = "off") -> Strategy:
    """The strategy ``dist.strategy`` names for this job (one process: no wrapper at all);
    ``compile_blocks``: ``train.compile``, ``fp8_recipe``: ``train.fp8`` (see ``Strategy``;
    refused in one line where FP8 cannot run: ``podtrain.train.fp8.check_supported``)."""
    fp8_training.check_supported(fp8_recipe, ctx.device)
    strategy = _strategy_for(cfg, ctx, precision, seq_len, accumulate_unsharded)
    strategy.compile_blocks = compile_blocks
    strategy.fp8 = fp8_recipe
    return strategy


def _strategy_for(cfg: DistSection, ctx: DistContext, precision: Precision, seq_len: int,
                  accumulate_unsharded: bool) -> Strategy:
    if not ctx.initialized:
        return Strategy()
    if cfg.strategy == "ddp":
        return DDPStrategy(cfg, ctx, seq_len)
    world = ctx.world_size
    if cfg.strategy == "fsdp":
        shape: tuple[int, ...] = (world,)
    else:
        shard = shard_group_size(cfg, world, ctx.env.local_world_size)
        shape = (world // shard, shard)
    return FSDPStrategy(cfg.strategy, shape, ctx, precision, accumulate_unsharded)
