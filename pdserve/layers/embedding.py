"""Token embedding and the LM head (which may share the embedding matrix)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pdserve.layers.weights import new_parameter


class VocabEmbedding(nn.Module):
    """Token ids -> embeddings.

    Args:
        vocab_size, hidden_size: the matrix ``[vocab_size, hidden_size]``.
        dtype, device: where it lives.
    """

    def __init__(self, vocab_size: int, hidden_size: int, dtype: torch.dtype,
                 device: torch.device):
        super().__init__()
        self.weight = new_parameter((vocab_size, hidden_size), dtype, device)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """``input_ids`` ``[T]`` int64 -> ``[T, hidden_size]``."""
        return F.embedding(input_ids, self.weight)


class LMHead(nn.Module):
    """Hidden states -> float32 logits over the vocabulary.

    Args:
        vocab_size, hidden_size: the matrix ``[vocab_size, hidden_size]``.
        dtype, device: where it lives.
        tie_to: share this embedding's matrix instead of owning one (``tie_word_embeddings``).
    """

    def __init__(self, vocab_size: int, hidden_size: int, dtype: torch.dtype,
                 device: torch.device, tie_to: VocabEmbedding | None = None):
        super().__init__()
        self.weight = (tie_to.weight if tie_to is not None
                       else new_parameter((vocab_size, hidden_size), dtype, device))

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """``hidden`` ``[S, hidden_size]`` -> ``[S, vocab_size]`` float32 logits."""
        return F.linear(hidden, self.weight).float()
