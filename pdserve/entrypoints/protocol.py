"""OpenAI-compatible request and response models (pydantic).

Requests accept unknown extra fields (clients send many we do not use) but validate the fields we
know strictly: a string where a number belongs, ``true`` where an integer belongs, or an
out-of-range value is a 400, never a silent coercion. Field names follow the OpenAI API; fields
that are not OpenAI's (``top_k``, ``min_p``, ``min_tokens``, ``ignore_eos``, ``stop_token_ids``,
``repetition_penalty``, ``kv_transfer_params``, ``chat_template_kwargs``, ``return_token_ids``)
follow vLLM's so that its users find the same knobs. ``pdserve_resume`` (:class:`ResumeFields`) is
pdserve's own extension: the proxy's mid-stream migration continues a generation another instance
started (docs/proxy.md).

OpenAI fields pdserve does not implement are refused with a 400 naming them rather than ignored,
since ignoring them silently changes what the client gets: ``logit_bias`` (unless empty),
``response_format`` (unless ``{"type": "text"}``), and for chat ``tools`` (unless empty),
``tool_choice`` (unless ``"none"``), ``functions`` and ``function_call`` (unless ``"none"``),
a user, system or developer message without ``content``, ``echo`` (unless false), and vLLM's
``prompt_logprobs``, ``include_stop_str_in_output`` and ``skip_special_tokens`` (unless their
defaults), ``truncate_prompt_tokens`` and the completions ``suffix`` (unless empty), vLLM's
constrained decoding (``structured_outputs``, ``guided_json``, ``guided_regex``,
``guided_choice``, ``guided_grammar``), ``allowed_token_ids``, ``bad_words`` and
``logits_processors`` (unless empty), ``use_beam_search`` (unless false) and, for chat, a
per-request ``chat_template`` (the model's own template is always used).
``null`` for a field with a plain default (``n``, ``stream``, ...) means that default.

The module stays whole past 450 lines: it is the API's one wire contract, requests and
responses of both endpoints, whose models share the base classes and field rules above.
"""

from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import (BaseModel, ConfigDict, Field, ValidationInfo, field_validator,
                      model_validator)

from pdserve.types.openai_errors import STREAM_OPTIONS_WITHOUT_STREAM

# Largest ``n`` accepted: each choice is one engine request.
MAX_N = 128
# Most alternatives per token for logprobs / top_logprobs (SamplingParams.validate's bound).
MAX_LOGPROBS = 20


class _Request(BaseModel):
    """Base of request bodies: strict types for known fields (floats finite), unknown fields
    allowed."""

    model_config = ConfigDict(extra="allow", strict=True, allow_inf_nan=False)


class StreamOptions(_Request):
    """``stream_options``: ``include_usage`` adds a final chunk with ``usage`` and no choices."""

    include_usage: bool = False


#: Body field of a resumed request (the proxy's mid-stream migration; docs/proxy.md).
RESUME_FIELD = "pdserve_resume"


class ResumeFields(_Request):
    """``pdserve_resume``: continue a generation another instance started and streamed.

    The instance computes ``prompt_token_ids + output_token_ids`` as its prompt (the body's
    ``messages`` / ``prompt`` are still validated but not used), generates at most
    ``max_tokens - len(output_token_ids)`` more tokens (``min_tokens`` reduced alike), reports
    usage as ``len(prompt_token_ids)`` prompt tokens and all completion tokens, continues the
    text (detokenizer and stop strings) after the output already sent, and streams without a
    second assistant-role chunk. Only the continuation is returned.
    """

    prompt_token_ids: list[int] = Field(..., min_length=1)
    output_token_ids: list[int]

    @field_validator("prompt_token_ids", "output_token_ids")
    @classmethod
    def _non_negative(cls, v: list[int]) -> list[int]:
        if any(t < 0 for t in v):
            raise ValueError("token ids must be non-negative")
        return v


