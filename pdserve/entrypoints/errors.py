"""OpenAI-style error bodies and the FastAPI exception handlers that produce them.

Every error the server returns has the body
``{"error": {"message": str, "type": str, "param": str | None, "code": int}}`` with ``code`` the
HTTP status (vLLM's ``ErrorResponse``; the proxy's errors have the same shape, see
:func:`pdserve.types.openai_errors.error_body`), which the official ``openai`` client parses into its
exception classes. Bad input is a 4xx;
a 5xx means the engine failed a request or a bug, never the client's input.
"""

from __future__ import annotations

import json
import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from pdserve.types.outputs import KVLoadFailure
from pdserve.types.openai_errors import (UPSTREAM_ERROR, UPSTREAM_UNAVAILABLE, error_body, quoted,
                                         error_type, not_json_content_type)

logger = logging.getLogger(__name__)

class OpenAIError(Exception):
    """An error to return to the client as an OpenAI error body.

    Args:
        message: human-readable reason.
        status: HTTP status code.
        param: the request field at fault, if any.
        type_: error type; defaults to the name for ``status``
            (:data:`pdserve.types.openai_errors.ERROR_TYPES`).
    """

    def __init__(
        self,
        message: str,
        status: int = 400,
        *,
        param: str | None = None,
        type_: str | None = None,
    ):
        super().__init__(message)
        self.message = message
        self.status = status
        self.param = param
        self.type = type_ or error_type(status)

    def body(self) -> dict[str, Any]:
        """The JSON body ``{"error": {...}}`` (``code``: the status)."""
        return error_body(self.message, self.type, self.status, self.param)

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status)


def bad_request(message: str, param: str | None = None) -> OpenAIError:
    """A 400 ``BadRequestError``."""
    return OpenAIError(message, 400, param=param)


def kv_load_error(message: str, failure: KVLoadFailure) -> OpenAIError:
    """The client error of a request whose KV load failed under ``kv_load_failure_policy``
    ``fail`` (``message``: the engine's, starting with the failure's phrase).

    A reference the client relayed in ``kv_transfer_params`` that the owner refuses (unknown or
    expired request, other tokens or blocks, a first token that is not the prefiller's) is a
    400 ``BadRequestError`` with ``param`` ``kv_transfer_params``. A failure of the remote or
    the transport is the remote's, as the proxy reports its upstreams' (``upstream_error``,
    ``upstream_unavailable``): a prefiller that did not answer in time (unreachable or gone)
    is a 503; a transport error or an incompatible remote KV cache a 502.
    """
    if failure.caused_by_params:
        return bad_request(f"invalid kv_transfer_params: {message}", param="kv_transfer_params")
    if failure is KVLoadFailure.TIMEOUT:
        return OpenAIError(message, 503, type_=UPSTREAM_UNAVAILABLE)
    return OpenAIError(message, 502, type_=UPSTREAM_ERROR)


def model_not_found(name: str | None, served: str) -> OpenAIError:
    """A 404 for a ``model`` this server does not serve."""
    return OpenAIError(
        f"The model {quoted(name)} does not exist; this server serves '{served}'.",
        404, param="model", type_="NotFoundError",
    )


def _clean_msg(msg: str) -> str:
    # pydantic prefixes messages raised by validators with "Value error, ".
    for prefix in ("Value error, ", "Assertion failed, "):
        if msg.startswith(prefix):
            return msg[len(prefix):]
    return msg


def validation_error_to_openai(errors: list[dict[str, Any]],
                               content_type: str | None = None) -> OpenAIError:
    """Turns FastAPI/pydantic validation errors into one 400.

    The first error names the field (``param`` = its top-level name); union members in the
    location (``str``, ``list[int]``) are dropped from the message. ``content_type``: the
    request's ``Content-Type`` header; a body refused whole under a type that is not JSON
    (the framework then reads no JSON at all) is told to send ``application/json``.
    """
    if not errors:
        return bad_request("Invalid request")
    err = errors[0]
    kind = err.get("type", "")
    loc = [str(x) for x in err.get("loc", ()) if x != "body"]
    if kind == "json_invalid":
        detail = (err.get("ctx") or {}).get("error", "")
        return bad_request(f"Malformed JSON body: {detail}".rstrip(": "))
    if not loc:
        if kind == "missing":
            return bad_request("The request body is missing; send a JSON object.")
        if kind in ("value_error", "assertion_error"):  # a check of the whole request
            return bad_request(_clean_msg(str(err.get("msg", "invalid request"))))
        not_json = not_json_content_type(content_type)
        if not_json is not None:
            return bad_request(not_json)
        return bad_request(f"The request body must be a JSON object: {_clean_msg(err['msg'])}")
    # Drop pydantic's union-member tags such as "str" / "list[int]" / "function-after[...]".
    path = [p for p in loc if not (("[" in p and "]" in p) or p in ("str", "int", "float", "bool"))]
    where = ".".join(path) or loc[0]
    msg = _clean_msg(str(err.get("msg", "invalid value")))
    if kind == "missing":
        msg = "field required"
    return bad_request(f"{where}: {msg}", param=path[0] if path else loc[0])


def install_error_handlers(app: FastAPI) -> None:
    """Registers handlers so every error leaves as an OpenAI error body."""

    @app.exception_handler(OpenAIError)
    async def _openai_error(_: Request, exc: OpenAIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        return validation_error_to_openai(list(exc.errors()),
                                          request.headers.get("content-type")).response()

    @app.exception_handler(json.JSONDecodeError)
    async def _json_error(_: Request, exc: json.JSONDecodeError) -> JSONResponse:
        return bad_request(f"Malformed JSON body: {exc}").response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        if isinstance(exc.__cause__, RecursionError):
            # FastAPI turns a body that json's decoder cannot parse without recursing too deep
            # into "There was an error parsing the body"; say what it is, as the proxy does
            return bad_request("Malformed JSON body: nested too deeply").response()
        detail = exc.detail if isinstance(exc.detail, str) else json.dumps(exc.detail)
        err = OpenAIError(detail, exc.status_code)
        return JSONResponse(err.body(), status_code=exc.status_code, headers=exc.headers)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error on %s %s", request.method, request.url.path)
        return OpenAIError(f"Internal server error: {type(exc).__name__}: {exc}", 500).response()


def engine_exception_to_error(exc: BaseException) -> OpenAIError:
    """The client error for an exception raised by ``engine.generate``: an
    :class:`OpenAIError` as is, a ``ValueError`` (the engine rejected the request's content) a
    400, ``EngineDeadError`` a 503, anything else a 500."""
    if isinstance(exc, OpenAIError):
        return exc
    if isinstance(exc, ValueError):
        return bad_request(str(exc))
    name = type(exc).__name__
    if name == "EngineDeadError":
        return OpenAIError(f"The engine is not running: {exc}", 503)
    return OpenAIError(f"The engine failed the request: {name}: {exc}", 500)
