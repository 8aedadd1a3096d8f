"""``GET /pdserve/instance``: what a client of an engine's server needs to know before its first
request (P/D role, chat template, a prefiller's KV endpoints), asked by ``pdserve proxy`` (role
check, concurrent hand-off) and ``pdserve up`` (the examples it prints)."""

from __future__ import annotations

from typing import Any

from pdserve import __version__
from pdserve.types.engine_config import EngineConfig
from pdserve.types.instance_info import INSTANCE_INFO_PATH
from pdserve.types.kv_endpoints import KVEndpoint, PrefillEndpoints

__all__ = ["INSTANCE_INFO_PATH", "instance_info", "instance_info_router", "prefill_endpoints"]


def prefill_endpoints(config: EngineConfig) -> PrefillEndpoints | None:
    """The KV endpoints of an instance whose connector can produce KV (``kv_producer`` or
    ``kv_both``), one per data-parallel rank: engine id ``KVTransferConfig.engine_id_for``,
    this host's side-channel host, port ``side_channel_port_for(rank)``
    (:func:`pdserve.engine.data_parallel.rank_config` gives each rank its config the same way).

    Returns:
        None without a producing connector. No endpoints at all (an empty tuple) when some
        ranks run on other hosts (``--headless``): their side-channel host and port are those
        hosts' settings, which this API server cannot know, and a router then falls back to
        the sequential hand-off.
    """
    kv = config.kv_transfer_config
    if kv is None or not kv.is_producer:
        return None
    size = config.data_parallel_size
    if config.local_data_parallel_size < size:
        return PrefillEndpoints((), config.tensor_parallel_size)
    host = kv.side_channel_host
    return PrefillEndpoints(
        tuple(KVEndpoint(kv.engine_id_for(rank, size), host, kv.side_channel_port_for(rank))
              for rank in range(size)),
        config.tensor_parallel_size)


def instance_info(model_name: str, kv_role: str | None, engine_id: str | None,
                  tokenizer: Any, endpoints: PrefillEndpoints | None = None) -> dict[str, Any]:
    """The body of ``GET /pdserve/instance``.

    Keys: ``model`` (the served name), ``kv_role`` (``kv_producer``: a prefiller,
    ``kv_consumer``: a decoder, ``kv_both``, or null without ``--kv-transfer-config``),
    ``engine_id`` (the KV connector's engine id, or null), ``chat_template`` (whether
    ``/v1/chat/completions`` can render a conversation; without one only ``/v1/completions``
    serves), ``version``; with ``endpoints`` (a prefiller) also ``kv_endpoints`` (a list of
    ``{"engine_id", "host", "port"}``, one per data-parallel rank) and ``tp_size``
    (docs/proxy.md, "Concurrent hand-off").
    """
    body = {"model": model_name, "kv_role": kv_role, "engine_id": engine_id,
            "chat_template": bool(getattr(tokenizer, "chat_template", None)),
            "version": __version__}
    if endpoints is not None:
        body.update(endpoints.to_info())
    return body


def instance_info_router(model_name: str, kv_role: str | None, engine_id: str | None,
                         tokenizer: Any, endpoints: PrefillEndpoints | None = None):
    """The route (a FastAPI ``APIRouter``), answering :func:`instance_info` of the engine."""
    # Imported here: the proxy and the launcher import this module for its path, not FastAPI.
    from fastapi import APIRouter
    from fastapi.responses import JSONResponse

    router = APIRouter()
    body = instance_info(model_name, kv_role, engine_id, tokenizer, endpoints)

    @router.get(INSTANCE_INFO_PATH)
    async def info() -> JSONResponse:
        return JSONResponse(body)

    return router
