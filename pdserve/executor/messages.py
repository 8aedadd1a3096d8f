"""Control messages between a tensor-parallel executor (rank 0, engine-core process) and its
rank worker processes, sent pickled over ZMQ ``ipc://`` sockets (both ends are this package, in
processes of one instance; nothing from outside reaches these sockets)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pdserve.types.engine_config import EngineConfig
from pdserve.types.outputs import SchedulerOutput
from pdserve.kv_transfer.base import KVConnectorWorkerSide, TPRank

#: Builds the KV connector worker side of one rank in that rank's process (a picklable,
#: module-level function; tests pass fakes). None: ``create_connector`` of
#: ``config.kv_transfer_config`` when there is one.
ConnectorFactory = Callable[[EngineConfig, TPRank], KVConnectorWorkerSide]


@dataclass
class WorkerInit:
    """First message to a rank worker: who it is and how to join the TP group.

    Attributes:
        config: the instance's engine configuration.
        rank, size: this worker's TP rank and the TP size.
        init_method: the ``torch.distributed`` rendezvous of the instance.
        connector_factory: see :data:`ConnectorFactory`.
    """

    config: EngineConfig
    rank: int
    size: int
    init_method: str
    connector_factory: ConnectorFactory | None = None


@dataclass
class NumBlocksRequest:
    """Size the KV cache: each rank answers its ``determine_num_blocks()`` (the executor takes
    the minimum; on CUDA every rank runs the profiling forward pass, collectives included)."""


@dataclass
class AllocateKVCache:
    """Allocate the KV cache of ``num_blocks`` blocks (and capture CUDA graphs)."""

    num_blocks: int


@dataclass
class AllocateKVTiers:
    """Allocate the rank's KV cache tiers (host pool of ``host_blocks``, files under
    ``disk_dir`` or none); after :class:`AllocateKVCache`."""

    host_blocks: int
    disk_dir: str | None


@dataclass
class RegisterKVCache:
    """Register the rank's KV cache with its connector worker side and attach the connector
    to its runner (every rank at the same point, as the connector's collectives need)."""


@dataclass
class Execute:
    """Run one engine step, the same :class:`SchedulerOutput` on every rank."""

    sched_out: SchedulerOutput


@dataclass
class Shutdown:
    """Release the connector and the runner, leave the TP group and exit."""


@dataclass
class WorkerReply:
    """A rank's answer to one message.

    Attributes:
        rank: the answering rank.
        value: the answer (``int`` blocks; the step's ``(KVConnectorOutput | None,
            KVTierReport | None)``; else None).
        error: ``"Type: message"`` when the rank failed (it exits after sending this).
        next_poll_in: the rank's connector's ``next_poll_in()`` after answering (None without a
            connector, or when it needs no poll).
    """

    rank: int
    value: Any = None
    error: str | None = None
    next_poll_in: float | None = None
