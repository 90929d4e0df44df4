"""Token shards -> this rank's micro-batches, with a global order that resumes exactly.

The model of the data (one picture to hold in your head):

* A split's shards are memory-mapped (zero copy), or read from S3 through a block cache
  (``data/cache.py``). The split is one token stream (its shards end to end): sample ``i`` is the
  window of ``seq_len + 1`` tokens from ``i * seq_len``; consecutive windows overlap by one token, so
  every token is a target once, and a window may cross a shard edge.
  Documents are packed: EOS separates them and a window may span two documents.
* All epochs form one **stream**: stream position ``p`` holds sample ``perm(seed, e)[p % N]``
  with ``e = p // N``, where ``perm`` is a permutation that is a pure function of (seed, epoch):
  a keyed bijection of ``[0, N)`` computed for the positions of each batch (``data/samples.py``),
  so no rank holds an epoch's order. The state records the order's name (``order``): a
  checkpoint from before it continues in the order it was made with, never re-ordered.
* Optimizer step ``s`` consumes the next ``global_batch_size`` stream positions. Rank ``r`` takes
  the ``r``-th contiguous slice of ``global_batch_size / world_size`` of them and cuts it into
  micro-batches. So the loader's whole state is the number of stream positions consumed: it does
  not depend on the world size, and a run resumed on 2 or 3 ranks continues exactly where 4 left
  off (same global batch), repeating and skipping nothing.
* The epoch tail: when ``N`` is not a multiple of the global batch, the last batch of epoch ``e``
  is completed with the first samples of epoch ``e + 1``'s order. Nothing is dropped or padded:
  every sample is seen exactly once per epoch, and the epoch advances by itself.

Batches are built ahead of the step by a background thread (or ``num_workers`` processes through
``torch.utils.data.DataLoader``), and the time the step waits for one is reported as ``wait_s``.
A read that fails in either (a ``UserError``, or a storage outage that outlasted its retries:
``storage.Transient``, exit 203) is raised by ``next()`` as the same exception, class included.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import torch

from podtrain.data.doc_mask import DocumentMasker
from podtrain.data.manifest import Manifest
from podtrain.data.mixture import Blend, MixOrder, ledger, mixed_entropy, parse_mix, restore_blend, segment_state
from podtrain.data.samples import ORDER, ORDERS, SHUFFLE_ORDER, SampleIndex, source_orders
from podtrain.data.sources import DataSources, MixedIndex
from podtrain.errors import UserError

log = logging.getLogger(__name__)


def rank_slice(global_batch: int, world_size: int, rank: int) -> slice:
    """The part of a global batch (stream positions relative to its start) this rank trains on."""
    per_rank = global_batch // world_size
    return slice(rank * per_rank, (rank + 1) * per_rank)


@dataclass
class StepBatch:
    """What one optimizer step receives on one rank.

    Attributes:
        micro_batches: ``accum`` tensors of shape [micro_batch, seq_len + 1]; inputs are
            ``[:, :-1]`` and targets ``[:, 1:]`` (views, no copy); with data.document_masking,
            ``doc_mask.DocumentRows`` holding such a tensor with its positions and mask.
        sample_ids: the global sample ids in this rank's share (for tests and diagnostics).
        consumed: stream positions consumed once this step is done (the state to save).
        wait_s: seconds the caller waited for this batch (data-loading stall).
    """

    micro_batches: list[torch.Tensor]
    sample_ids: np.ndarray
    consumed: int
    wait_s: float = 0.0


class _StepDataset(torch.utils.data.Dataset):
    """Map-style view used by worker processes: item ``k`` is step ``first_step + k``'s batch."""

    def __init__(self, loader: "ShardedLoader", start: int):
        self.loader, self.start = loader, start

    def __len__(self) -> int:  # effectively infinite; the sampler bounds it
        return 2**62

    def __getitem__(self, k: int):
        try:
            batch = self.loader.build(self.start + k * self.loader.global_batch_size, pin=False)
        except UserError as exc:
            # DataLoader would re-raise it as ``type(exc)(its traceback text)``: a RuntimeError for a
            # StorageError (whose constructor takes (url, cause)), a many-line UserError otherwise,
            # and a Transient's retryable exit code lost. Handed over as an item, it arrives whole.
            return _Failed(exc)
        return batch.micro_batches, batch.sample_ids, batch.consumed


@dataclass
class _Failed:
    """A worker's read failure, carried to the main process as an item (exceptions pickle)."""

    error: UserError


