"""Messages between the front end (:class:`pdserve.engine.async_engine.AsyncEngine`) and the
engine-core process, encoded with msgspec's MessagePack codec.

Two ZMQ sockets per engine core (``ipc://`` for a core on the API server's host, ``tcp://``
for a data-parallel rank on another host), both bound by the front end:

* input (front end PUSH -> core PULL): :data:`CoreInput` = ``AddRequest | AbortRequests |
  ReleaseEarly | Shutdown | Ping``;
* output (core PUSH -> front end PULL): :data:`CoreMessage` = ``Ready | StartupFailed |
  StepOutputs | CoreFailed``.

The structs are tagged (field ``type``) so one decoder handles each direction.

A remote rank (``CoreAddresses.remote``) cannot be watched as a child process: the front end
sends it a :class:`Ping` and the core an empty :class:`StepOutputs` every
:data:`HEARTBEAT_INTERVAL_S` while nothing else was sent; either side treats
:data:`HEARTBEAT_TIMEOUT_S` of silence as the other's death.

Rendezvous of multi-host data parallelism (a headless host's REQ -> the head's ROUTER at
``--data-parallel-address:--data-parallel-rpc-port``): :class:`JoinRequest` ->
:class:`JoinReply`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Union

import msgspec

from pdserve.types.outputs import EngineCoreOutput
from pdserve.types.sampling_params import SamplingParams
from pdserve.types.kv_params import KVTransferParams


@dataclass(frozen=True)
class CoreAddresses:
    """ZMQ endpoints of one engine core (``ipc://`` paths in a private temp directory)."""

    input_address: str
    output_address: str
    remote: bool = False  # a rank on another host: liveness by heartbeats


# Seconds between heartbeats to and from a remote rank, and of silence that means death.
HEARTBEAT_INTERVAL_S = 1.0
HEARTBEAT_TIMEOUT_S = 10.0


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


class ReleaseEarly(msgspec.Struct, tag="release_early"):
    """The proxy's early release of a finished prefill's held blocks, which its decode leg
    will not read (``POST /v1/kv_transfer/release``): the connector's scheduler side ends the
    hold when it is of exactly ``block_ids`` for ``request_id``, otherwise nothing happens
    (:mod:`pdserve.kv_transfer.nixl.release`)."""

    request_id: str
    block_ids: list[int]


class Shutdown(msgspec.Struct, tag="shutdown"):
    """Stop the core loop and exit."""


class Ping(msgspec.Struct, tag="ping"):
    """Heartbeat of the front end to a remote rank (no other effect)."""


class Ready(msgspec.Struct, tag="ready"):
    """The core finished starting.

    Attributes:
        model_info: ``dataclasses.asdict`` of :class:`pdserve.types.model_info.ModelInfo`.
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


class JoinRequest(msgspec.Struct, tag="join"):
    """A headless host's rank asks the head for its sockets.

    Attributes:
        rank: the data-parallel rank.
        data_parallel_size: the size the joining host was started with (must match).
        model: the served model name (must match).
        side_channel_host: the NIXL side-channel host the rank advertises ("" without a KV
            connector); a loopback address is refused, remote peers could not reach it.
    """

    rank: int
    data_parallel_size: int
    model: str
    side_channel_host: str = ""


class JoinReply(msgspec.Struct, tag="join_reply"):
    """The head's answer: the rank's input/output ZMQ addresses, or why it is refused."""

    ok: bool
    reason: str = ""
    input_address: str = ""
    output_address: str = ""


CoreInput = Union[AddRequest, AbortRequests, ReleaseEarly, Shutdown, Ping]
CoreMessage = Union[Ready, StartupFailed, StepOutputs, CoreFailed]


def make_encoder() -> msgspec.msgpack.Encoder:
    return msgspec.msgpack.Encoder()


def make_input_decoder() -> msgspec.msgpack.Decoder:
    return msgspec.msgpack.Decoder(CoreInput)


def make_output_decoder() -> msgspec.msgpack.Decoder:
    return msgspec.msgpack.Decoder(CoreMessage)
