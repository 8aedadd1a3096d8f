"""Engine-side request state (pure Python, no torch)."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from pdserve.types.sampling_params import SamplingParams
from pdserve.types.kv_params import KVTransferParams


class RequestStatus(enum.Enum):
    """Life cycle of a request inside the engine core."""

    WAITING = "waiting"
    # KV is being loaded from another instance (connector); not schedulable until it lands.
    WAITING_FOR_REMOTE_KVS = "waiting_for_remote_kvs"
    # KV is being copied back from the KV cache tiers (host memory, disk); as above.
    WAITING_FOR_TIER_KVS = "waiting_for_tier_kvs"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "finished_stopped"
    FINISHED_LENGTH = "finished_length"
    FINISHED_ABORTED = "finished_aborted"
    FINISHED_ERROR = "finished_error"

    @property
    def finished(self) -> bool:
        return self.value.startswith("finished")

    @property
    def finish_reason(self) -> str | None:
        """OpenAI ``finish_reason`` for a finished status (``stop``, ``length``, ``abort``, ``error``)."""
        return {
            RequestStatus.FINISHED_STOPPED: "stop",
            RequestStatus.FINISHED_LENGTH: "length",
            RequestStatus.FINISHED_ABORTED: "abort",
            RequestStatus.FINISHED_ERROR: "error",
        }.get(self)


@dataclass(eq=False)
class Request:
    """One sequence being served by the engine core. Requests compare (and hash) by identity:
    removing one from the scheduler's queues finds it without comparing every field of the
    requests before it.

    Attributes:
        request_id: unique id (the front end derives child ids for ``n`` > 1).
        prompt_token_ids: prompt tokens, length ``num_prompt_tokens``; not changed after
            creation.
        sampling_params: how to sample and when to stop.
        kv_transfer_params: the request's parsed ``kv_transfer_params``
            (:class:`~pdserve.types.kv_params.KVTransferParams`) or None; the connector
            reads it.
        output_token_ids: generated tokens so far.
        num_computed_tokens: tokens whose KV is in this engine's cache (prefix hits, transferred
            tokens and computed tokens alike).
        num_cached_tokens: prompt tokens served from the local prefix cache (set once, at first
            scheduling); reported as ``usage.prompt_tokens_details.cached_tokens``.
        num_transferred_tokens: prompt tokens whose KV was loaded from another instance.
        block_ids: the request's block table (physical block ids, in token order).
        arrival_time: ``time.monotonic()`` at arrival (seconds).
        error: a human-readable reason when ``status`` is ``FINISHED_ERROR``.
        num_prompt_tokens: ``len(prompt_token_ids)``, set once at creation (the scheduler
            reads it several times per request and step).
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_id: int | None = None
    kv_transfer_params: KVTransferParams | None = None
    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = -1
    num_transferred_tokens: int = 0
    num_preemptions: int = 0
    block_ids: list[int] = field(default_factory=list)
    arrival_time: float = field(default_factory=time.monotonic)
    first_token_time: float | None = None
    error: str | None = None
    num_prompt_tokens: int = field(init=False)

    def __post_init__(self) -> None:
        self.num_prompt_tokens = len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        """Prompt plus generated tokens."""
        return self.num_prompt_tokens + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        """Prompt followed by output tokens (a new list)."""
        return self.prompt_token_ids + self.output_token_ids

    def token_ids(self, start: int, end: int) -> list[int]:
        """Tokens ``start .. end - 1`` of :attr:`all_token_ids` (a new list), without copying
        the whole sequence first."""
        p = self.num_prompt_tokens
        if start >= p:
            return self.output_token_ids[start - p : end - p]
        if end <= p:
            return self.prompt_token_ids[start:end]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - p]
