"""Per-step metadata that the NIXL connector's scheduler side hands to its worker side.

Pure Python (no torch). The scheduler side builds one :class:`NixlConnectorMetadata` per engine
step; the worker side acts on it in ``start_load_kv`` / ``get_finished``.
"""

from __future__ import annotations

import hashlib
import struct

from dataclasses import dataclass, field
from typing import Any, Sequence

from pdserve.kv_transfer.nixl.prefix_match import BlockHashError, parse_block_hashes


class KVTransferParamsError(ValueError):
    """``kv_transfer_params`` that name a remote instance but lack or mistype a field."""


MAX_KV_CACHE_GROUPS = 1  # models served today have one KV-cache group


def parse_block_id_groups(value: Any) -> list[list[int]]:
    """``remote_block_ids`` in either form: flat (``[0, 15, 16]``, one group) or per
    KV-cache group (``[[0, 15, 16]]``, vLLM's current form).

    Returns:
        One list of non-negative block ids per group.

    Raises:
        KVTransferParamsError: not a list of non-negative integers nor a list of such lists,
            or more groups than :data:`MAX_KV_CACHE_GROUPS` (no served model has several).
    """
    def ids(items: Any) -> bool:
        return isinstance(items, list) and all(
            isinstance(b, int) and not isinstance(b, bool) and b >= 0 for b in items)

    if isinstance(value, list) and value and all(isinstance(g, list) for g in value):
        if not all(ids(g) for g in value):
            raise KVTransferParamsError(
                "kv_transfer_params.remote_block_ids must be a list of non-negative integers "
                "or a list of such lists (one per KV-cache group)")
        if len(value) > MAX_KV_CACHE_GROUPS:
            raise KVTransferParamsError(
                f"kv_transfer_params.remote_block_ids names {len(value)} KV-cache groups; this "
                f"model has {MAX_KV_CACHE_GROUPS}")
        return [list(g) for g in value]
    if not ids(value):
        raise KVTransferParamsError(
            "kv_transfer_params.remote_block_ids must be a list of non-negative integers "
            "or a list of such lists (one per KV-cache group)")
    return [list(value)]


@dataclass(frozen=True)
class RemoteEndpoint:
    """Where a remote engine's side channel listens, and who it claims to be.

    Attributes:
        engine_id: the remote instance's ``engine_id``.
        host: side-channel host.
        port: side-channel TCP port.
    """

    engine_id: str
    host: str
    port: int

    @property
    def key(self) -> tuple[str, str, int]:
        return (self.engine_id, self.host, self.port)


@dataclass
class RemoteKVRef:
    """A remote instance's KV for one request, parsed from ``kv_transfer_params``.

    Attributes:
        endpoint: the remote instance.
        request_id: the request id on the remote instance (``remote_request_id``).
        block_ids: the remote block table covering the remote request's computed tokens (of
            the one KV-cache group; ``remote_block_ids`` in the flat or the per-group form,
            see :func:`parse_block_id_groups`).
        num_tokens: tokens whose KV the remote holds (``remote_num_tokens``), or None when the
            params do not say (P→D: the whole prompt).
        block_hashes: chained per-block token hashes of the remote's full blocks, when given
            (parsed from hex strings or integers, see
            :mod:`pdserve.kv_transfer.nixl.prefix_match`).
        expiry_time: the remote's wall-clock time (``time.time()`` seconds) at which its blocks
            are freed, when given.
    """

    endpoint: RemoteEndpoint
    request_id: str
    block_ids: list[int]
    num_tokens: int | None = None
    block_hashes: list[int] | None = None
    expiry_time: float | None = None

    @classmethod
    def from_params(cls, params: dict[str, Any]) -> "RemoteKVRef":
        """Parse the remote fields of ``kv_transfer_params`` (unknown extra fields are ignored).

        Raises:
            KVTransferParamsError: a required field is missing or has the wrong type.
        """
        def need(name: str, types: type | tuple[type, ...]) -> Any:
            if name not in params or params[name] is None:
                raise KVTransferParamsError(f"kv_transfer_params lacks {name!r}")
            value = params[name]
            if not isinstance(value, types) or isinstance(value, bool):
                raise KVTransferParamsError(
                    f"kv_transfer_params.{name} has the wrong type ({type(value).__name__})"
                )
            return value

        engine_id = need("remote_engine_id", str)
        host = need("remote_host", str)
        port = need("remote_port", int)
        if not 0 < port < 65536:
            raise KVTransferParamsError(f"kv_transfer_params.remote_port {port} is out of range")
        request_id = need("remote_request_id", str)
        (block_ids,) = parse_block_id_groups(need("remote_block_ids", list))
        num_tokens = params.get("remote_num_tokens")
        if num_tokens is not None and (not isinstance(num_tokens, int) or num_tokens < 0):
            raise KVTransferParamsError("kv_transfer_params.remote_num_tokens must be an integer")
        hashes = params.get("remote_block_hashes")
        if hashes is not None:
            try:
                hashes = parse_block_hashes(hashes)
            except BlockHashError as e:
                raise KVTransferParamsError(str(e)) from None
        tp_size = params.get("tp_size")  # returned as vLLM returns it; the handshake is read
        if tp_size is not None and (not isinstance(tp_size, int) or isinstance(tp_size, bool)
                                    or tp_size < 1):
            raise KVTransferParamsError("kv_transfer_params.tp_size must be a positive integer")
        expiry = params.get("remote_blocks_expiry_time")
        if expiry is not None and (not isinstance(expiry, (int, float)) or isinstance(expiry, bool)):
            raise KVTransferParamsError(
                "kv_transfer_params.remote_blocks_expiry_time must be a number"
            )
        return cls(
            endpoint=RemoteEndpoint(engine_id=engine_id, host=host, port=port),
            request_id=request_id,
            block_ids=list(block_ids),
            num_tokens=num_tokens,
            block_hashes=list(hashes) if hashes is not None else None,
            expiry_time=float(expiry) if expiry is not None else None,
        )


