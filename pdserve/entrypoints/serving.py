"""Request handling shared by the completions and chat endpoints: a validated request into
engine jobs.

:class:`OpenAIServing` tokenises in a worker thread, checks lengths against ``max_model_len``,
parses ``kv_transfer_params``, builds :class:`SamplingParams` and makes one
:class:`~pdserve.entrypoints.job_runner.EngineJob` per choice (prompt index x ``n``); its
:attr:`~OpenAIServing.jobs` (:class:`~pdserve.entrypoints.job_runner.JobRunner`) runs them.
"""

from __future__ import annotations

import asyncio
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from pdserve.types.sampling_params import (GREEDY_TEMPERATURE_EPS, INT64_MAX, SamplingParams,
                                           SamplingParamsError)
from pdserve.entrypoints.chat_tokenization import SegmentCachedEncoder, _sample_chats
from pdserve.types import prompt_handoff
from pdserve.types.kv_params import (
    KVRole,
    KVTransferParams,
    KVTransferParamsError,
    parse_request_params,
)
from pdserve.entrypoints import decode_leg
from pdserve.entrypoints.errors import bad_request, model_not_found
from pdserve.entrypoints.job_runner import EngineJob, JobRunner
from pdserve.entrypoints.protocol import RESUME_FIELD, ChatCompletionRequest, CompletionRequest
from pdserve.types.kv_endpoints import DATA_PARALLEL_RANK_HEADER, parse_data_parallel_rank
from pdserve.types.resume import resume_refusal
from pdserve.entrypoints.metrics import ServerMetrics
from pdserve.model_files.tokenizer import max_prompt_chars


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

    Attributes:
        jobs: runs the jobs :meth:`make_jobs` makes (collected or streamed).
    """

    def __init__(self, engine: Any, metrics: ServerMetrics):
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self.model_name: str = engine.config.name
        self.jobs = JobRunner(engine, metrics, self.model_name)
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

    def data_parallel_rank(self, header: str | None) -> int | None:
        """The data-parallel rank a request's ``X-data-parallel-rank`` header pins it to (None:
        no header, the least-loaded rank serves it). Without data parallelism only 0 is valid.

        Raises:
            OpenAIError: 400 naming the header for a value that is not an integer in
                ``0 .. data_parallel_size - 1``.
        """
        try:
            return parse_data_parallel_rank(header, self.engine.config.data_parallel_size)
        except ValueError as e:
            raise bad_request(str(e), param=DATA_PARALLEL_RANK_HEADER) from None

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

    def resumed_prompt(self, req: CompletionRequest | ChatCompletionRequest) -> list[int] | None:
        """A resumed request's original prompt ids (``pdserve_resume``), checked; None when
        the request is not resumed.

        Raises:
            OpenAIError: 400 naming ``pdserve_resume`` (or the field that forbids resuming:
                :func:`pdserve.types.resume.resume_refusal`) for ids outside the vocabulary, or
                a request that cannot be continued identically.
        """
        resume = req.pdserve_resume
        if resume is None:
            return None
        refusal = resume_refusal(
            n=req.n, seed=req.seed, logprobs=req.logprobs,
            top_logprobs=getattr(req, "top_logprobs", None),
            presence_penalty=req.presence_penalty, frequency_penalty=req.frequency_penalty)
        if refusal is not None:
            raise bad_request(f"{RESUME_FIELD}: {refusal[1]}", param=refusal[0])
        if isinstance(req, CompletionRequest) and len(req.prompts()) > 1:
            raise bad_request(f"{RESUME_FIELD}: a request with several prompts cannot be resumed",
                              param="prompt")
        self._check_token_ids(resume.prompt_token_ids, RESUME_FIELD)
        self._check_token_ids(resume.output_token_ids, RESUME_FIELD)
        return list(resume.prompt_token_ids)

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
                        logprobs: int | None, choice: int, done_tokens: int = 0) -> SamplingParams:
        """SamplingParams for choice ``choice`` (its seed is ``seed + choice``); ``done_tokens``:
        output tokens a resumed request already has (``min_tokens`` counts them).

        Raises:
            OpenAIError: 400 when a combination is invalid (``SamplingParams.validate``).
        """
        sp = SamplingParams(
            n=1,
            temperature=1.0 if req.temperature is None else
            0.0 if req.temperature < GREEDY_TEMPERATURE_EPS else req.temperature,
            top_p=1.0 if req.top_p is None else req.top_p,
            top_k=0 if req.top_k is None else req.top_k,
            min_p=0.0 if req.min_p is None else req.min_p,
            seed=None if req.seed is None else _wrap_int64(req.seed + choice),
            repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
            presence_penalty=0.0 if req.presence_penalty is None else req.presence_penalty,
            frequency_penalty=0.0 if req.frequency_penalty is None else req.frequency_penalty,
            max_tokens=max_tokens,
            min_tokens=max(0, req.min_tokens - done_tokens),
            stop=req.stop_list(),
            stop_token_ids=list(req.stop_token_ids or []),
            ignore_eos=req.ignore_eos,
            logprobs=logprobs,
        )
        try:
            sp.validate()
        except SamplingParamsError as e:
            raise bad_request(str(e), param=e.param) from e
        return sp

    def make_jobs(self, base_id: str, req: CompletionRequest | ChatCompletionRequest,
                  prompts: list[list[int]], requested_max_tokens: int | None,
                  logprobs: int | None, prompt_param: str,
                  kv: KVTransferParams | None = None,
                  data_parallel_rank: int | None = None) -> list[EngineJob]:
        """One job per (prompt, choice); engine ids are ``base_id`` for a single job, else
        ``f"{base_id}-{index}"``. ``kv``: the request's parsed ``kv_transfer_params``
        (:meth:`kv_params`); ``data_parallel_rank``: the rank every job goes to
        (:meth:`data_parallel_rank`; None: the engine picks).

        A resumed request (``pdserve_resume``; ``prompts`` is then its original prompt): the
        engine's prompt is the prompt plus the output ids, ``max_tokens`` and ``min_tokens`` are
        reduced by their number (a prefill leg checks its decode leg's limits so reduced).

        Raises:
            OpenAIError: 400 when a prompt does not fit, a sampling parameter is invalid, or a
                resumed request has no tokens left to generate.
        """
        resumed = req.resumed_output_ids()
        done = len(resumed)
        # the prompt-ids hand-off was consumed by chat_prompt; the engine does not need it
        kv_params = kv.for_engine() if kv is not None else None
        hand_on = kv is not None and kv.role is KVRole.PREFILL
        # A proxied prefill leg: refuse now what the decode leg will refuse (no wasted prefill).
        d_view = decode_leg.decode_view(req) if hand_on else None
        # A prefiller's first token belongs to its one choice: other choices draw their own. A
        # remote KV is read by the first choice alone; the others start after its first output.
        other_params = kv_params.for_other_choices() if kv_params is not None else None
        after = 0 if kv_params is not None and kv_params.reads_remote_kv else None
        total = len(prompts) * req.n
        jobs = []
        for p, ids in enumerate(prompts):
            if d_view is not None:
                d_max = self.max_tokens_for(
                    len(ids) + done, _left(decode_leg.requested_max_tokens(d_view), done),
                    prompt_param)
                self.sampling_params(d_view, d_max, logprobs, 0, done)
            # a prefill leg's own max_tokens (1) is not reduced
            own_max = requested_max_tokens if d_view is not None else _left(requested_max_tokens,
                                                                             done)
            max_tokens = self.max_tokens_for(len(ids) + done, own_max, prompt_param)
            # a prefiller's connector hands its prompt ids on with the params it returns
            digest = getattr(ids, "text_digest", None) if hand_on else None
            for i in range(req.n):
                index = p * req.n + i
                job_params = kv_params if index == 0 else other_params
                jobs.append(EngineJob(
                    index=index,
                    request_id=base_id if total == 1 else f"{base_id}-{index}",
                    prompt_token_ids=ids,
                    sampling_params=self.sampling_params(req, max_tokens, logprobs, i, done),
                    kv_transfer_params=job_params.with_prompt_digest(digest)
                    if job_params is not None else None,
                    resumed_output_ids=resumed,
                    data_parallel_rank=data_parallel_rank,
                    after=after if index else None,
                ))
        return jobs


def _wrap_int64(value: int) -> int:
    """``value`` wrapped into the 64-bit signed range (a choice's seed ``seed + choice`` past
    :data:`~pdserve.types.sampling_params.INT64_MAX` continues at the range's bottom)."""
    return (value + INT64_MAX + 1) % 2**64 - INT64_MAX - 1


def _left(requested: int | None, done: int) -> int | None:
    """A resumed request's remaining ``max_tokens`` (None: up to ``max_model_len``).

    Raises:
        OpenAIError: 400 when ``done`` output tokens already reach ``requested``.
    """
    if requested is None or not done:
        return requested
    if done >= requested:
        raise bad_request(f"{RESUME_FIELD}: {done} output tokens already reach max_tokens "
                          f"({requested}); nothing is left to generate", param=RESUME_FIELD)
    return requested - done


def new_request_id(prefix: str) -> str:
    """``prefix-<32 hex digits>``."""
    return f"{prefix}-{uuid.uuid4().hex}"
