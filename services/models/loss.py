"""The loss every model's ``forward(idx, targets)`` computes: the mean cross-entropy over
the targets that count.

A target of :data:`IGNORE_INDEX` does not count (a prompt token of a chat example; the
convention of PyTorch and Hugging Face). Ranks whose batches count different numbers of
tokens are weighted by the data (:attr:`cargohold.services.data.batches.Batch.weight`),
so the step's loss is the mean over every counted token of the global batch.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

IGNORE_INDEX = -100
"""A target that the loss does not count."""


def mean_token_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of ``logits`` ``[B, T, V]`` against ``targets`` ``[B, T]`` over
    the targets that are not :data:`IGNORE_INDEX`, in fp32 whatever the logits' dtype (as
    autocast would do: a bf16 log-softmax loses the small differences the loss is made of).

    A batch without a counted target has no mean (0/0): its loss is 0 and its gradient
    zero, so a rank whose rows are all prompt still runs backward, and its collectives.
    """
    flat = targets.flatten()
    loss = F.cross_entropy(logits.float().flatten(0, 1), flat, ignore_index=IGNORE_INDEX)
    return torch.where(flat.ne(IGNORE_INDEX).any(), loss, torch.zeros_like(loss))
