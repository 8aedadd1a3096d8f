"""``POST /v1/chat/completions``: chat through the tokenizer's chat template, streaming and not."""

from __future__ import annotations

import time
from typing import Any, AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from pdserve.utils import phase_trace
from pdserve.entrypoints.protocol import (
    ChatCompletionChoice,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatLogprobs,
    ChatResponseMessage,
    ChatTokenLogprob,
    TopLogprob,
)
from pdserve.entrypoints.choices import ChoiceState, first_kv_transfer_params, usage_of
from pdserve.entrypoints.disconnect import cancel_on_disconnect
from pdserve.entrypoints.job_runner import EngineJob
from pdserve.entrypoints.serving import OpenAIServing, new_request_id
from pdserve.entrypoints.sse import EventStreamResponse
from pdserve.entrypoints.tokens import TokenText
from pdserve.types.kv_endpoints import DATA_PARALLEL_RANK_HEADER


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
        phase_trace.mark("api.in")
        arrival = time.monotonic()
        s = self.serving
        s.check_model(req.model)
        rank = s.data_parallel_rank(raw.headers.get(DATA_PARALLEL_RANK_HEADER))
        kv = s.kv_params(req)
        phase_trace.mark("api.kv")
        prompt = s.resumed_prompt(req)
        if prompt is None:
            prompt = await s.chat_prompt(req, kv)
        phase_trace.mark("api.prompt")
        response_id = new_request_id("chatcmpl")
        jobs = s.make_jobs(response_id, req, [prompt], req.requested_max_tokens(),
                           req.num_logprobs(), prompt_param="messages", kv=kv,
                           data_parallel_rank=rank)
        phase_trace.mark("api.jobs")
        if req.stream:
            return EventStreamResponse(self._stream(req, response_id, jobs, arrival, prompt))
        states = await cancel_on_disconnect(raw, s.jobs.collect(jobs, arrival, [0] * len(jobs)))
        if states is None:
            return Response(status_code=499)
        phase_trace.mark("api.collected")
        return JSONResponse(self._response(req, response_id, states, prompt).model_dump())

    def _logprobs(self, req: ChatCompletionRequest, entries: list[Any]) -> ChatLogprobs | None:
        if not req.logprobs:
            return None
        return chat_logprobs(self.tokens, entries, req.top_logprobs or 0)

    def _response(self, req: ChatCompletionRequest, response_id: str,
                  states: list[ChoiceState], prompt: list[int]) -> ChatCompletionResponse:
        extra = {"prompt_token_ids": list(prompt)} if req.return_token_ids else {}
        return ChatCompletionResponse(
            id=response_id,
            model=self.serving.model_name,
            choices=[
                ChatCompletionChoice(
                    index=st.index,
                    message=ChatResponseMessage(role="assistant", content=st.text),
                    logprobs=self._logprobs(req, st.logprobs),
                    finish_reason=st.finish_reason,
                    **({"token_ids": st.token_ids} if req.return_token_ids else {}),
                )
                for st in states
            ],
            usage=usage_of(states),
            kv_transfer_params=first_kv_transfer_params(states),
            **extra,
        )

    def _stream(self, req: ChatCompletionRequest, response_id: str, jobs: list[EngineJob],
                arrival: float, prompt: list[int]) -> AsyncIterator[str]:
        """The chunks; ``return_token_ids`` (vLLM's): the first chunk carries
        ``prompt_token_ids`` and every choice its ``token_ids``. A resumed request
        (``pdserve_resume``) continues a stream whose role chunk was sent: it sends none and
        no ``prompt_token_ids``."""
        ids = req.return_token_ids
        resumed = req.pdserve_resume is not None

        def choice_of(index: int, out: Any, finish_reason: str | None) -> dict[str, Any]:
            logprobs = self._logprobs(req, out.new_logprobs or [])
            choice = {"index": index, "delta": {"content": out.new_text} if out.new_text else {},
                      "logprobs": None if logprobs is None else logprobs.model_dump(),
                      "finish_reason": finish_reason}
            if ids:
                choice["token_ids"] = list(out.new_token_ids)
            return choice

        opening = [] if resumed else [
            {"index": job.index, "delta": {"role": "assistant", "content": ""},
             "logprobs": None, "finish_reason": None, **({"token_ids": []} if ids else {})}
            for job in jobs]

        return self.serving.jobs.stream(
            jobs, arrival, response_id=response_id, object_name="chat.completion.chunk",
            prompt_indices=[0] * len(jobs),
            include_usage=bool(req.stream_options and req.stream_options.include_usage),
            choice_of=choice_of,
            # Every choice opens with the assistant role and empty content.
            opening_choices=opening, token_ids=ids,
            first_chunk_extra={"prompt_token_ids": list(prompt)} if ids and not resumed else None,
        )
