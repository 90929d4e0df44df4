"""Checkpoints: atomic, checksummed, pickle-free, written in the background; auto-resume.

``Checkpointer`` is what the training loop uses::

    ckpt = Checkpointer(run_dir, cfg.ckpt, ctx)          # every rank
    state = ckpt.restore(model, optimizer, scaler)        # every rank; None: start fresh
    ...
    if ckpt.should_save(step, total):
        ckpt.save(step, model, optimizer, scaler, train_state)   # every rank, same step
    ...
    ckpt.close()                                           # every exit path

What a checkpoint holds (``podtrain.ckpt.layout`` shows the files): the unwrapped model weights;
the optimizer state (tensors in safetensors, structure in JSON); the GradScaler state (fp16);
every rank's RNG states (Python, numpy, torch CPU, the rank's GPU); the loop's ``train_state``
(step, tokens seen, loader position, metrics run id, resolved config) plus podtrain's version and
the world size; the transformers model config. Nothing is pickled: a directory holding a pickle
file is refused with a ``UserError`` before any of it is read.

Saving: ``save`` copies what this rank must contribute to reused host buffers (the only stall of
the step loop) and hands it to one background thread; a second ``save`` first waits for the
first. With ``format=safetensors`` only global rank 0 writes; the other ranks send it their RNG
states. With ``format=dcp`` every rank writes a share of the tensors through
``torch.distributed.checkpoint`` (its safetensors storage: no pickled metadata). The background
thread's collectives use a gloo group of its own, created here on every rank, so they never
interleave with the main thread's collectives on the default group. Rank 0 writes into a
temporary directory, fsyncs every file, writes ``manifest.json`` (size and SHA-256 of every file)
last, renames the directory into place, then updates ``latest`` and applies retention.

Resuming: rank 0 alone looks at the file system (ranks on a shared file system can disagree about
what exists), picks the newest complete checkpoint whose checksums hold (warning with the name of
each one it skips) and broadcasts the choice; every rank then loads it and the ranks agree on
success before anyone continues.
"""

from __future__ import annotations

import datetime
import json
import logging
import os
import queue
import threading
import time
import uuid
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from podtrain import __version__
from podtrain.ckpt import layout
from podtrain.ckpt.state import capture_rng, from_plain, restore_rng, to_plain
from podtrain.ckpt.tensorio import FileRecord, read_safetensors, write_json, write_safetensors
from podtrain.config import CkptSection
from podtrain.distributed.group import DistContext
from podtrain.errors import UserError
from podtrain.fsutil import atomic_write_text, fsync_dir, sha256_file
from podtrain.model import unwrap

log = logging.getLogger("podtrain.checkpoint")

# The background group waits while rank 0 writes; a multi-GB checkpoint on a slow shared file
# system can take many minutes, far longer than a training collective should.
CKPT_GROUP_TIMEOUT_S = 3600.0
MODEL_FILE = "model.safetensors"
STATE_FILE = "state.safetensors"
STATE_JSON = "state.json"
CONFIG_JSON = "config.json"
DCP_SUBDIR = "dcp"


