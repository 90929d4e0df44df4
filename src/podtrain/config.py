"""The typed run configuration: dataclasses, a YAML file plus dotted overrides, validation.

``load_config("configs/demo.yaml", ["optim.lr=3e-4", "train.steps=200"])`` returns a ``RunConfig``.
Unknown keys and values of the wrong type raise ``UserError`` with one line naming the key and the
closest valid key. ``dump_config`` writes the resolved config (what ``RUN_DIR/config.yaml`` holds).
Each component receives only its own section (``cfg.train``, ``cfg.data``...), never the whole tree.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import signal
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Union

import yaml

from podtrain.errors import UserError


@dataclass
class RunSection:
    """Where the run lives and what makes it reproducible."""

    dir: str = "runs/demo"
    """Run directory: config.yaml, metrics.jsonl, ckpt/, logs/, debug/ go here (shared by nodes)."""
    seed: int = 1234
    """Seed for model init (same on every rank) and data order."""


@dataclass
class ModelSection:
    """Which architecture to pre-train (random init)."""

    preset: str = "tiny"
    """A preset (tiny, gpt2-124m, qwen2.5-0.5b, llama-1b, llama-8b) or a path to a config.json."""
    vocab_size: int | None = None
    """Vocabulary size; null takes the tokenizer's from the data manifest, rounded up to 64."""
    attn_implementation: str = "sdpa"
    """transformers attention kernel: sdpa, eager, or flash_attention_2 where installed."""
    memory_check: str = "error"
    """When params + grads + AdamW state cannot fit one device: error, warn, or off."""


@dataclass
class DataSection:
    """Token shards and how samples are cut from them."""

    path: str = "data/builtin"
    """Directory made by ``podtrain prepare`` (holds manifest.json)."""
    seq_len: int = 256
    """Tokens per training sequence (each sample reads seq_len + 1 tokens: inputs and targets)."""
    prefetch: int = 4
    """Batches the background loader keeps ready ahead of the step."""
    num_workers: int = 0
    """Worker processes building batches; 0 uses one background thread (enough for memmaps)."""
    verify: bool = True
    """Check every shard's SHA-256 against the manifest at start (rank 0 reads all the data once:
    turn off for very large corpora)."""


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
    """Wrap the DDP model in torch.compile."""


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
    """Validation loss on the held-out split."""

    every: int = 100
    """Evaluate every N steps and at the end; 0 disables evaluation."""
    max_batches: int = 20
    """Micro-batches per rank per evaluation (bounded so evaluation stays cheap)."""


@dataclass
class CkptSection:
    """Checkpoints under RUN_DIR/ckpt/ (rank 0 writes, every rank reads)."""

    every: int | str = 100
    """Save every N steps and at the end; 0 saves only at the end; auto picks N from the measured
    save stall and ckpt.mtbf_h (Young/Daly: sqrt(2 x stall x MTBF))."""
    mtbf_h: float = 24.0
    """ckpt.every=auto: expected hours between failures of the whole job."""
    allow_changes: list[str] = field(default_factory=list)
    """Keys that alter the math (model.*, data.path, data.seq_len, data.tokenizer,
    train.global_batch_size, run.seed) allowed to differ from the checkpoint's on resume."""
    keep_last: int = 3
    """Keep the newest K checkpoints; 0 keeps all."""
    keep_every: int = 0
    """Also keep every checkpoint whose step is a multiple of N, forever; 0 disables."""
    async_save: bool = True
    """Write in a background thread: the step loop only pays for a copy to host memory."""
    format: str = "safetensors"
    """safetensors (rank 0 writes one folder) or dcp (torch.distributed.checkpoint, all ranks)."""
    resume: str = "auto"
    """auto (newest valid checkpoint in the run directory, else fresh), never, or a path."""
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
    """Process group and DistributedDataParallel knobs."""

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


# Allowed values of string keys that act as enums, checked at load time.
CHOICES: dict[str, tuple[str, ...]] = {
    "train.precision": ("auto", "fp32", "bf16", "fp16"),
    "optim.implementation": ("auto", "fused", "foreach"),
    "log.progress": ("auto", "rich", "plain", "off"),
    "dist.backend": ("auto", "nccl", "gloo"),
    "ckpt.format": ("safetensors", "dcp"),
    "model.memory_check": ("error", "warn", "off"),
    "optim.schedule": ("cosine", "wsd", "constant"),
}


