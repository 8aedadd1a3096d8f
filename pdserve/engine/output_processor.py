"""The front end's side of a request's outputs: :class:`RequestOutput` (what
:meth:`pdserve.engine.async_engine.AsyncEngine.generate` yields), :class:`EngineStats` (the
engine snapshot for ``/metrics``) and :func:`process_output` (incremental detokenization and
stop strings for one core delta)."""

from __future__ import annotations

import asyncio
import dataclasses
from dataclasses import dataclass, field
from typing import Any, Sequence

from pdserve.engine.detokenizer import IncrementalDetokenizer, StopStringMatcher
from pdserve.types.outputs import EngineCoreOutput, TokenLogprobs
from pdserve.types.sampling_params import SamplingParams
from pdserve.types.outputs import KVLoadFailure


@dataclass
class RequestOutput:
    """One delta of a request's output, as yielded by :meth:`AsyncEngine.generate`.

    Attributes:
        request_id: the request.
        new_token_ids: tokens generated since the previous delta.
        new_text: text since the previous delta (stop strings and the text of the EOS or stop
            token that ended the request removed; may be empty while a multi-byte character or
            a possible stop-string prefix is held back).
        new_logprobs: logprobs of ``new_token_ids`` when requested.
        finished: True on the last delta.
        finish_reason: ``stop``, ``length``, ``abort`` or ``error`` on the last delta.
        stop_reason: the stop string or stop token id that ended the request, if any.
        num_prompt_tokens: prompt length (tokens).
        num_output_tokens: tokens generated so far (cumulative).
        num_cached_tokens: prompt tokens served from the local prefix cache.
        num_transferred_tokens: prompt tokens whose KV came from another instance.
        kv_transfer_params: the connector's params for the client (last delta only).
        error: the reason when ``finish_reason == "error"``.
        kv_load_failure: why the KV load failed, when that is the error.
    """

    request_id: str
    new_token_ids: list[int] = field(default_factory=list)
    new_text: str = ""
    new_logprobs: list[TokenLogprobs] = field(default_factory=list)
    finished: bool = False
    finish_reason: str | None = None
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    num_cached_tokens: int = 0
    kv_transfer_params: dict[str, Any] | None = None
    error: str | None = None
    stop_reason: int | str | None = None
    num_transferred_tokens: int = 0
    kv_load_failure: KVLoadFailure | None = None


@dataclass
class EngineStats:
    """Engine snapshot for ``/metrics``: queue sizes, KV cache use, cumulative token counters.

    ``kv_cache_usage`` is the fraction of blocks held by requests (0..1); all ``*_total`` fields
    are cumulative since the engine started (tokens, or events for preemptions). With data
    parallelism the fields are summed over the ranks (``kv_cache_usage``: used blocks over all
    blocks) and ``per_rank`` holds each rank's snapshot, in rank order (empty with one rank).
    """

    num_running: int = 0
    num_waiting: int = 0
    num_waiting_for_remote_kvs: int = 0
    kv_cache_usage: float = 0.0
    num_blocks: int = 0
    num_free_blocks: int = 0
    prompt_tokens_total: int = 0
    prompt_tokens_computed_total: int = 0
    prompt_tokens_cached_total: int = 0
    prompt_tokens_transferred_total: int = 0
    generation_tokens_total: int = 0
    num_preemptions_total: int = 0
    num_kv_load_failures_total: int = 0
    num_kv_partial_loads_total: int = 0  # loads that brought only their leading blocks
    num_held_for_transfer: int = 0
    # the KV cache tiers' snapshot (pdserve.engine.kv_tiers.TierManager.stats), None without
    kv_tiers: dict[str, Any] | None = None
    # a decoder's turn-lease counters (pdserve.engine.turn_demotion.TurnDemoter.stats), None
    # without a KV connector
    kv_turns: dict[str, Any] | None = None
    per_rank: tuple["EngineStats", ...] = ()

    @classmethod
    def combine(cls, ranks: list["EngineStats"]) -> "EngineStats":
        """The sum of several ranks' snapshots, keeping each in ``per_rank``."""
        total = cls(per_rank=tuple(ranks))
        for f in dataclasses.fields(cls):
            if f.name not in ("per_rank", "kv_cache_usage", "kv_tiers", "kv_turns"):
                setattr(total, f.name, sum(getattr(r, f.name) for r in ranks))
        for name in ("kv_tiers", "kv_turns"):
            parts = [getattr(r, name) for r in ranks if getattr(r, name)]
            setattr(total, name, _sum_nested(parts) if parts else None)
        used = sum(r.kv_cache_usage * r.num_blocks for r in ranks)
        total.kv_cache_usage = used / total.num_blocks if total.num_blocks else 0.0
        return total

    @classmethod
    def from_snapshot(cls, snapshot: dict[str, Any]) -> "EngineStats":
        names = {f.name for f in dataclasses.fields(cls)} - {"per_rank"}
        return cls(**{k: v for k, v in snapshot.items() if k in names})


