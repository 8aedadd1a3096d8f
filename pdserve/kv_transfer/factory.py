"""Create a KV connector side from a :class:`~pdserve.types.kv_transfer_config.KVTransferConfig`.

The engine core creates the scheduler side for the Scheduler, and each tensor-parallel rank
creates a worker side for its ModelRunner in its own process (rank 0: the engine-core process),
which then calls ``register_kv_cache``. The sides share no object; they talk only through the
per-step metadata and ``KVConnectorOutput``.
"""

from __future__ import annotations

from typing import Any

from pdserve.types.engine_config import EngineConfig
from pdserve.kv_transfer.base import KVConnectorSchedulerSide, KVConnectorWorkerSide, TPRank
from pdserve.types.kv_transfer_config import KVTransferConfig, KVTransferConfigError

ROLES = ("scheduler", "worker")


def create_connector(
    kv_transfer_config: KVTransferConfig,
    role: str,
    engine_config: EngineConfig | None = None,
    tp: TPRank = TPRank(),
) -> KVConnectorSchedulerSide | KVConnectorWorkerSide:
    """Build one side of the configured connector.

    Args:
        kv_transfer_config: the validated configuration.
        role: ``"scheduler"`` or ``"worker"``.
        engine_config: the instance's configuration (None: :class:`EngineConfig`'s defaults).
            The scheduler side reads ``block_size`` and ``tensor_parallel_size``; the
            ``data_parallel_rank`` selects the side-channel port ``base + rank``.
        tp: where the worker side sits in the instance's tensor-parallel group (one worker
            side per TP rank, each in its rank's process); the scheduler side ignores it.

    Returns:
        A :class:`KVConnectorSchedulerSide` for ``"scheduler"``, a
        :class:`KVConnectorWorkerSide` for ``"worker"``.

    Raises:
        ValueError: unknown role.
        KVTransferConfigError: unknown connector.
        NixlUnavailableError, SideChannelBindError: the worker side cannot start (missing NIXL
            backend, side-channel port in use).
    """
    if role not in ROLES:
        raise ValueError(f"unknown connector role {role!r}; expected one of {list(ROLES)}")
    if kv_transfer_config.kv_connector != "NixlConnector":
        raise KVTransferConfigError(f"unknown kv_connector {kv_transfer_config.kv_connector!r}")
    config = engine_config if engine_config is not None else EngineConfig()
    dp_rank = config.data_parallel_rank
    if role == "scheduler":
        from pdserve.kv_transfer.nixl.scheduler import NixlConnectorScheduler

        return NixlConnectorScheduler(kv_transfer_config, config.block_size,
                                      data_parallel_rank=dp_rank,
                                      tp_size=config.tensor_parallel_size)
    from pdserve.kv_transfer.nixl.worker import NixlConnectorWorker

    return NixlConnectorWorker(kv_transfer_config, data_parallel_rank=dp_rank, tp=tp)


def validate_kv_transfer_params(kv_transfer_config: KVTransferConfig, params: Any) -> None:
    """Check a request's ``kv_transfer_params`` for this instance (the check of
    :func:`pdserve.types.kv_params.parse_request_params`, without the vocabulary bound).

    Args:
        kv_transfer_config: this instance's validated configuration.
        params: the request's ``kv_transfer_params`` (a dict, or None for none).

    Raises:
        KVTransferParamsError: a field the requested transfer needs is missing or has the wrong
            type; the message names the field.
        KVTransferConfigError: unknown connector.
    """
    if params is None:
        return
    if kv_transfer_config.kv_connector != "NixlConnector":
        raise KVTransferConfigError(f"unknown kv_connector {kv_transfer_config.kv_connector!r}")
    from pdserve.types.kv_params import parse_request_params

    parse_request_params(params, kv_transfer_config, None)