#: Fields whose ``null`` means their default.
_NULL_IS_DEFAULT = ("n", "stream", "min_tokens", "ignore_eos", "echo", "skip_special_tokens",
                    "add_generation_prompt",
                    "return_token_ids")


#: Fields pdserve does not implement, accepted only in the forms that ask for nothing (compared
#: with their types: ``0`` is not ``false``), and the message that refuses any other value.
_ASK_NOTHING: dict[str, tuple[tuple[Any, ...], str]] = {
    "logit_bias": ((None, {}), "logit_bias is not supported by pdserve (leave it out or send {})"),
    "response_format": ((None, {"type": "text"}),
                        'pdserve supports only the response_format {"type": "text"} '
                        '(structured output is not supported)'),
    "prompt_logprobs": ((None,), "prompt_logprobs is not supported by pdserve (leave it out)"),
    "include_stop_str_in_output": ((None, False),
                                   "include_stop_str_in_output is not supported by pdserve (the "
                                   "stop string or stop token's text is always left out)"),
    "echo": ((False,), "echo=true is not supported by pdserve"),
    "skip_special_tokens": ((True,), "skip_special_tokens=false is not supported by pdserve "
                                     "(special tokens are always left out of the text)"),
    "truncate_prompt_tokens": ((None,), "truncate_prompt_tokens is not supported by pdserve "
                                        "(send the prompt to keep; a prompt longer than the "
                                        "context is a 400)"),
    # vLLM's constrained decoding and token constraints
    **{name: ((None,), f"{name} is not supported by pdserve (structured output and guided "
                       "decoding are not implemented)")
       for name in ("structured_outputs", "guided_json", "guided_regex", "guided_choice",
                    "guided_grammar")},
    "allowed_token_ids": ((None,), "allowed_token_ids is not supported by pdserve"),
    "bad_words": ((None, []), "bad_words is not supported by pdserve"),
    "logits_processors": ((None, []), "logits_processors is not supported by pdserve"),
    "use_beam_search": ((None, False), "beam search is not supported by pdserve"),
    # completions
    "suffix": ((None, ""), "suffix is not supported by pdserve (leave it out)"),
    # chat
    "tools": ((None, []), "tool and function calling are not supported by pdserve"),
    "functions": ((None, []), "tool and function calling are not supported by pdserve"),
    "tool_choice": ((None, "none"), 'tool and function calling are not supported by pdserve '
                                    '(only "none" is accepted)'),
    "function_call": ((None, "none"), 'tool and function calling are not supported by pdserve '
                                      '(only "none" is accepted)'),
    "chat_template": ((None,), "a per-request chat_template is not supported by pdserve (the "
                               "model's own template is used; chat_template_kwargs are passed "
                               "to it)"),
}


def null_is_default(data: Any) -> Any:
    """``data`` without the ``null`` values of :data:`_NULL_IS_DEFAULT`: ``null`` for a field
    with a plain default means that default (OpenAI's and vLLM's servers accept ``"n": null``,
    ``"stream": null``). For the request models' ``mode="before"`` validators."""
    if isinstance(data, dict) and any(data.get(k, 0) is None for k in _NULL_IS_DEFAULT):
        data = {k: v for k, v in data.items() if not (k in _NULL_IS_DEFAULT and v is None)}
    return data


