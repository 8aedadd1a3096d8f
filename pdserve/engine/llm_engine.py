"""Synchronous, in-process engine for tests and offline benchmarks (no HTTP, no extra process)."""

from __future__ import annotations

import gc
import time
from dataclasses import dataclass, field
from typing import Any, Sequence

from pdserve.types.engine_config import EngineConfig
from pdserve.engine.core import EngineCore
from pdserve.types.core_messages import AddRequest
from pdserve.types.outputs import TokenLogprobs
from pdserve.types.sampling_params import SamplingParams
from pdserve.types.kv_params import KVTransferParams
from pdserve.utils.process_gc import freeze_start_up_objects


@dataclass
class GenerationOutput:
    """The complete result of one prompt.

    Attributes:
        request_id: the id the engine used.
        prompt_token_ids: the prompt.
        token_ids: generated tokens (an EOS or stop token that ended the sequence included).
        finish_reason: ``stop``, ``length``, ``abort`` or ``error``.
        stop_reason: the stop token id that ended it, if any.
        logprobs: per generated token, when requested.
        num_cached_tokens: prompt tokens served from the prefix cache.
        num_transferred_tokens: prompt tokens whose KV came from another instance.
        kv_transfer_params: the connector's params (finishing output).
        error: reason when ``finish_reason == "error"``.
    """

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | None = None
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    num_cached_tokens: int = 0
    num_transferred_tokens: int = 0
    kv_transfer_params: dict[str, Any] | None = None
    error: str | None = None


class LLMEngine:
    """Runs an :class:`EngineCore` in the calling thread.

    Args:
        config: engine configuration.
        runner: optional model runner (tests inject fakes); default: the real ModelRunner.
        connectors: optional ``(scheduler_side, worker_side)`` KV connector pair (tests).
    """

    def __init__(self, config: EngineConfig, runner: Any = None, connectors: tuple[Any, Any] | None = None):
        if runner is None:
            # The composition root of an in-process engine: the executor (torch, the model) is
            # imported here, lazily, as in the engine-core process (pdserve/engine/core_loop.py).
            from pdserve.executor import create_executor

            make_executor = create_executor
        else:
            make_executor = lambda _config: runner  # noqa: E731 - a test's fake runner
        self.core = EngineCore(config, make_executor, connectors=connectors)
        self._next_id = 0
        # The model, caches and imported modules live as long as the engine: as in the
        # engine-core process (pdserve/engine/core_loop.py), they sit out the garbage
        # collector's passes until shutdown (pdserve/utils/process_gc.py says why). Freezing only
        # inside generate() without the collect first still let two full passes into a timed
        # run under Python 3.12. Shutdown hands everything back only when nothing was frozen
        # before (a caller's freeze is left as it is).
        self._unfreeze_at_shutdown = freeze_start_up_objects()

    @property
    def scheduler(self):
        return self.core.scheduler

    @property
    def kv_cache_manager(self):
        return self.core.scheduler.kv_cache_manager

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        kv_transfer_params: Sequence[dict[str, Any] | None] | None = None,
    ) -> list[GenerationOutput]:
        """Generate for all prompts at once (continuous batching) and return results in prompt
        order.

        Args:
            prompts: token id lists.
            sampling_params: one for all prompts, or one per prompt (default:
                ``SamplingParams()``).
            kv_transfer_params: per prompt, or None (parsed here, unchecked, with
                :meth:`KVTransferParams.parse <pdserve.types.kv_params.KVTransferParams.parse>`).

        Raises:
            ValueError: mismatched list lengths.
        """
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            params = [sampling_params] * len(prompts)
        else:
            params = list(sampling_params)
        if len(params) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(params)} sampling params")
        kvp = list(kv_transfer_params) if kv_transfer_params is not None else [None] * len(prompts)
        results: dict[str, GenerationOutput] = {}
        order: list[str] = []
        for prompt, sp, kv in zip(prompts, params, kvp):
            request_id = f"llm-{self._next_id}"
            self._next_id += 1
            order.append(request_id)
            res = GenerationOutput(request_id=request_id, prompt_token_ids=list(prompt))
            results[request_id] = res
            rejected = self.core.add_request(
                AddRequest(request_id=request_id, prompt_token_ids=list(prompt), sampling_params=sp,
                           kv_transfer_params=KVTransferParams.parse(kv))
            )
            if rejected is not None:
                res.finish_reason, res.error = rejected.finish_reason, rejected.error
        pending = {request_id for request_id in order if results[request_id].finish_reason is None}
        while pending:
            outputs, progressed = self.core.step()
            if not progressed and not outputs:
                time.sleep(0.001)  # only transfers pending: poll without spinning
            for o in outputs:
                res = results.get(o.request_id)
                if res is None:
                    continue
                res.token_ids.extend(o.new_token_ids)
                res.logprobs.extend(o.new_logprobs)
                res.num_cached_tokens = o.num_cached_tokens
                res.num_transferred_tokens = o.num_transferred_tokens
                if o.finish_reason is not None:
                    res.finish_reason = o.finish_reason
                    res.stop_reason = o.stop_reason
                    res.kv_transfer_params = o.kv_transfer_params
                    res.error = o.error
                    pending.discard(o.request_id)
        return [results[request_id] for request_id in order]

    def stats(self) -> dict[str, Any]:
        return self.core.stats()

    def shutdown(self) -> None:
        """Stop the engine core; objects frozen at construction go back to the collector
        (unless objects were frozen before it: then all stay frozen)."""
        self.core.shutdown()
        if self._unfreeze_at_shutdown:
            self._unfreeze_at_shutdown = False
            gc.unfreeze()
