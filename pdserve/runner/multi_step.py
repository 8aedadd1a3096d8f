"""The model runner's multi-step rounds (:attr:`SchedulerOutput.num_steps
<pdserve.types.outputs.SchedulerOutput.num_steps>` > 1): several decode steps back to back,
each step's sampled tokens the next step's inputs, read back to the host once at the end.

The scheduler's side of a round (when one is scheduled, and its commit) is
:mod:`pdserve.engine.multi_step`; docs/architecture.md, "Model runner", describes the device
side.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import torch

from pdserve.types.outputs import ScheduledRequest, TokenLogprobs
from pdserve.runner.cuda_graphs import CUDAGraphRunner
from pdserve.runner.decode_graphs import DecodeGraphReplay
from pdserve.runner.sampler import Sampler

# (scheduled, kv_cache) -> (sampled requests, their token ids, their logprobs or None)
ForwardAndSample = Callable[[list[ScheduledRequest], torch.Tensor],
                            tuple[list[ScheduledRequest], list[int],
                                  "list[TokenLogprobs | None]"]]


class MultiStepDecoder:
    """Runs multi-step rounds of decode steps.

    Args:
        forward_and_sample: one ordinary step, ``(scheduled, kv_cache) -> (sampled_requests,
            token_ids, logprobs)`` (:meth:`ModelRunner.forward_and_sample
            <pdserve.runner.model_runner.ModelRunner.forward_and_sample>`), for rounds that do
            not replay graphs.
        replay: the replay of the decode graphs (their inputs of the first step).
        sampler: the runner's sampler.
        block_size: tokens per KV block.
        max_model_len: longest sequence (prompt + output) in tokens.
        device: the runner's device.
    """

    def __init__(self, forward_and_sample: ForwardAndSample, replay: DecodeGraphReplay,
                 sampler: Sampler, block_size: int, max_model_len: int, device: torch.device):
        self._forward_and_sample = forward_and_sample
        self._replay = replay
        self._sampler = sampler
        self._block_size = block_size
        self._max_model_len = max_model_len
        self._device = device

    def decode(self, decodes: list[ScheduledRequest], num_steps: int, kv_cache: torch.Tensor,
               graphs: CUDAGraphRunner | None) -> dict[str, list[int]]:
        """A multi-step round: ``num_steps`` decode steps in which each step's sampled tokens
        are the next step's inputs, read back to the host once at the end. With CUDA graphs
        (``graphs``, captured on ``kv_cache``) the steps after the first only update the graph's
        static inputs on the device (token, position, slot, context length) and replay, so the
        host never waits for the GPU inside the round; without them each step is an ordinary
        step on ``kv_cache``.

        Returns:
            request_id -> its ``num_steps`` sampled tokens, in order.

        Raises:
            ValueError: a request that is not a sampled single-token decode, or positions
                beyond ``max_model_len``.
        """
        if any(len(r.token_ids) != 1 or not r.sample for r in decodes):
            raise ValueError("a multi-step round takes only sampled single-token decodes")
        last = max(r.num_computed_tokens for r in decodes) + num_steps
        if last > self._max_model_len:
            raise ValueError(f"a multi-step round reaches {last} tokens, beyond max_model_len="
                             f"{self._max_model_len}")
        if graphs is None or len(decodes) > graphs.max_batch_size:
            return self._decode_eager(decodes, num_steps, kv_cache)
        n = len(decodes)
        sampler = self._sampler
        plan = sampler.plan(decodes)
        tokens = torch.empty((num_steps, n), dtype=torch.int64, device=self._device)
        logits = self._replay.replay(decodes, graphs)
        buf = graphs.buffers
        bs = self._block_size
        for step in range(num_steps):
            if step:
                positions = buf["positions"][:n]
                positions.add_(1)
                buf["context_lens"][:n].add_(1)
                buf["input_ids"][:n].copy_(tokens[step - 1])
                blocks = buf["block_tables"][:n].gather(
                    1, (positions // bs).unsqueeze(1)).squeeze(1)
                torch.add(positions % bs, blocks.to(torch.int64), alpha=bs,
                          out=buf["slot_mapping"][:n])
                logits = graphs.replay(n)
            tokens[step] = sampler.draw(logits, plan, step)
        rows = tokens.t().tolist()
        return {r.request_id: row for r, row in zip(decodes, rows)}

    def _decode_eager(self, decodes: list[ScheduledRequest], num_steps: int,
                      kv_cache: torch.Tensor) -> dict[str, list[int]]:
        """:meth:`decode` as ordinary steps (CPU, ``enforce_eager``, or a batch larger than the
        captured graphs); the host sees every step's tokens."""
        sampled_ids: dict[str, list[int]] = {r.request_id: [] for r in decodes}
        for step in range(num_steps):
            batch = [dataclasses.replace(
                r, token_ids=[sampled_ids[r.request_id][-1]] if step else r.token_ids,
                num_computed_tokens=r.num_computed_tokens + step,
                output_token_ids=r.output_token_ids + sampled_ids[r.request_id])
                for r in decodes]
            sampled, tokens, _ = self._forward_and_sample(batch, kv_cache)
            for r, tok in zip(sampled, tokens):
                sampled_ids[r.request_id].append(tok)
        return sampled_ids