# Keys whose change between a checkpoint and its resume changes what is being trained: refused
# unless listed in ckpt.allow_changes (data.tokenizer is the data manifest's, not a config key).
MATH_KEYS: tuple[str, ...] = ("model.preset", "model.vocab_size", "data.path", "data.seq_len",
                              "data.tokenizer", "train.global_batch_size", "run.seed")


def all_keys(cls: type = RunConfig, prefix: str = "") -> list[str]:
    """Every dotted key of the config tree (``optim.lr``, ``train.steps``, ...)."""
    keys = []
    for f in dataclasses.fields(cls):
        ftype = _field_types(cls)[f.name]
        if dataclasses.is_dataclass(ftype):
            keys.extend(all_keys(ftype, f"{prefix}{f.name}."))
        else:
            keys.append(prefix + f.name)
    return keys


def load_config(path: str | os.PathLike | None, overrides: list[str] | tuple[str, ...] = ()) -> RunConfig:
    """Read a YAML file (or start from defaults when ``path`` is None) and apply ``key=value``s."""
    raw: dict[str, Any] = {}
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise UserError(f"config file {p} does not exist")
        try:
            raw = yaml.safe_load(p.read_text()) or {}
        except yaml.YAMLError as exc:
            mark = getattr(exc, "problem_mark", None)
            where = f" line {mark.line + 1}" if mark else ""
            raise UserError(f"config file {p}{where}: invalid YAML ({getattr(exc, 'problem', exc)})") from None
        if not isinstance(raw, dict):
            raise UserError(f"config file {p}: top level must be a mapping of sections")
    flat = _flatten(raw, source=str(path) if path else "defaults")
    for item in overrides:
        key, value = parse_override(item)
        flat[key] = value
    cfg = RunConfig()
    for key, value in flat.items():
        _set(cfg, key, value)
    validate(cfg)
    return cfg


class RawText(str):
    """An override's value as typed; parsed by the type of the key it sets (see ``_coerce``).

    Parsing by type matters because YAML 1.1 reads ``off``, ``no`` and ``on`` as booleans: a
    string key such as ``log.progress=off`` must keep the text.
    """


def parse_override(item: str) -> tuple[str, Any]:
    """Split ``section.key=value``; the value stays text until its key's type is known."""
    if "=" not in item:
        raise UserError(f"override {item!r} must look like section.key=value")
    key, text = item.split("=", 1)
    return key.strip(), RawText(text)


def _parse_yaml_scalar(text: str) -> Any:
    try:
        return yaml.safe_load(text) if text.strip() else ""
    except yaml.YAMLError:
        return str(text)


def _flatten(raw: dict, source: str, prefix: str = "") -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for k, v in raw.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict) and key.count(".") == 0 and not prefix:
            flat.update(_flatten(v, source, key + "."))
        else:
            flat[key] = v
    return flat


def _closest(key: str) -> str:
    """The valid key a typo most likely meant: the same leaf in another section first
    ("train.lr" -> "optim.lr"), then the nearest spelling."""
    keys = all_keys()
    leaf = key.rsplit(".", 1)[-1]
    same_leaf = [k for k in keys if k.rsplit(".", 1)[-1] == leaf]
    if same_leaf:
        return same_leaf[0]
    match = difflib.get_close_matches(key, keys, n=1, cutoff=0.0)
    return match[0] if match else ""


def _set(cfg: RunConfig, key: str, value: Any) -> None:
    parts = key.split(".")
    if len(parts) != 2:
        raise UserError(f"unknown config key {key!r} (did you mean {_closest(key)!r}?)")
    section_name, leaf = parts
    section = getattr(cfg, section_name, None)
    if section is None or not dataclasses.is_dataclass(section):
        raise UserError(f"unknown config key {key!r} (did you mean {_closest(key)!r}?)")
    types_ = _field_types(type(section))
    if leaf not in types_:
        raise UserError(f"unknown config key {key!r} (did you mean {_closest(key)!r}?)")
    setattr(section, leaf, _coerce(key, value, types_[leaf]))


