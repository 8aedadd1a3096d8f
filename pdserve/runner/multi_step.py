"""The model runner's multi-step rounds (:attr:`SchedulerOutput.num_steps
<pdserve.types.outputs.SchedulerOutput.num_steps>` > 1): several decode steps back to back,
each step's sampled tokens the next step's inputs, read back to the host once at the end.

The scheduler's side of a round (when one is scheduled, and its commit) is
:mod:`pdserve.engine.multi_step`; docs/architecture.md, "Model runner", describes the device
side.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import torch

from pdserve.types.outputs import ScheduledRequest
from pdserve.runner.decode_graphs import replay_decode_graph

if TYPE_CHECKING:
    from pdserve.runner.model_runner import ModelRunner


def multi_step_decode(runner: "ModelRunner", decodes: list[ScheduledRequest], num_steps: int
                      ) -> dict[str, list[int]]:
    """A multi-step round: ``num_steps`` decode steps in which each step's sampled tokens are
    the next step's inputs, read back to the host once at the end. With CUDA graphs the steps
    after the first only update the graph's static inputs on the device (token, position, slot,
    context length) and replay, so the host never waits for the GPU inside the round; without
    them each step is an ordinary step.

    Returns:
        request_id -> its ``num_steps`` sampled tokens, in order.

    Raises:
        ValueError: a request that is not a sampled single-token decode, or positions
            beyond ``max_model_len``.
    """
    if any(len(r.token_ids) != 1 or not r.sample for r in decodes):
        raise ValueError("a multi-step round takes only sampled single-token decodes")
    last = max(r.num_computed_tokens for r in decodes) + num_steps
    if last > runner.max_model_len:
        raise ValueError(f"a multi-step round reaches {last} tokens, beyond max_model_len="
                         f"{runner.max_model_len}")
    graphs = runner.decode_graphs
    if graphs is None or len(decodes) > graphs.max_batch_size:
        return _multi_step_eager(runner, decodes, num_steps)
    n = len(decodes)
    sampler = runner.sampler
    plan = sampler.plan(decodes)
    tokens = torch.empty((num_steps, n), dtype=torch.int64, device=runner.device)
    logits = replay_decode_graph(runner, decodes, graphs)
    buf = graphs.buffers
    bs = runner.block_size
    for step in range(num_steps):
        if step:
            positions = buf["positions"][:n]
            positions.add_(1)
            buf["context_lens"][:n].add_(1)
            buf["input_ids"][:n].copy_(tokens[step - 1])
            blocks = buf["block_tables"][:n].gather(1, (positions // bs).unsqueeze(1)).squeeze(1)
            torch.add(positions % bs, blocks.to(torch.int64), alpha=bs,
                      out=buf["slot_mapping"][:n])
            logits = graphs.replay(n)
        tokens[step] = sampler.draw(logits, plan, step)
    rows = tokens.t().tolist()
    return {r.request_id: row for r, row in zip(decodes, rows)}


def _multi_step_eager(runner: "ModelRunner", decodes: list[ScheduledRequest], num_steps: int
                      ) -> dict[str, list[int]]:
    """:func:`multi_step_decode` as ordinary steps (CPU, ``enforce_eager``, or a batch larger
    than the captured graphs); the host sees every step's tokens."""
    out: dict[str, list[int]] = {r.request_id: [] for r in decodes}
    for step in range(num_steps):
        batch = [dataclasses.replace(
            r, token_ids=[out[r.request_id][-1]] if step else r.token_ids,
            num_computed_tokens=r.num_computed_tokens + step,
            output_token_ids=r.output_token_ids + out[r.request_id]) for r in decodes]
        sampled, tokens, _ = runner.forward_and_sample(batch, runner.kv_cache)
        for r, tok in zip(sampled, tokens):
            out[r.request_id].append(tok)
    return out
