"""Memory per device, itemised, for DDP, FSDP and HSDP: pure arithmetic on a ``ModelShape``.

Training state (AdamW, fp32 master weights, also under bf16 autocast): weights 4, gradients 4,
optimizer 8 bytes per parameter; FSDP divides all three by the world size, HSDP by the ranks of a
node. Activations are what autograd saves for backward, per token (e = bytes of the compute dtype,
h hidden, a = heads x head_dim, kv = kv_heads x head_dim, I = MLP width, V vocabulary):

* per block: both norms' input and output 4h; q, k, v projections a + 2kv; rotary copies of q and k
  a + kv (Llama/Qwen); attention output a (SDPA keeps no seq x seq matrix; eager attention adds
  scores and probabilities 2 x heads x seq_len); MLP 4I when gated (gate, up, act, product) or 8h
  for GPT-2's 4h GELU MLP (input and output of the GELU);
* after the blocks: the final norm 2h, the logits V in the compute dtype plus the loss's fp32 copy
  and log-softmax 8V bytes.

With activation checkpointing every block keeps only its input (h) and one block's activations
live again during its recomputation (Korthikanti et al. 2022, "Reducing Activation Recomputation in
Large Transformer Models", the same accounting).

Task evaluation during training (``eval.tasks``) runs between steps, when no micro-batch's
activations are held, with the model as training holds it (sharded under FSDP/HSDP: no copy), on
forwards of at most a training micro-batch's tokens (``train/evaluations.py``). It saves nothing
for backward, but keeps KV caches: ``task_eval_bytes``. The activations item is the larger of
the two, so a run whose evaluation would not fit is refused at start like one whose step would not.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

# Bytes per parameter of the training state, fp32 master weights and AdamW's two moments.
WEIGHT_BYTES, GRAD_BYTES, OPTIM_BYTES = 4, 4, 8


def checkpoint_bytes(params: int) -> int:
    """Bytes of one checkpoint of a model of ``params`` parameters, all ranks together: fp32
    weights and AdamW's two moments (the data position, RNG and metadata are small beside them)."""
    return (WEIGHT_BYTES + OPTIM_BYTES) * params


# Per-process memory that is not tensors: the CUDA context, cuBLAS/NCCL workspaces and allocator
# fragmentation on a GPU; the interpreter, torch and transformers on a CPU rank.
GPU_RESERVE_BYTES = 3 * 2**30
CPU_RESERVE_BYTES = 600 * 2**20
STRATEGIES = ("ddp", "fsdp", "hsdp")


