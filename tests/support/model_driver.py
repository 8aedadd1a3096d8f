"""A minimal hand-written scheduler that drives :class:`ModelRunner` in tests.

It builds :class:`SchedulerOutput` objects by hand: block tables from a free list, prompts in
one or more prefill chunks, then one decode token per step, requests joining at chosen steps so
prefills and decodes share batches. It has no prefix caching of its own; tests that share
blocks pass explicit block tables.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pdserve.types.outputs import ModelRunnerOutput, ScheduledRequest, SchedulerOutput
from pdserve.types.sampling_params import SamplingParams


@dataclass
class DrivenRequest:
    request_id: str
    prompt: list[int]
    max_new_tokens: int
    params: SamplingParams
    chunks: list[int] | None = None  # prefill chunk sizes (sum = len(prompt) - num_computed)
    start_step: int = 0
    num_computed: int = 0  # tokens whose KV is already in the cache (shared blocks)
    block_ids: list[int] = field(default_factory=list)
    output: list[int] = field(default_factory=list)
    logprobs: list = field(default_factory=list)

    @property
    def done(self) -> bool:
        return len(self.output) >= self.max_new_tokens


class MiniScheduler:
    """Allocates blocks and emits one SchedulerOutput per step."""

    def __init__(self, runner, num_blocks: int):
        self.runner = runner
        self.block_size = runner.block_size
        self.free = list(range(num_blocks))

    def ensure_blocks(self, req: DrivenRequest, num_tokens: int) -> None:
        """Grow the block table of ``req`` to hold ``num_tokens`` tokens."""
        need = -(-num_tokens // self.block_size)
        while len(req.block_ids) < need:
            req.block_ids.append(self.free.pop(0))

    def run(self, reqs: list[DrivenRequest], max_steps: int = 1000) -> list[ModelRunnerOutput]:
        outs = []
        step = 0
        pending_chunks = {r.request_id: list(r.chunks or [len(r.prompt) - r.num_computed])
                          for r in reqs}
        finished: set[str] = set()
        while not all(r.done for r in reqs) and step < max_steps:
            scheduled = []
            for r in reqs:
                if r.done or step < r.start_step:
                    continue
                chunks = pending_chunks[r.request_id]
                if chunks:
                    n = chunks.pop(0)
                    tokens = r.prompt[r.num_computed:r.num_computed + n]
                    sample = not chunks
                else:
                    tokens = [r.output[-1]]
                    sample = True
                self.ensure_blocks(r, r.num_computed + len(tokens))
                scheduled.append(ScheduledRequest(
                    request_id=r.request_id, token_ids=tokens, num_computed_tokens=r.num_computed,
                    block_ids=list(r.block_ids), sample=sample, sampling_params=r.params,
                    prompt_token_ids=r.prompt, output_token_ids=r.output, eos_token_id=2))
            sched = SchedulerOutput(scheduled=scheduled, finished_request_ids=set(finished),
                                    total_num_scheduled_tokens=sum(len(s.token_ids)
                                                                   for s in scheduled))
            finished.clear()
            out = self.runner.execute(sched)
            outs.append(out)
            by_id = {r.request_id: r for r in reqs}
            for s in scheduled:
                r = by_id[s.request_id]
                r.num_computed += len(s.token_ids)
                if s.sample:
                    r.output.append(out.sampled_token_ids[s.request_id])
                    if s.request_id in out.logprobs:
                        r.logprobs.append(out.logprobs[s.request_id])
                    if r.done:
                        finished.add(r.request_id)
                else:
                    assert s.request_id not in out.sampled_token_ids
            step += 1
        return outs


def greedy(max_tokens: int = 16, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, **kw)
