"""Token embedding and the LM head (which may share the embedding matrix), vocabulary-parallel:
with TP size ``T`` rank ``r`` holds vocabulary rows ``[r*V/T, (r+1)*V/T)`` (Megatron-LM's
``VocabParallelEmbedding``). The embedding sums the ranks' partial lookups with an all-reduce;
the LM head all-gathers the ranks' logits, so every rank has the full ``[S, V]`` logits and
samples the same tokens. At TP 1 both are a plain lookup / matmul.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pdserve.distributed.communication import tp_all_gather, tp_all_reduce
from pdserve.distributed.parallel_state import get_tp_rank, get_tp_size
from pdserve.distributed.sharding import shard_range
from pdserve.layers.weights import (
    LoadedWeight,
    default_weight_loader,
    narrow_weight,
    new_parameter,
)


class _VocabRows(nn.Module):
    """A ``[vocab_size, hidden_size]`` matrix split by vocabulary rows over the TP ranks: this
    rank holds rows ``[vocab_start, vocab_start + num_local)`` and loads only those.

    Raises:
        TPShardingError: ``vocab_size`` does not split over the TP size.
    """

    def __init__(self, vocab_size: int):
        super().__init__()
        self.tp_size = get_tp_size()
        self.vocab_size = vocab_size
        self.vocab_start, self.num_local = shard_range(vocab_size, self.tp_size, get_tp_rank())

    def weight_loader(self, param: nn.Parameter, loaded: LoadedWeight,
                      shard_id: int | None = None) -> None:
        """Copy this rank's vocabulary rows of the checkpoint matrix.

        Raises:
            ValueError: a shard id, or a shape mismatch.
        """
        if self.tp_size > 1:
            loaded = narrow_weight(loaded, 0, self.vocab_size, self.vocab_start, self.num_local)
        default_weight_loader(param, loaded, shard_id)


class VocabEmbedding(_VocabRows):
    """Token ids -> embeddings, the vocabulary split over the TP ranks.

    Args:
        vocab_size, hidden_size: the checkpoint's matrix ``[vocab_size, hidden_size]``.
        dtype, device: where it lives.

    Attributes:
        weight: this rank's rows ``[vocab_size / T, hidden_size]``.
        vocab_start: the first vocabulary id of this rank's rows.

    Raises:
        TPShardingError: ``vocab_size`` does not split over the TP size.
    """

    def __init__(self, vocab_size: int, hidden_size: int, dtype: torch.dtype,
                 device: torch.device):
        super().__init__(vocab_size)
        self.weight = new_parameter((self.num_local, hidden_size), dtype, device,
                                    self.weight_loader)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """``input_ids`` ``[T]`` int64 -> ``[T, hidden_size]``."""
        if self.tp_size == 1:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.vocab_start
        outside = (local < 0) | (local >= self.num_local)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        out.masked_fill_(outside.unsqueeze(-1), 0)
        return tp_all_reduce(out)


class LMHead(_VocabRows):
    """Hidden states -> logits over the vocabulary, in the weights' dtype; each rank computes
    its vocabulary rows' logits and the ranks all-gather them. Consumers that compute on the
    logits upcast them to float32 themselves (the sampler, :mod:`pdserve.runner.sampler`), so
    a decode step whose tokens are argmax or the fused draw makes no float32 copy.

    Args:
        vocab_size, hidden_size: the checkpoint's matrix ``[vocab_size, hidden_size]``.
        dtype, device: where it lives.
        tie_to: share this embedding's matrix instead of owning one (``tie_word_embeddings``;
            the same rows on the same rank).

    Raises:
        TPShardingError: ``vocab_size`` does not split over the TP size.
    """

    def __init__(self, vocab_size: int, hidden_size: int, dtype: torch.dtype,
                 device: torch.device, tie_to: VocabEmbedding | None = None):
        super().__init__(vocab_size)
        self.weight = (tie_to.weight if tie_to is not None
                       else new_parameter((self.num_local, hidden_size), dtype, device,
                                          self.weight_loader))

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """``hidden`` ``[S, hidden_size]`` -> ``[S, vocab_size]`` logits in the weights' dtype
        (every rank)."""
        return tp_all_gather(F.linear(hidden, self.weight), dim=-1)
