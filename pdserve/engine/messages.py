"""Messages between the front end (:class:`pdserve.engine.async_engine.AsyncEngine`) and the
engine-core process, encoded with msgspec's MessagePack codec.

Two ZMQ ``ipc://`` sockets, both bound by the front end:

* input (front end PUSH -> core PULL): :data:`CoreInput` = ``AddRequest | AbortRequests |
  Shutdown``;
* output (core PUSH -> front end PULL): :data:`CoreMessage` = ``Ready | StartupFailed |
  StepOutputs | CoreFailed``.

The structs are tagged (field ``type``) so one decoder handles each direction.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Union

import msgspec

from pdserve.engine.outputs import EngineCoreOutput
from pdserve.engine.sampling_params import SamplingParams
from pdserve.kv_transfer.params import KVTransferParams


@dataclass(frozen=True)
class CoreAddresses:
    """ZMQ endpoints of one engine core (``ipc://`` paths in a private temp directory)."""

    input_address: str
    output_address: str


class AddRequest(msgspec.Struct, tag="add"):
    """A new request for the core (``kv_transfer_params`` parsed by the front end)."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_id: int | None = None
    kv_transfer_params: KVTransferParams | None = None


class AbortRequests(msgspec.Struct, tag="abort"):
    """Abort these requests (unknown ids are ignored)."""

    request_ids: list[str]


class Shutdown(msgspec.Struct, tag="shutdown"):
    """Stop the core loop and exit."""


class Ready(msgspec.Struct, tag="ready"):
    """The core finished starting.

    Attributes:
        model_info: ``dataclasses.asdict`` of :class:`pdserve.model_info.ModelInfo`.
        num_blocks: KV cache blocks.
        block_size: tokens per block.
        max_model_len: the effective max_model_len (tokens).
    """

    model_info: dict[str, Any]
    num_blocks: int
    block_size: int
    max_model_len: int


class StartupFailed(msgspec.Struct, tag="startup_failed"):
    """The core could not start (bad model path, bad config, not enough memory...)."""

    message: str
    traceback: str = ""


class StepOutputs(msgspec.Struct, tag="outputs"):
    """Outputs of one or more engine steps.

    Attributes:
        outputs: per-request deltas in step order.
        stats: the scheduler's :meth:`~pdserve.engine.scheduler.Scheduler.stats` snapshot, or None
            when unchanged.
        connector_stats: connector stats deltas (``KVConnectorOutput.stats``), forwarded as is.
    """

    outputs: list[EngineCoreOutput] = []
    stats: dict[str, Any] | None = None
    connector_stats: list[dict[str, Any]] = []


class CoreFailed(msgspec.Struct, tag="core_failed"):
    """The core hit a fatal error while running and is exiting."""

    message: str
    traceback: str = ""


CoreInput = Union[AddRequest, AbortRequests, Shutdown]
CoreMessage = Union[Ready, StartupFailed, StepOutputs, CoreFailed]


def make_encoder() -> msgspec.msgpack.Encoder:
    return msgspec.msgpack.Encoder()


def make_input_decoder() -> msgspec.msgpack.Decoder:
    return msgspec.msgpack.Decoder(CoreInput)


def make_output_decoder() -> msgspec.msgpack.Decoder:
    return msgspec.msgpack.Decoder(CoreMessage)
