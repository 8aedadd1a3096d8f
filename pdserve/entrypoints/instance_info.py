"""``GET /pdserve/instance``: what a client of an engine's server needs to know before its first
request (P/D role, chat template), asked by ``pdserve proxy`` (role check) and ``pdserve up``
(the examples it prints)."""

from __future__ import annotations

from typing import Any

from pdserve import __version__
from pdserve.types.instance_info import INSTANCE_INFO_PATH

__all__ = ["INSTANCE_INFO_PATH", "instance_info", "instance_info_router"]



def instance_info(model_name: str, kv_role: str | None, engine_id: str | None,
                  tokenizer: Any) -> dict[str, Any]:
    """The body of ``GET /pdserve/instance``.

    Keys: ``model`` (the served name), ``kv_role`` (``kv_producer``: a prefiller,
    ``kv_consumer``: a decoder, ``kv_both``, or null without ``--kv-transfer-config``),
    ``engine_id`` (the KV connector's engine id, or null), ``chat_template`` (whether
    ``/v1/chat/completions`` can render a conversation; without one only ``/v1/completions``
    serves), ``version``.
    """
    return {"model": model_name, "kv_role": kv_role, "engine_id": engine_id,
            "chat_template": bool(getattr(tokenizer, "chat_template", None)),
            "version": __version__}


def instance_info_router(model_name: str, kv_role: str | None, engine_id: str | None,
                         tokenizer: Any):
    """The route (a FastAPI ``APIRouter``), answering :func:`instance_info` of the engine."""
    # Imported here: the proxy and the launcher import this module for its path, not FastAPI.
    from fastapi import APIRouter
    from fastapi.responses import JSONResponse

    router = APIRouter()
    body = instance_info(model_name, kv_role, engine_id, tokenizer)

    @router.get(INSTANCE_INFO_PATH)
    async def info() -> JSONResponse:
        return JSONResponse(body)

    return router