def _field_types(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _coerce(key: str, value: Any, ftype: Any) -> Any:
    """Check ``value`` against the field type; allow the safe widenings (int -> float)."""
    origin = typing.get_origin(ftype)
    if origin in (Union, types.UnionType):
        args = typing.get_args(ftype)
        if isinstance(value, RawText) and value.strip() in ("null", "~", "none", "None"):
            return None
        if value is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        for member in inner[:-1]:  # e.g. ckpt.every: int | str takes 100 as an int, auto as text
            try:
                return _coerce(key, value, member)
            except UserError:
                continue
        return _coerce(key, value, inner[-1])
    if isinstance(value, RawText):
        value = str(value) if ftype is str else _parse_yaml_scalar(value)
    if ftype is str and isinstance(value, bool) and "off" in CHOICES.get(key, ()):
        value = "on" if value else "off"  # a YAML file's bare `off` is a boolean to YAML 1.1
    if origin is list:
        (item_type,) = typing.get_args(ftype)
        if isinstance(value, str):
            value = [v.strip() for v in value.split(",") if v.strip()]
        if not isinstance(value, list):
            raise UserError(f"config key {key!r} expects a list, got {value!r}")
        return [_coerce(key, v, item_type) for v in value]
    if ftype is bool:
        if isinstance(value, bool):
            return value
        raise UserError(f"config key {key!r} expects true or false, got {value!r}")
    if ftype is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        raise UserError(f"config key {key!r} expects an integer, got {value!r}")
    if ftype is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):
            try:
                return float(value)  # YAML 1.1 reads "3e-4" as a string
            except ValueError:
                pass
        raise UserError(f"config key {key!r} expects a number, got {value!r}")
    if ftype is str:
        if isinstance(value, (str, int, float)) and not isinstance(value, bool):
            return str(value)
        raise UserError(f"config key {key!r} expects a string, got {value!r}")
    return value


def validate(cfg: RunConfig) -> None:
    """Cross-field checks that need no processes (the world size is checked by ``accumulation``)."""
    for key, choices in CHOICES.items():
        section, leaf = key.split(".")
        value = getattr(getattr(cfg, section), leaf)
        if value not in choices:
            raise UserError(f"config key {key!r} must be one of {', '.join(choices)}, got {value!r}")
    positive = {
        "train.steps": cfg.train.steps, "train.micro_batch_size": cfg.train.micro_batch_size,
        "train.global_batch_size": cfg.train.global_batch_size, "data.seq_len": cfg.data.seq_len,
        "log.every": cfg.log.every, "dist.timeout_s": cfg.dist.timeout_s,
        "dist.init_timeout_s": cfg.dist.init_timeout_s, "data.prefetch": cfg.data.prefetch,
    }
    for key, value in positive.items():
        if value <= 0:
            raise UserError(f"config key {key!r} must be positive, got {value}")
    if isinstance(cfg.ckpt.every, str) and cfg.ckpt.every != "auto":
        raise UserError(f"config key 'ckpt.every' must be a number of steps or auto, got {cfg.ckpt.every!r}")
    if not 0 < cfg.optim.decay_fraction <= 1:
        raise UserError(f"config key 'optim.decay_fraction' must be in (0, 1], got {cfg.optim.decay_fraction}")
    non_negative = {
        "eval.every": cfg.eval.every, "optim.lr": cfg.optim.lr,
        "ckpt.every": cfg.ckpt.every if cfg.ckpt.every != "auto" else 0,
        "optim.min_lr": cfg.optim.min_lr, "optim.warmup_steps": cfg.optim.warmup_steps,
        "train.grad_clip": cfg.train.grad_clip, "ckpt.keep_every": cfg.ckpt.keep_every,
        "data.num_workers": cfg.data.num_workers, "monitor.straggler_every": cfg.monitor.straggler_every,
        "optim.weight_decay": cfg.optim.weight_decay,
        "ckpt.keep_last": cfg.ckpt.keep_last, "guard.spike_factor": cfg.guard.spike_factor,
        "ckpt.mtbf_h": cfg.ckpt.mtbf_h,
    }
    for key, value in non_negative.items():
        if value < 0:
            raise UserError(f"config key {key!r} must not be negative, got {value}")
    if cfg.optim.min_lr > cfg.optim.lr:
        raise UserError(f"config key 'optim.min_lr' ({cfg.optim.min_lr}) exceeds 'optim.lr' ({cfg.optim.lr})")
    if cfg.train.global_batch_size % cfg.train.micro_batch_size:
        raise UserError(
            f"config key 'train.global_batch_size' ({cfg.train.global_batch_size}) is not a multiple of "
            f"'train.micro_batch_size' ({cfg.train.micro_batch_size})")
    positive_guard = {"guard.history": cfg.guard.history, "guard.max_skips": cfg.guard.max_skips,
                      "guard.window": cfg.guard.window}
    for key, value in positive_guard.items():
        if value <= 0:
            raise UserError(f"config key {key!r} must be positive, got {value}")
    for key in cfg.ckpt.allow_changes:
        if key not in MATH_KEYS:
            raise UserError(f"config key 'ckpt.allow_changes' lists {key!r}, which is not a key that "
                            f"alters the math (one of {', '.join(MATH_KEYS)})")
    for name in cfg.ckpt.signals:
        signal_from_name(name, "config key 'ckpt.signals'")
    _validate_observe(cfg)
    if cfg.ckpt.host_staging_mb is not None and not cfg.ckpt.host_staging_mb >= 1:
        raise UserError(f"config key 'ckpt.host_staging_mb' must be at least 1 (MB), got {cfg.ckpt.host_staging_mb}")
    if cfg.eval.every and cfg.eval.max_batches < 1:
        raise UserError(f"config key 'eval.max_batches' must be at least 1 when eval.every > 0, "
                        f"got {cfg.eval.max_batches}")


