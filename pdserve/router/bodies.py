"""Request bodies of the two legs (docs/proxy.md) and the proxy's own checks on client bodies.

Prefill leg (to P): the client's body with ``max_tokens=1`` (and ``max_completion_tokens=1`` when
the client sent that field), ``stream=false``, ``min_tokens=1`` when the client asked for at
least one (P's token is then drawn as D's first token would be, EOS and ``stop_token_ids``
masked), without ``stream_options``, ``n`` and ``conversation_id``, with the client's limits in
:data:`DECODE_LEG_FIELD`, and with
``kv_transfer_params`` set to :data:`PREFILL_KV_PARAMS`; in
multi-turn mode the decoder's params from the previous turn are merged in (see
:func:`prefill_leg_body`).

Decode leg (to D): the client's body without ``conversation_id``, with ``kv_transfer_params``
replaced by what P returned; with ``return_token_ids: true`` when the stream may be migrated
(:mod:`pdserve.router.migration`).

Concurrent hand-off (docs/proxy.md, "the wire contract"): the prefill leg's params get the
attempt's ``transfer_id`` (:func:`concurrent_prefill_body`); the decode leg, sent at the same
time, gets pending params naming P's rank and the transfer id, without P's blocks, request id or
first token (:func:`pending_decode_leg_body`).
"""

from __future__ import annotations

from typing import Any

from pdserve.types.openai_errors import STREAM_OPTIONS_WITHOUT_STREAM, quoted
from pdserve.router.errors import INVALID_REQUEST, ProxyError
from pdserve.types.kv_endpoints import KVEndpoint

#: ``kv_transfer_params`` of a stateless prefill request: P must keep the blocks for a remote
#: decoder and has nothing to pull itself.
PREFILL_KV_PARAMS: dict[str, Any] = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}

#: Body fields the proxy consumes and never forwards.
PROXY_FIELDS = ("conversation_id",)

#: The longest conversation id (``conversation_id`` or ``X-Session-ID``, characters) the proxy
#: takes: the id is a key of its conversation table (or Redis), kept per conversation.
MAX_CONVERSATION_ID_CHARS = 512

#: Prefill-leg field with the limits the proxy rewrote (``max_tokens``,
#: ``max_completion_tokens``, ``min_tokens`` as the client sent them): P refuses a request its
#: decode leg would refuse before prefilling it.
DECODE_LEG_FIELD = "pdserve_decode_leg"


def check_client_body(body: Any) -> None:
    """Reject bodies the disaggregated flow cannot serve faithfully.

    ``n`` / ``best_of`` > 1 are refused: the prefill leg computes one sequence and the decode
    leg would have to fork it, which the engines do not do; silently returning one choice would
    lose the others. A ``prompt`` list of several prompts (strings or token lists; a list of
    token ids is one prompt) is refused for the same reason.

    Raises:
        ProxyError: 400 with an OpenAI-style body naming the offending field.
    """
    if not isinstance(body, dict):
        raise ProxyError(400, "request body must be a JSON object", INVALID_REQUEST)
    for field in ("n", "best_of"):
        value = body.get(field)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ProxyError(400, f"'{field}' must be a positive integer, got {quoted(value)}",
                             INVALID_REQUEST, field)
        if value > 1:
            raise ProxyError(400, f"'{field}' > 1 is not supported by the disaggregated proxy "
                             f"(got {value}); send {value} separate requests instead",
                             INVALID_REQUEST, field)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) > 1 and all(
            isinstance(p, (str, list)) for p in prompt):
        # several prompts: one prefill leg would answer for all of them, and D would read one
        # prompt's KV for another (the lease's token digest refuses it)
        raise ProxyError(400, f"a list of {len(prompt)} prompts is not supported by the "
                         "disaggregated proxy; send one request per prompt", INVALID_REQUEST,
                         "prompt")
    stream = body.get("stream")
    if stream is not None and not isinstance(stream, bool):
        raise ProxyError(400, f"'stream' must be a boolean, got {quoted(stream)}", INVALID_REQUEST,
                         "stream")
    ids = body.get("return_token_ids")
    if ids is not None and not isinstance(ids, bool):
        # the decode leg of a migratable stream sets it: checked here, before it is overwritten
        raise ProxyError(400, f"'return_token_ids' must be a boolean, got {quoted(ids)}",
                         INVALID_REQUEST, "return_token_ids")
    if body.get("stream_options") is not None and not stream:
        # D would refuse it after P's prefill (the engines' rule, as vLLM's)
        raise ProxyError(400, STREAM_OPTIONS_WITHOUT_STREAM, INVALID_REQUEST, "stream_options")
    kv = body.get("kv_transfer_params")
    if kv is not None and not isinstance(kv, dict):
        raise ProxyError(400, "'kv_transfer_params' must be an object", INVALID_REQUEST,
                         "kv_transfer_params")


