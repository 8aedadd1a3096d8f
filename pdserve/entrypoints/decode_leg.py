"""A prefill leg checked against the request its decode leg will carry.

The disaggregation proxy sends P the client's body with ``max_tokens: 1`` (and
``max_completion_tokens: 1``) and ``min_tokens`` at most 1; it puts the values it rewrote in the
body field :data:`FIELD` (``{"max_tokens": .., "max_completion_tokens": .., "min_tokens": ..}``,
only those the client sent). P's front end rebuilds the decode leg's view of the request from
them and checks it as D will (length against ``max_model_len``, ``max_tokens >= 1``,
``min_tokens <= max_tokens``), so a request D would refuse is refused before P prefills it, with
the same 400.
"""

from __future__ import annotations

from typing import Any, TypeVar

from pydantic import Field, ValidationError, model_validator

from pdserve.entrypoints.errors import validation_error_to_openai
from pdserve.entrypoints.protocol import (ChatCompletionRequest, CompletionRequest, _Request,
                                          null_is_default)

#: Body field of a prefill leg with the client's own limits (set by the proxy).
FIELD = "pdserve_decode_leg"

#: The fields the proxy rewrites on the prefill leg.
REWRITTEN = ("max_tokens", "max_completion_tokens", "min_tokens")

R = TypeVar("R", CompletionRequest, ChatCompletionRequest)


class DecodeLegLimits(_Request):
    """The client's limits, validated as the request models validate them (``min_tokens:
    null`` is the default)."""

    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    min_tokens: int = Field(0, ge=0)

    @model_validator(mode="before")
    @classmethod
    def _null_is_default(cls, data: Any) -> Any:
        return null_is_default(data)


def decode_view(req: R) -> R | None:
    """The request as the decode leg will carry it, or None when ``req`` has no
    :data:`FIELD` (not a proxied prefill leg).

    Raises:
        OpenAIError: 400, as D would answer, when the client's limits are invalid.
    """
    raw = (req.model_extra or {}).get(FIELD)
    if raw is None:
        return None
    try:
        limits = DecodeLegLimits.model_validate(raw)
    except ValidationError as e:
        raise validation_error_to_openai(e.errors()) from None
    fields = type(req).model_fields
    # a field the client did not send takes the request model's default on D
    update = {k: (getattr(limits, k) if k in limits.model_fields_set else fields[k].default)
              for k in REWRITTEN if k in fields}
    return req.model_copy(update=update)


def requested_max_tokens(req: CompletionRequest | ChatCompletionRequest) -> int | None:
    """The ``max_tokens`` a request asks for (chat: ``max_completion_tokens`` first)."""
    if isinstance(req, ChatCompletionRequest):
        return req.requested_max_tokens()
    return req.max_tokens
