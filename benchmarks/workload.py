"""The requests of an offline benchmark run (``benchmarks/offline_throughput.py``, whose
diagnostics in ``benchmarks/run_diagnostics.py`` take them too): prompts of random token ids and
their output lengths."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Workload:
    """The requests: prompt token ids and output lengths (tokens)."""

    prompts: list[list[int]]
    output_lens: list[int]

    @property
    def num_output_tokens(self) -> int:
        return sum(self.output_lens)

    @property
    def num_prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)


def make_workload(num_prompts: int, min_len: int, max_len: int, vocab_size: int, seed: int,
                  min_out: int | None = None, max_out: int | None = None) -> Workload:
    """Uniform prompt lengths in ``[min_len, max_len]`` and output lengths in
    ``[min_out, max_out]`` (default: the same range), random token ids, from ``seed``."""
    gen = torch.Generator().manual_seed(seed)
    min_out = min_len if min_out is None else min_out
    max_out = max_len if max_out is None else max_out
    in_lens = torch.randint(min_len, max_len + 1, (num_prompts,), generator=gen).tolist()
    out_lens = torch.randint(min_out, max_out + 1, (num_prompts,), generator=gen).tolist()
    prompts = [torch.randint(0, vocab_size, (n,), generator=gen).tolist() for n in in_lens]
    return Workload(prompts, out_lens)