def conversation_key(body: dict[str, Any], session_header: str | None) -> str | None:
    """The conversation id: the body's ``conversation_id``, else the ``X-Session-ID`` header.

    Raises:
        ProxyError: 400 when ``conversation_id`` is neither a string nor an integer, is
            empty, or when the id taken is longer than :data:`MAX_CONVERSATION_ID_CHARS`. An
            integer is the same conversation as its decimal string; an empty header is no id.
    """
    cid = body.get("conversation_id")
    if cid is None:
        if session_header and len(session_header) > MAX_CONVERSATION_ID_CHARS:
            raise ProxyError(400, f"the X-Session-ID header is {len(session_header)} characters "
                             f"long; at most {MAX_CONVERSATION_ID_CHARS} are allowed",
                             INVALID_REQUEST)
        return session_header or None
    if isinstance(cid, bool) or not isinstance(cid, (str, int)):
        raise ProxyError(400, "'conversation_id' must be a string or an integer, got "
                         f"{quoted(cid)}", INVALID_REQUEST, "conversation_id")
    key = str(cid)
    if not key:
        raise ProxyError(400, "'conversation_id' must not be empty", INVALID_REQUEST,
                         "conversation_id")
    if len(key) > MAX_CONVERSATION_ID_CHARS:
        raise ProxyError(400, f"'conversation_id' is {len(key)} characters long; at most "
                         f"{MAX_CONVERSATION_ID_CHARS} are allowed", INVALID_REQUEST,
                         "conversation_id")
    return key


def prefill_leg_body(body: dict[str, Any], decoder_params: dict[str, Any] | None = None) -> dict[str, Any]:
    """The body sent to P.

    Args:
        body: the client's (checked) body; not modified.
        decoder_params: multi-turn only: the ``kv_transfer_params`` D returned for the previous
            turn (``remote_block_ids``, ``remote_num_tokens``, ``remote_blocks_expiry_time``,
            ``remote_host``, ``remote_port``, ``remote_engine_id``, ``remote_request_id``, ...).
            All of D's fields are copied over :data:`PREFILL_KV_PARAMS`, then ``do_remote_decode``
            is forced to true and ``do_remote_prefill`` to false, so P both keeps its blocks for D
            and sees where the previous turn's blocks are.

    Returns:
        A new dict (shallow copy; nested values are shared with ``body``).
    """
    out = dict(body)
    # P checks the request as D will see it (pdserve/entrypoints/decode_leg.py)
    out[DECODE_LEG_FIELD] = {k: body[k] for k in ("max_tokens", "max_completion_tokens",
                                                  "min_tokens") if k in body}
    out["max_tokens"] = 1
    if "max_completion_tokens" in out:
        out["max_completion_tokens"] = 1
    out["stream"] = False
    min_tokens = out.pop("min_tokens", None)
    if isinstance(min_tokens, int) and not isinstance(min_tokens, bool) and min_tokens >= 1:
        out["min_tokens"] = 1  # (an invalid value is refused by P through DECODE_LEG_FIELD)
    for field in ("stream_options", "n", "return_token_ids", *PROXY_FIELDS):
        out.pop(field, None)
    params = dict(PREFILL_KV_PARAMS)
    if decoder_params:
        params.update(decoder_params)
        params["do_remote_decode"] = True
        params["do_remote_prefill"] = False
    out["kv_transfer_params"] = params
    return out


def decode_leg_body(body: dict[str, Any], prefill_params: dict[str, Any] | None,
                    return_token_ids: bool = False) -> dict[str, Any]:
    """The body sent to D: the client's body plus P's returned ``kv_transfer_params``
    (``return_token_ids``: ask D for the token ids, so the stream can be migrated).

    When P returned no params (P not configured as a KV producer), D gets no
    ``kv_transfer_params`` and computes the prompt itself.
    """
    out = dict(body)
    for field in PROXY_FIELDS:
        out.pop(field, None)
    if prefill_params is None:
        out.pop("kv_transfer_params", None)
    else:
        out["kv_transfer_params"] = prefill_params
    if return_token_ids:
        out["return_token_ids"] = True
    return out


def concurrent_prefill_body(prefill_body: dict[str, Any], transfer_id: str) -> dict[str, Any]:
    """The prefill leg of a concurrent attempt: :func:`prefill_leg_body`'s result (not
    modified) with ``transfer_id`` added to its ``kv_transfer_params``."""
    out = dict(prefill_body)
    out["kv_transfer_params"] = dict(prefill_body["kv_transfer_params"], transfer_id=transfer_id)
    return out


def pending_decode_leg_body(body: dict[str, Any], endpoint: KVEndpoint, tp_size: int,
                            transfer_id: str, return_token_ids: bool = False) -> dict[str, Any]:
    """The decode leg of a concurrent attempt: the client's body with the pending params of the
    wire contract (P's rank ``endpoint``, P's ``tp_size``, the attempt's ``transfer_id``)."""
    return decode_leg_body(body, {
        "do_remote_prefill": True, "do_remote_decode": False,
        "remote_engine_id": endpoint.engine_id, "remote_host": endpoint.host,
        "remote_port": endpoint.port, "remote_transfer_id": transfer_id, "tp_size": tp_size},
        return_token_ids)