class HostBuffers:
    """Host copies of tensors, reused from one save to the next.

    Fresh allocations pay a page fault per 4 KiB on first touch (~1.4 GB/s here), reused buffers
    copy at memory bandwidth: the difference is most of the step loop's stall. CPU tensors are
    copied by a few threads with numpy's memcpy (which releases the GIL); torch's ``copy_`` splits
    each copy over the OpenMP pool, which on a busy CPU waits for its slowest thread (measured
    0.6-4 GB/s against 3-9 GB/s). GPU tensors go to pinned buffers with asynchronous DMA copies.
    """

    def __init__(self, pin: bool, threads: int | None = None) -> None:
        self.pin = pin
        self.threads = threads or max(1, min(4, os.cpu_count() or 1))
        self._buffers: dict[str, torch.Tensor] = {}
        self._cpu_copies: list[tuple[torch.Tensor, torch.Tensor]] = []

    def copy(self, name: str, t: torch.Tensor) -> torch.Tensor:
        """The host buffer that will hold ``t`` once ``finish`` returns."""
        t = t.detach()
        buf = self._buffers.get(name)
        if buf is None or buf.shape != t.shape or buf.dtype != t.dtype:
            buf = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=self.pin)
            self._buffers[name] = buf
        if t.device.type == "cpu" and t.is_contiguous() and t.numel() > 0:
            self._cpu_copies.append((buf, t))
        else:
            buf.copy_(t, non_blocking=self.pin and t.device.type != "cpu")
        return buf

    def finish(self, device: torch.device) -> None:
        """Complete every copy requested since the last call (CPU memcpys, GPU transfers)."""
        copies, self._cpu_copies = self._cpu_copies, []
        copies.sort(key=lambda c: -c[0].numel() * c[0].element_size())  # big first: even finish
        if self.threads > 1 and len(copies) > 1:
            from concurrent.futures import ThreadPoolExecutor

            with ThreadPoolExecutor(self.threads, thread_name_prefix="podtrain-copy") as pool:
                list(pool.map(lambda c: np.copyto(_bytes(c[0]), _bytes(c[1])), copies))
        else:
            for dst, src in copies:
                np.copyto(_bytes(dst), _bytes(src))
        if self.pin and device.type != "cpu" and torch.cuda.is_available():
            torch.cuda.synchronize(device)


def _bytes(t: torch.Tensor) -> np.ndarray:
    """A contiguous CPU tensor's memory as a numpy byte array (no copy; any dtype, bf16 too)."""
    flat = t.reshape(-1)
    return (flat if flat.dtype == torch.uint8 else flat.view(torch.uint8)).numpy()


@dataclass
class _Job:
    """One save, as handed from the step loop to the background thread."""

    step: int
    rng: dict[str, Any]
    model_tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    aliases: dict[str, str] = field(default_factory=dict)
    state_tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    state_plain: dict[str, Any] = field(default_factory=dict)
    model_config: str | None = None
    stall_s: float = 0.0
    done: threading.Event = field(default_factory=threading.Event)
    error: BaseException | None = None
    write_s: float = 0.0
    nbytes: int = 0


