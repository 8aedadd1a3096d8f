"""Request handling shared by the completions and chat endpoints.

:class:`OpenAIServing` turns a validated request into engine requests (tokenises in a worker
thread, checks lengths against ``max_model_len``, builds :class:`SamplingParams`), runs them
through ``engine.generate`` (one engine request per choice: prompt index x ``n``), merges their
outputs, aborts whatever is unfinished when the consumer goes away, and records TTFT / TPOT /
end-to-end latency.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
import uuid
from array import array
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Awaitable, Callable, Sequence, TypeVar

from fastapi import Request

from pdserve.engine.sampling_params import SamplingParams
from pdserve.kv_transfer import prompt_handoff
from pdserve.kv_transfer.base import FIRST_TOKEN_KEY
from pdserve.entrypoints import decode_leg
from pdserve.entrypoints.errors import OpenAIError, bad_request, model_not_found
from pdserve.entrypoints.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    PromptTokensDetails,
    UsageInfo,
)
from pdserve.entrypoints.sse import DONE, sse_event
from pdserve.metrics import ServerMetrics

logger = logging.getLogger(__name__)

T = TypeVar("T")

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
        kv_transfer_params: the client's ``kv_transfer_params`` or None.
    """

    index: int
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    kv_transfer_params: dict[str, Any] | None = None
    prompt_digest: str | None = None


class PromptIds(list):
    """A prompt's token ids plus the digest of the rendered text they were computed from
    (:func:`pdserve.kv_transfer.prompt_handoff.text_digest`; None when not computed)."""

    text_digest: str | None = None


def _remote_role(params: Any) -> str | None:
    """``"prefill"`` for a P leg (``do_remote_decode``), ``"decode"`` for a D leg
    (``do_remote_prefill``), else None."""
    if not isinstance(params, dict):
        return None
    if params.get("do_remote_prefill"):
        return "decode"
    if params.get("do_remote_decode"):
        return "prefill"
    return None


