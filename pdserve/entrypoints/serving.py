"""Request handling shared by the completions and chat endpoints.

:class:`OpenAIServing` turns a validated request into engine requests (tokenises in a worker
thread, checks lengths against ``max_model_len``, builds :class:`SamplingParams`), runs them
through ``engine.generate`` (one engine request per choice: prompt index x ``n``), merges their
outputs, aborts whatever is unfinished when the consumer goes away, and records TTFT / TPOT /
end-to-end latency.

It stays whole past ~450 lines: one class, whose steps (prompt, limits, sampling, jobs, run,
collect / stream) share the request's validated state from parse to the last chunk.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, AsyncIterator, Callable, Sequence

from pdserve.utils import phase_trace
from pdserve.types.sampling_params import SamplingParams
from pdserve.entrypoints.chat_tokenization import SegmentCachedEncoder, _sample_chats
from pdserve.types import prompt_handoff
from pdserve.types.kv_params import (
    KVRole,
    KVTransferParams,
    KVTransferParamsError,
    parse_request_params,
    with_prompt_handoff,
)
from pdserve.entrypoints import decode_leg
from pdserve.entrypoints.errors import (
    OpenAIError,
    bad_request,
    engine_exception_to_error,
    model_not_found,
)
from pdserve.entrypoints.choices import (
    ChoiceState,
    failed_request_error,
    first_kv_transfer_params,
    usage_of,
)
from pdserve.entrypoints.protocol import ChatCompletionRequest, CompletionRequest
from pdserve.entrypoints.sse import DONE, sse_event
from pdserve.entrypoints.metrics import ServerMetrics

logger = logging.getLogger(__name__)

# Finish reasons that end a request normally; anything else is reported as an error.
OK_FINISH_REASONS = ("stop", "length")


@dataclass
class EngineJob:
    """One engine request: one choice of one prompt.

    Attributes:
        index: the choice index in the response (prompt index * n + i).
        request_id: the engine request id.
        prompt_token_ids: the prompt.
        sampling_params: sampling for this choice (``n`` = 1; seed already offset by i).
        kv_transfer_params: the request's parsed ``kv_transfer_params`` or None.
        prompt_digest: a prefiller's rendered-prompt digest, to hand its prompt ids on with
            the returned params (None: nothing to hand on).
    """

    index: int
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    kv_transfer_params: KVTransferParams | None = None
    prompt_digest: str | None = None


class PromptIds(list):
    """A prompt's token ids plus the digest of the rendered text they were computed from
    (:func:`pdserve.types.prompt_handoff.text_digest`; None when not computed)."""

    text_digest: str | None = None


class OpenAIServing:
    """Front-end logic for one engine.

    Args:
        engine: an ``AsyncEngine`` (``tokenizer``, ``model_info``, ``max_model_len``, ``config``,
            ``generate``, ``abort``).
        metrics: where latencies are recorded.
    """

    def __init__(self, engine: Any, metrics: ServerMetrics):
        self.engine = engine
        self.metrics = metrics
        self.tokenizer = engine.tokenizer
        self.model_name: str = engine.config.name
        self.max_model_len: int = int(engine.max_model_len)
        self.vocab_size: int | None = getattr(engine.model_info, "vocab_size", None)
        # One worker: HF fast tokenizers are not safe for concurrent encode calls, and one thread
        # is enough to keep long prompts off the event loop.
        self._tokenizer_pool = ThreadPoolExecutor(max_workers=1,
                                                  thread_name_prefix="pdserve-tokenize")
        # Multi-turn histories repeat every earlier message: tokenize each message once. The
        # piece split is checked on rendered sample chats here, so live prompts are checked only
        # every 100th (a full encode on the request path costs milliseconds).
        self._chat_encoder = SegmentCachedEncoder(self.tokenizer, verify_first=0)
        self._chat_encoder.self_check(_sample_chats(self.tokenizer))
        self.max_prompt_chars = max_prompt_chars(self.tokenizer, self.max_model_len)

    def close(self) -> None:
        self._tokenizer_pool.shutdown(wait=False, cancel_futures=True)

    # ---- validation and preprocessing ---------------------------------------------------------
    def check_model(self, name: str | None) -> None:
        """Raises a 404 when ``name`` is given and is not the served model name."""
        if name is not None and name != self.model_name:
            raise model_not_found(name, self.model_name)

    async def _in_tokenizer_thread(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._tokenizer_pool, lambda: fn(*args, **kwargs))

    async def completion_prompts(self, req: CompletionRequest) -> list[list[int]]:
        """Token ids of each prompt of a completions request.

        Raises:
            OpenAIError: 400 for an empty prompt or token ids outside the vocabulary.
        """
        prompts = req.prompts()
        if not prompts:
            raise bad_request("prompt must not be empty", param="prompt")
        if isinstance(prompts[0], str):
            if any(p == "" for p in prompts):
                raise bad_request("prompt must not be an empty string", param="prompt")
            texts = list(prompts)
            for text in texts:
                self._check_prompt_chars(len(text), "prompt")
            encoded = await self._in_tokenizer_thread(
                lambda: [self.tokenizer.encode(t, add_special_tokens=True) for t in texts]
            )
            result = [list(ids) for ids in encoded]
        else:
            result = [list(p) for p in prompts]  # type: ignore[arg-type]
        for ids in result:
            if not ids:
                raise bad_request("prompt must not be empty", param="prompt")
            self._check_token_ids(ids, "prompt")
        return result

    def kv_params(self, req: CompletionRequest | ChatCompletionRequest) -> KVTransferParams | None:
        """The request's ``kv_transfer_params``, parsed and checked once, when it arrives
        (:func:`pdserve.types.kv_params.parse_request_params`).

        Raises:
            OpenAIError: 400 naming the field when the params are malformed for this
                instance's KV connector (before a streamed response's status is sent).
        """
        try:
            return parse_request_params(req.kv_transfer_params,
                                        self.engine.config.kv_transfer_config, self.vocab_size)
        except KVTransferParamsError as exc:
            raise bad_request(str(exc), param="kv_transfer_params") from exc

    async def chat_prompt(self, req: ChatCompletionRequest,
                          kv: KVTransferParams | None = None) -> list[int]:
        """Token ids of the chat prompt rendered by the tokenizer's chat template (``kv``: the
        parsed ``kv_transfer_params``; a decoder leg may reuse the prefiller's ids).

        Raises:
            OpenAIError: 400 when the model has no chat template or the template rejects the
                conversation (e.g. roles that do not alternate).
        """
        if not getattr(self.tokenizer, "chat_template", None):
            raise bad_request("This model has no chat template; use /v1/completions.",
                              param="messages")
        messages = []
        for m in req.messages:
            d = m.model_dump(exclude_none=True)
            d["content"] = m.text() or ""
            messages.append(d)
        self._check_prompt_chars(sum(len(m["content"]) for m in messages), "messages")
        kwargs = dict(req.chat_template_kwargs or {})
        role = kv.role if kv is not None else KVRole.NONE

        def render() -> list[int]:
            text = self.tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=req.add_generation_prompt,
                **kwargs,
            )
            if role is KVRole.NONE:
                return self._chat_encoder.encode(text)
            # P/D: a decoder reuses the prefiller's ids for the same text; a prefiller
            # remembers the digest to hand its ids on.
            digest = prompt_handoff.text_digest(text, self.vocab_size)
            handed = kv.handed_prompt_ids(digest, self.vocab_size)
            out = PromptIds(handed if handed is not None else self._chat_encoder.encode(text))
            out.text_digest = digest
            return out

        try:
            ids = await self._in_tokenizer_thread(render)
        except Exception as e:  # noqa: BLE001 - jinja2 errors come in several types
            raise bad_request(f"Could not apply the chat template: {e}", param="messages") from e
        if not ids:
            raise bad_request("The chat template produced an empty prompt", param="messages")
        return ids

    def _check_prompt_chars(self, num_chars: int, param: str) -> None:
        """Refuse, before tokenizing, a text no tokenization fits in ``max_model_len`` (one
        worker thread tokenizes every request: a 60 MB prompt held the others for about a
        minute)."""
        if num_chars > self.max_prompt_chars:
            raise bad_request(
                f"The prompt is {num_chars} characters long; no text over {self.max_prompt_chars} "
                f"characters fits in this model's maximum context length (max_model_len) of "
                f"{self.max_model_len} tokens.", param=param)

    def _check_token_ids(self, ids: list[int], param: str) -> None:
        limit = self.vocab_size
        for t in ids:
            if t < 0 or (limit is not None and t >= limit):
                raise bad_request(
                    f"token id {t} is outside the vocabulary [0, {limit})", param=param)

    def max_tokens_for(self, prompt_len: int, requested: int | None, prompt_param: str) -> int:
        """The ``max_tokens`` to use for a prompt of ``prompt_len`` tokens.

        Raises:
            OpenAIError: 400 when the prompt leaves no room in ``max_model_len`` or
                prompt + ``requested`` exceeds it.
        """
        if prompt_len >= self.max_model_len:
            raise bad_request(
                f"The prompt is {prompt_len} tokens long; this model's maximum context length "
                f"(max_model_len) is {self.max_model_len} tokens, which leaves no room for "
                f"output.", param=prompt_param)
        room = self.max_model_len - prompt_len
        if requested is None:
            return room
        if requested > room:
            raise bad_request(
                f"The prompt ({prompt_len} tokens) plus max_tokens ({requested}) is "
                f"{prompt_len + requested} tokens, more than this model's maximum context length "
                f"(max_model_len) of {self.max_model_len} tokens.", param="max_tokens")
        return requested

    def sampling_params(self, req: CompletionRequest | ChatCompletionRequest, max_tokens: int,
                        logprobs: int | None, choice: int) -> SamplingParams:
        """SamplingParams for choice ``choice`` (its seed is ``seed + choice``).

        Raises:
            OpenAIError: 400 when a combination is invalid (``SamplingParams.validate``).
        """
        sp = SamplingParams(
            n=1,
            temperature=1.0 if req.temperature is None else req.temperature,
            top_p=1.0 if req.top_p is None else req.top_p,
            top_k=0 if req.top_k is None else req.top_k,
            min_p=0.0 if req.min_p is None else req.min_p,
            seed=None if req.seed is None else req.seed + choice,
            repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
            presence_penalty=0.0 if req.presence_penalty is None else req.presence_penalty,
            frequency_penalty=0.0 if req.frequency_penalty is None else req.frequency_penalty,
            max_tokens=max_tokens,
            min_tokens=req.min_tokens,
            stop=req.stop_list(),
            stop_token_ids=list(req.stop_token_ids or []),
            ignore_eos=req.ignore_eos,
            logprobs=logprobs,
        )
        try:
            sp.validate()
        except ValueError as e:
            raise bad_request(str(e)) from e
        return sp

    def make_jobs(self, base_id: str, req: CompletionRequest | ChatCompletionRequest,
                  prompts: list[list[int]], requested_max_tokens: int | None,
                  logprobs: int | None, prompt_param: str,
                  kv: KVTransferParams | None = None) -> list[EngineJob]:
        """One job per (prompt, choice); engine ids are ``base_id`` for a single job, else
        ``f"{base_id}-{index}"``. ``kv``: the request's parsed ``kv_transfer_params``
        (:meth:`kv_params`).

        Raises:
            OpenAIError: 400 when a prompt does not fit or a sampling parameter is invalid.
        """
        # the prompt-ids hand-off was consumed by chat_prompt; the engine does not need it
        kv_params = kv.for_engine() if kv is not None else None
        hand_on = kv is not None and kv.role is KVRole.PREFILL
        # A proxied prefill leg: refuse now what the decode leg will refuse (no wasted prefill).
        d_view = decode_leg.decode_view(req) if hand_on else None
        # A prefiller's first token belongs to its one choice: other choices draw their own.
        other_params = kv_params.for_other_choices() if kv_params is not None else None
        total = len(prompts) * req.n
        jobs = []
        for p, ids in enumerate(prompts):
            if d_view is not None:
                d_max = self.max_tokens_for(len(ids), decode_leg.requested_max_tokens(d_view),
                                            prompt_param)
                self.sampling_params(d_view, d_max, logprobs, 0)
            max_tokens = self.max_tokens_for(len(ids), requested_max_tokens, prompt_param)
            for i in range(req.n):
                index = p * req.n + i
                jobs.append(EngineJob(
                    index=index,
                    request_id=base_id if total == 1 else f"{base_id}-{index}",
                    prompt_token_ids=ids,
                    sampling_params=self.sampling_params(req, max_tokens, logprobs, i),
                    kv_transfer_params=kv_params if index == 0 else other_params,
                    prompt_digest=getattr(ids, "text_digest", None) if hand_on else None,
                ))
        return jobs

    # ---- running ------------------------------------------------------------------------------
    async def run(self, jobs: list[EngineJob], arrival: float) -> AsyncIterator[tuple[int, Any]]:
        """Yields ``(choice index, RequestOutput)`` as outputs arrive from all jobs.

        Leaving early (consumer closed, cancelled, or an exception) aborts every job that has not
        finished. Exceptions from ``engine.generate`` are raised as :class:`OpenAIError`.

        Args:
            jobs: the engine requests.
            arrival: ``time.monotonic()`` when the HTTP request arrived (for TTFT / e2e).
        """
        unfinished = {job.index: job.request_id for job in jobs}
        first_token_at: dict[int, float] = {}
        queue: asyncio.Queue[tuple[int, Any]] = asyncio.Queue()
        done_marker = object()

        async def pump(job: EngineJob) -> None:
            try:
                gen = self.engine.generate(job.request_id, job.prompt_token_ids,
                                           job.sampling_params, job.kv_transfer_params)
                async with contextlib.aclosing(gen):
                    async for out in gen:
                        if out.finished and job.prompt_digest is not None:
                            out.kv_transfer_params = with_prompt_handoff(
                                out.kv_transfer_params, job.prompt_token_ids, job.prompt_digest)
                        queue.put_nowait((job.index, out))
            except asyncio.CancelledError:
                raise
            except Exception as e:  # noqa: BLE001 - forwarded to the consumer
                queue.put_nowait((job.index, e))
            finally:
                queue.put_nowait((job.index, done_marker))

        tasks = [asyncio.create_task(pump(job)) for job in jobs]
        try:
            remaining = len(tasks)
            while remaining:
                index, item = await queue.get()
                if item is done_marker:
                    remaining -= 1
                    continue
                if isinstance(item, BaseException):
                    raise engine_exception_to_error(item) from item
                phase_trace.mark("api.item")
                now = time.monotonic()
                if item.new_token_ids and index not in first_token_at:
                    first_token_at[index] = now
                    self.metrics.observe_first_token(now - arrival)
                if item.finished:
                    unfinished.pop(index, None)
                    self.metrics.count_finished(item.finish_reason)
                    if item.finish_reason in OK_FINISH_REASONS:
                        self.metrics.observe_finished(now - arrival, (
                            first_token_at[index] - arrival if index in first_token_at else None
                        ), item.num_output_tokens)
                yield index, item
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            for request_id in unfinished.values():
                self.metrics.count_finished("abort")
                try:
                    await self.engine.abort(request_id)
                except Exception:  # noqa: BLE001 - best effort; the engine may be gone
                    logger.debug("abort of %s failed", request_id, exc_info=True)

    async def collect(self, jobs: list[EngineJob], arrival: float,
                      prompt_indices: list[int]) -> list[ChoiceState]:
        """Runs the jobs to completion and returns one state per choice, in index order.

        Raises:
            OpenAIError: an engine exception, or a choice that finished with ``error``/``abort``.
        """
        states = {j.index: ChoiceState(j.index, prompt_indices[k]) for k, j in enumerate(jobs)}
        gen = self.run(jobs, arrival)
        async with contextlib.aclosing(gen):
            async for index, out in gen:
                st = states[index]
                st.update(out)
                if out.finished and st.finish_reason not in OK_FINISH_REASONS:
                    raise failed_request_error(st)
        return [states[i] for i in sorted(states)]

    async def stream(self, jobs: list[EngineJob], arrival: float, *, response_id: str,
                     object_name: str, prompt_indices: list[int], include_usage: bool,
                     choice_of: Callable[[int, Any, str | None], dict[str, Any]],
                     opening_choices: Sequence[dict[str, Any]] = ()) -> AsyncIterator[str]:
        """The SSE events of a streamed completions / chat response, ending with ``[DONE]``.

        Each chunk is ``{"id", "object": object_name, "created", "model", "choices"}``, plus
        ``"usage": null`` when ``include_usage``. First one chunk per ``opening_choices`` entry,
        then one chunk per engine output that carries text, logprobs or the finish, whose single
        choice is ``choice_of(index, output, finish_reason or None)``. The chunk that finishes the
        last choice carries ``kv_transfer_params`` unless ``include_usage``, in which case a final
        chunk with no choices carries ``usage`` and ``kv_transfer_params``.

        A choice that finishes with ``error``/``abort``, an :class:`OpenAIError`, or any other
        exception is reported in-band as an OpenAI error event followed by ``[DONE]`` (the HTTP
        status has already been sent).
        """
        created = int(time.time())
        states = {j.index: ChoiceState(j.index, prompt_indices[k]) for k, j in enumerate(jobs)}
        remaining = len(jobs)

        def chunk(choices: list[dict[str, Any]], **extra: Any) -> str:
            body: dict[str, Any] = {"id": response_id, "object": object_name,
                                    "created": created, "model": self.model_name,
                                    "choices": choices}
            if include_usage:
                body["usage"] = None
            body.update(extra)
            return sse_event(body)

        try:
            for choice in opening_choices:
                yield chunk([choice])
            runner = self.run(jobs, arrival)
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
                    extra: dict[str, Any] = {}
                    if out.finished:
                        remaining -= 1
                        if remaining == 0 and not include_usage:
                            extra["kv_transfer_params"] = first_kv_transfer_params(
                                list(states.values()))
                    phase_trace.mark("api.chunk")
                    yield chunk([choice_of(index, out,
                                           st.finish_reason if out.finished else None)], **extra)
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


def new_request_id(prefix: str) -> str:
    """``prefix-<32 hex digits>``."""
    return f"{prefix}-{uuid.uuid4().hex}"


def max_prompt_chars(tokenizer: Any, max_model_len: int) -> int:
    """The longest text (characters) whose tokens could fit in ``max_model_len``: the longest
    vocabulary entry's length times ``max_model_len``.

    A token's string in the vocabulary is at least as long as the text it stands for (byte-level
    BPE spells each byte as one character, SentencePiece pieces spell their text, byte-fallback
    pieces like ``<0x41>`` are longer), so a text longer than this has more than
    ``max_model_len`` tokens. (A normaliser that deletes characters would break that; the
    tokenizers served here have none.) Falls back to 64 characters per token when the
    tokenizer has no ``get_vocab``.
    """
    try:
        longest = max((len(t) for t in tokenizer.get_vocab()), default=0)
    except (AttributeError, NotImplementedError, TypeError):
        longest = 0
    return max(1, max_model_len) * (longest or 64)
