"""Launching a step whose outputs are read one step later (the runner's side of async
scheduling, ``ModelRunner.execute_async``): its sampled tokens stay on the device for the next
step's inputs and reach the host later.

On CUDA a step's ``[S]`` sampled tokens are copied (non-blocking) into pinned host memory and a
CUDA event is recorded after the copy; :meth:`PendingRunnerStep.result` waits on that event
only, so the host that launched step n+1 before asking for step n's tokens never waits for step
n+1. Step n+1's decodes whose input is step n's token (``ScheduledRequest.
input_from_previous_step``) get it by a device-side gather from step n's tokens
(:func:`~pdserve.runner.device_tokens.feed_previous_tokens`). On CPU torch runs synchronously:
the same code gives the same tokens, without the overlap.
"""

from __future__ import annotations

from typing import Callable

import torch

from pdserve.types.outputs import (
    KVConnectorOutput,
    ModelRunnerOutput,
    ScheduledRequest,
    SchedulerOutput,
    TokenLogprobs,
)
from pdserve.kv_transfer.base import KVConnectorWorkerSide
from pdserve.types.kv_tiers import KVTierReport
from pdserve.attention.host_tensors import int_tensor
from pdserve.runner.device_tokens import DeviceTokens
from pdserve.runner.sampler import Sampler

# (scheduled, kv_cache, previous) -> (sampled requests, their [S, vocab] logits or None)
ForwardLogits = Callable[[list[ScheduledRequest], torch.Tensor, "DeviceTokens | None"],
                         tuple[list[ScheduledRequest], "torch.Tensor | None"]]


class PendingRunnerStep:
    """A launched step (``ModelRunner.execute_async``); implements
    :class:`~pdserve.types.outputs.PendingStep`.

    Args:
        request_ids: the sampled requests, in row order of ``tokens``.
        tokens: ``[S]`` int64 sampled tokens on the device.
        logprobs: request_id -> logprobs, for the requests that asked (sampled on the host).
        kv_connector_output: the connector's report of this step (taken at launch), or None.

    Attributes:
        kv_connector_output: as given.
        kv_tier_report: the KV cache tiers' report at launch (set by the runner), or None.
    """

    def __init__(self, request_ids: list[str], tokens: torch.Tensor,
                 logprobs: dict[str, TokenLogprobs], kv_connector_output: KVConnectorOutput | None):
        self._request_ids = request_ids
        self._logprobs = logprobs
        self.kv_connector_output = kv_connector_output
        self.kv_tier_report: KVTierReport | None = None
        self._event: torch.cuda.Event | None = None
        if tokens.device.type == "cuda":
            self._host = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True)
            self._host.copy_(tokens, non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record()
        else:
            self._host = tokens

    def result(self) -> ModelRunnerOutput:
        """Wait for this step's tokens (its event only) and return its output."""
        if self._event is not None:
            self._event.synchronize()
        tokens = self._host.tolist()
        return ModelRunnerOutput(sampled_token_ids=dict(zip(self._request_ids, tokens)),
                                 logprobs=self._logprobs,
                                 kv_connector_output=self.kv_connector_output,
                                 kv_tier_report=self.kv_tier_report)


class StepLauncher:
    """Launches the steps of a model runner whose outputs are read one step later
    (``ModelRunner.execute_async``) and keeps the last one's sampled tokens on the device, for
    the placeholder inputs of the next.

    Args:
        forward_logits: runs one step's forward pass, ``(scheduled, kv_cache, previous) ->
            (sampled_requests, logits)`` (:meth:`ModelRunner.forward_logits
            <pdserve.runner.model_runner.ModelRunner.forward_logits>`).
        sampler: the runner's sampler.
        device: the runner's device (of the sampled tokens).

    Attributes:
        previous: the last launched step's sampled tokens; None until a step is launched and
            after :meth:`reset` (a synchronous step, ``ModelRunner.execute``).
    """

    def __init__(self, forward_logits: ForwardLogits, sampler: Sampler, device: torch.device):
        self._forward_logits = forward_logits
        self._sampler = sampler
        self._device = device
        self.previous: DeviceTokens | None = None

    def reset(self) -> None:
        """Forget the last launched step's tokens (a synchronous step ran since)."""
        self.previous = None

    def launch(self, sched_out: SchedulerOutput, kv_cache: torch.Tensor | None,
               worker: KVConnectorWorkerSide | None) -> PendingRunnerStep:
        """Launch one engine step whose sampled tokens stay on the device: as
        ``ModelRunner.execute``, except that placeholder inputs (``input_from_previous_step``)
        take the previous launched step's sampled tokens on the device, and the result is read
        later through the returned step. A batch with logprobs or penalties samples on the host
        (:meth:`Sampler.samples_on_host <pdserve.runner.sampler.Sampler.samples_on_host>`).

        Args:
            sched_out: the step's scheduler output.
            kv_cache: the runner's KV cache (None when not allocated yet).
            worker: the KV connector's worker side attached to the runner, or None.

        Raises:
            RuntimeError: the KV cache was not allocated.
            ValueError: a malformed scheduled request, a multi-step round, or a placeholder
                whose request the previous step did not sample.
        """
        sampler = self._sampler
        if sched_out.num_steps > 1:
            raise ValueError("multi-step rounds run through execute()")
        if kv_cache is None:
            raise RuntimeError("allocate_kv_cache() must be called before execute_async()")
        sampler.drop(sched_out.finished_request_ids)
        if worker is not None:
            worker.bind_connector_metadata(sched_out.kv_connector_metadata)
            worker.start_load_kv()
        sampled: list[ScheduledRequest] = []
        logprobs = {}
        tokens = torch.empty(0, dtype=torch.int64, device=self._device)
        if sched_out.scheduled:
            sampled, logits = self._forward_logits(sched_out.scheduled, kv_cache, self.previous)
        if sampled and sampler.samples_on_host(sampled):
            token_list, lps = sampler.sample(logits, sampled)
            tokens = int_tensor(token_list).to(self._device, non_blocking=True)
            logprobs = {r.request_id: lp for r, lp in zip(sampled, lps) if lp is not None}
        elif sampled:
            tokens = sampler.sample_on_device(logits, sampled)
        request_ids = [r.request_id for r in sampled]
        self.previous = DeviceTokens({request_id: i for i, request_id in enumerate(request_ids)},
                                     tokens)
        kv_out = (worker.get_finished(sched_out.finished_request_ids) if worker is not None
                  else None)
        return PendingRunnerStep(request_ids, tokens, logprobs, kv_out)
