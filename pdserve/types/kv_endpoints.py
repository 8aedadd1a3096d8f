"""A prefiller's KV endpoints (``GET /pdserve/instance``) and the header that pins a request to
one data-parallel rank: the concurrent hand-off's names shared by the engine and routers.

The wire contract is in docs/proxy.md ("Concurrent hand-off"). The engine's front end builds
:class:`PrefillEndpoints` from its configuration (:mod:`pdserve.entrypoints.instance_info`) and
parses :data:`DATA_PARALLEL_RANK_HEADER` (:func:`parse_data_parallel_rank`); the proxy parses
an instance's answer once, with :meth:`PrefillEndpoints.from_info`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

#: Request header naming the data-parallel rank that serves a generation request (vLLM's name).
DATA_PARALLEL_RANK_HEADER = "X-data-parallel-rank"
#: Keys of ``GET /pdserve/instance`` for the concurrent hand-off.
KV_ENDPOINTS_KEY = "kv_endpoints"
TP_SIZE_KEY = "tp_size"


class KVEndpointsError(ValueError):
    """An instance's ``kv_endpoints`` / ``tp_size`` are malformed (the message names the key)."""


@dataclass(frozen=True)
class KVEndpoint:
    """The NIXL side channel of one data-parallel rank.

    Attributes:
        engine_id: the rank's KV engine id (``<engine_id>_dp<rank>`` with several ranks).
        host: the side channel's host, as decoders reach it.
        port: the side channel's TCP port.
    """

    engine_id: str
    host: str
    port: int

    def to_dict(self) -> dict[str, Any]:
        """``{"engine_id", "host", "port"}``."""
        return {"engine_id": self.engine_id, "host": self.host, "port": self.port}


@dataclass(frozen=True)
class PrefillEndpoints:
    """What a router needs to send a decode leg before the prefill leg's answer.

    Attributes:
        endpoints: one per data-parallel rank, in rank order; empty when the instance cannot
            name them (ranks on other hosts): such an instance is served sequentially.
        tp_size: the prefiller's tensor-parallel size (the decode leg's ``tp_size``).
    """

    endpoints: tuple[KVEndpoint, ...]
    tp_size: int

    def to_info(self) -> dict[str, Any]:
        """The two keys of ``GET /pdserve/instance``."""
        return {KV_ENDPOINTS_KEY: [e.to_dict() for e in self.endpoints],
                TP_SIZE_KEY: self.tp_size}

    @classmethod
    def from_info(cls, info: dict[str, Any]) -> "PrefillEndpoints | None":
        """Parse an instance's ``GET /pdserve/instance`` answer.

        Returns:
            None when the answer lists no endpoints (key absent, null or an empty list: a
            decoder, a vLLM engine, an older pdserve, or ranks on other hosts).

        Raises:
            KVEndpointsError: the endpoints or ``tp_size`` are malformed.
        """
        raw = info.get(KV_ENDPOINTS_KEY)
        if not raw:
            return None
        if not isinstance(raw, list):
            raise KVEndpointsError(f"{KV_ENDPOINTS_KEY} must be a list, got {raw!r}")
        tp = info.get(TP_SIZE_KEY)
        if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
            raise KVEndpointsError(f"{TP_SIZE_KEY} must be a positive integer, got {tp!r}")
        endpoints = []
        for i, entry in enumerate(raw):
            if not isinstance(entry, dict):
                raise KVEndpointsError(f"{KV_ENDPOINTS_KEY}[{i}] must be an object")
            engine_id, host, port = entry.get("engine_id"), entry.get("host"), entry.get("port")
            if not isinstance(engine_id, str) or not engine_id:
                raise KVEndpointsError(f"{KV_ENDPOINTS_KEY}[{i}].engine_id must be a string")
            if not isinstance(host, str) or not host:
                raise KVEndpointsError(f"{KV_ENDPOINTS_KEY}[{i}].host must be a string")
            if isinstance(port, bool) or not isinstance(port, int) or not 0 < port < 65536:
                raise KVEndpointsError(f"{KV_ENDPOINTS_KEY}[{i}].port must be a TCP port")
            endpoints.append(KVEndpoint(engine_id, host, port))
        return cls(tuple(endpoints), tp)


def parse_data_parallel_rank(value: str | None, data_parallel_size: int) -> int | None:
    """The rank a request's :data:`DATA_PARALLEL_RANK_HEADER` names (None: header absent).

    Raises:
        ValueError: not a decimal integer in ``0 .. data_parallel_size - 1`` (the message names
            the header).
    """
    if value is None:
        return None
    text = value.strip()
    if text.isascii() and text.isdigit() and int(text) < data_parallel_size:
        return int(text)
    highest = data_parallel_size - 1
    allowed = "0" if highest == 0 else f"an integer from 0 to {highest}"
    raise ValueError(f"header {DATA_PARALLEL_RANK_HEADER} must be {allowed} (this instance has "
                     f"{data_parallel_size} data-parallel rank{'s' if highest else ''}), got "
                     f"{value!r}")