class _SamplingFields(_Request):
    """Sampling and stopping fields shared by both endpoints (None: the default)."""

    model: str | None = None
    n: int = Field(1, ge=1, le=MAX_N)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=-1)
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    # a 64-bit signed integer, as vLLM bounds it (the engine core's messages carry int64)
    seed: int | None = Field(None, ge=-(2**63), le=2**63 - 1)
    max_tokens: int | None = Field(None, ge=1)
    min_tokens: int = Field(0, ge=0)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    repetition_penalty: float | None = Field(None, gt=0.0)
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    kv_transfer_params: dict[str, Any] | None = None
    # vLLM's: answers carry the prompt's and each choice's token ids
    return_token_ids: bool = False
    pdserve_resume: ResumeFields | None = None
    # accepted only in the forms that ask for nothing (see the module docstring)
    logit_bias: Any = None
    response_format: Any = None
    prompt_logprobs: Any = None
    include_stop_str_in_output: Any = None
    echo: bool = False
    # vLLM's; pdserve's text always leaves special tokens out, and prompts are never truncated
    skip_special_tokens: bool = True
    truncate_prompt_tokens: Any = None
    structured_outputs: Any = None
    guided_json: Any = None
    guided_regex: Any = None
    guided_choice: Any = None
    guided_grammar: Any = None
    allowed_token_ids: Any = None
    bad_words: Any = None
    logits_processors: Any = None
    use_beam_search: Any = None

    @model_validator(mode="before")
    @classmethod
    def _null_is_default(cls, data: Any) -> Any:
        return null_is_default(data)

    @field_validator(*_ASK_NOTHING, check_fields=False)  # the endpoints' own ones too
    @classmethod
    def _asks_for_nothing(cls, v: Any, info: ValidationInfo) -> Any:
        """Refuse a field of :data:`_ASK_NOTHING` in any form but those that ask for nothing."""
        allowed, message = _ASK_NOTHING[info.field_name]
        if not any(type(v) is type(a) and v == a for a in allowed):
            raise ValueError(message)
        return v

    @model_validator(mode="after")
    def _stream_options_need_stream(self) -> "_SamplingFields":
        if self.stream_options is not None and not self.stream:
            raise ValueError(STREAM_OPTIONS_WITHOUT_STREAM)
        return self

    @field_validator("stop_token_ids")
    @classmethod
    def _non_negative_ids(cls, v: list[int] | None) -> list[int] | None:
        if v is not None and any(t < 0 for t in v):
            raise ValueError("token ids must be non-negative")
        return v

    def resumed_output_ids(self) -> list[int]:
        """The output token ids a resumed request continues after (empty when not resumed)."""
        return list(self.pdserve_resume.output_token_ids) if self.pdserve_resume else []

    def stop_list(self) -> list[str]:
        """``stop`` as a list (empty strings dropped)."""
        if self.stop is None:
            return []
        stops = [self.stop] if isinstance(self.stop, str) else self.stop
        return [s for s in stops if s]


def _check_unicode(text: str, what: str) -> None:
    """Raise ValueError when ``text`` cannot be encoded as UTF-8 (a lone surrogate such as the
    JSON escape ``\\ud800``), which the tokenizer would refuse deep inside the request."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"{what} is not valid Unicode: {e.reason} at character {e.start}") from None


class CompletionRequest(_SamplingFields):
    """``POST /v1/completions`` body.

    ``prompt`` is a string, a list of strings, a list of token ids, or a list of token-id lists;
    each prompt gets ``n`` choices (choice index = prompt index * n + i). ``logprobs`` is the
    number of alternatives per token (0..20).
    """

    prompt: str | list[str] | list[int] | list[list[int]] = Field(...)
    max_tokens: int | None = Field(16, ge=1)
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    suffix: Any = None

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompt_shape(cls, v: Any) -> Any:
        ok = isinstance(v, str) or (
            isinstance(v, list)
            and (
                all(isinstance(p, str) for p in v)
                or all(isinstance(t, int) and not isinstance(t, bool) for t in v)
                or all(
                    isinstance(p, list)
                    and all(isinstance(t, int) and not isinstance(t, bool) for t in p)
                    for p in v
                )
            )
        )
        if not ok:
            raise ValueError(
                "prompt must be a string, a list of strings, a list of token ids, "
                "or a list of token-id lists"
            )
        for text in [v] if isinstance(v, str) else v:
            if isinstance(text, str):
                _check_unicode(text, "prompt")
        return v

    def prompts(self) -> list[str] | list[list[int]]:
        """The prompts as a list: strings or token-id lists (never mixed)."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if not p:
            return []
        if isinstance(p[0], int):
            return [p]  # type: ignore[list-item]
        return p  # type: ignore[return-value]