@dataclass(frozen=True)
class ModelShape:
    """The numbers of a model the plan needs (from ``podtrain.plan.shape.model_shape``)."""

    params: int
    """Trainable parameters (tied weights once)."""
    embedding_params: int
    """Input-embedding parameters."""
    matmul_params: int
    """Parameters in matmuls per token (``ModelSize.matmul_params``)."""
    flops_per_token: float
    """Training FLOPs per token at the plan's seq_len (``ModelSize.flops_per_token``)."""
    layers: int
    """Transformer blocks."""
    hidden: int
    """Residual width."""
    attn_width: int
    """num_heads x head_dim."""
    kv_width: int
    """num_kv_heads x head_dim."""
    heads: int
    """Attention heads."""
    intermediate: int
    """MLP width."""
    vocab: int
    """Vocabulary (logits per token)."""
    gated_mlp: bool
    """SwiGLU-style MLP (Llama, Qwen) rather than GPT-2's GELU MLP."""
    rotary: bool
    """Rotary position embeddings (copies of q and k are saved)."""

    @property
    def layer_params(self) -> int:
        """Parameters of one block (what FSDP gathers at a time)."""
        head = 0 if self.params == self.matmul_params else self.vocab * self.hidden  # untied LM head
        return max(1, (self.params - self.embedding_params - head) // max(1, self.layers))


@dataclass(frozen=True)
class MemoryItems:
    """Bytes per device, itemised; ``total`` sums them."""

    weights: int
    gradients: int
    optimizer: int
    activations: int
    buffers: int
    reserve: int
    task_eval: int = 0
    """Task evaluation's forwards (``eval.tasks``; 0 without): already in ``activations`` when larger."""

    @property
    def static(self) -> int:
        """Everything but activations: what a micro-batch of 0 would need."""
        return self.weights + self.gradients + self.optimizer + self.buffers + self.reserve

    @property
    def total(self) -> int:
        """All items."""
        return self.static + self.activations

    def as_dict(self) -> dict[str, int]:
        """The items and the total, for JSON."""
        return {**asdict(self), "total": self.total}


def shard_factor(strategy: str, world: int, devices_per_node: int) -> int:
    """Ranks the training state is divided over: 1 (ddp), the world (fsdp), a node (hsdp)."""
    if strategy == "ddp":
        return 1
    if strategy == "fsdp":
        return max(1, world)
    return max(1, min(world, devices_per_node))


def block_activation_bytes_per_token(shape: ModelShape, dtype_bytes: int, seq_len: int,
                                     eager_attention: bool = False) -> int:
    """Bytes one block saves for backward per token (see the module docstring)."""
    h, a, kv = shape.hidden, shape.attn_width, shape.kv_width
    items = 4 * h + (a + 2 * kv) + a
    if shape.rotary:
        items += a + kv
    items += 4 * shape.intermediate if shape.gated_mlp else 8 * h
    if eager_attention:
        items += 2 * shape.heads * seq_len
    return items * dtype_bytes


def head_activation_bytes_per_token(shape: ModelShape, dtype_bytes: int) -> int:
    """Bytes after the blocks per token: final norm, logits, the loss's fp32 copies."""
    return 2 * shape.hidden * dtype_bytes + shape.vocab * (dtype_bytes + 8)


def task_eval_bytes(shape: ModelShape, micro_batch: int, seq_len: int, dtype_bytes: int,
                    eager_attention: bool = False) -> int:
    """Memory of one task-evaluation forward of ``micro_batch`` x ``seq_len`` tokens (its bound):
    the KV caches of every block, twice (a multiple-choice context's cache beside its copies for
    the choices: ``eval.scoring``), 2 x 2 kv per token per block; one block's values at a time
    (no autograd: as a block saves them for backward); and after the blocks the log-probabilities
    at the scored positions, at most every token (``head_activation_bytes_per_token``)."""
    cache = 2 * shape.layers * 2 * shape.kv_width * dtype_bytes
    block = block_activation_bytes_per_token(shape, dtype_bytes, seq_len, eager_attention)
    return micro_batch * seq_len * (cache + block + head_activation_bytes_per_token(shape, dtype_bytes))


def activation_bytes(shape: ModelShape, micro_batch: int, seq_len: int, dtype_bytes: int,
                     checkpointing: bool, eager_attention: bool = False) -> int:
    """Activations of one micro-batch of ``micro_batch`` x ``seq_len`` tokens."""
    tokens = micro_batch * seq_len
    block = block_activation_bytes_per_token(shape, dtype_bytes, seq_len, eager_attention)
    blocks = (shape.layers * shape.hidden * dtype_bytes + block) if checkpointing else shape.layers * block
    return tokens * (blocks + head_activation_bytes_per_token(shape, dtype_bytes))


def memory_items(shape: ModelShape, strategy: str, shards: int, micro_batch: int, seq_len: int,
                 dtype_bytes: int, checkpointing: bool, gpu: bool, bucket_view: bool = True,
                 eager_attention: bool = False, task_eval: bool = False) -> MemoryItems:
    """Memory per device for ``strategy`` with the state divided over ``shards`` ranks;
    ``task_eval``: the run scores ``eval.tasks`` (activations: the larger of a step's and an
    evaluation forward's, see the module docstring).

    Buffers: DDP's gradient buckets unless gradients are bucket views (4 bytes/param), the
    autocast copies of the matmul weights in 16-bit (2 bytes each); FSDP/HSDP gather two blocks at
    a time (the current one and the prefetched next) in the compute dtype and reduce-scatter their
    gradients.
    """
    p = shape.params
    autocast = dtype_bytes < 4
    if strategy == "ddp":
        buffers = (0 if bucket_view else GRAD_BYTES * p) + (2 * shape.matmul_params if autocast else 0)
    else:
        gathered = max(shape.layer_params, shape.embedding_params)
        buffers = 2 * gathered * (dtype_bytes + GRAD_BYTES)
    training = activation_bytes(shape, micro_batch, seq_len, dtype_bytes, checkpointing, eager_attention)
    evaluation = task_eval_bytes(shape, micro_batch, seq_len, dtype_bytes, eager_attention) if task_eval else 0
    return MemoryItems(
        weights=WEIGHT_BYTES * p // shards, gradients=GRAD_BYTES * p // shards,
        optimizer=OPTIM_BYTES * p // shards, activations=max(training, evaluation),
        buffers=buffers, reserve=GPU_RESERVE_BYTES if gpu else CPU_RESERVE_BYTES, task_eval=evaluation)


def largest_micro_batch(items_at_one: MemoryItems, per_sequence: int, device_bytes: int) -> int:
    """The largest micro-batch whose memory fits ``device_bytes`` (0 when not even the static
    memory fits); ``items_at_one`` is the memory at micro-batch 1."""
    free = device_bytes - items_at_one.static
    return max(0, free // per_sequence) if per_sequence > 0 else 0