def _sum_nested(parts: list[Any]) -> Any:
    """Sum numbers, element-wise lists and dicts key by key (the ranks' tier snapshots)."""
    first = parts[0]
    if isinstance(first, dict):
        keys = {k for p in parts for k in p}
        return {k: _sum_nested([p[k] for p in parts if k in p]) for k in keys}
    if isinstance(first, list):
        return [sum(p[i] for p in parts) for i in range(len(first))]
    return sum(parts)


@dataclass(slots=True, init=False)
class RequestState:
    """A running request's output state in the front end: its output queue, detokenizer
    and stop-string matcher, and token counts."""

    queue: asyncio.Queue
    detokenizer: IncrementalDetokenizer
    stop_matcher: StopStringMatcher
    min_tokens: int  # no stop string may end in the text of the first min_tokens tokens
    num_prompt_tokens: int
    num_output_tokens: int
    finished: bool

    def __init__(self, tokenizer: Any, prompt_token_ids: Sequence[int], params: SamplingParams,
                 resumed_output_ids: Sequence[int] = ()):
        """``resumed_output_ids``: a resumed request's output so far (the proxy's migration):
        replayed through the detokenizer and the stop-string matcher as the first instance
        processed them, one token at a time and with no stop string ending in them (the first
        instance did not stop there), so the text held back at the seam (an incomplete
        character, a possible stop-string prefix) comes out with the next tokens, and counted as
        output tokens; ``params.min_tokens`` counts only the tokens left."""
        self.queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self.detokenizer = IncrementalDetokenizer(tokenizer, prompt_token_ids)
        self.stop_matcher = StopStringMatcher(params.stop)
        for tok in resumed_output_ids:
            self.stop_matcher.feed(self.detokenizer.add_tokens([tok]), search=False)
        done = len(resumed_output_ids)
        # no stop string ends in the first min_tokens tokens (numbered from the first instance's)
        self.min_tokens = params.min_tokens + done
        self.num_prompt_tokens = len(prompt_token_ids)
        self.num_output_tokens = done
        self.finished = False


def process_output(o: EngineCoreOutput, st: RequestState) -> RequestOutput:
    """Turn one core delta into the client's :class:`RequestOutput`: detokenize, match stop
    strings (a stop string cut from the text finishes the request with ``"stop"``; the caller
    then aborts it in the core), count tokens. Marks ``st.finished`` on the last delta.

    A delta the core finished with ``"stop"`` ends in the token that stopped the request (EOS or
    one of ``stop_token_ids``; the core stops on tokens only): that token's text is left out,
    while its id stays in ``new_token_ids`` and the counts, as vLLM does without
    ``include_stop_str_in_output`` (``vllm/v1/engine/detokenizer.py``: a stop-terminated
    delta's last token is not detokenized)."""
    finished = o.finish_reason is not None
    finish_reason = o.finish_reason
    stop_reason: int | str | None = o.stop_reason
    tokens = o.new_token_ids
    # tokens whose text is shown: all but a stop token
    n_text = len(tokens) - 1 if tokens and o.finish_reason == "stop" else len(tokens)
    if len(tokens) > 1 and st.stop_matcher.stop:
        # Several tokens at once (a multi-step round): match stop strings token by token,
        # so that tokens after a stop are neither emitted nor counted, as with single steps.
        emit, stop = "", None
        for i, tok in enumerate(tokens[:n_text]):
            part, stop = st.stop_matcher.feed(st.detokenizer.add_tokens([tok]),
                                              st.num_output_tokens + i + 1 > st.min_tokens)
            emit += part
            if stop is not None:
                tokens = tokens[: i + 1]
                break
        if stop is None and finished:
            part, stop = st.stop_matcher.feed(st.detokenizer.flush(),
                                              st.num_output_tokens + len(tokens) > st.min_tokens)
            emit += part
    else:
        text = st.detokenizer.add_tokens(tokens[:n_text]) if n_text else ""
        if finished:
            text += st.detokenizer.flush()
        emit, stop = st.stop_matcher.feed(text, st.num_output_tokens + len(tokens) > st.min_tokens)
    if stop is not None:
        finished = True
        finish_reason = "stop"
        stop_reason = stop
    elif finished:
        emit += st.stop_matcher.flush()
    st.num_output_tokens += len(tokens)
    if finished:
        st.finished = True
    return RequestOutput(
        request_id=o.request_id,
        new_token_ids=list(tokens),
        new_text=emit,
        new_logprobs=list(o.new_logprobs[: len(tokens)]),
        finished=finished,
        finish_reason=finish_reason,
        stop_reason=stop_reason,
        num_prompt_tokens=st.num_prompt_tokens,
        num_output_tokens=st.num_output_tokens,
        # a resumed request's cache hits may include its earlier output, not counted as prompt
        num_cached_tokens=min(o.num_cached_tokens, st.num_prompt_tokens),
        num_transferred_tokens=o.num_transferred_tokens,
        kv_transfer_params=o.kv_transfer_params,
        error=o.error,
        kv_load_failure=o.kv_load_failure,
    )
