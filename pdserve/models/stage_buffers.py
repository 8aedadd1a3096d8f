"""The static tensors a model's stages and its attention hand each other in a step replayed
from piecewise CUDA graphs (:mod:`pdserve.runner.piecewise_graphs`), as the model defines them."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class StageBuffers:
    """Buffers of ``N`` rows between the stages of each layer (every layer reuses them).

    Attributes:
        projection: what a layer's ``attention_inputs`` projects into (its ``qkv_out``: the
            fused QKV buffer ``[N, q_size + 2 * kv_size]`` of the Llama family), or None when
            the layer projects into new tensors (then they are copied into ``inputs``).
        inputs: the three tensors ``attention_inputs`` returns and ``attend`` takes, each
            ``[N, ...]`` (Llama: queries, keys, values as views of ``projection``; DeepSeek:
            queries ``[N, H, qk_head_dim]``, the latent projection ``[N, W]`` and None).
        out: attention's output ``[N, H, head_dim]`` (DeepSeek: ``v_head_dim``), which the next
            stage reads.
    """

    projection: torch.Tensor | None
    inputs: tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]
    out: torch.Tensor

    def rows(self, n: int) -> StageBuffers:
        """The same buffers' first ``n`` rows (views)."""
        return StageBuffers(None if self.projection is None else self.projection[:n],
                            tuple(None if t is None else t[:n] for t in self.inputs),
                            self.out[:n])
