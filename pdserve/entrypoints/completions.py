"""``POST /v1/completions``: legacy text completions, streaming and not."""

from __future__ import annotations

import contextlib
import logging
import time
from typing import Any, AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from pdserve.entrypoints.errors import OpenAIError
from pdserve.entrypoints.protocol import (
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
)
from pdserve.entrypoints.serving import (
    OK_FINISH_REASONS,
    ChoiceState,
    EngineJob,
    OpenAIServing,
    cancel_on_disconnect,
    failed_request_error,
    first_kv_transfer_params,
    new_request_id,
    usage_of,
)
from pdserve.entrypoints.sse import DONE, EventStreamResponse, sse_event
from pdserve.entrypoints.tokens import TokenText

logger = logging.getLogger(__name__)


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
        prompts = await s.completion_prompts(req)
        response_id = new_request_id("cmpl")
        jobs = s.make_jobs(response_id, req, prompts, req.max_tokens, req.logprobs,
                           prompt_param="prompt")
        prompt_indices = [j.index // req.n for j in jobs]
        if req.stream:
            return EventStreamResponse(
                self._stream(req, response_id, jobs, prompt_indices, arrival))
        states = await cancel_on_disconnect(raw, s.collect(jobs, arrival, prompt_indices))
        if states is None:
            return Response(status_code=499)
        return JSONResponse(self._response(req, response_id, states).model_dump())

    def _response(self, req: CompletionRequest, response_id: str,
                  states: list[ChoiceState]) -> CompletionResponse:
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
                )
                for st in states
            ],
            usage=usage_of(states),
            kv_transfer_params=first_kv_transfer_params(states),
        )

    async def _stream(self, req: CompletionRequest, response_id: str, jobs: list[EngineJob],
                      prompt_indices: list[int], arrival: float) -> AsyncIterator[str]:
        created = int(time.time())
        model = self.serving.model_name
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        states = {j.index: ChoiceState(j.index, prompt_indices[k]) for k, j in enumerate(jobs)}
        text_offsets = {j.index: 0 for j in jobs}
        remaining = len(jobs)

        def chunk(choices: list[dict[str, Any]], **extra: Any) -> str:
            body: dict[str, Any] = {"id": response_id, "object": "text_completion",
                                    "created": created, "model": model, "choices": choices}
            if include_usage:
                body["usage"] = None
            body.update(extra)
            return sse_event(body)

        try:
            runner = self.serving.run(jobs, arrival)
            async with contextlib.aclosing(runner):
                async for index, out in runner:
                    st = states[index]
                    st.update(out)
                    if out.finished and st.finish_reason not in OK_FINISH_REASONS:
                        yield sse_event(failed_request_error(st).body())
                        yield DONE
                        return
                    if not (out.new_text or out.new_logprobs or out.finished):
                        continue
                    logprobs = None
                    if req.logprobs is not None:
                        lp = completion_logprobs(self.tokens, out.new_logprobs or [], req.logprobs,
                                                 text_offsets[index])
                        text_offsets[index] += sum(len(t) for t in lp.tokens)
                        logprobs = lp.model_dump()
                    extra: dict[str, Any] = {}
                    if out.finished:
                        remaining -= 1
                        if remaining == 0 and not include_usage:
                            extra["kv_transfer_params"] = first_kv_transfer_params(
                                list(states.values()))
                    yield chunk([{"index": index, "text": out.new_text or "", "logprobs": logprobs,
                                  "finish_reason": st.finish_reason if out.finished else None}],
                                **extra)
            if include_usage:
                all_states = [states[i] for i in sorted(states)]
                yield chunk([], usage=usage_of(all_states).model_dump(),
                            kv_transfer_params=first_kv_transfer_params(all_states))
            yield DONE
        except OpenAIError as e:
            yield sse_event(e.body())
            yield DONE
        except Exception as e:  # noqa: BLE001 - the stream has started; report in-band
            logger.exception("error while streaming %s", response_id)
            yield sse_event(OpenAIError(f"Internal server error: {e}", 500).body())
            yield DONE
