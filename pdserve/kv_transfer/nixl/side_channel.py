"""The NIXL side channel: a small ZMQ request/reply service every connector worker runs.

Each instance (prefiller and decoder alike, so KV can move in both directions) binds a ZMQ
``ROUTER`` socket on its side-channel host/port and answers msgpack-encoded requests from other
instances' ``REQ`` sockets:

``{"type": "get_info"}``
    -> ``{"ok": True, "info": {...}}``: the NIXL agent name and metadata, the KV cache base
    address, ``block_bytes``, ``num_blocks``, memory type and device id, the compatibility
    fields and their hash, the lease duration and the server's wall clock (for clock offsets).
``{"type": "claim", "request_id": str, "block_ids": [int]}``
    -> ``{"ok": bool, "reason": str, "lease_expiry_in": float}``: before reading, the reader
    checks that the owner still holds exactly these blocks for that request, and extends the
    lease for the read. A claim for a request the owner does not know yet (its lease is
    registered one engine step after the request finished) is answered when it appears, or
    rejected after ``claim_wait_s``.
``{"type": "notify", "kind": "abort"|"done"|"heartbeat", "request_id": str}``
    -> ``{"ok": True}``: the same control messages as the NIXL notifications, for readers
    that could not load this agent's metadata (for example after a compatibility mismatch).

The reader side (:func:`side_channel_request`) runs in background threads only, never on the
engine loop.
"""

from __future__ import annotations

import hashlib
import json
import logging
import socket
import threading
import time
from typing import Any, Callable

import msgspec
import zmq

from pdserve.kv_transfer.base import KVCacheSpec

logger = logging.getLogger(__name__)

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder()

PROTOCOL_VERSION = 1


class SideChannelError(RuntimeError):
    """A side-channel request failed: no answer in time, or a malformed answer."""


class SideChannelTimeout(SideChannelError):
    """The remote side channel did not answer in time (remote down or unreachable)."""


class SideChannelBindError(RuntimeError):
    """The side channel could not listen on its host/port (for example: port in use)."""


def compat_fields(spec: KVCacheSpec, tp_size: int = 1) -> dict[str, Any]:
    """The KV cache properties two instances must share for one to read the other's blocks."""
    return {
        "protocol": PROTOCOL_VERSION,
        "model": spec.model_name,
        "dtype": spec.dtype,
        "num_layers": spec.num_layers,
        "num_kv_heads": spec.num_kv_heads,
        "head_dim": spec.head_dim,
        "block_size": spec.block_size,
        "layout": spec.layout,
        "tp_size": tp_size,
    }


def compat_hash(fields: dict[str, Any]) -> str:
    """SHA-256 (hex) of the canonical JSON of :func:`compat_fields`."""
    return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()


def compat_mismatch(local: dict[str, Any], remote: dict[str, Any]) -> str:
    """Human-readable list of differing compatibility fields (empty when equal)."""
    diffs = [
        f"{k}: local={local.get(k)!r} remote={remote.get(k)!r}"
        for k in sorted(set(local) | set(remote))
        if local.get(k) != remote.get(k)
    ]
    return "; ".join(diffs)


def _bind_address(host: str) -> str:
    try:
        return socket.gethostbyname(host)
    except OSError:
        return host


def side_channel_request(host: str, port: int, message: dict[str, Any], timeout_s: float,
                         context: zmq.Context | None = None) -> dict[str, Any]:
    """Send one request to a side channel and wait for its answer (call from a background
    thread).

    Args:
        host, port: the remote side channel.
        message: the request (see the module docstring).
        timeout_s: seconds to wait for the answer.
        context: a shared ZMQ context (thread-safe); the global instance by default.

    Raises:
        SideChannelTimeout: no answer within ``timeout_s``.
        SideChannelError: an undecodable answer or a socket error.
    """
    ctx = context or zmq.Context.instance()
    sock = ctx.socket(zmq.REQ)
    sock.setsockopt(zmq.LINGER, 0)
    endpoint = f"tcp://{host}:{port}"
    try:
        sock.connect(endpoint)
        sock.send(_encoder.encode(message))
        if not sock.poll(int(timeout_s * 1000), zmq.POLLIN):
            raise SideChannelTimeout(
                f"no answer from the NIXL side channel {endpoint} within {timeout_s:g} s "
                f"(is the remote instance running with a kv-transfer config?)"
            )
        raw = sock.recv()
    except zmq.ZMQError as e:
        raise SideChannelError(f"side channel {endpoint}: {e}") from e
    finally:
        sock.close(linger=0)
    try:
        reply = _decoder.decode(raw)
    except msgspec.DecodeError as e:
        raise SideChannelError(f"malformed answer from side channel {endpoint}: {e}") from e
    if not isinstance(reply, dict):
        raise SideChannelError(f"malformed answer from side channel {endpoint}")
    return reply


ClaimResult = tuple[str, str, float]  # ("ok"|"wait"|"reject", reason, lease seconds left)


