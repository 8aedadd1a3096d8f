"""Early release of a prefiller's lease when its decode leg will not read the blocks.

The proxy calls ``POST /v1/kv_transfer/release`` on P with the ``kv_transfer_params`` P returned
when the decode leg will not read them (D refused the request, no decoder was reachable, the
client went away between the legs). P's front end checks the params name this instance
(:func:`parse_release`: the engine id and the side-channel port of one of its data-parallel
ranks) and hands the release (request id and block ids) to that rank's engine core
(:class:`pdserve.types.core_messages.ReleaseEarly`), whose connector scheduler side passes it to
the worker (``NixlConnectorMetadata.early_releases``); the worker closes the lease only when it
holds exactly those blocks for that request (a forged release naming another request's id with
other block ids leaves that lease alone), and counts it
(``pdserve:kv_leases_released_early_total``). Without the call the lease still ends by itself,
so a proxy that dies leaks nothing. That is the only way in: the side channel and NIXL
notifications carry readers' notices only ("done", "abort", "heartbeat"), so no one but this
instance's own front end can end a lease early.
"""

from __future__ import annotations

from typing import Any

from pdserve.types.kv_transfer_config import KVTransferConfig
from pdserve.types.remote_ref import KVTransferParamsError, RemoteKVRef


def parse_release(config: KVTransferConfig | None, params: Any,
                  data_parallel_size: int = 1) -> RemoteKVRef:
    """The lease a release names, checked against this instance (``data_parallel_size``: its
    ranks, rank ``r`` with engine id ``config.engine_id_for(r, data_parallel_size)`` and
    side-channel port ``base + r``).

    Raises:
        KVTransferParamsError: no KV connector here, malformed params, or params naming another
            engine or a port that is not one of this instance's side channels (or not the
            side channel of the rank the engine id names).
    """
    if config is None:
        raise KVTransferParamsError("this instance has no KV transfer configuration")
    if not isinstance(params, dict):
        raise KVTransferParamsError("'kv_transfer_params' must be an object")
    ref = RemoteKVRef.from_params(params)
    engine_ids = [config.engine_id_for(rank, data_parallel_size)
                  for rank in range(data_parallel_size)]
    if ref.endpoint.engine_id not in engine_ids:
        raise KVTransferParamsError(
            f"kv_transfer_params name engine {ref.endpoint.engine_id!r}, not this instance "
            f"({', '.join(map(repr, engine_ids))})")
    ports = [config.side_channel_port_for(rank) for rank in range(data_parallel_size)]
    if ref.endpoint.port not in ports:
        raise KVTransferParamsError(
            f"kv_transfer_params.remote_port {ref.endpoint.port} is not a side-channel port of "
            f"this instance ({', '.join(map(str, ports))})")
    rank = engine_ids.index(ref.endpoint.engine_id)
    if ports[rank] != ref.endpoint.port:
        raise KVTransferParamsError(
            f"kv_transfer_params.remote_port {ref.endpoint.port} is not the side-channel port of "
            f"engine {ref.endpoint.engine_id!r} ({ports[rank]})")
    return ref


def release_rank(config: KVTransferConfig, ref: RemoteKVRef) -> int:
    """The data-parallel rank holding the lease of a release :func:`parse_release` accepted
    (the one whose side-channel port it names)."""
    return ref.endpoint.port - config.side_channel_base_port

