"""Executors: what runs the model for the engine core, behind the interface the core states
(:class:`pdserve.engine.executor_interface.Executor`: ``model_info``,
``determine_num_blocks()``, ``allocate_kv_cache(n)``, ``kv_cache``, ``kv_cache_spec``,
``set_kv_connector_worker(w)``, ``execute(sched_out)``, ``shutdown()``).
:func:`create_executor` is the factory the engine core's callers hand it (the engine-core
process, ``LLMEngine``); the core itself never imports this package.

- TP 1: the :class:`~pdserve.runner.model_runner.ModelRunner` itself, in the engine-core
  process (no extra process, no extra copy);
- TP > 1: :class:`~pdserve.executor.multiproc.TPExecutor`: rank 0's runner in the engine-core
  process, ranks ``1..N-1`` in worker processes (:mod:`.worker`), control over ZMQ
  (:mod:`.messages`), the ranks' KV connector outputs merged (:mod:`.kv_merge`).
"""

from __future__ import annotations

from typing import Any

from pdserve.types.engine_config import EngineConfig


def create_executor(config: EngineConfig) -> Any:
    """The executor of ``config.tensor_parallel_size`` ranks (see the module docstring; an
    :data:`~pdserve.engine.executor_interface.ExecutorFactory`).

    Raises:
        ValueError / RuntimeError: the model cannot be loaded or split, or a rank failed to
            start.
    """
    if config.tensor_parallel_size == 1:
        from pdserve.runner.model_runner import ModelRunner

        return ModelRunner(config)
    from pdserve.executor.multiproc import TPExecutor

    return TPExecutor(config)