def _validate_observe(cfg: RunConfig) -> None:
    """Tracker names and the profile range (whether a tracker is installed is checked at start)."""
    from podtrain.observe.profile import parse_steps
    from podtrain.observe.trackers import TRACKER_NAMES

    for name in cfg.log.trackers:
        if name not in TRACKER_NAMES:
            raise UserError(f"config key 'log.trackers': unknown tracker {name!r} "
                            f"(choose from {', '.join(TRACKER_NAMES)})")
    steps = parse_steps(cfg.profile.steps)
    if steps is not None and steps[0] > cfg.train.steps:
        hint = ("; YAML reads an unquoted 10:13 as the base-60 number 613: quote it"
                if ":" not in cfg.profile.steps else "")
        raise UserError(f"config key 'profile.steps' ({cfg.profile.steps}) starts after the last "
                        f"step (train.steps={cfg.train.steps}){hint}")


def signal_from_name(name: str | int, where: str = "signal") -> signal.Signals:
    """``"SIGTERM"``, ``"TERM"``, ``"sigusr1"`` or a number -> the signal; else a UserError
    naming ``where``. SIGKILL and SIGSTOP are refused: a process cannot catch them."""
    text = str(name).strip().upper()
    try:
        sig = signal.Signals(int(text)) if text.isdigit() else signal.Signals[
            text if text.startswith("SIG") else "SIG" + text]
    except (KeyError, ValueError):
        raise UserError(f"{where}: unknown signal {name!r} (e.g. SIGTERM, SIGUSR1)") from None
    if sig in (signal.SIGKILL, signal.SIGSTOP):
        raise UserError(f"{where}: {sig.name} cannot be caught")
    return sig


def accumulation_steps(global_batch: int, micro_batch: int, world_size: int) -> int:
    """Micro-batches per optimizer step on each rank: global / (micro x world), which must divide."""
    per_step = micro_batch * world_size
    if global_batch % per_step:
        raise UserError(
            f"train.global_batch_size={global_batch} is not divisible by train.micro_batch_size x "
            f"world size = {micro_batch} x {world_size} = {per_step}; choose a global batch that is "
            f"a multiple of {per_step}")
    return global_batch // per_step


def to_dict(cfg: RunConfig) -> dict[str, Any]:
    """The config as plain data (YAML/JSON-ready)."""
    return dataclasses.asdict(cfg)


def dump_config(cfg: RunConfig, path: str | os.PathLike) -> None:
    """Write the resolved config atomically (temporary name, fsync, rename)."""
    from podtrain.fsutil import atomic_write_text

    atomic_write_text(Path(path), yaml.safe_dump(to_dict(cfg), sort_keys=False))
