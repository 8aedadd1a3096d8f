"""Data passed between the scheduler, the model runner and the front end (no torch).

One engine step is::

    sched_out = scheduler.schedule()                 # SchedulerOutput (bookkeeping only)
    runner_out = model_runner.execute(sched_out)     # ModelRunnerOutput (tensors stay inside)
    core_outs = scheduler.update_from_output(sched_out, runner_out)  # list[EngineCoreOutput]

The scheduler and the model runner live in the same engine-core process, so the lists below are
shared by reference, not copied.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any, Protocol

from pdserve.types.kv_tiers import KVTierJobs, KVTierReport
from pdserve.types.sampling_params import SamplingParams


class KVLoadFailure(enum.Enum):
    """Why a KV load failed; its value is the phrase the client's error message starts with."""

    ENGINE_MISMATCH = "engine mismatch"
    """The remote's KV cache is incompatible with this instance's (dtype, geometry, model)."""
    LEASE_REFUSED = "lease refused"
    """The owner no longer holds those blocks for those tokens, or frees them too soon."""
    TRANSPORT = "transport error"
    """The side channel or the NIXL READ failed (for example: the owner died)."""
    TIMEOUT = "timeout"
    """The owner's side channel did not answer, or the READ did not finish, in time."""
    INVALID_REFERENCE = "invalid reference"
    """The params name blocks the owner does not have, an engine that is not the one at the
    side channel they name, or are malformed."""

    @property
    def caused_by_params(self) -> bool:
        """True when the client's ``kv_transfer_params`` are at fault (a lease refused for the
        request, tokens or blocks they name, an invalid reference, a relayed first token that
        is not the prefiller's); False when the remote instance or the transport failed."""
        return self in (KVLoadFailure.LEASE_REFUSED, KVLoadFailure.INVALID_REFERENCE)


@dataclass(frozen=True)
class KVLoadError:
    """One failed KV load, reported by the worker side.

    Attributes:
        reason: the kind of failure.
        detail: a sentence for the log and the client.
    """

    reason: KVLoadFailure
    detail: str

    def __str__(self) -> str:
        return f"{self.reason.value}: {self.detail}"


@dataclass
class ScheduledRequest:
    """One request's share of a step.

    The runner computes KV for ``token_ids`` at positions
    ``num_computed_tokens .. num_computed_tokens + len(token_ids) - 1`` and writes it into the
    slots given by ``block_ids`` (slot of position ``p`` = ``block_ids[p // block_size] *
    block_size + p % block_size``). Attention for those tokens covers positions
    ``0 .. num_computed_tokens + len(token_ids) - 1`` (causal).

    Attributes:
        request_id: the request id.
        token_ids: the tokens to compute this step (a prefill chunk, or the last sampled token).
        num_computed_tokens: tokens already in the KV cache before this step.
        block_ids: the whole block table of the request (may be longer than needed).
        sample: True when a token must be sampled after this chunk (last prefill chunk or decode);
            False for a non-final chunk of a chunked prefill.
        sampling_params: the request's sampling parameters.
        prompt_token_ids: the prompt (for the repetition penalty).
        output_token_ids: the tokens generated so far (for penalties and ``min_tokens``).
        eos_token_id: EOS id, suppressed while fewer than ``min_tokens`` tokens exist.
        input_from_previous_step: async scheduling (:mod:`pdserve.engine.async_scheduling`):
            ``token_ids`` is one placeholder (:data:`PLACEHOLDER_TOKEN`) for the token the
            runner sampled for this request in the previous step, which the host does not know
            yet; the runner takes it from that step's sampled tokens on the device.
        num_output_tokens: output tokens before this step's sample, the one sampled by the
            previous step included when ``input_from_previous_step`` (its output position);
            -1 means ``len(output_token_ids)``. Read it through :meth:`output_position`.
    """

    request_id: str
    token_ids: list[int]
    num_computed_tokens: int
    block_ids: list[int]
    sample: bool
    sampling_params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    eos_token_id: int | None = None
    input_from_previous_step: bool = False
    num_output_tokens: int = -1

    def output_position(self) -> int:
        """Output tokens that exist before the token this step samples (the position of that
        token among the outputs): seeded draws, ``min_tokens`` and forced tokens key on it."""
        return len(self.output_token_ids) if self.num_output_tokens < 0 else self.num_output_tokens


