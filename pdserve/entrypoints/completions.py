"""``POST /v1/completions``: legacy text completions, streaming and not."""

from __future__ import annotations

import time
from typing import Any, AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from pdserve.entrypoints.protocol import (
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
)
from pdserve.entrypoints.choices import ChoiceState, first_kv_transfer_params, usage_of
from pdserve.entrypoints.disconnect import cancel_on_disconnect
from pdserve.entrypoints.job_runner import EngineJob
from pdserve.entrypoints.serving import OpenAIServing, new_request_id
from pdserve.entrypoints.sse import EventStreamResponse
from pdserve.entrypoints.tokens import TokenText
from pdserve.types.kv_endpoints import DATA_PARALLEL_RANK_HEADER


def completion_logprobs(tokens: TokenText, entries: list[Any], num: int,
                        text_offset: int = 0) -> CompletionLogprobs:
    """The legacy ``logprobs`` object for a run of ``TokenLogprobs``.

    ``top_logprobs`` holds the ``num`` best alternatives plus the sampled token; ``text_offset``
    counts characters from the start of the choice's text.
    """
    out = CompletionLogprobs()
    offset = text_offset
    for e in entries:
        piece = tokens.text(e.token_id)
        out.tokens.append(piece)
        out.token_logprobs.append(e.logprob)
        top = {tokens.text(t): lp for t, lp in list(e.top)[:num]}
        top.setdefault(piece, e.logprob)
        out.top_logprobs.append(top)
        out.text_offset.append(offset)
        offset += len(piece)
    return out


class CompletionsHandler:
    """Serves ``/v1/completions`` for one :class:`OpenAIServing`."""

    def __init__(self, serving: OpenAIServing):
        self.serving = serving
        self.tokens = TokenText(serving.tokenizer)

    async def __call__(self, req: CompletionRequest, raw: Request) -> Response:
        arrival = time.monotonic()
        s = self.serving
        s.check_model(req.model)
        rank = s.data_parallel_rank(raw.headers.get(DATA_PARALLEL_RANK_HEADER))
        kv = s.kv_params(req)
        resumed = s.resumed_prompt(req)
        prompts = [resumed] if resumed is not None else await s.completion_prompts(req)
        response_id = new_request_id("cmpl")
        jobs = s.make_jobs(response_id, req, prompts, req.max_tokens, req.logprobs,
                           prompt_param="prompt", kv=kv,
                           data_parallel_rank=rank)
        prompt_indices = [j.index // req.n for j in jobs]
        if req.stream:
            return EventStreamResponse(
                self._stream(req, response_id, jobs, prompts, prompt_indices, arrival))
        states = await cancel_on_disconnect(raw, s.jobs.collect(jobs, arrival, prompt_indices))
        if states is None:
            return Response(status_code=499)
        return JSONResponse(self._response(req, response_id, states, prompts).model_dump())

    def _response(self, req: CompletionRequest, response_id: str,
                  states: list[ChoiceState], prompts: list[list[int]]) -> CompletionResponse:
        def ids(st: ChoiceState) -> dict[str, Any]:
            if not req.return_token_ids:
                return {}
            return {"prompt_token_ids": list(prompts[st.prompt_index]), "token_ids": st.token_ids}

        return CompletionResponse(
            id=response_id,
            model=self.serving.model_name,
            choices=[
                CompletionChoice(
                    index=st.index,
                    text=st.text,
                    logprobs=None if req.logprobs is None else completion_logprobs(
                        self.tokens, st.logprobs, req.logprobs),
                    finish_reason=st.finish_reason,
                    **ids(st),
                )
                for st in states
            ],
            usage=usage_of(states),
            kv_transfer_params=first_kv_transfer_params(states),
        )

    def _stream(self, req: CompletionRequest, response_id: str, jobs: list[EngineJob],
                prompts: list[list[int]], prompt_indices: list[int],
                arrival: float) -> AsyncIterator[str]:
        """The chunks; ``return_token_ids`` (vLLM's): each choice's first chunk carries its
        ``prompt_token_ids`` (not for a resumed request: ``pdserve_resume``), every chunk its
        ``token_ids``."""
        text_offsets = {j.index: 0 for j in jobs}
        ids = req.return_token_ids
        prompt_of = {j.index: prompts[prompt_indices[k]] for k, j in enumerate(jobs)}
        first = set() if req.pdserve_resume is not None or not ids else set(prompt_of)

        def choice_of(index: int, out: Any, finish_reason: str | None) -> dict[str, Any]:
            logprobs = None
            if req.logprobs is not None:
                lp = completion_logprobs(self.tokens, out.new_logprobs or [], req.logprobs,
                                         text_offsets[index])
                text_offsets[index] += sum(len(t) for t in lp.tokens)
                logprobs = lp.model_dump()
            choice = {"index": index, "text": out.new_text or "", "logprobs": logprobs,
                      "finish_reason": finish_reason}
            if ids:
                if index in first:
                    first.discard(index)
                    choice["prompt_token_ids"] = list(prompt_of[index])
                choice["token_ids"] = list(out.new_token_ids)
            return choice

        return self.serving.jobs.stream(
            jobs, arrival, response_id=response_id, object_name="text_completion",
            prompt_indices=prompt_indices,
            include_usage=bool(req.stream_options and req.stream_options.include_usage),
            choice_of=choice_of, token_ids=ids,
        )
