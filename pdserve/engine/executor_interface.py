"""What the engine core needs of the executor that runs the model: the :class:`Executor`
protocol and the factory the core's caller hands it.

The engine core never builds an executor itself: its composition roots (the engine-core
process, :mod:`pdserve.engine.core_loop`; the in-process :mod:`pdserve.engine.llm_engine`) pass
:func:`pdserve.executor.create_executor`, tests a factory of fakes. The executors of
:mod:`pdserve.executor` (the ``ModelRunner`` at TP 1, ``TPExecutor`` at TP > 1) satisfy it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Protocol

if TYPE_CHECKING:
    from pdserve.types.engine_config import EngineConfig
    from pdserve.types.outputs import ModelRunnerOutput, SchedulerOutput


class Executor(Protocol):
    """Runs the model of one instance for the engine core.

    Attributes:
        model_info: the model's :class:`~pdserve.types.model_info.ModelInfo`.
        kv_cache: the KV cache (after :meth:`allocate_kv_cache`), registered with the
            connector's worker side.
        kv_cache_spec: its layout (:class:`~pdserve.kv_transfer.base.KVCacheSpec`).

    Besides: an executor of several TP ranks creates the connector's worker sides itself and
    has ``connector_worker`` (rank 0's, as the core drives it); with ``--async-scheduling``
    (TP 1) the core also calls ``execute_async`` (:mod:`pdserve.engine.async_step`).
    """

    model_info: Any
    kv_cache: Any
    kv_cache_spec: Any

    def determine_num_blocks(self) -> int:
        """KV cache blocks that fit in the memory left after the weights."""

    def allocate_kv_cache(self, num_blocks: int) -> None:
        """Allocate the KV cache of ``num_blocks`` blocks."""

    def allocate_kv_tiers(self, host_blocks: int, disk_dir: "str | None") -> None:
        """Allocate the KV cache tiers' host pool (``host_blocks`` blocks) and block files
        under ``disk_dir`` (None: no disk tier); only with ``--kv-offloading-size``."""

    def set_kv_connector_worker(self, worker: Any) -> None:
        """Drive the connector's worker side around every step (None: no connector)."""

    def execute(self, sched_out: "SchedulerOutput") -> "ModelRunnerOutput":
        """Run one scheduled step and return its outputs."""

    def shutdown(self) -> None:
        """Release the devices and any worker process."""


#: Builds the executor of a configuration (after the connector sides exist: a port in use is
#: then reported before the model loads). Raises ValueError / RuntimeError when the model
#: cannot be loaded or split.
ExecutorFactory = Callable[["EngineConfig"], Executor]