class ContentPart(_Request):
    """One part of a message's ``content`` list; only ``{"type": "text", "text": ...}`` is
    supported."""

    type: str
    text: str | None = None


class ChatMessage(_Request):
    """One chat message. Extra keys (``name``, ``tool_calls``, ...) go to the chat template."""

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None

    @model_validator(mode="after")
    def _content_where_needed(self) -> "ChatMessage":
        if self.content is None and self.role in ("system", "developer", "user"):
            raise ValueError(f"a {self.role} message needs 'content'")
        return self

    def text(self) -> str | None:
        """The content as one string (text parts joined)."""
        if self.content is None or isinstance(self.content, str):
            return self.content
        return "".join(part.text or "" for part in self.content)

    @field_validator("content")
    @classmethod
    def _text_parts_only(cls, v: Any) -> Any:
        if isinstance(v, list):
            for part in v:
                if part.type != "text" or part.text is None:
                    raise ValueError(
                        f"only text content parts are supported, got type {part.type!r}"
                    )
                _check_unicode(part.text, "content")
        elif isinstance(v, str):
            _check_unicode(v, "content")
        return v


class ChatCompletionRequest(_SamplingFields):
    """``POST /v1/chat/completions`` body.

    ``max_completion_tokens`` wins over ``max_tokens``; without either, generation may run to
    ``max_model_len``. ``logprobs`` is a bool and ``top_logprobs`` (0..20) needs it.
    ``add_generation_prompt`` (default true) and ``chat_template_kwargs`` go to the tokenizer's
    chat template.
    """

    messages: list[ChatMessage]
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None
    # tool and function calling are not supported: accepted only when they ask for nothing
    tools: Any = None
    tool_choice: Any = None
    functions: Any = None
    function_call: Any = None
    chat_template: Any = None

    @field_validator("messages")
    @classmethod
    def _not_empty(cls, v: list[ChatMessage]) -> list[ChatMessage]:
        if not v:
            raise ValueError("messages must not be empty")
        return v

    @model_validator(mode="after")
    def _top_logprobs_needs_logprobs(self) -> "ChatCompletionRequest":
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs requires logprobs=true")
        return self

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None \
            else self.max_tokens

    def num_logprobs(self) -> int | None:
        """Alternatives per token for the engine, or None without logprobs."""
        return (self.top_logprobs or 0) if self.logprobs else None


# ---------------------------------------------------------------------------------------------
# Responses
# ---------------------------------------------------------------------------------------------


class _Response(BaseModel):
    model_config = ConfigDict(extra="allow")


class PromptTokensDetails(_Response):
    cached_tokens: int = 0


class UsageInfo(_Response):
    """Token accounting: ``prompt_tokens`` counts each prompt once (not once per choice)."""

    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails = Field(default_factory=PromptTokensDetails)


class CompletionLogprobs(_Response):
    """Legacy completions ``logprobs`` object."""

    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class CompletionChoice(_Response):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None


class CompletionResponse(_Response):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None
    kv_transfer_params: dict[str, Any] | None = None


class TopLogprob(_Response):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(_Response):
    token: str
    logprob: float
    bytes: list[int] | None = None
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(_Response):
    content: list[ChatTokenLogprob] | None = None


class ChatResponseMessage(_Response):
    role: str = "assistant"
    content: str | None = None


class ChatCompletionChoice(_Response):
    index: int
    message: ChatResponseMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionResponse(_Response):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatCompletionChoice]
    usage: UsageInfo | None = None
    kv_transfer_params: dict[str, Any] | None = None


class ModelCard(_Response):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "pdserve"
    root: str | None = None
    max_model_len: int | None = None


class ModelList(_Response):
    object: Literal["list"] = "list"
    data: list[ModelCard] = Field(default_factory=list)