class Checkpointer:
    """Save, resume and retention for one run directory (see the module docstring)."""

    def __init__(self, run_dir: Path, cfg: CkptSection, ctx: DistContext) -> None:
        """Every rank constructs one (it creates the background gloo group collectively)."""
        self.run_dir = Path(run_dir)
        self.root = self.run_dir / layout.CKPT_SUBDIR
        self.cfg = cfg
        self.ctx = ctx
        self.group = None
        if ctx.initialized and ctx.world_size > 1 and dist.is_initialized():
            self.group = dist.new_group(backend="gloo",
                                        timeout=datetime.timedelta(seconds=CKPT_GROUP_TIMEOUT_S))
        self._buffers = HostBuffers(pin=ctx.device.type != "cpu")
        self._queue: queue.Queue[_Job | None] = queue.Queue()
        self._thread: threading.Thread | None = None
        self._pending: _Job | None = None
        self._last_step: int | None = None
        self.skipped: list[tuple[str, str]] = []
        """Checkpoints the last ``restore`` passed over (path, reason), on rank 0."""
        self.last_save: dict[str, float] = {}
        """Timings of the last finished save: step, stall_s, write_s, bytes."""

    # -- resume --------------------------------------------------------------------------------
    def restore(self, model: nn.Module, optimizer: torch.optim.Optimizer,
                scaler: torch.amp.GradScaler | None) -> dict | None:
        """Load the checkpoint ``cfg.resume`` designates into every rank; None: start fresh.

        Every rank calls. Rank 0 chooses (and cleans temporary directories of killed saves) and
        broadcasts; every rank loads weights into the unwrapped model, the optimizer state, the
        scaler, and its own RNG states when the world size is the one that saved; then the ranks
        agree that all of them succeeded. Returns the saved ``train_state`` (with ``version`` and
        ``world_size`` added).
        """
        choice = self._rank0_decides(self._choose)
        if choice is None:
            log.info("no checkpoint to resume from (ckpt.resume=%s): starting fresh", self.cfg.resume)
            return None
        path, manifest = Path(choice["path"]), choice["manifest"]
        t0 = time.perf_counter()
        failure = None
        train_state = None
        try:
            train_state = self._load(path, manifest, model, optimizer, scaler)
        except Exception as exc:  # agreed below, so no rank waits on one that failed
            failure = exc
        self.ctx.agree(failure)  # ranks that loaded fine raise, naming the rank that did not
        if isinstance(failure, UserError):
            raise UserError(f"resuming from {path} failed: {failure}") from None
        if failure is not None:
            raise failure
        self._last_step = int(manifest["step"])
        log.info("resumed from %s (step %d) in %.1f s", path, self._last_step, time.perf_counter() - t0)
        return train_state

    def _choose(self) -> dict | None:
        """Rank 0: clean up killed saves, then pick the checkpoint to resume from."""
        removed = layout.clean_stale(self.root)
        if removed:
            log.info("removed %d unfinished save(s) under %s: %s", len(removed), self.root, ", ".join(removed))
        choice = layout.resolve_resume(self.run_dir, self.cfg.resume)
        self.skipped = choice.skipped
        if choice.path is None:
            return None
        return {"path": str(choice.path), "manifest": choice.manifest}

    def _rank0_decides(self, fn: Callable[[], Any]) -> Any:
        """Run ``fn`` on rank 0 only and broadcast its result (or its error) to every rank."""
        outcome: tuple[str, Any] | None = None
        if self.ctx.is_main:
            try:
                outcome = ("ok", fn())
            except UserError as exc:
                outcome = ("user", str(exc))
            except Exception as exc:
                outcome = ("bug", f"{type(exc).__name__}: {exc}")
                if not self.ctx.initialized:
                    raise
                log.exception("checkpoint decision failed on rank 0")
        outcome = self.ctx.broadcast_object(outcome)
        kind, value = outcome
        if kind == "user":
            raise UserError(value)
        if kind == "bug":
            raise RuntimeError(f"rank 0 could not choose a checkpoint: {value}")
        return value

    def _load(self, path: Path, manifest: dict, model: nn.Module, optimizer: torch.optim.Optimizer,
              scaler: torch.amp.GradScaler | None) -> dict:
        """Every rank: read the chosen checkpoint (files named by rank 0's manifest) and apply it."""
        ckpt = read_checkpoint(path, manifest)
        _load_model(unwrap(model), ckpt.model_state, path)
        state = ckpt.state
        try:
            optimizer.load_state_dict(state["optimizer"])
        except (ValueError, KeyError, RuntimeError) as exc:
            raise UserError(f"checkpoint {path}: optimizer state does not fit this optimizer ({exc})") from None
        if scaler is not None and state.get("scaler"):
            scaler.load_state_dict(state["scaler"])
        rngs = state.get("rng") or []
        if len(rngs) == self.ctx.world_size:
            restore_rng(rngs[self.ctx.rank], self.ctx.device)
        elif self.ctx.is_main:
            log.warning("checkpoint %s was saved by %d rank(s), this run has %d: RNG states not "
                        "restored (data order depends only on the seed and the loader position)",
                        path, len(rngs), self.ctx.world_size)
        return state["train_state"]

    # -- save ----------------------------------------------------------------------------------
    def should_save(self, step: int, last_step: int) -> bool:
        """True every ``ckpt.every`` steps (0: never in between) and always at ``last_step``."""
        return step == last_step or (self.cfg.every > 0 and step % self.cfg.every == 0)

    def save(self, step: int, model: nn.Module, optimizer: torch.optim.Optimizer,
             scaler: torch.amp.GradScaler | None, train_state: dict) -> None:
        """Snapshot to host memory now, write in the background (every rank calls, same step).

        Saving the step that was just saved (a stop signal right after a scheduled save) does
        nothing: nothing changed in between.
        """
        if step == self._last_step:
            log.info("step %d is already checkpointed", step)
            return
        waited = self.wait()  # at most one save in flight: its buffers are about to be reused
        t0 = time.perf_counter()
        job = self._snapshot(step, model, optimizer, scaler, train_state)
        job.stall_s = time.perf_counter() - t0
        self._last_step = step
        self._pending = job
        self._start_thread()
        self._queue.put(job)
        log.info("checkpoint step %d: step loop stalled %.3f s (host copy)%s, writing in the %s",
                 step, job.stall_s, f" + {waited:.2f} s for the previous save" if waited > 0.01 else "",
                 "background" if self.cfg.async_save else "foreground")
        if not self.cfg.async_save:
            self.wait()

    def _snapshot(self, step: int, model: nn.Module, optimizer: torch.optim.Optimizer,
                  scaler: torch.amp.GradScaler | None, train_state: dict) -> _Job:
        """Copy what this rank contributes to host buffers; the training may then go on."""
        job = _Job(step=step, rng=capture_rng(self.ctx.device))
        writes_tensors = self.ctx.is_main or self.cfg.format == "dcp"
        if writes_tensors:
            net = unwrap(model)
            job.model_tensors, job.aliases = self._copy_model(net)
            sink = self._sink(job.state_tensors)
            job.state_plain = {
                "optimizer": to_plain(optimizer.state_dict(), sink, "optimizer"),
                "scaler": (to_plain(scaler.state_dict(), sink, "scaler")
                           if scaler is not None and scaler.is_enabled() else None),
                "train_state": to_plain({**train_state, "version": __version__,
                                         "world_size": self.ctx.world_size}, sink, "train_state"),
            }
            config = getattr(net, "config", None)
            job.model_config = config.to_json_string() if hasattr(config, "to_json_string") else None
            self._buffers.finish(self.ctx.device)
        return job

    def _sink(self, into: dict[str, torch.Tensor]) -> Callable[[str, torch.Tensor], None]:
        def sink(name: str, t: torch.Tensor) -> None:
            into[name] = self._buffers.copy(name, t)
        return sink

    def _copy_model(self, net: nn.Module) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
        """Host copies of the weights; tied tensors (embeddings = LM head) stored once, aliased."""
        tensors: dict[str, torch.Tensor] = {}
        aliases: dict[str, str] = {}
        seen: dict[tuple, str] = {}
        for name, t in net.state_dict().items():
            key = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.stride(), t.dtype)
            if key in seen:
                aliases[name] = seen[key]
                continue
            seen[key] = name
            tensors[name] = self._buffers.copy(f"model/{name}", t)
        return tensors, aliases

    def wait(self) -> float:
        """Block until the in-flight save is durable on rank 0; seconds waited.

        Raises when that save failed (on every rank: the ranks learn rank 0's outcome).
        """
        job = self._pending
        if job is None:
            return 0.0
        t0 = time.perf_counter()
        job.done.wait()
        self._pending = None
        if job.error is not None:
            self._last_step = None  # that step is not on disk: saving it again must not be skipped
            raise RuntimeError(f"checkpoint of step {job.step} failed: {job.error}") from job.error
        return time.perf_counter() - t0

    def close(self) -> None:
        """Wait for the in-flight save, stop the thread, release the group (every exit path)."""
        try:
            self.wait()
        finally:
            if self._thread is not None:
                self._queue.put(None)
                self._thread.join()
                self._thread = None
            if self.group is not None and dist.is_initialized():
                try:
                    dist.destroy_process_group(self.group)
                except Exception as exc:  # never mask the error that brought us here
                    log.debug("destroying the checkpoint group failed: %s", exc)
            self.group = None

    # -- background thread ---------------------------------------------------------------------
    def _start_thread(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._worker, name="podtrain-ckpt", daemon=True)
            self._thread.start()

    def _worker(self) -> None:
        while (job := self._queue.get()) is not None:
            t0 = time.perf_counter()
            try:
                self._write(job)
            except BaseException as exc:  # surfaced to the step loop by wait()
                job.error = exc
            job.write_s = time.perf_counter() - t0
            if job.error is None:
                self.last_save = {"step": job.step, "stall_s": job.stall_s, "write_s": job.write_s,
                                  "bytes": job.nbytes}
                if self.ctx.is_main:
                    mb = job.nbytes / 1e6
                    log.info("checkpoint step %d durable: %.1f MB written in %.2f s (%.0f MB/s) "
                             "in the background; the step loop stalled %.3f s", job.step, mb,
                             job.write_s, mb / max(job.write_s, 1e-9), job.stall_s)
            job.done.set()

    def _write(self, job: _Job) -> None:
        """Every rank, in the background thread: the collectives of one save, in a fixed order."""
        rngs = self._gather(job.rng)
        if self.cfg.format == "dcp":
            self._write_dcp(job, rngs)
            return
        error = None
        if self.ctx.is_main:
            try:
                self._write_rank0(job, rngs)
            except Exception as exc:
                log.exception("writing checkpoint step %d failed", job.step)
                error = f"{type(exc).__name__}: {exc}"
        error = self._broadcast(error)
        if error:
            raise RuntimeError(f"rank 0 could not write it: {error}")

    def _gather(self, obj: Any) -> list[Any]:
        if self.group is None:
            return [obj]
        out: list[Any] = [None] * self.ctx.world_size
        dist.all_gather_object(out, obj, group=self.group)
        return out

    def _broadcast(self, obj: Any) -> Any:
        if self.group is None:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0, group=self.group)
        return box[0]

    def _state_files(self, job: _Job, rngs: list[dict]) -> tuple[dict, dict[str, torch.Tensor]]:
        """state.json's content and the tensors that go with it (optimizer + every rank's RNG)."""
        tensors = dict(job.state_tensors)
        sink = tensors.__setitem__
        state = {"step": job.step, "aliases": job.aliases, **job.state_plain,
                 "rng": [to_plain(r, sink, f"rng/{i}") for i, r in enumerate(rngs)]}
        return state, tensors

    def _write_rank0(self, job: _Job, rngs: list[dict]) -> None:
        name = layout.step_name(job.step)
        tmp = self.root / f"{layout.TMP_PREFIX}{name}-{uuid.uuid4().hex[:8]}"
        tmp.mkdir(parents=True)
        state, state_tensors = self._state_files(job, rngs)
        files = {MODEL_FILE: write_safetensors(tmp / MODEL_FILE, job.model_tensors,
                                               {"format": "pt", "podtrain": __version__}),
                 STATE_FILE: write_safetensors(tmp / STATE_FILE, state_tensors)}
        self._finish(job, tmp, state, files)

    def _write_dcp(self, job: _Job, rngs: list[dict]) -> None:
        """format=dcp: every rank writes a share of the tensors, rank 0 finishes the directory."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint import HuggingFaceStorageWriter

        name = layout.step_name(job.step)
        tmp = self.root / f"{layout.TMP_PREFIX}{name}-dcp"  # every rank must know the name
        error = None
        if self.ctx.is_main:
            try:
                if tmp.exists():
                    layout.remove_tree(tmp)
                (tmp / DCP_SUBDIR).mkdir(parents=True)
            except OSError as exc:
                error = f"{type(exc).__name__}: {exc}"
        error = self._broadcast(error)
        state, state_tensors = self._state_files(job, rngs)
        if not error:
            tensors = {f"model/{k}": v for k, v in job.model_tensors.items()}
            tensors.update({f"state/{k}": v for k, v in state_tensors.items() if not k.startswith("rng/")})
            try:
                writer = HuggingFaceStorageWriter(str(tmp / DCP_SUBDIR), save_distributed=True)
                with warnings.catch_warnings():  # one process: DCP warns that it saves alone
                    warnings.simplefilter("ignore", UserWarning)
                    dcp.save(tensors, storage_writer=writer, process_group=self.group,
                             no_dist=self.group is None)
            except Exception as exc:
                error = f"{type(exc).__name__}: {exc}"
        # Every rank's share is on disk (or someone failed) before rank 0 seals the directory.
        error = next((e for e in self._gather(error) if e), None)
        if self.ctx.is_main and not error:
            try:
                rng_tensors = {k: v for k, v in state_tensors.items() if k.startswith("rng/")}
                files = {STATE_FILE: write_safetensors(tmp / STATE_FILE, rng_tensors)}
                for shard in sorted((tmp / DCP_SUBDIR).iterdir()):
                    rel = f"{DCP_SUBDIR}/{shard.name}"
                    files[rel] = FileRecord(bytes=shard.stat().st_size, sha256=sha256_file(shard))
                fsync_dir(tmp / DCP_SUBDIR)
                self._finish(job, tmp, state, files)
            except Exception as exc:
                log.exception("finishing checkpoint step %d failed", job.step)
                error = f"{type(exc).__name__}: {exc}"
        error = self._broadcast(error)
        if error:
            raise RuntimeError(error)

    def _finish(self, job: _Job, tmp: Path, state: dict, files: dict[str, FileRecord]) -> None:
        """Rank 0: JSON files, the manifest last, rename into place, ``latest``, retention."""
        files[STATE_JSON] = write_json(tmp / STATE_JSON, state)
        if job.model_config is not None:
            files[CONFIG_JSON] = write_json(tmp / CONFIG_JSON, json.loads(job.model_config))
        manifest = {"format": layout.FORMAT, "step": job.step, "version": __version__,
                    "layout": self.cfg.format, "world_size": self.ctx.world_size,
                    "created": time.time(),
                    "files": {k: {"bytes": r.bytes, "sha256": r.sha256} for k, r in files.items()}}
        write_json(tmp / layout.MANIFEST, manifest)
        fsync_dir(tmp)
        final = self.root / layout.step_name(job.step)
        if final.exists():  # the same step saved by an earlier timeline (resume=never)
            layout.remove_tree(final)
        os.rename(tmp, final)
        fsync_dir(self.root)
        atomic_write_text(self.root / layout.LATEST, final.name + "\n")
        job.nbytes = sum(r.bytes for r in files.values())
        self._apply_retention(job.step)

    def _apply_retention(self, current: int) -> None:
        complete = [s for s, p in layout.list_checkpoints(self.root) if (p / layout.MANIFEST).is_file()]
        delete, abandon = layout.retention_plan(complete, current, self.cfg.keep_last, self.cfg.keep_every)
        for step in abandon:
            src = self.root / layout.step_name(step)
            dst = self.root / layout.ABANDONED / f"{src.name}-{uuid.uuid4().hex[:6]}"
            dst.parent.mkdir(exist_ok=True)
            log.warning("moving %s (newer than this run's step %d, from an earlier timeline) to %s",
                        src, current, dst)
            os.rename(src, dst)
        for step in delete:
            layout.remove_tree(self.root / layout.step_name(step))


# -- reading without a process group (sample, export, tests) -----------------------------------
@dataclass
class CheckpointData:
    """A checkpoint read into memory."""

    path: Path
    step: int
    model_state: dict[str, torch.Tensor]
    """Weights by unwrapped name, tied names included."""
    state: dict[str, Any]
    """Decoded state.json: optimizer, scaler, rng (per rank), train_state, aliases."""
    model_config: dict[str, Any] | None
    """The transformers model config (config.json), when the model had one."""


def read_checkpoint(path: Path, manifest: dict) -> CheckpointData:
    """Read a validated checkpoint directory (files named by ``manifest``); no process group."""
    state_raw = json.loads((path / STATE_JSON).read_text())
    if manifest.get("layout") == "dcp":
        merged: dict[str, torch.Tensor] = {}
        for rel in manifest["files"]:
            if rel.startswith(f"{DCP_SUBDIR}/"):
                merged.update(read_safetensors(path / rel))  # DDP: every tensor whole in one shard
        weights = {k[len("model/"):]: v for k, v in merged.items() if k.startswith("model/")}
        tensors = {k[len("state/"):]: v for k, v in merged.items() if k.startswith("state/")}
        tensors.update(read_safetensors(path / STATE_FILE))
    else:
        weights = read_safetensors(path / MODEL_FILE)
        tensors = read_safetensors(path / STATE_FILE)
    for name, target in state_raw.get("aliases", {}).items():
        weights[name] = weights[target]
    state = {k: from_plain(v, tensors) for k, v in state_raw.items() if k not in ("aliases",)}
    config = None
    if CONFIG_JSON in manifest["files"]:
        config = json.loads((path / CONFIG_JSON).read_text())
    return CheckpointData(path=path, step=int(manifest["step"]), model_state=weights, state=state,
                          model_config=config)


def _load_model(net: nn.Module, weights: dict[str, torch.Tensor], path: Path) -> None:
    """Copy ``weights`` into ``net``; a different architecture is a one-line user error."""
    own = net.state_dict()
    missing = sorted(set(own) - set(weights))
    unexpected = sorted(set(weights) - set(own))
    shapes = [k for k in own if k in weights and tuple(own[k].shape) != tuple(weights[k].shape)]
    if missing or unexpected or shapes:
        parts = []
        for label, names in (("missing", missing), ("unexpected", unexpected), ("shape differs", shapes)):
            if names:
                parts.append(f"{label}: {', '.join(names[:3])}{' ...' if len(names) > 3 else ''}")
        raise UserError(f"checkpoint {path} does not fit this model ({'; '.join(parts)}): "
                        "was it saved with another model.preset or vocabulary?")
    net.load_state_dict(weights, strict=True)


def load_latest(run_dir: str | os.PathLike) -> CheckpointData:
    """The newest valid checkpoint of a run, read into memory (no process group needed)."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise UserError(f"run directory {run_dir} does not exist")
    choice = layout.find_latest_valid(run_dir / layout.CKPT_SUBDIR)
    if choice.path is None:
        raise UserError(f"run directory {run_dir} has no complete checkpoint under "
                        f"{run_dir / layout.CKPT_SUBDIR} (train first, or check run.dir)")
    return read_checkpoint(choice.path, choice.manifest)


