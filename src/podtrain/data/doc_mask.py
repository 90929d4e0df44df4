"""Document masking (``data.document_masking``): attention stays inside each packed document.

A sample is a window of the token stream, and documents are packed in it, each ended by EOS
(``data/loader.py``). With masking on, the loader (its producer thread or worker processes, off the
step's critical path) turns each micro-batch into ``DocumentRows``: the tokens plus what the
attention needs, computed from the EOS ids in the window:

* document ids: token ``t``'s document is the number of EOS ids before it in the inputs (an EOS
  belongs to the document it ends, the next document starts after it);
* ``position_ids``: positions restart at 0 at each document's first token (the window's first,
  partial document starts at 0 too: where it began in the stream is not in the window);
* the mask, in the form the model's attention kernel takes:
  - ``sdpa``: a boolean [batch, 1, seq, seq] tensor (True: attend), ``eager``: the same as an
    additive float mask; both dense, seq x seq per sample: fine on a CPU at the sizes it trains,
    and what SDPA needs there (flex_attention has no CPU backward in torch 2.13);
  - ``flex_attention`` (GPUs): a flex ``BlockMask``'s block tables (which 128 x 128 tiles are
    empty, full or partial), computed here with numpy from the document ids; the step only
    wraps them with a ``mask_mod`` over the device's document ids. A dense mask at seq 8192 is
    64 MiB per sample and keeps SDPA off its flash kernel; the block tables are 4 x 64 x 64
    int32 and the kernel skips the empty tiles, so the masking costs a few percent, not more.

The loss is unchanged: next-token targets, and an EOS's target is the next document's first
token, as without masking. A window that holds one document gets the plain causal mask and
positions 0..seq-1: its loss is the unmasked run's.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, fields, replace
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from podtrain.errors import UserError

BLOCK = 128
"""flex_attention's tile (its default BLOCK_SIZE): the block tables' granularity."""

KINDS = {"sdpa": "bool", "eager": "additive", "flex_attention": "block"}
"""model.attn_implementation -> the mask the loader builds for it."""


def document_ids(inputs: np.ndarray, eos_id: int) -> np.ndarray:
    """[batch, seq] int32: each input token's document within its row (EOS ids before it)."""
    eos = (inputs == eos_id).astype(np.int32)
    return np.cumsum(eos, axis=1, dtype=np.int32) - eos


def position_ids(docs: np.ndarray) -> np.ndarray:
    """[batch, seq] int64: each token's offset in its document (0 at every document's start)."""
    index = np.arange(docs.shape[1], dtype=np.int64)
    starts = np.where(np.diff(docs, axis=1, prepend=docs[:, :1]) != 0, index, 0)
    return index - np.maximum.accumulate(starts, axis=1)


def dense_mask(docs: np.ndarray) -> torch.Tensor:
    """[batch, 1, seq, seq] bool: query ``q`` attends key ``k`` when ``k <= q`` in the same document."""
    d = torch.from_numpy(docs)
    seq = d.shape[1]
    causal = torch.ones(seq, seq, dtype=torch.bool).tril_()
    return ((d[:, :, None] == d[:, None, :]) & causal).unsqueeze(1)


