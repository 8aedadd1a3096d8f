"""The engine core's start-up pieces (:class:`pdserve.engine.core.EngineCore` builds itself
with them): the effective ``max_model_len``, the KV connector's two sides and the KV cache tiers
of a configuration.
"""

from __future__ import annotations

import logging
from typing import Any

from pdserve.engine.executor_interface import Executor
from pdserve.engine.kv_tiers import TierManager
from pdserve.types.engine_config import EngineConfig

logger = logging.getLogger("pdserve.engine.core")  # start-up lines under the core's name


def resolve_max_model_len(config: EngineConfig, max_position_embeddings: int, num_blocks: int) -> int:
    """Effective ``max_model_len`` in tokens.

    Default: the model's ``max_position_embeddings``, capped (with a warning) at the KV cache
    capacity ``num_blocks * block_size`` so that a single request always fits.

    Raises:
        ValueError: an explicit ``max_model_len`` exceeds the model's positions or the KV cache.
    """
    capacity = num_blocks * config.block_size
    if config.max_model_len is None:
        if max_position_embeddings > capacity:
            logger.warning(
                "max_model_len defaults to the KV cache capacity, %d tokens (the model supports %d);"
                " give the cache more memory to serve longer sequences",
                capacity, max_position_embeddings,
            )
        return min(max_position_embeddings, capacity)
    if config.max_model_len < 1:
        raise ValueError(f"max_model_len must be at least 1, got {config.max_model_len}")
    if config.max_model_len > max_position_embeddings:
        raise ValueError(
            f"max_model_len ({config.max_model_len}) is larger than the model's "
            f"max_position_embeddings ({max_position_embeddings})"
        )
    if config.max_model_len > capacity:
        raise ValueError(
            f"max_model_len ({config.max_model_len} tokens) does not fit in the KV cache "
            f"({num_blocks} blocks x {config.block_size} = {capacity} tokens); lower "
            "--max-model-len or raise --kv-cache-memory / --gpu-memory-utilization"
        )
    return config.max_model_len


def create_connectors(kv_transfer_config: Any, engine_config: EngineConfig) -> tuple[Any, Any]:
    """Both sides of the configured KV connector (scheduler side, worker side). At TP > 1 the
    worker side is None here: the executor creates one per rank, in the rank's process.

    Raises:
        RuntimeError: no KV connector can be imported (its message says why).
        KVTransferConfigError, NixlUnavailableError, SideChannelBindError: as
            :func:`pdserve.kv_transfer.factory.create_connector` raises them (an unknown
            connector, a missing NIXL backend, a side-channel port in use).
    """
    try:
        from pdserve.kv_transfer.factory import create_connector
    except ImportError as e:
        raise RuntimeError(f"a KV transfer config was given but no connector is available: {e}") from e
    scheduler_side = create_connector(kv_transfer_config, "scheduler", engine_config)
    if engine_config.tensor_parallel_size > 1:
        return scheduler_side, None
    return scheduler_side, create_connector(kv_transfer_config, "worker", engine_config)


def build_tiers(config: EngineConfig, runner: Executor, num_blocks: int) -> TierManager | None:
    """The KV cache tiers of ``config.kv_offloading``: their capacity in blocks of the
    engine's KV cache (``num_blocks`` blocks; each TP rank its shard), the runner's host pool
    and files, and the scheduler's bookkeeping; None without tiers.

    Raises:
        ValueError: a tier too small for one block.
    """
    off = config.kv_offloading
    if off is None:
        return None
    if not config.enable_prefix_caching:
        logger.warning("--kv-offloading-size without prefix caching: no block has a hash, "
                       "so the KV cache tiers stay empty")
    block_bytes = runner.kv_cache_spec.block_bytes
    host_blocks, disk_blocks = off.capacity(block_bytes, config.tensor_parallel_size)
    runner.allocate_kv_tiers(host_blocks, off.disk_dir)
    disk = (f"; disk tier: {disk_blocks} blocks, {disk_blocks * block_bytes / (1 << 30):.2f} "
            f"GiB under {off.disk_dir}" if off.disk_dir else "; no disk tier")
    logger.info("KV cache tiers (backend %s): host tier %d blocks, %.2f GiB per rank "
                "(%.1fx the KV cache)%s", off.backend.value, host_blocks,
                host_blocks * block_bytes / (1 << 30), host_blocks / num_blocks, disk)
    return TierManager(host_blocks, disk_blocks, block_bytes)