def run_config_of(run_dir: str | os.PathLike, ckpt: CheckpointData) -> dict[str, Any]:
    """The run's resolved config: the checkpoint's own copy, else ``RUN_DIR/config.yaml``."""
    config = ckpt.state.get("train_state", {}).get("config")
    if isinstance(config, dict):
        return config
    path = Path(run_dir) / "config.yaml"
    if not path.is_file():
        raise UserError(f"{path} is missing and checkpoint {ckpt.path} carries no config")
    import yaml

    return yaml.safe_load(path.read_text()) or {}


def load_latest_weights(run_dir: str | os.PathLike) -> tuple[dict, dict[str, torch.Tensor], int]:
    """``(resolved run config dict, weights by unwrapped name, step)`` of a run's newest checkpoint."""
    ckpt = load_latest(run_dir)
    return run_config_of(run_dir, ckpt), ckpt.model_state, ckpt.step


def build_model_from_checkpoint(ckpt: CheckpointData, run_config: dict[str, Any]) -> nn.Module:
    """The transformers model a checkpoint holds, weights loaded, in eval mode, on the CPU."""
    from transformers import AutoModelForCausalLM

    config = model_config_of(ckpt, run_config)
    net = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    _load_model(net, ckpt.model_state, ckpt.path)
    return net.eval()


def model_config_of(ckpt: CheckpointData, run_config: dict[str, Any]) -> Any:
    """The transformers config: the checkpoint's config.json, else rebuilt from the preset."""
    if ckpt.model_config is not None:
        from transformers import CONFIG_MAPPING

        raw = dict(ckpt.model_config)
        return CONFIG_MAPPING[raw["model_type"]].from_dict(raw)
    from podtrain.model import preset_config

    embed = next((v for k, v in ckpt.model_state.items() if k.endswith("embed_tokens.weight")
                  or k.endswith("wte.weight")), None)
    vocab = int(embed.shape[0]) if embed is not None else None
    return preset_config(run_config.get("model", {}).get("preset", "tiny"), vocab)
