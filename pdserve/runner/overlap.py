"""The runner's side of overlapped scheduling: launching a step (``ModelRunner.execute_async``)
whose sampled tokens stay on the device for the next step's inputs and reach the host later.

On CUDA a step's ``[S]`` sampled tokens are copied (non-blocking) into pinned host memory and a
CUDA event is recorded after the copy; :meth:`PendingRunnerStep.result` waits on that event
only, so the host that launched step n+1 before asking for step n's tokens never waits for step
n+1. Step n+1's decodes whose input is step n's token (``ScheduledRequest.
input_from_previous_step``) get it by a device-side gather from step n's tokens
(:func:`feed_previous_tokens`). On CPU torch runs synchronously: the same code gives the same
tokens, without the overlap.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from pdserve.types.outputs import (
    KVConnectorOutput,
    ModelRunnerOutput,
    ScheduledRequest,
    SchedulerOutput,
    TokenLogprobs,
)
from pdserve.kv_transfer.base import KVConnectorWorkerSide
from pdserve.attention.host_tensors import int_tensor

if TYPE_CHECKING:
    from pdserve.runner.model_runner import ModelRunner


@dataclass
class DeviceTokens:
    """The sampled tokens of the last launched step, on the device.

    Attributes:
        rows: request_id -> its row in ``tokens``.
        tokens: ``[S]`` int64 on the runner's device.
    """

    rows: dict[str, int]
    tokens: torch.Tensor


def feed_previous_tokens(input_ids: torch.Tensor, rows: list[tuple[int, str]],
                         previous: DeviceTokens | None) -> None:
    """Write the previous step's sampled token of each request into its input row, on the
    device and without waiting for it.

    Args:
        input_ids: ``[T]`` int64 input tokens of the step, on the device; modified in place.
        rows: ``(row in input_ids, request_id)`` of the placeholder rows.
        previous: the previous step's tokens.

    Raises:
        ValueError: a request was not sampled in the previous step (a scheduling bug).
    """
    if not rows:
        return
    sampled_rows = previous.rows if previous is not None else {}
    try:
        src = [sampled_rows[request_id] for _, request_id in rows]
    except KeyError:
        missing = [request_id for _, request_id in rows if request_id not in sampled_rows]
        raise ValueError(f"requests {missing[:5]} take their input token from a previous step "
                         "that did not sample them") from None
    # [2, R]: destination rows, then source rows; one host-to-device copy
    index = torch.from_numpy(np.array([[i for i, _ in rows], src], dtype=np.int64))
    index = index.to(input_ids.device, non_blocking=True)
    input_ids[index[0]] = previous.tokens[index[1]]


class PendingRunnerStep:
    """A launched step (``ModelRunner.execute_async``); implements
    :class:`~pdserve.types.outputs.PendingStep`.

    Args:
        request_ids: the sampled requests, in row order of ``tokens``.
        tokens: ``[S]`` int64 sampled tokens on the device.
        logprobs: request_id -> logprobs, for the requests that asked (sampled on the host).
        kv_connector_output: the connector's report of this step, or None.
    """

    def __init__(self, request_ids: list[str], tokens: torch.Tensor,
                 logprobs: dict[str, TokenLogprobs], kv_connector_output: KVConnectorOutput | None):
        self._request_ids = request_ids
        self._logprobs = logprobs
        self._kv_out = kv_connector_output
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
                                 logprobs=self._logprobs, kv_connector_output=self._kv_out)


class StepLauncher:
    """Launches the overlapped steps of a model runner (``ModelRunner.execute_async``) and
    keeps the last one's sampled tokens on the device, for the placeholder inputs of the next.

    Args:
        runner: the model runner whose steps it launches.

    Attributes:
        previous: the last launched step's sampled tokens; None until a step is launched and
            after a synchronous step (``ModelRunner.execute`` resets it).
    """

    def __init__(self, runner: "ModelRunner"):
        self.runner = runner
        self.previous: DeviceTokens | None = None

    def launch(self, sched: SchedulerOutput, worker: KVConnectorWorkerSide | None
               ) -> PendingRunnerStep:
        """Launch one engine step whose sampled tokens stay on the device: as
        ``ModelRunner.execute``, except that placeholder inputs (``input_from_previous_step``)
        take the previous launched step's sampled tokens on the device, and the result is read
        later through the returned step. A batch with logprobs or penalties samples on the host
        (:meth:`Sampler.samples_on_host <pdserve.runner.sampler.Sampler.samples_on_host>`).

        Args:
            sched: the step's scheduler output.
            worker: the KV connector's worker side attached to the runner, or None.

        Raises:
            RuntimeError: the KV cache was not allocated.
            ValueError: a malformed scheduled request, a multi-step round, or a placeholder
                whose request the previous step did not sample.
        """
        runner = self.runner
        if sched.num_steps > 1:
            raise ValueError("multi-step rounds run through execute()")
        if runner.kv_cache is None:
            raise RuntimeError("allocate_kv_cache() must be called before execute_async()")
        runner.sampler.drop(sched.finished_request_ids)
        if worker is not None:
            worker.bind_connector_metadata(sched.kv_connector_metadata)
            worker.start_load_kv()
        sampled: list[ScheduledRequest] = []
        logprobs = {}
        tokens = torch.empty(0, dtype=torch.int64, device=runner.device)
        if sched.scheduled:
            sampled, logits = runner.forward_logits(sched.scheduled, runner.kv_cache,
                                                    self.previous)
        if sampled and runner.sampler.samples_on_host(sampled):
            token_list, lps = runner.sampler.sample(logits, sampled)
            tokens = int_tensor(token_list).to(runner.device, non_blocking=True)
            logprobs = {r.request_id: lp for r, lp in zip(sampled, lps) if lp is not None}
        elif sampled:
            tokens = runner.sampler.sample_on_device(logits, sampled)
        request_ids = [r.request_id for r in sampled]
        self.previous = DeviceTokens({request_id: i for i, request_id in enumerate(request_ids)}, tokens)
        kv_out = worker.get_finished(sched.finished_request_ids) if worker is not None else None
        return PendingRunnerStep(request_ids, tokens, logprobs, kv_out)