class SegmentCachedEncoder:
    """Tokenizes rendered chat prompts piece by piece, caching each piece's ids, so that a
    conversation's history is tokenized once instead of again on every turn.

    A fast (Rust) tokenizer cuts its input at added tokens before normalizing or
    pre-tokenizing anything, so for a text cut right before a special added token that does
    not strip whitespace on its left, ``encode(a + b) == encode(a) + encode(b)``. Prompts are
    cut before every such token (in a chat template: every message starts with one) and each
    piece is looked up in an LRU cache by its text. The equivalence is checked against a
    plain ``encode`` on sample texts (:meth:`self_check`), on the first ``verify_first``
    prompts and then every ``verify_every``-th; any difference turns the cache off for good
    (with a warning).

    Args:
        tokenizer: a ``transformers`` tokenizer; a slow one, or one without such special
            tokens, is simply used as is.
        max_tokens: cache bound (tokens over all cached pieces; ids are stored as int32).
        verify_first / verify_every: see above.
    """

    def __init__(self, tokenizer: Any, max_tokens: int = 1 << 22, verify_first: int = 8,
                 verify_every: int = 100):
        self.tokenizer = tokenizer
        self.max_tokens = max_tokens
        self.verify_first = verify_first
        self.verify_every = verify_every
        self._cache: OrderedDict[str, array] = OrderedDict()
        self._tokens = 0
        self._count = 0
        self._lock = threading.Lock()
        self.boundaries = self._boundary_tokens(tokenizer)
        self.enabled = bool(self.boundaries)

    @staticmethod
    def _boundary_tokens(tokenizer: Any) -> list[str]:
        if not getattr(tokenizer, "is_fast", False):
            return []
        found = []
        for tok in (getattr(tokenizer, "added_tokens_decoder", None) or {}).values():
            content = getattr(tok, "content", None)
            if content and getattr(tok, "special", False) and getattr(tok, "lstrip", True) is False:
                found.append(content)
        return found

    def _pieces(self, text: str) -> list[str]:
        cuts = {0, len(text)}
        for b in self.boundaries:
            at = text.find(b, 1)
            while at != -1:
                cuts.add(at)
                at = text.find(b, at + 1)
        points = sorted(cuts)
        return [text[i:j] for i, j in zip(points, points[1:])]

    def _plain(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def _agrees(self, text: str, ids: list[int]) -> tuple[bool, list[int]]:
        """``(piece ids == plain ids, plain ids)``; a difference turns the cache off for good."""
        plain = self._plain(text)
        if plain == ids:
            return True, plain
        logger.warning("tokenizing chat prompts piece by piece differs from tokenizing them "
                       "whole for this tokenizer; the piece cache is off")
        self.enabled = False
        with self._lock:
            self._cache.clear()
        return False, plain

    def self_check(self, texts: Sequence[str]) -> bool:
        """Compare the piece-by-piece encoding of ``texts`` with plain ``encode`` (without
        filling the cache); any difference turns the cache off. Returns whether it is on."""
        for text in texts:
            if not self.enabled:
                break
            pieces = self._pieces(text)
            ids = [i for piece in self.tokenizer(pieces, add_special_tokens=False)["input_ids"]
                   for i in piece] if pieces else []
            self._agrees(text, ids)
        return self.enabled

    def encode(self, text: str) -> list[int]:
        """``tokenizer.encode(text, add_special_tokens=False)``, from cached pieces where
        possible."""
        if not self.enabled:
            return self._plain(text)
        pieces = self._pieces(text)
        with self._lock:
            found = [self._cache.get(p) for p in pieces]
            for p, ids in zip(pieces, found):
                if ids is not None:
                    self._cache.move_to_end(p)
        todo = list(dict.fromkeys(p for p, ids in zip(pieces, found) if ids is None))
        if todo:
            encoded = self.tokenizer(todo, add_special_tokens=False)["input_ids"]
            new = {p: array("i", ids) for p, ids in zip(todo, encoded)}
            with self._lock:
                for p, ids in new.items():
                    if p not in self._cache:
                        self._cache[p] = ids
                        self._tokens += len(ids)
                while self._tokens > self.max_tokens and self._cache:
                    self._tokens -= len(self._cache.popitem(last=False)[1])
            found = [ids if ids is not None else new[p] for p, ids in zip(pieces, found)]
        out: list[int] = []
        for ids in found:
            out.extend(ids)
        self._count += 1
        if self._count <= self.verify_first or self._count % self.verify_every == 0:
            return self._agrees(text, out)[1]
        return out


def _sample_chats(tokenizer: Any) -> list[str]:
    """Chats rendered with the tokenizer's template for :meth:`SegmentCachedEncoder.self_check`:
    text next to message boundaries with leading and trailing spaces, newlines, tabs, digits,
    code, accents, CJK and emoji. Empty when there is no chat template."""
    if not getattr(tokenizer, "chat_template", None):
        return []
    contents = [" leading space", "trailing space ", "\n\nnew lines\n", "\tx = [1, 2, 3]\n",
                "12345 67.89", "déjà vu — ünïcödé", "中文字符和日本語", "emoji 🙂🚀 end", "  ", "a"]
    chats = []
    for shift in range(3):
        turns = contents[shift:] + contents[:shift]
        messages = [{"role": "system", "content": "You are a helpful assistant."}]
        messages += [{"role": "user" if i % 2 == 0 else "assistant", "content": c}
                     for i, c in enumerate(turns)]
        try:
            chats.append(tokenizer.apply_chat_template(messages, tokenize=False,
                                                       add_generation_prompt=True))
        except Exception:  # a template that refuses these roles: nothing to check against
            return []
    return chats


@dataclass
class ChoiceState:
    """What one choice accumulated so far.

    Attributes:
        text: generated text (deltas joined; stop strings removed by the engine).
        token_ids: generated tokens.
        logprobs: one ``TokenLogprobs`` per generated token, when requested.
        finish_reason / error: from the finishing output.
        num_prompt_tokens / num_cached_tokens / num_output_tokens: token accounting.
        kv_transfer_params: the engine's params for the client (on the finishing output).
    """

    index: int
    prompt_index: int
    text_parts: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[Any] = field(default_factory=list)
    finish_reason: str | None = None
    error: str | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    num_output_tokens: int = 0
    kv_transfer_params: dict[str, Any] | None = None

    @property
    def text(self) -> str:
        return "".join(self.text_parts)

    def update(self, out: Any) -> None:
        """Folds one ``RequestOutput`` delta into the state."""
        if out.new_text:
            self.text_parts.append(out.new_text)
        self.token_ids.extend(out.new_token_ids or ())
        if out.new_logprobs:
            self.logprobs.extend(out.new_logprobs)
        self.num_prompt_tokens = out.num_prompt_tokens or self.num_prompt_tokens
        self.num_cached_tokens = out.num_cached_tokens or self.num_cached_tokens
        self.num_output_tokens = out.num_output_tokens or len(self.token_ids)
        if out.finished:
            self.finish_reason = out.finish_reason
            self.error = getattr(out, "error", None)
            self.kv_transfer_params = out.kv_transfer_params


def failed_request_error(state: ChoiceState) -> OpenAIError:
    """The error to report for a choice that finished with ``error`` or ``abort``."""
    if state.finish_reason == "abort":
        return OpenAIError(
            state.error or "The request was aborted by the engine.", 503,
            code="request_aborted",
        )
    return OpenAIError(
        state.error or "The engine failed the request.", 500, code="engine_request_failed",
    )


def usage_of(states: Sequence[ChoiceState]) -> UsageInfo:
    """Token usage: each prompt counted once; its cached tokens = the minimum over its choices
    (the first choice of a prompt may warm the prefix cache for the others)."""
    prompt_tokens = 0
    cached = 0
    by_prompt: dict[int, list[ChoiceState]] = {}
    for st in states:
        by_prompt.setdefault(st.prompt_index, []).append(st)
    for group in by_prompt.values():
        prompt_tokens += max(st.num_prompt_tokens for st in group)
        cached += min(st.num_cached_tokens for st in group)
    completion = sum(st.num_output_tokens for st in states)
    return UsageInfo(
        prompt_tokens=prompt_tokens,
        completion_tokens=completion,
        total_tokens=prompt_tokens + completion,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=cached),
    )