# token_ids of a ScheduledRequest whose input is the previous step's sampled token (on device)
PLACEHOLDER_TOKEN = -1


@dataclass
class SchedulerOutput:
    """What the scheduler decided for one step.

    Attributes:
        scheduled: requests to run, prefills and decodes mixed, in batch order.
        finished_request_ids: requests that finished or were aborted since the last step; the runner
            drops its per-request state (RNG generators) for them.
        kv_connector_metadata: opaque object built by the connector's scheduler side for its
            worker side (None without a connector).
        total_num_scheduled_tokens: sum of ``len(r.token_ids)`` over the round's steps.
        num_steps: decode steps to run back to back (multi-step scheduling): every scheduled
            request is a decode with one token and ``sample=True``, its blocks have room for
            ``num_steps`` new tokens, and the runner feeds each step's sampled token to the
            next, reporting ``num_steps`` tokens per request in
            :attr:`ModelRunnerOutput.sampled_token_id_lists`. 1 for an ordinary step.
        kv_tier_jobs: the KV cache tiers' copies of this step (:mod:`pdserve.types.kv_tiers`),
            run in order before the forward pass; None when there are none.
    """

    scheduled: list[ScheduledRequest] = field(default_factory=list)
    finished_request_ids: set[str] = field(default_factory=set)
    kv_connector_metadata: Any = None
    kv_tier_jobs: KVTierJobs | None = None
    total_num_scheduled_tokens: int = 0
    num_steps: int = 1


@dataclass
class TokenLogprobs:
    """Log-probabilities for one sampled token.

    Attributes:
        token_id: the sampled token.
        logprob: its log-probability under the (penalised, temperature-free) distribution.
        top: the ``k`` most likely ``(token_id, logprob)`` pairs, best first.
    """

    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)


@dataclass
class KVConnectorOutput:
    """What the connector's worker side reports after a step.

    Attributes:
        finished_sending: request ids whose blocks another instance finished reading (or whose
            lease expired); the scheduler may now free their blocks.
        finished_recving: request ids whose KV load completed (successfully or not).
        invalid_block_ids: block ids whose load failed; the scheduler applies
            ``kv_load_failure_policy`` to the requests holding them.
        first_tokens: request_id -> the first output token the remote prefiller sampled, for
            loads of the whole prompt whose token the connector vouches for (the owner's answer
            to the lease claim). Reported once, as soon as it is known: usually before the load
            is in ``finished_recving`` (the token does not depend on the local KV, so the
            scheduler appends it at once, while the blocks are still being read, instead of
            recomputing the last prompt token; a whole-prompt load without an entry recomputes
            that token).
        remote_clock_offsets: remote ``time.time()`` minus local ``time.time()`` (seconds) per
            remote endpoint key ``(engine_id, host, port)``, measured at new handshakes (for the
            connector's scheduler side; not sent to the front end).
        load_errors: request_id -> why its load failed (for the error message), for the failed
            loads among ``finished_recving``.
        partial_loads: request_id -> how many of its load's blocks (counted from the load's
            first block) hold the KV, for the loads among ``finished_recving`` that brought
            fewer blocks than planned (the owner holds only the leading ones now: a decoder's
            restored turn lease), or none (a pull given up: its claim waited longer than
            computing its tokens takes). Not a failure: the scheduler marks the tokens of those
            blocks computed and computes the rest; the load's other blocks stay the request's.
        stats: connector statistics for the front end's metrics (JSON-serialisable).
        demoted_turns: a decoder's turn leases that gave up their GPU blocks (the scheduler
            frees them into the prefix cache; the lease lives on until its TTL).
        kept_turns: turn leases asked to demote that refused (a granted claim's READ may be
            under way, or the lease is gone): they keep their GPU blocks.
        turns_to_restore: demoted turn leases a reader's claim waits for (the scheduler brings
            their blocks back, :mod:`pdserve.engine.turn_demotion`).
        restored_turns: demoted turn leases that took the blocks their KV was restored into.
        failed_turns: demoted turn leases that could not take them (the lease ended here).

    At TP > 1 each rank reports its own turn leases; the executor merges them
    (:mod:`pdserve.executor.kv_merge`): a turn is demoted or restored once every rank said so,
    kept once every rank answered and one refused, failed as soon as one rank failed. A partial
    load is merged as the fewest blocks any rank loaded.
    """

    finished_sending: set[str] = field(default_factory=set)
    finished_recving: set[str] = field(default_factory=set)
    invalid_block_ids: set[int] = field(default_factory=set)
    first_tokens: dict[str, int] = field(default_factory=dict)
    remote_clock_offsets: dict[tuple[str, str, int], float] = field(default_factory=dict)
    load_errors: dict[str, KVLoadError] = field(default_factory=dict)
    partial_loads: dict[str, int] = field(default_factory=dict)
    stats: dict[str, Any] | None = None
    demoted_turns: set[str] = field(default_factory=set)
    kept_turns: set[str] = field(default_factory=set)
    turns_to_restore: set[str] = field(default_factory=set)
    restored_turns: set[str] = field(default_factory=set)
    failed_turns: set[str] = field(default_factory=set)