class SideChannelServer:
    """Serves this instance's side channel from a daemon thread.

    Args:
        host: host name or address to listen on (resolved to an address).
        port: TCP port.
        get_info: returns the ``get_info`` payload, or None while the KV cache is not
            registered yet.
        claim: ``claim(request_id, block_ids) -> (status, reason, lease_left_s)`` with status
            ``"ok"``, ``"wait"`` (unknown yet, ask again) or ``"reject"``; called on the server
            thread, so it must be thread-safe.
        notify: ``notify(kind, request_id)``; thread-safe.
        claim_wait_s: how long a ``"wait"`` claim is retried before it is rejected.

    Raises:
        SideChannelBindError: the port is in use or the address cannot be bound.
    """

    def __init__(
        self,
        host: str,
        port: int,
        get_info: Callable[[], dict[str, Any] | None],
        claim: Callable[[str, list[int]], ClaimResult],
        notify: Callable[[str, str], None],
        claim_wait_s: float = 5.0,
    ):
        self.host = host
        self.port = port
        self._get_info = get_info
        self._claim = claim
        self._notify = notify
        self._claim_wait_s = claim_wait_s
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        address = f"tcp://{_bind_address(host)}:{port}"
        try:
            self._sock.bind(address)
        except zmq.ZMQError as e:
            self._sock.close(linger=0)
            self._ctx.term()
            hint = (
                "the port is already in use; give each instance (and each data-parallel rank) "
                "its own port with PDSERVE_NIXL_SIDE_CHANNEL_PORT"
                if e.errno == zmq.EADDRINUSE
                else "check PDSERVE_NIXL_SIDE_CHANNEL_HOST"
            )
            raise SideChannelBindError(
                f"cannot listen for the NIXL side channel on {address} ({e}): {hint}"
            ) from e
        self._stop = threading.Event()
        # (identity, request_id, block_ids, deadline) of claims answered "wait"
        self._pending_claims: list[tuple[bytes, str, list[int], float]] = []
        self._thread = threading.Thread(
            target=self._serve, name=f"nixl-side-channel-{port}", daemon=True
        )
        self._thread.start()
        logger.info("NIXL side channel listening on %s", address)

    def _reply(self, ident: bytes, payload: dict[str, Any]) -> None:
        self._sock.send_multipart([ident, b"", _encoder.encode(payload)])

    def _handle(self, ident: bytes, raw: bytes) -> None:
        try:
            msg = _decoder.decode(raw)
            kind = msg.get("type") if isinstance(msg, dict) else None
        except msgspec.DecodeError:
            kind = None
        if kind == "get_info":
            info = self._get_info()
            if info is None:
                self._reply(ident, {"ok": False, "reason": "KV cache not registered yet"})
            else:
                self._reply(ident, {"ok": True, "info": dict(info, time=time.time())})
        elif kind == "claim":
            req_id, block_ids = msg.get("request_id"), msg.get("block_ids")
            if not isinstance(req_id, str) or not isinstance(block_ids, list):
                self._reply(ident, {"ok": False, "reason": "malformed claim"})
                return
            self._try_claim(ident, req_id, block_ids, time.monotonic() + self._claim_wait_s)
        elif kind == "notify":
            req_id, note = msg.get("request_id"), msg.get("kind")
            if isinstance(req_id, str) and isinstance(note, str):
                self._notify(note, req_id)
                self._reply(ident, {"ok": True})
            else:
                self._reply(ident, {"ok": False, "reason": "malformed notify"})
        else:
            self._reply(ident, {"ok": False, "reason": f"unknown request type {kind!r}"})

    def _try_claim(self, ident: bytes, req_id: str, block_ids: list[int], deadline: float) -> None:
        status, reason, left = self._claim(req_id, block_ids)
        if status == "wait" and time.monotonic() < deadline:
            self._pending_claims.append((ident, req_id, block_ids, deadline))
            return
        if status == "wait":
            status = "reject"
        self._reply(ident, {"ok": status == "ok", "reason": reason, "lease_expiry_in": left})

    def _serve(self) -> None:
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        while not self._stop.is_set():
            timeout_ms = 5 if self._pending_claims else 100
            try:
                events = dict(poller.poll(timeout_ms))
            except zmq.ZMQError:
                break
            if self._sock in events:
                try:
                    frames = self._sock.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    frames = None
                if frames and len(frames) == 3:
                    try:
                        self._handle(frames[0], frames[2])
                    except Exception:  # a bad peer must not kill the side channel
                        logger.exception("NIXL side channel: error while handling a request")
            if self._pending_claims:
                pending, self._pending_claims = self._pending_claims, []
                for ident, req_id, block_ids, deadline in pending:
                    self._try_claim(ident, req_id, block_ids, deadline)
        self._sock.close(linger=0)

    def close(self) -> None:
        """Stop the thread and release the port."""
        self._stop.set()
        self._thread.join(timeout=5)
        self._ctx.term()
