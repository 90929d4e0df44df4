"""The sections of the run configuration: one dataclass per section, a docstring per key.

``config.py`` reads YAML and overrides into these, checks them and writes them back; the docs'
config reference (docs/reference/config.md) is generated from the docstrings here (``python -m
podtrain.docs_gen``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class RunSection:
    """Where the run lives and what makes it reproducible."""

    dir: str = "runs/demo"
    """Run directory: config.yaml, metrics.jsonl, ckpt/, logs/, debug/ go here (shared by nodes)."""
    seed: int = 1234
    """Seed for model init (same on every rank) and data order."""


@dataclass
class ModelSection:
    """Which architecture to pre-train (random init, or a Hugging Face folder's weights: init_from)."""

    preset: str = "tiny"
    """A preset (tiny, gpt2-124m, qwen2.5-0.5b, llama-1b, llama-8b) or a path to a config.json."""
    vocab_size: int | None = None
    """Vocabulary size; null takes the tokenizer's from the data manifest, rounded up to 64."""
    attn_implementation: str = "sdpa"
    """transformers attention kernel: sdpa, eager, or flash_attention_2 where installed."""
    memory_check: str = "error"
    """When the strategy's memory (state, activations, buffers, reserve: `podtrain plan`'s) cannot fit one device: error, warn, or off."""
    init_from: str = ""
    """A Hugging Face model folder (a path or s3://bucket/prefix: config.json plus model.safetensors or
    sharded model-0000X-of-0000N.safetensors with their index) to continue pre-training: its config.json
    replaces model.preset, its weights (bf16/fp16 become fp32) replace the random start, the optimizer
    starts fresh at step 0. Read at a fresh start only: a resume restores the run's own checkpoint."""


@dataclass
class DataSection:
    """Token shards and how samples are cut from them."""

    path: str = "data/builtin"
    """Directory made by ``podtrain prepare`` (holds manifest.json); the one source when data.mix
    is empty."""
    mix: list[dict[str, Any]] = field(default_factory=list)
    """Weighted sources instead of data.path: a list of {path, weight, name} (name defaults to
    the folder's name), all prepared with one tokenizer. Blended deterministically by weight;
    each source keeps its own exactly-once order per epoch."""
    seq_len: int = 256
    """Tokens per training sequence (each sample reads seq_len + 1 tokens: inputs and targets)."""
    prefetch: int = 4
    """Batches the background loader keeps ready ahead of the step."""
    num_workers: int = 0
    """Worker processes building batches; 0 uses one background thread (enough for memmaps)."""
    verify: bool = True
    """Check every shard's size and SHA-256 against the manifest at start (the read is shared out:
    each rank hashes every world_size-th shard; turn off for very large corpora)."""
    cache_dir: str = ""
    """s3:// data: local folder caching the shards' blocks (node-local disk, not shared storage);
    empty: $PODTRAIN_CACHE/data, else ~/.cache/podtrain/data."""
    cache_gb: float = 20.0
    """s3:// data: most GB the block cache keeps per node (split between its ranks; least
    recently used blocks are evicted)."""
    document_masking: bool = False
    """Attention stays inside each document of a sample (documents end with EOS) and positions
    restart at each; the loader builds the masks. CPU: model.attn_implementation sdpa or eager;
    GPU: flex_attention (data.seq_len a multiple of 128). The loss is unchanged."""


@dataclass
class TrainSection:
    """The optimisation loop."""

    steps: int = 300
    """Optimizer steps to run (the LR schedule ends here)."""
    micro_batch_size: int = 8
    """Sequences per rank per forward/backward."""
    global_batch_size: int = 16
    """Sequences per optimizer step across all ranks; accumulation = global / (micro x world)."""
    precision: str = "auto"
    """auto (bf16 on GPU, fp32 on CPU), fp32, bf16, or fp16 (with a GradScaler)."""
    grad_clip: float = 1.0
    """Clip the global gradient norm to this; 0 disables clipping."""
    compile: bool = False
    """torch.compile each decoder block (before DDP or FSDP wrap the model; parameter names and
    checkpoints unchanged)."""
    activation_checkpointing: str = "none"
    """none, or full: recompute each decoder layer's activations in backward (less memory,
    about a third more compute), under every dist.strategy."""
    fp8: str = "off"
    """off, tensorwise or rowwise: the decoder's linear layers run their matmuls in FP8 (torchao's
    Float8Linear, that recipe's scaling; pip extra fp8), on GPUs of compute capability 8.9+ (H100,
    H200, L40S); the embedding, LM head and the rest stay in train.precision, weights in fp32.
    Under fsdp/hsdp, tensorwise all-gathers the weights in FP8. On CPU it runs, slowly (tests)."""
    gc_every: int = 50
    """Python's garbage collector on a schedule all ranks share: set-up's objects frozen, the automatic
    collector off, a young-generation collection after every N-th step (a full one every 10th time
    and at each save), so no rank pauses alone while the others wait at the gradient AllReduce.
    0: Python's automatic collector (train/gc_schedule.py)."""


@dataclass
class OptimSection:
    """AdamW and the learning-rate schedule (linear warmup, then cosine, WSD or constant)."""

    lr: float = 1e-3
    """Peak learning rate."""
    min_lr: float = 1e-4
    """Learning rate at the end of the cosine decay."""
    warmup_steps: int = 30
    """Steps of linear warmup from 0 to lr."""
    schedule: str = "cosine"
    """cosine (to min_lr at train.steps), wsd (warmup-stable-decay: lr until the last
    decay_fraction of train.steps, then linear to min_lr; raise train.steps to extend a run before
    its decay), or constant (lr after the warmup)."""
    decay_fraction: float = 0.2
    """wsd: the final fraction of train.steps spent decaying to min_lr."""
    weight_decay: float = 0.1
    """Decoupled weight decay, applied to matrices only (not to norms, biases, embeddings)."""
    beta1: float = 0.9
    """AdamW beta1."""
    beta2: float = 0.95
    """AdamW beta2."""
    eps: float = 1e-8
    """AdamW epsilon."""
    implementation: str = "auto"
    """fused, foreach, or auto (fused where supported, else foreach)."""


@dataclass
class EvalSection:
    """Validation loss (and bits per byte) on the held-out split; lm-eval tasks."""

    every: int = 100
    """Evaluate every N steps and at the end; 0 disables evaluation."""
    max_batches: int = 20
    """Micro-batches per rank per evaluation (bounded so evaluation stays cheap)."""
    tasks: list[str] = field(default_factory=list)
    """lm-eval tasks scored during training, each rank its share (podtrain-next-line is made from
    data.path's validation split, offline; others as in `podtrain eval`). Needs podtrain[eval]."""
    tasks_every: int = 0
    """Score eval.tasks every N steps and at the end; 0: at the end only."""
    tasks_limit: int = 200
    """Documents per task per scoring (0: all of them)."""


@dataclass
class CkptSection:
    """Checkpoints under ckpt.dir (every rank writes and reads its own share), optionally with a
    fast node-local tier under ckpt.local_dir."""

    dir: str = ""
    """Where durable checkpoints live: a shared directory or s3://bucket/prefix (pip extra s3;
    credentials from the standard AWS chain, AWS_ENDPOINT_URL honoured); empty: RUN_DIR/ckpt."""
    every: int | str = 100
    """Save every N steps and at the end; 0 saves only at the end; auto picks N from the measured
    save stall and ckpt.mtbf_h (Young/Daly: sqrt(2 x stall x MTBF))."""
    mtbf_h: float = 24.0
    """ckpt.every=auto: expected hours between failures of the whole job."""
    allow_changes: list[str] = field(default_factory=list)
    """Keys that alter the math (model.preset, model.vocab_size, data.path, data.mix, data.seq_len,
    train.global_batch_size, run.seed, and data.tokenizer: not a config key but the tokenizer the
    data was prepared with, read from the data's manifest) allowed to differ from the checkpoint's
    on resume (data.mix: the run continues from its token ledger with the new weights)."""
    keep_last: int = 3
    """Keep the newest K checkpoints; 0 keeps all."""
    keep_every: int = 0
    """Also keep every checkpoint whose step is a multiple of N, forever; 0 disables."""
    async_save: bool = True
    """Write in a background thread: the step loop only pays for a copy to host memory."""
    resume: str = "auto"
    """auto (this run's newest valid checkpoint, else fresh), never (a fresh start: a new lineage
    that leaves every earlier checkpoint untouched), or a path (one of this run's checkpoints to
    roll back to; another run's is a branch, as with ckpt.resume_from)."""
    resume_from: str = ""
    """Start this run from another run's checkpoint (a step directory, a run directory or a
    checkpoint location; a path or s3://): its weights, and its optimizer state and data position
    unless ckpt.resume_from_reset says otherwise. Used only while this run has no checkpoint of
    its own; the run keeps its own lineage and records the other as its parent."""
    resume_from_reset: list[str] = field(default_factory=list)
    """What a ckpt.resume_from start does not take over: optimizer (fresh AdamW moments), data
    (the data position and the step count start from 0, e.g. a new schedule on new data)."""
    lease_timeout_s: float = 300.0
    """Seconds without a heartbeat after which another job may take over this run's lease
    (RUN_DIR/lease, CKPT_DIR/lease); a restart of the same job takes it at once."""
    save_wait_s: float = 10.0
    """The longest the step loop waits for the previous save when the next one is due. A previous
    save still retrying on a failing storage is cancelled first (the newest state wins) and waited
    for this long to end; one still being written then makes this one skipped, with a warning."""
    max_outage_s: float = 1800.0
    """Seconds the storage may keep failing saves before the run stops with exit code 203
    (retryable: Kubernetes' ExitCode policy and podtrain's Slurm script requeue it); shorter
    outages only skip saves."""
    signals: list[str] = field(default_factory=lambda: ["SIGTERM", "SIGINT", "SIGUSR1"])
    """Signals that trigger checkpoint-and-exit at the next step boundary (SIGINT: Ctrl-C, exit
    130; the others exit 143)."""
    grace_s: float = 120.0
    """Seconds the scheduler allows between the signal and SIGKILL; the save time is logged
    against it."""
    host_staging_mb: float | None = None
    """Host memory (MB, 2^20 bytes) per rank for checkpoint copies; null: a quarter of the node's
    memory (cgroup limit included) divided by its ranks. Saves stream through it: when a rank's
    share of the state is larger, the step loop also waits for part of the write."""
    local_dir: str = ""
    """Node-local directory (NVMe, /dev/shm) of the fast tier; empty: no local tier. Environment
    variables are expanded (/nvme/${SLURM_NODEID}); each run keeps its own folder in it (by
    lineage), so one base YAML is safe. Each rank writes its own pieces there; a restart resumes from the newest step every rank's
    local tier holds (same world size and strategy), else from ckpt.dir."""
    local_every: int = 0
    """Save to ckpt.local_dir every N steps (steps that also save to ckpt.dir write only there);
    0: no local saves."""
    local_keep: int = 2
    """Keep the newest N local checkpoints on each node (at least 1)."""
    local_replicas: int = 1
    """With ckpt.local_dir: copy each rank's local pieces to the same local rank on the next K
    nodes (a ring), in the background after each local save, so that a replaced node restores
    from its peers instead of ckpt.dir; 0: no replicas. K nodes lost at once still leave a copy
    of every piece; one node has no peers (no replicas)."""


@dataclass
class LogSection:
    """Metrics and console output."""

    every: int = 10
    """Write one metrics.jsonl line (and read losses back from the device) every N steps."""
    progress: str = "auto"
    """auto (rich bar in a terminal, plain lines otherwise), rich, plain, or off."""
    peak_flops: float | None = None
    """Peak FLOP/s of one device for MFU; null looks it up (GPU) or measures it once (CPU)."""
    trackers: list[str] = field(default_factory=lambda: ["auto"])
    """Where rank 0 also sends metrics.jsonl's records: tensorboard (RUN_DIR/tb/), wandb
    (RUN_DIR/wandb/, offline unless WANDB_MODE is set), mlflow (RUN_DIR/mlruns); auto means
    tensorboard when installed; none or an empty list, nothing. Each is a pip extra."""


@dataclass
class ProfileSection:
    """torch.profiler traces of chosen steps, on every rank, under RUN_DIR/profile/."""

    steps: str = ""
    """Steps to trace, FIRST:LAST as numbered in the log lines (e.g. 10:13; quote it in a YAML
    file); empty is off."""
    cuda_memory: bool = True
    """On GPU, also write a CUDA memory snapshot of those steps (for pytorch.org/memory_viz)."""


@dataclass
class DistSection:
    """Process group, the strategy that spreads the model (DDP, FSDP2, HSDP) and its knobs."""

    backend: str = "auto"
    """auto (nccl with CUDA, else gloo), nccl, or gloo."""
    timeout_s: float = 600.0
    """Seconds without a completed step before the watchdog dumps stacks and ends the run; the
    collective timeout is set longer (1.25x + 60 s) so the watchdog reports first."""
    init_timeout_s: float = 1200.0
    """Timeout for rendezvous, start-up and the first step (compilation, cold file systems)."""
    bucket_cap_mb: float = 25.0
    """DDP gradient bucket size: buckets are all-reduced while backward continues."""
    gradient_as_bucket_view: bool = True
    """Gradients alias the AllReduce buckets (saves one copy and the memory of one gradient)."""
    static_graph: bool = False
    """Tell DDP the graph never changes (enables extra overlap; breaks with conditional code)."""
    find_unused_parameters: bool = False
    """Let DDP search for parameters without gradients each step (slow; off unless needed)."""
    threads_per_rank: int | None = None
    """CPU threads per rank; null gives each rank an equal share of the cores."""
    strategy: str = "ddp"
    """ddp (every rank holds the whole model), fsdp (weights, gradients and optimizer state
    sharded over all ranks: FSDP2), or hsdp (sharded within groups of dist.shard_size ranks,
    replicated across the groups). See "DDP or FSDP?" in the docs (docs/concepts.md)."""
    shard_size: int | None = None
    """hsdp's shard group size; null: the ranks of one node (LOCAL_WORLD_SIZE)."""


@dataclass
class MonitorSection:
    """Straggler reports and the hang watchdog."""

    straggler_every: int = 50
    """Every N steps all ranks share their step and data-wait times; 0 disables."""
    straggler_threshold: float = 0.2
    """Report the slowest rank when it exceeds the median step time by this fraction."""
    watchdog: bool = True
    """Dump stacks and recent collectives to RUN_DIR/debug/ and exit when no step completes
    within dist.timeout_s (dist.init_timeout_s before the first step)."""


@dataclass
class GuardSection:
    """Spike and non-finite guard: bad steps are not applied; repeated ones roll back."""

    enabled: bool = True
    """Skip steps whose gradient norm (or loss) is non-finite or spikes; off: a non-finite loss
    stops the run at the next log line."""
    spike_factor: float = 10.0
    """A step whose gradient norm exceeds this multiple of the median of recent accepted norms is
    skipped; 0 skips only non-finite steps."""
    history: int = 32
    """Accepted gradient norms the median is taken over (spikes are judged once it is full)."""
    max_skips: int = 3
    """This many skipped steps within guard.window steps roll back to the last checkpoint and
    skip the data from the first skipped step on (recorded in RUN_DIR/skipped.jsonl)."""
    window: int = 50
    """Steps over which skipped steps are counted."""
    max_rollbacks: int = 1
    """Rollbacks a run may take (counted in RUN_DIR/skipped.jsonl); one more stops the run."""


@dataclass
class RunConfig:
    """The whole configuration of one training run."""

    run: RunSection = field(default_factory=RunSection)
    model: ModelSection = field(default_factory=ModelSection)
    data: DataSection = field(default_factory=DataSection)
    train: TrainSection = field(default_factory=TrainSection)
    optim: OptimSection = field(default_factory=OptimSection)
    eval: EvalSection = field(default_factory=EvalSection)
    ckpt: CkptSection = field(default_factory=CkptSection)
    log: LogSection = field(default_factory=LogSection)
    dist: DistSection = field(default_factory=DistSection)
    monitor: MonitorSection = field(default_factory=MonitorSection)
    profile: ProfileSection = field(default_factory=ProfileSection)
    guard: GuardSection = field(default_factory=GuardSection)
