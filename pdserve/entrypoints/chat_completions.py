"""``POST /v1/chat/completions``: chat through the tokenizer's chat template, streaming and not."""

from __future__ import annotations

import contextlib
import logging
import time
from typing import Any, AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from pdserve.entrypoints.errors import OpenAIError
from pdserve.entrypoints.protocol import (
    ChatCompletionChoice,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatLogprobs,
    ChatResponseMessage,
    ChatTokenLogprob,
    TopLogprob,
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


def chat_logprobs(tokens: TokenText, entries: list[Any], num: int) -> ChatLogprobs:
    """The chat ``logprobs`` object: per token its text, logprob, UTF-8 bytes and the ``num``
    best alternatives."""
    content = []
    for e in entries:
        piece = tokens.text(e.token_id)
        content.append(ChatTokenLogprob(
            token=piece, logprob=e.logprob, bytes=list(piece.encode("utf-8")),
            top_logprobs=[
                TopLogprob(token=(t_text := tokens.text(t)), logprob=lp,
                           bytes=list(t_text.encode("utf-8")))
                for t, lp in list(e.top)[:num]
            ],
        ))
    return ChatLogprobs(content=content)


class ChatCompletionsHandler:
    """Serves ``/v1/chat/completions`` for one :class:`OpenAIServing`."""

    def __init__(self, serving: OpenAIServing):
        self.serving = serving
        self.tokens = TokenText(serving.tokenizer)

    async def __call__(self, req: ChatCompletionRequest, raw: Request) -> Response:
        arrival = time.monotonic()
        s = self.serving
        s.check_model(req.model)
        prompt = await s.chat_prompt(req)
        response_id = new_request_id("chatcmpl")
        jobs = s.make_jobs(response_id, req, [prompt], req.requested_max_tokens(),
                           req.num_logprobs(), prompt_param="messages")
        if req.stream:
            return EventStreamResponse(self._stream(req, response_id, jobs, arrival))
        states = await cancel_on_disconnect(raw, s.collect(jobs, arrival, [0] * len(jobs)))
        if states is None:
            return Response(status_code=499)
        return JSONResponse(self._response(req, response_id, states).model_dump())

    def _logprobs(self, req: ChatCompletionRequest, entries: list[Any]) -> ChatLogprobs | None:
        if not req.logprobs:
            return None
        return chat_logprobs(self.tokens, entries, req.top_logprobs or 0)

    def _response(self, req: ChatCompletionRequest, response_id: str,
                  states: list[ChoiceState]) -> ChatCompletionResponse:
        return ChatCompletionResponse(
            id=response_id,
            model=self.serving.model_name,
            choices=[
                ChatCompletionChoice(
                    index=st.index,
                    message=ChatResponseMessage(role="assistant", content=st.text),
                    logprobs=self._logprobs(req, st.logprobs),
                    finish_reason=st.finish_reason,
                )
                for st in states
            ],
            usage=usage_of(states),
            kv_transfer_params=first_kv_transfer_params(states),
        )

    async def _stream(self, req: ChatCompletionRequest, response_id: str, jobs: list[EngineJob],
                      arrival: float) -> AsyncIterator[str]:
        created = int(time.time())
        model = self.serving.model_name
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        states = {j.index: ChoiceState(j.index, 0) for j in jobs}
        remaining = len(jobs)

        def chunk(choices: list[dict[str, Any]], **extra: Any) -> str:
            body: dict[str, Any] = {"id": response_id, "object": "chat.completion.chunk",
                                    "created": created, "model": model, "choices": choices}
            if include_usage:
                body["usage"] = None
            body.update(extra)
            return sse_event(body)

        try:
            # Every choice opens with the assistant role and empty content.
            for job in jobs:
                yield chunk([{"index": job.index, "delta": {"role": "assistant", "content": ""},
                              "logprobs": None, "finish_reason": None}])
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
                    logprobs = self._logprobs(req, out.new_logprobs or [])
                    extra: dict[str, Any] = {}
                    if out.finished:
                        remaining -= 1
                        if remaining == 0 and not include_usage:
                            extra["kv_transfer_params"] = first_kv_transfer_params(
                                list(states.values()))
                    delta = {"content": out.new_text} if out.new_text else {}
                    yield chunk([{"index": index, "delta": delta,
                                  "logprobs": None if logprobs is None else logprobs.model_dump(),
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
