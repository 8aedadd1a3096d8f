"""The ``type`` names of OpenAI-style error bodies by HTTP status, and the messages of the
request rules both check, shared by the engine server (:mod:`pdserve.entrypoints.errors`) and the
proxy (:mod:`pdserve.router.errors`), so that a client sees one name for one kind of error
whichever of them answered (no dependencies)."""

from __future__ import annotations

# HTTP status -> error ``type``, named like the openai client's exception classes (as vLLM's
# server names them).
ERROR_TYPES = {
    400: "BadRequestError",
    401: "AuthenticationError",
    403: "PermissionDeniedError",
    404: "NotFoundError",
    405: "MethodNotAllowedError",
    409: "ConflictError",
    413: "RequestTooLargeError",
    415: "UnsupportedMediaTypeError",
    422: "UnprocessableEntityError",
    429: "RateLimitError",
    500: "InternalServerError",
    503: "ServiceUnavailableError",
}


#: ``type`` of an error whose cause is an instance the answering server relied on: the proxy's
#: upstream (prefill or decode instance), or the prefiller a decoder loads KV from. Unreachable
#: (or silent): 503; failed or answered something unusable: 502; timed out (the proxy): 504.
UPSTREAM_UNAVAILABLE = "upstream_unavailable"
UPSTREAM_ERROR = "upstream_error"
UPSTREAM_TIMEOUT = "upstream_timeout"


#: Largest request body the proxy and the engine server accept (bytes); long multi-turn
#: histories are large. A larger body is a 413 (:func:`body_too_large`).
MAX_BODY_BYTES = 64 * 1024 * 1024


#: Characters of a client's value an error message quotes at most (:func:`quoted`).
MAX_QUOTED_CHARS = 80


def quoted(value: object) -> str:
    """``repr(value)`` for an error message, cut to :data:`MAX_QUOTED_CHARS` characters with
    the full length said: an error never sends a client's megabytes back."""
    text = repr(value)
    if len(text) <= MAX_QUOTED_CHARS:
        return text
    return f"{text[:MAX_QUOTED_CHARS]}... ({len(text):,} characters)"


def body_too_large(limit: int) -> str:
    """The message of the 413 for a body over ``limit`` bytes."""
    return f"request body larger than {limit} bytes"


#: ``stream_options`` in a request that does not stream (vLLM's rule and wording).
def not_json_content_type(content_type: str | None) -> str | None:
    """The message of the 400 for a body sent with ``content_type`` (a ``Content-Type``
    header) that is not JSON (``application/json`` or a ``+json`` type), or None when it is
    JSON or absent."""
    media = (content_type or "").split(";")[0].strip().lower()
    if not media or media == "application/json" or media.endswith("+json"):
        return None
    return f"The request body must be JSON sent with Content-Type: application/json (got {media!r})"


STREAM_OPTIONS_WITHOUT_STREAM = "Stream options can only be defined when `stream=True`."


def error_body(message: str, err_type: str, status: int, param: str | None = None) -> dict:
    """The error object every pdserve server answers (engine and proxy alike), vLLM's
    ``ErrorResponse``: ``{"error": {"message", "type", "param", "code"}}`` with ``code`` the HTTP
    status as an integer."""
    return {"error": {"message": message, "type": err_type, "param": param, "code": status}}


def error_type(status: int) -> str:
    """The ``type`` of an error answered with ``status``: :data:`ERROR_TYPES`, else
    ``BadRequestError`` for another 4xx and ``InternalServerError`` for a 5xx."""
    return ERROR_TYPES.get(status, "BadRequestError" if status < 500 else "InternalServerError")
