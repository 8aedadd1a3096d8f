"""OpenAI-style error bodies and the exception the proxy raises for errors it answers itself.

Every error the proxy returns has the shape of the OpenAI API:
``{"error": {"message": str, "type": str, "param": str | None, "code": int}}``, where ``code`` is
the HTTP status. The proxy's own client errors (4xx) carry the same ``type`` names as the
engine's (:mod:`pdserve.types.openai_errors`: ``BadRequestError`` for every 400, ...), so a client sees
one name whether the proxy or an instance refused its request. Errors from an upstream instance keep the upstream's status; their body is passed
through unchanged when it already has that shape, otherwise it is wrapped into it
(:func:`normalize_upstream_error`).
"""

from __future__ import annotations

import json

from pdserve.types.openai_errors import (UPSTREAM_ERROR, UPSTREAM_TIMEOUT, UPSTREAM_UNAVAILABLE,
                                   error_body, error_type)

#: ``type`` strings used for errors the proxy produces itself: the engine's names for 400, 401,
#: 404, 405 and 413 (:func:`pdserve.types.openai_errors.error_type`), and the proxy's own for failed
#: upstreams.
INVALID_REQUEST = error_type(400)
AUTHENTICATION = error_type(401)
NOT_FOUND = error_type(404)
METHOD_NOT_ALLOWED = error_type(405)
REQUEST_TOO_LARGE = error_type(413)
__all__ = ["INVALID_REQUEST", "AUTHENTICATION", "NOT_FOUND", "METHOD_NOT_ALLOWED",
           "REQUEST_TOO_LARGE", "UPSTREAM_UNAVAILABLE", "UPSTREAM_ERROR", "UPSTREAM_TIMEOUT",
           "ProxyError", "error_body", "error_bytes", "normalize_upstream_error"]


def error_bytes(message: str, err_type: str, status: int, param: str | None = None) -> bytes:
    """:func:`error_body` encoded as compact JSON bytes."""
    return json.dumps(error_body(message, err_type, status, param), separators=(",", ":")).encode()


class ProxyError(Exception):
    """An error the proxy answers with its own OpenAI-style body.

    Args:
        status: HTTP status code sent to the client (400, 401, 404, 413, 502, 503, 504).
        message: human-readable message; for upstream failures it names the leg and instance,
            e.g. ``"prefill instance http://127.0.0.1:8100 unreachable (...)"``.
        err_type: the ``type`` field of the body (one of the constants in this module).
        param: the offending request field, if any.
        upstream: base URL of the instance that failed, when the error is one instance's failure
            (the proxy may retry the leg on another instance).
    """

    def __init__(self, status: int, message: str, err_type: str, param: str | None = None,
                 upstream: str | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.err_type = err_type
        self.param = param
        self.upstream = upstream

    def body(self) -> bytes:
        """The JSON error body as bytes."""
        return error_bytes(self.message, self.err_type, self.status, self.param)


def normalize_upstream_error(status: int, raw: bytes, leg: str, url: str) -> bytes:
    """Make an upstream's error body OpenAI-shaped, keeping it byte-identical when it already is.

    Args:
        status: the upstream's HTTP status (>= 400).
        raw: the upstream's response body (any bytes, possibly empty or not JSON).
        leg: ``"prefill"`` or ``"decode"``, used in the message of wrapped bodies.
        url: the upstream's base URL, used in the message of wrapped bodies.

    Returns:
        ``raw`` when it is a JSON object with an ``"error"`` object; otherwise a new body whose
        message carries the upstream's own message (``message`` or FastAPI's ``detail`` field) or
        its text.
    """
    try:
        parsed = json.loads(raw) if raw else None
    except ValueError:
        parsed = None
    if isinstance(parsed, dict):
        if isinstance(parsed.get("error"), dict):
            return raw
        inner = parsed.get("message", parsed.get("detail"))
        text = inner if isinstance(inner, str) else json.dumps(inner if inner is not None else parsed)
    else:
        text = raw.decode("utf-8", "replace").strip() or "(empty body)"
    err_type = error_type(status) if status < 500 else UPSTREAM_ERROR
    if status < 500:
        message = text
    else:
        message = f"{leg} instance {url} failed with HTTP {status}: {text}"
    return error_bytes(message, err_type, status)
