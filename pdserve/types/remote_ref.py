"""What ``kv_transfer_params`` name on another instance: its endpoint, its blocks (in block-id
groups), and the digest of the tokens they hold.
"""

from __future__ import annotations

import hashlib
import sys
from array import array
from dataclasses import dataclass
from typing import Any, Sequence

from pdserve.types.block_hash import BlockHashError, parse_block_hashes


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
        transfer_id: the router's id of a concurrent hand-off (``remote_transfer_id``,
            docs/proxy.md "Concurrent hand-off"), or None. A reference with it and no blocks
            is *pending*: the prefiller is still computing, and its request id and block ids
            come from its answer to the reader's pending claim (:meth:`resolved`).
    """

    endpoint: RemoteEndpoint
    request_id: str
    block_ids: list[int]
    num_tokens: int | None = None
    block_hashes: list[int] | None = None
    expiry_time: float | None = None
    transfer_id: str | None = None

    @property
    def pending(self) -> bool:
        """True while the remote request and its blocks are not known yet (a concurrent
        hand-off before the prefiller's claim answer)."""
        return self.transfer_id is not None and not self.request_id

    def resolved(self, request_id: str, block_ids: list[int]) -> "RemoteKVRef":
        """This pending reference completed with what the owner's claim answer named."""
        return RemoteKVRef(self.endpoint, request_id, list(block_ids), self.num_tokens,
                           self.block_hashes, self.expiry_time, self.transfer_id)

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
        host = check_host(need("remote_host", str), "remote_host")
        port = need("remote_port", int)
        if not 0 < port < 65536:
            raise KVTransferParamsError(f"kv_transfer_params.remote_port {port} is out of range")
        transfer_id = params.get("remote_transfer_id")
        if transfer_id is not None:
            transfer_id = check_transfer_id(transfer_id, "remote_transfer_id")
        if transfer_id is not None and params.get("remote_block_ids") is None \
                and params.get("remote_request_id") is None:
            # a concurrent hand-off: the prefiller names its request and blocks when it holds them
            request_id, block_ids = "", []
        else:
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
            transfer_id=transfer_id,
        )


#: The longest ``transfer_id`` accepted (the router draws 32 hex digits).
MAX_TRANSFER_ID_CHARS = 128


def check_transfer_id(value: Any, name: str) -> str:
    """A concurrent hand-off's transfer id as received in ``kv_transfer_params.<name>``.

    Raises:
        KVTransferParamsError: not a string of 1..:data:`MAX_TRANSFER_ID_CHARS` characters from
            ``[A-Za-z0-9_-]``.
    """
    if not isinstance(value, str) or not 0 < len(value) <= MAX_TRANSFER_ID_CHARS or \
            not all(c.isascii() and (c.isalnum() or c in "-_") for c in value):
        raise KVTransferParamsError(
            f"kv_transfer_params.{name} must be a string of 1 to {MAX_TRANSFER_ID_CHARS} "
            "letters, digits, '-' or '_'")
    return value


#: Longest host name (RFC 1035 section 2.3.4: 253 characters written out).
MAX_HOST_CHARS = 253


def check_host(value: str, name: str) -> str:
    """A side-channel host as the params may name it: a DNS name or an IPv4 address (labels of
    ASCII letters, digits and ``-``, not starting or ending with ``-``, joined by dots; RFC 1123
    section 2.1). Checked at the edge because the engine thread connects to it by ZMQ, which
    refuses other strings (spaces, ``*``, a newline). IPv6 literals are not supported by the
    side channel (its addresses are ``tcp://host:port``).

    Raises:
        KVTransferParamsError: ``value`` is no such name.
    """
    labels = value.split(".")
    if not 0 < len(value) <= MAX_HOST_CHARS or not all(
            0 < len(label) <= 63 and label[0] != "-" and label[-1] != "-"
            and all(c.isascii() and (c.isalnum() or c == "-") for c in label)
            for label in labels):
        raise KVTransferParamsError(
            f"kv_transfer_params.{name} must be a host name or an IPv4 address (letters, "
            f"digits, '-' and '.'; at most {MAX_HOST_CHARS} characters)")
    return value


def _packed(token_ids: Sequence[int]) -> bytes:
    """Token ids as little-endian int64 bytes (:func:`token_digest`'s input)."""
    arr = array("q", token_ids)
    if sys.byteorder != "little":  # pragma: no cover - every supported platform is little-endian
        arr.byteswap()
    return arr.tobytes()


def token_digest(token_ids: Sequence[int]) -> str:
    """SHA-256 (hex) of token ids (as little-endian int64): what a KV reader and the blocks'
    owner compare in a lease claim, so that KV is only read into a request whose tokens are the
    ones it was computed from."""
    return hashlib.sha256(_packed(token_ids)).hexdigest()


@dataclass(frozen=True)
class PackedTokens:
    """An owner's tokens packed once (as :func:`token_digest` hashes them), so that a claim's
    digest of a prefix hashes bytes: a lease of 16k tokens answers a claim in about 0.1 ms
    instead of packing the token list again (0.5-0.7 ms on the development machine), on the
    hand-off's critical path (docs/benchmarks.md).

    Attributes:
        data: the tokens as little-endian int64, 8 bytes each.
    """

    data: bytes

    @classmethod
    def of(cls, token_ids: Sequence[int]) -> "PackedTokens":
        """Pack ``token_ids``."""
        return cls(_packed(token_ids))

    def __len__(self) -> int:
        return len(self.data) // 8

    def digest(self, num_tokens: int) -> str:
        """:func:`token_digest` of the first ``num_tokens`` tokens (``0 <= num_tokens <=
        len(self)``)."""
        return hashlib.sha256(memoryview(self.data)[:8 * num_tokens]).hexdigest()
