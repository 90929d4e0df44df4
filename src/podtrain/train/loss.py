"""The training loss of one micro-batch, shared by the step, evaluation and the start-up checks."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from podtrain.train.precision import Precision


def micro_batch_loss_sum(model: nn.Module, rows: torch.Tensor, precision: Precision) -> torch.Tensor:
    """Summed next-token cross-entropy of a [batch, seq_len + 1] block (fp32 loss)."""
    inputs, targets = rows[:, :-1], rows[:, 1:]
    with precision.autocast():
        logits = model(input_ids=inputs).logits
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), reduction="sum")