@dataclass
class ModelRunnerOutput:
    """What the runner produced for one step.

    Attributes:
        sampled_token_ids: request_id -> sampled token, only for requests with ``sample=True``.
        sampled_token_id_lists: request_id -> the ``num_steps`` tokens of a multi-step round, in
            order (instead of ``sampled_token_ids``).
        logprobs: request_id -> logprobs of that token, only when the request asked for logprobs.
        kv_connector_output: the connector's report, or None without a connector.
        kv_tier_report: the KV cache tiers' report (finished and failed loads, copy times),
            or None without tiers.
    """

    sampled_token_ids: dict[str, int] = field(default_factory=dict)
    sampled_token_id_lists: dict[str, list[int]] = field(default_factory=dict)
    logprobs: dict[str, TokenLogprobs] = field(default_factory=dict)
    kv_connector_output: KVConnectorOutput | None = None
    kv_tier_report: KVTierReport | None = None


@dataclass
class EngineCoreOutput:
    """Per-request delta sent from the engine core to the front end after a step.

    Attributes:
        request_id: the request.
        new_token_ids: tokens generated in this step (usually one).
        new_logprobs: logprobs for ``new_token_ids`` when requested.
        finish_reason: ``stop``, ``length``, ``abort`` or ``error`` when finished, else None.
        stop_reason: the stop token id that ended the request, if any.
        num_prompt_tokens: prompt length.
        num_cached_tokens: prompt tokens served from the local prefix cache.
        num_transferred_tokens: prompt tokens whose KV came from another instance.
        kv_transfer_params: params to return to the client (on the finishing output).
        error: human-readable reason when ``finish_reason == "error"``.
        kv_load_failure: why the request's KV load failed, when that is the error (the front
            end's HTTP status depends on it).
    """

    request_id: str
    new_token_ids: list[int] = field(default_factory=list)
    new_logprobs: list[TokenLogprobs] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    num_transferred_tokens: int = 0
    kv_transfer_params: dict[str, Any] | None = None
    kv_load_failure: KVLoadFailure | None = None
    error: str | None = None


class PendingStep(Protocol):
    """A step launched by ``runner.execute_async(sched_out)`` whose results the host reads later
    (async scheduling, :mod:`pdserve.engine.async_scheduling`).

    Attributes:
        kv_connector_output: the KV connector's report taken at launch (``get_finished``), or
            None without a connector.
        kv_tier_report: the KV cache tiers' report taken at launch, or None without tiers.

    Neither report depends on the step's device work: the engine core applies them as soon as
    the step is launched (``Scheduler.apply_reports``), not with its tokens."""

    kv_connector_output: KVConnectorOutput | None
    kv_tier_report: KVTierReport | None

    def result(self) -> ModelRunnerOutput:
        """Wait for the step's sampled tokens (on CUDA: its event) and return the step's
        output, as ``runner.execute(sched_out)`` would have (with the launch's reports)."""
        ...