class ShardedLoader:
    """This rank's batches of one split, built ahead of the step.

    Args:
        data_dir: a ``podtrain prepare`` output directory (ignored when ``sources`` is given).
        seq_len: tokens per training sequence.
        global_batch_size: sequences per optimizer step across all ranks.
        micro_batch_size: sequences per forward/backward on this rank.
        rank, world_size: this rank's place; ``global_batch_size`` must split evenly.
        seed: data-order seed.
        split: "train" (or "val").
        prefetch: batches kept ready ahead.
        num_workers: 0 builds batches in one background thread; N > 0 uses N worker processes.
        pin_memory: pin host batches so copies to the GPU can overlap compute.
        manifest: ``data_dir``'s manifest when already read.
        sources: the run's sources (``data.mix``), blended by weight (``data/mixture.py``).
        document_masks: ``data.document_masking``'s mask kind (``doc_mask.mask_kind``): each
            micro-batch becomes a ``doc_mask.DocumentRows`` with its documents' positions and
            mask, built here with the batch, off the step's path; None: plain token tensors.
    """

    join_timeout_s = 5.0  # how long close() waits for a producer busy in a slow read

    def __init__(self, data_dir: str | Path | None, seq_len: int, global_batch_size: int,
                 micro_batch_size: int, rank: int, world_size: int, seed: int,
                 split: str = "train", prefetch: int = 4, num_workers: int = 0,
                 pin_memory: bool = False, manifest: Manifest | None = None,
                 sources: DataSources | None = None, document_masks: str | None = None):
        if global_batch_size % (micro_batch_size * world_size):
            raise UserError(
                f"train.global_batch_size={global_batch_size} is not divisible by "
                f"train.micro_batch_size x world size = {micro_batch_size} x {world_size}")
        self.sources = sources or DataSources(parse_mix([], str(data_dir)), seq_len, split,
                                              [manifest] if manifest is not None else None)
        self.manifest = self.sources.manifest
        self.index = MixedIndex(self.sources.indexes)
        self.seq_len = seq_len
        self.order_name = ORDER  # which order the sources' streams follow (``samples.ORDERS``)
        self.order = MixOrder(self._source_orders(seed), Blend([s.weight for s in self.sources.specs]), seed)
        self.retired: dict[str, int] = {}  # sources a curriculum dropped: their frozen sample counts
        self.global_batch_size = global_batch_size
        self.micro_batch_size = micro_batch_size
        self.rank, self.world_size = rank, world_size
        self.prefetch, self.num_workers, self.pin_memory = prefetch, num_workers, pin_memory
        self.consumed = 0  # stream positions consumed by steps handed to the trainer
        self._remote = any(ix.tokens.remote for ix in self.sources.indexes)
        self._stream: Iterator[StepBatch] | None = None
        self._stop: threading.Event | None = None  # the running producer's own (one per stream)
        self._thread: threading.Thread | None = None
        self.masker = DocumentMasker(self.manifest.eos_id, document_masks) if document_masks else None

    # -- state ---------------------------------------------------------------------------------
    @property
    def samples_per_epoch(self) -> int:
        """N: samples in one pass over the split (all sources together)."""
        return self.index.num_samples

    @property
    def epoch(self) -> int:
        """The epoch the next batch starts in (a mixture's: its most-repeated source's)."""
        counts = self.order.blend.counts(self.consumed)
        return max(int(n) // ix.num_samples for n, ix in zip(counts, self.sources.indexes))

    def ledger(self) -> dict[str, dict[str, int]]:
        """Samples and tokens each source has given the run so far (``mixture.ledger``)."""
        return ledger(self.sources.names, self.order.blend.counts(self.consumed), self.seq_len, self.retired)

    def state_dict(self) -> dict[str, Any]:
        """Where the data stands, independent of the world size: global samples consumed, the
        blend's segment and the per-source ledger (JSON-able)."""
        names = self.sources.names
        return {"epoch": self.epoch, "consumed": self.consumed,
                "samples_per_epoch": self.index.num_samples, "seed": self.order.seed,
                "mix": segment_state(names, [s.weight for s in self.sources.specs], self.order.blend),
                "sources": {n: ix.num_samples for n, ix in zip(names, self.sources.indexes)},
                "ledger": self.ledger(), "windows": SampleIndex.WINDOWS, "order": self.order_name}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from a saved state (before the first ``next``); a state with only
        ``consumed`` (the guard's skip) moves along the current blend."""
        if state.get("seed", self.order.seed) != self.order.seed:
            raise UserError(
                f"run.seed is {self.order.seed} but the checkpoint's data order was made with seed "
                f"{state['seed']}: resuming would repeat and skip samples (keep run.seed)")
        self._check_sizes(state)
        name = saved_order(state, self.order_name)
        self.close()
        self.consumed = int(state["consumed"])
        blend = self.order.blend
        if "mix" in state:
            blend, self.retired = restore_blend(self.sources.names, [s.weight for s in self.sources.specs],
                                                state["mix"], state.get("ledger", {}), self.consumed)
        orders = self.order.orders
        if name != self.order_name:
            log.info("data order: the checkpoint's %s order continues (it holds an epoch's order, 4 bytes "
                     "per sample, on every rank); a new run takes %s, computed on demand", name, ORDER)
            self.order_name = name
            orders = self._source_orders(self.order.seed)
        self.order = MixOrder(orders, blend, self.order.seed)

    def _source_orders(self, seed: int) -> list:
        """Each source's own stream in the order ``order_name``."""
        return source_orders(self.order_name, [ix.num_samples for ix in self.sources.indexes], seed)

    def _check_sizes(self, state: dict[str, Any]) -> None:
        """Refuse a checkpoint whose sources have other sample counts (other data or seq_len)."""
        saved = state.get("sources")
        if saved is None and "samples_per_epoch" in state:  # a checkpoint from before data.mix
            saved = {self.sources.names[0]: state["samples_per_epoch"]} if len(self.sources.names) == 1 else {}
        if (saved and len(saved) == 1 and len(self.sources.names) == 1 and self.sources.names[0] not in saved
                and int(state.get("consumed", 0)) > self.index.num_samples):
            # Another single dataset (ckpt.allow_changes=[data.path]) whose epoch ends before the
            # saved position: no position in it is "where the run was".
            raise UserError(
                f"the checkpoint's data position ({int(state['consumed'])} samples) is past the end of an "
                f"epoch of {self.sources.manifests[0].root} ({self.index.num_samples} samples): it is not the "
                f"data the run trained on; to train on it from its start, branch with "
                f"ckpt.resume_from=CHECKPOINT ckpt.resume_from_reset=[data] in a new run.dir")
        for i, (name, index) in enumerate(zip(self.sources.names, self.sources.indexes)):
            if name in (saved or {}) and "windows" not in state and len(index.shards) > 1:
                check_shard_windows(self.sources.manifests[i], index, saved[name])
            if name in (saved or {}) and saved[name] != index.num_samples:
                raise UserError(
                    f"data in {self.sources.manifests[i].root} has {index.num_samples} samples per epoch but "
                    f"the checkpoint was made with {saved[name]}: different data or data.seq_len")

    # -- building ------------------------------------------------------------------------------
    def build(self, start: int, pin: bool | None = None) -> StepBatch:
        """This rank's batch of the step whose global batch starts at stream position ``start``.

        ``pin`` defaults to ``pin_memory``; worker processes pass False (CUDA cannot be used in a
        forked worker; the DataLoader pins in the parent instead).
        """
        positions = rank_slice(self.global_batch_size, self.world_size, self.rank)
        ids = self.order.ids(start + positions.start, positions.stop - positions.start)
        rows = torch.from_numpy(self.index.gather(ids))
        pin = self.pin_memory if pin is None else pin
        if pin and self.masker is None:
            rows = rows.pin_memory()
        micro = list(rows.split(self.micro_batch_size))
        if self.masker is not None:  # data.document_masking: each micro-batch with its positions and mask
            micro = [self.masker(m) for m in micro]
            micro = [m.pin_memory() for m in micro] if pin else micro
        return StepBatch(micro, ids, start + self.global_batch_size)

    def warm(self, start: int) -> None:
        """Start reading the data of the batch at stream position ``start`` (S3 sources; returns at once)."""
        if self._remote:
            positions = rank_slice(self.global_batch_size, self.world_size, self.rank)
            self.index.warm(self.order.ids(start + positions.start, positions.stop - positions.start))

    def _thread_stream(self) -> Iterator[StepBatch]:
        # Each stream has its own queue and stop event: a producer that close() could not join
        # (stuck in a slow read) finds its event still set when it returns and ends, whatever
        # later streams do.
        ready: queue.Queue = queue.Queue(maxsize=self.prefetch)
        stop = self._stop = threading.Event()
        start = self.consumed

        def hand_over(item: Any) -> bool:
            while not stop.is_set():
                try:
                    ready.put(item, timeout=0.1)
                    return True
                except queue.Full:
                    continue
            return False

        def produce() -> None:
            pos = start
            try:
                while not stop.is_set():
                    self.warm(pos + self.global_batch_size)  # S3: fetch the next batch's blocks meanwhile
                    if not hand_over(self.build(pos)):
                        break
                    pos += self.global_batch_size
            except BaseException as exc:  # hand the failure to the consumer instead of hanging it
                hand_over(exc)

        self._thread = threading.Thread(target=produce, name="podtrain-loader", daemon=True)
        self._thread.start()
        while True:
            item = ready.get()
            if isinstance(item, BaseException):
                raise item
            yield item

    def _worker_stream(self) -> Iterator[StepBatch]:
        import itertools

        loader = torch.utils.data.DataLoader(
            _StepDataset(self, self.consumed), batch_size=None, sampler=itertools.count(),
            num_workers=self.num_workers, prefetch_factor=max(1, self.prefetch // self.num_workers),
            pin_memory=self.pin_memory, persistent_workers=False)
        for item in loader:
            if isinstance(item, _Failed):
                raise item.error
            micro, ids, consumed = item
            yield StepBatch(list(micro), np.asarray(ids), int(consumed))

    def next(self) -> StepBatch:
        """The next step's batch; ``wait_s`` is how long this call blocked."""
        if self._stream is None:
            self._stream = self._worker_stream() if self.num_workers else self._thread_stream()
        t0 = time.perf_counter()
        batch = next(self._stream)
        batch.wait_s = time.perf_counter() - t0
        self.consumed = batch.consumed
        return batch

    def close(self) -> None:
        """Stop the background thread or workers, then release the S3 block cache (safe to call
        twice). A producer still busy after ``join_timeout_s`` is left to end by itself at its next check."""
        if self._stop is not None:
            self._stop.set()
            self._stop = None
        if self._thread is not None:
            self._thread.join(timeout=self.join_timeout_s)
            self._thread = None
        if self._stream is not None:
            self._stream.close()
            self._stream = None
        self.sources.close()  # the S3 block cache's fetch threads and stores


def saved_order(state: dict[str, Any], current: str) -> str:
    """The order a saved loader state continues in: the one it names; ``SHUFFLE_ORDER`` for a
    checkpoint written before states named it; ``current`` for a bare position (the guard's skip).
    An order this podtrain does not know is refused in one line: resuming in another order would
    repeat and skip samples."""
    if "order" in state:
        name = state["order"]
    elif "samples_per_epoch" in state or "sources" in state:
        name = SHUFFLE_ORDER
    else:
        return current
    if name not in ORDERS:
        raise UserError(
            f"the checkpoint's data order {name!r} is not one this podtrain knows ({', '.join(ORDERS)}): "
            "resuming would repeat and skip samples; finish the run with the podtrain that wrote it, or branch "
            "with ckpt.resume_from=CHECKPOINT ckpt.resume_from_reset=[data] in a new run.dir")
    return name


def check_shard_windows(manifest: Manifest, index: SampleIndex, saved_samples: int) -> None:
    """Refuse, in one line, a checkpoint of a split of several shards made before samples were cut
    from a split as one token stream (its samples differ; a split of one shard gives the same
    windows either way, so those checkpoints resume unchanged). Recognised by that podtrain's
    sample count, one window run per shard; another count is other data (refused by the caller)."""
    per_shard = sum(max(0, (s.tokens - 1) // index.seq_len) for s in index.shards)
    if saved_samples == per_shard:
        raise UserError(
            f"the checkpoint was made by a podtrain that cut samples from each shard of {manifest.root} "
            "separately; this one reads a split as one token stream, so its samples differ and resuming "
            "would repeat and skip data: finish that run with the podtrain that started it, or start anew")


def unigram_entropy(manifest: Manifest, split: str = "train", max_tokens: int = 50_000_000) -> float:
    """Entropy in nats of the split's token frequencies (over its first ``max_tokens`` tokens).

    The loss a model would reach by predicting every token from its frequency alone: a trained
    model must get clearly below it to have learnt anything about context.
    """
    return blend_entropy([manifest], [1.0], split, max_tokens)


def blend_entropy(manifests: list[Manifest], weights: list[float], split: str = "train",
                  max_tokens: int = 50_000_000) -> float:
    """Entropy in nats of the token frequencies of a ``data.mix`` blend: each source's unigram
    distribution (over its first ``max_tokens`` tokens) weighted by its share of the blend (the
    weights are shares of samples, all ``data.seq_len`` long, so shares of tokens too). What a
    context-free model of the data the run trains on would reach, not of its first source.
    Reads the tokens: the closing line uses the counts ``prepare`` kept instead (``entropy_clause``)."""
    vocab = max(m.vocab_size for m in manifests)
    counts = [np.bincount(m.head_tokens(split, max_tokens), minlength=vocab) for m in manifests]
    return mixed_entropy(counts, weights, vocab)
