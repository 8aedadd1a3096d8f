"""What each choice of a response accumulated (:class:`ChoiceState`), and the response parts
built from all choices: usage, the returned ``kv_transfer_params``, the error of a failed one."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

from pdserve.entrypoints.errors import OpenAIError, kv_load_error
from pdserve.types.outputs import KVLoadFailure
from pdserve.entrypoints.protocol import PromptTokensDetails, UsageInfo


@dataclass
class ChoiceState:
    """What one choice accumulated so far.

    Attributes:
        text: generated text (deltas joined; stop strings removed by the engine).
        token_ids: generated tokens.
        logprobs: one ``TokenLogprobs`` per generated token, when requested.
        finish_reason / error / kv_load_failure: from the finishing output.
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
    kv_load_failure: KVLoadFailure | None = None
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
            self.error = out.error
            self.kv_load_failure = out.kv_load_failure
            self.kv_transfer_params = out.kv_transfer_params


def failed_request_error(state: ChoiceState) -> OpenAIError:
    """The error to report for a choice that finished with ``error`` or ``abort`` (a failed KV
    load: :func:`~pdserve.entrypoints.errors.kv_load_error`)."""
    if state.kv_load_failure is not None:
        return kv_load_error(state.error or "", state.kv_load_failure)
    if state.finish_reason == "abort":
        return OpenAIError(
            state.error or "The request was aborted by the engine.", 503)
    return OpenAIError(
        state.error or "The engine failed the request.", 500)


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