def _ordered(blocks: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
    """(count, indices) per row of a [batch, rows, cols] bool tile table, as flex's BlockMask
    holds them: [batch, 1, rows] int32 and [batch, 1, rows, cols] int32, the marked columns first
    in ascending order (create_block_mask's stable descending sort)."""
    count = blocks.sum(axis=-1, dtype=np.int32)
    order = np.argsort(~blocks, axis=-1, kind="stable").astype(np.int32)
    return torch.from_numpy(count[:, None]), torch.from_numpy(np.ascontiguousarray(order[:, None]))


def block_tables(docs: np.ndarray, block: int = BLOCK) -> tuple[torch.Tensor, ...]:
    """The eight tables of a flex ``BlockMask`` for causal attention within documents, from
    document ids that never decrease along a row (``seq`` a multiple of ``block``):
    ``kv_num_blocks, kv_indices, full_kv_num_blocks, full_kv_indices`` and their ``q`` transposes.

    Tile (query block i, key block j), j < i, is empty when the key block's last document
    precedes the query block's first, full when both blocks lie in one document; the diagonal
    tiles are partial (causal inside), tiles above it empty. O((seq / block)^2) per sample."""
    seq = docs.shape[1]
    first, last = docs[:, ::block], docs[:, block - 1::block]
    n = seq // block
    below = np.tri(n, n, -1, dtype=bool)
    full = below & (first[:, None, :] == last[:, :, None])
    touching = below & (last[:, None, :] >= first[:, :, None])
    partial = (touching & ~full) | np.eye(n, dtype=bool)
    kv = _ordered(partial) + _ordered(full)
    q = _ordered(partial.transpose(0, 2, 1)) + _ordered(full.transpose(0, 2, 1))
    return kv + q


@dataclass
class DocumentRows:
    """One micro-batch with its documents' positions and mask (what ``data.document_masking``
    hands the step instead of a bare [batch, seq + 1] tensor): ``shape`` and ``to`` act as the
    token tensor's, so the step handles both alike."""

    rows: torch.Tensor
    """[batch, seq + 1] token ids: inputs ``[:, :-1]``, targets ``[:, 1:]``."""
    position_ids: torch.Tensor
    """[batch, seq] int64, restarting at each document."""
    mask: torch.Tensor | None = None
    """sdpa/eager: the dense [batch, 1, seq, seq] mask (bool, or additive float for eager)."""
    doc_ids: torch.Tensor | None = None
    """flex_attention: [batch, seq] int32 document ids, read by the BlockMask's mask_mod."""
    blocks: tuple[torch.Tensor, ...] | None = None
    """flex_attention: the BlockMask's tables (``block_tables``)."""

    @property
    def shape(self) -> torch.Size:
        """The token rows' shape."""
        return self.rows.shape

    def _map(self, fn) -> "DocumentRows":
        """A copy with ``fn`` applied to every tensor."""
        out = {}
        for f in fields(self):
            value = getattr(self, f.name)
            out[f.name] = (tuple(fn(t) for t in value) if isinstance(value, tuple)
                           else fn(value) if value is not None else None)
        return replace(self, **out)

    def to(self, device: torch.device | str, non_blocking: bool = False) -> "DocumentRows":
        """Every tensor on ``device`` (asynchronous copies from pinned memory with ``non_blocking``)."""
        return self._map(lambda t: t.to(device, non_blocking=non_blocking))

    def pin_memory(self) -> "DocumentRows":
        """Every tensor in pinned host memory (the DataLoader's pin thread calls this too)."""
        return self._map(lambda t: t.pin_memory())

    def attention_mask(self) -> Any:
        """What the model's ``attention_mask`` takes: the dense mask, or a flex ``BlockMask``
        over these tables whose ``mask_mod`` reads the document ids on their device (built here,
        on the device, because a mask_mod closure cannot travel from a loader worker)."""
        if self.blocks is None:
            return self.mask
        from torch.nn.attention.flex_attention import BlockMask

        docs = self.doc_ids
        seq = docs.shape[1]

        def same_document(b, h, q_idx, kv_idx):
            return (docs[b, q_idx] == docs[b, kv_idx]) & (q_idx >= kv_idx)

        return BlockMask(seq_lengths=(seq, seq), kv_num_blocks=self.blocks[0], kv_indices=self.blocks[1],
                         full_kv_num_blocks=self.blocks[2], full_kv_indices=self.blocks[3],
                         q_num_blocks=self.blocks[4], q_indices=self.blocks[5],
                         full_q_num_blocks=self.blocks[6], full_q_indices=self.blocks[7],
                         BLOCK_SIZE=(BLOCK, BLOCK), mask_mod=same_document)


class DocumentMasker:
    """Builds ``DocumentRows`` from token rows in the loader: ``kind`` is ``bool`` (sdpa),
    ``additive`` (eager) or ``block`` (flex_attention), ``KINDS``' values."""

    def __init__(self, eos_id: int, kind: str):
        if kind not in KINDS.values():
            raise ValueError(f"kind={kind!r}: one of {sorted(set(KINDS.values()))}")
        self.eos_id, self.kind = int(eos_id), kind

    def __call__(self, rows: torch.Tensor) -> DocumentRows:
        """The micro-batch ``rows`` ([batch, seq + 1], on the host) with its positions and mask."""
        docs = document_ids(rows[:, :-1].numpy(), self.eos_id)
        positions = torch.from_numpy(position_ids(docs))
        if self.kind == "block":
            return DocumentRows(rows, positions, doc_ids=torch.from_numpy(docs), blocks=block_tables(docs))
        mask = dense_mask(docs)
        if self.kind == "additive":  # eager adds the mask to the scores
            mask = torch.zeros(mask.shape).masked_fill_(~mask, torch.finfo(torch.float32).min)
        return DocumentRows(rows, positions, mask=mask)


def document_loss_sum(model: nn.Module, batch: DocumentRows, precision: Any) -> torch.Tensor:
    """``train.loss.micro_batch_loss_sum`` for a masked micro-batch: the same summed next-token
    cross-entropy (fp32), the model given the documents' positions and mask."""
    inputs, targets = batch.rows[:, :-1], batch.rows[:, 1:]
    with precision.autocast():
        logits = model(input_ids=inputs, position_ids=batch.position_ids,
                       attention_mask=batch.attention_mask()).logits
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), reduction="sum")