def token_digest(token_ids: Sequence[int]) -> str:
    """SHA-256 (hex) of token ids (as little-endian int64): what a KV reader and the blocks'
    owner compare in a lease claim, so that KV is only read into a request whose tokens are the
    ones it was computed from."""
    return hashlib.sha256(struct.pack(f"<{len(token_ids)}q", *token_ids)).hexdigest()


@dataclass
class RecvSpec:
    """One asynchronous KV load: read ``remote_block_ids[i]`` into ``local_block_ids[i]``.

    Attributes:
        request_id: the local request id.
        remote: the remote request (its full block table is sent in the lease claim).
        local_block_ids: local destination blocks, in token order.
        remote_read_block_ids: remote source blocks, same length and order.
        num_tokens: tokens this load makes computed (for logs).
        error: set when the load is known to fail before any I/O (bad params); the worker
            reports it as a failed load.
        min_lease_left_s: the READ is posted only when the owner's claim answer says its blocks
            live at least this many more seconds (bidirectional pulls from D's TTL blocks);
            0 for no check.
        digest_tokens: the reader's tokens up to the end of what it loads (positions
            ``0 .. digest_tokens - 1``), whose :func:`token_digest` the claim carries.
        token_digest: :func:`token_digest` of those tokens ("" for none).
        first_token: the prefiller's first output token as the client relayed it, when the
            load brings the whole prompt and the request may start with that token; the
            worker reports the owner's own token (from the claim answer) in
            ``KVConnectorOutput.first_tokens`` and fails the load when the two differ.
    """

    request_id: str
    remote: RemoteKVRef | None
    local_block_ids: list[int]
    remote_read_block_ids: list[int]
    num_tokens: int
    error: str | None = None
    min_lease_left_s: float = 0.0
    digest_tokens: int = 0
    token_digest: str = ""
    first_token: int | None = None


@dataclass
class SendSpec:
    """Blocks this instance keeps for a remote reader.

    Attributes:
        request_id: the local request id (the ``remote_request_id`` the reader will name).
        block_ids: the blocks kept, in token order.
        lease_duration: seconds to keep them without a heartbeat or read.
        renew_on_heartbeat: heartbeats extend the lease (P→D leases) or not (D's TTL blocks).
        token_ids: the tokens whose KV the blocks hold, in order; a claim must carry the
            :func:`token_digest` of a prefix of them (None: no check).
        first_token: the first output token sampled after those tokens (a prefiller's), told
            to the reader in the claim answer; None when there is none.
    """

    request_id: str
    block_ids: list[int]
    lease_duration: float
    renew_on_heartbeat: bool = True
    token_ids: list[int] | None = None
    first_token: int | None = None


@dataclass
class RemoteNotice:
    """A control notification to a remote instance about one of its requests.

    Attributes:
        remote: the remote request.
        kind: ``"abort"`` (this instance will not read; free the blocks) or ``"done"``.
        tp_rank: the remote TP rank to tell, or None for every remote rank this rank notifies
            (:func:`~pdserve.kv_transfer.nixl.tp_plan.notice_targets`).
    """

    remote: RemoteKVRef
    kind: str
    tp_rank: int | None = None


@dataclass
class NixlConnectorMetadata:
    """What the worker side must do this step.

    Attributes:
        reqs_to_recv: loads to start (after the scheduler allocated their blocks).
        reqs_to_send: finished requests whose blocks this instance keeps for a remote reader.
        notices: control notifications to send (abort before read, release).
        heartbeat_start: requests waiting in the local queue whose remote lease must be kept
            alive (request_id -> remote request).
        heartbeat_stop: requests that no longer need heartbeats.
        aborted_recvs: requests finished locally while their load was planned or in flight;
            the worker reports each in ``finished_recving`` once no READ writes its blocks.
        release_sends: leases to drop now (the local side decided the blocks are not needed).
        handshakes: remote instances to handshake with ahead of time.
        expired_pulls: bidirectional pulls skipped because the decoder's blocks expire too soon
            (counted by the worker as expired requests).
    """

    reqs_to_recv: dict[str, RecvSpec] = field(default_factory=dict)
    reqs_to_send: dict[str, SendSpec] = field(default_factory=dict)
    notices: list[RemoteNotice] = field(default_factory=list)
    heartbeat_start: dict[str, RemoteKVRef] = field(default_factory=dict)
    heartbeat_stop: set[str] = field(default_factory=set)
    aborted_recvs: set[str] = field(default_factory=set)
    release_sends: set[str] = field(default_factory=set)
    handshakes: list[RemoteEndpoint] = field(default_factory=list)
    expired_pulls: int = 0

    def is_empty(self) -> bool:
        return not (
            self.reqs_to_recv or self.reqs_to_send or self.notices or self.heartbeat_start
            or self.heartbeat_stop or self.aborted_recvs or self.release_sends or self.handshakes
            or self.expired_pulls
        )