def first_kv_transfer_params(states: Sequence[ChoiceState]) -> dict[str, Any] | None:
    """The engine's ``kv_transfer_params`` of the lowest-index choice that returned some."""
    for st in sorted(states, key=lambda s: s.index):
        if st.kv_transfer_params is not None:
            return st.kv_transfer_params
    return None


def _engine_exception_to_error(exc: BaseException) -> OpenAIError:
    """Maps an exception raised by ``engine.generate`` to the client error."""
    if isinstance(exc, OpenAIError):
        return exc
    if isinstance(exc, ValueError):  # the engine rejected the request's content
        return bad_request(str(exc))
    name = type(exc).__name__
    if name == "EngineDeadError":
        return OpenAIError(f"The engine is not running: {exc}", 503, code="engine_dead")
    return OpenAIError(f"The engine failed the request: {name}: {exc}", 500,
                       code="engine_request_failed")


async def wait_for_disconnect(request: Request) -> None:
    """Returns when the HTTP client disconnects (its ASGI ``http.disconnect`` message).

    Only valid once the request body has been read (FastAPI reads it before the handler runs).
    """
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def cancel_on_disconnect(request: Request, work: Awaitable[T]) -> T | None:
    """Runs ``work``; cancels it (aborting its engine requests) if the client disconnects first.

    Returns:
        the result of ``work``, or None when the client went away.
    """
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(wait_for_disconnect(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if task.done():
            return task.result()
        logger.info("client disconnected; aborting its request")
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await task
        return None
    finally:
        for t in (task, watcher):
            if not t.done():
                t.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await watcher


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

    async def chat_prompt(self, req: ChatCompletionRequest) -> list[int]:
        """Token ids of the chat prompt rendered by the tokenizer's chat template.

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
        kwargs = dict(req.chat_template_kwargs or {})
        params = req.kv_transfer_params
        role = _remote_role(params)

        def render() -> list[int]:
            text = self.tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=req.add_generation_prompt,
                **kwargs,
            )
            if role is None:
                return self._chat_encoder.encode(text)
            # P/D: a decoder reuses the prefiller's ids for the same text; a prefiller
            # remembers the digest to hand its ids on.
            digest = prompt_handoff.text_digest(text, self.vocab_size)
            handed = (prompt_handoff.decode(params.get(prompt_handoff.KEY), digest, self.vocab_size)
                      if role == "decode" else None)
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
                f"output.", param=prompt_param, code="context_length_exceeded")
        room = self.max_model_len - prompt_len
        if requested is None:
            return room
        if requested > room:
            raise bad_request(
                f"The prompt ({prompt_len} tokens) plus max_tokens ({requested}) is "
                f"{prompt_len + requested} tokens, more than this model's maximum context length "
                f"(max_model_len) of {self.max_model_len} tokens.", param="max_tokens",
                code="context_length_exceeded")
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
                  logprobs: int | None, prompt_param: str) -> list[EngineJob]:
        """One job per (prompt, choice); engine ids are ``base_id`` for a single job, else
        ``f"{base_id}-{index}"``.

        Raises:
            OpenAIError: 400 when ``kv_transfer_params`` is malformed for this instance's KV
                connector (checked here so that streaming requests fail before the stream starts).
        """
        try:
            self.engine.check_kv_transfer_params(req.kv_transfer_params)
        except ValueError as exc:
            raise bad_request(str(exc), param="kv_transfer_params") from exc
        kv_params = req.kv_transfer_params
        if isinstance(kv_params, dict) and prompt_handoff.KEY in kv_params:
            # consumed by the front end (chat_prompt); the engine does not need the ids twice
            kv_params = {k: v for k, v in kv_params.items() if k != prompt_handoff.KEY}
        hand_on = _remote_role(kv_params) == "prefill"
        # A proxied prefill leg: refuse now what the decode leg will refuse (no wasted prefill).
        d_view = decode_leg.decode_view(req) if hand_on else None
        # A prefiller's first token belongs to its one choice: other choices draw their own.
        other_params = kv_params
        if isinstance(kv_params, dict) and FIRST_TOKEN_KEY in kv_params:
            other_params = {k: v for k, v in kv_params.items() if k != FIRST_TOKEN_KEY}
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
                            _hand_on_prompt(out, job)
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
                    raise _engine_exception_to_error(item) from item
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


def _hand_on_prompt(out: Any, job: EngineJob) -> None:
    """A prefiller's finished output: add the prompt's token ids to the ``kv_transfer_params``
    that send the decoder here (:mod:`pdserve.kv_transfer.prompt_handoff`)."""
    params = out.kv_transfer_params
    if not isinstance(params, dict) or not params.get("do_remote_prefill"):
        return
    try:
        handed = prompt_handoff.encode(job.prompt_token_ids, job.prompt_digest)
    except OverflowError:
        return
    out.kv_transfer_params = dict(params, **{prompt_handoff.KEY: handed})


def new_request_id(prefix: str) -> str:
    """``prefix-<32 hex digits>``."""
    return f"{prefix}-{uuid.uuid4().hex}"