def mask_kind(attn_implementation: str, device: torch.device, model_config: Any) -> str:
    """The mask the loader builds for this run (``KINDS``), or a one-line ``UserError`` where
    document masking cannot work: flex_attention on a CPU (no backward there), sdpa on a GPU
    (a dense seq x seq mask per sample: use flex_attention), a model with sliding-window layers
    (one 4D mask would replace their window) or whose forward takes no ``position_ids``."""
    kind = KINDS.get(attn_implementation)
    if kind is None:
        raise UserError(f"data.document_masking needs model.attn_implementation sdpa or eager (CPU) or "
                        f"flex_attention (GPU), got {attn_implementation!r}")
    device = torch.device(device)
    if device.type == "cpu" and kind == "block":
        raise UserError("data.document_masking with model.attn_implementation=flex_attention needs a GPU "
                        f"(torch {torch.__version__.split('+')[0]} has no flex_attention backward on CPU): "
                        "use sdpa on a CPU")
    if device.type != "cpu" and kind != "block":
        raise UserError(f"data.document_masking on a GPU takes model.attn_implementation=flex_attention, not "
                        f"{attn_implementation}: a dense seq x seq mask per sample costs memory and keeps "
                        "SDPA off its flash kernel")
    layer_types = set(getattr(model_config, "layer_types", None) or ())
    windowed = (layer_types - {"full_attention"} or
                (getattr(model_config, "sliding_window", None) and getattr(model_config, "use_sliding_window", True)))
    model_type = getattr(model_config, "model_type", "?")
    if windowed:
        raise UserError(f"data.document_masking cannot mask {model_type} models with sliding-window or "
                        "chunked attention layers (one document mask would replace their window)")
    from transformers import AutoModelForCausalLM  # the class, no weights

    model_class = AutoModelForCausalLM._model_mapping.get(type(model_config), None)
    if model_class is not None and "position_ids" not in inspect.signature(model_class.forward).parameters:
        raise UserError(f"data.document_masking: {model_type} models take no position_ids, so positions "
                        "cannot restart at each document")
    return kind
