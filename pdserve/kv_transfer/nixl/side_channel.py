"""The NIXL side channel: a small ZMQ request/reply service every connector worker runs.

Each instance (prefiller and decoder alike, so KV can move in both directions) binds a ZMQ
``ROUTER`` socket on its side-channel host/port and answers msgpack-encoded requests from other
instances' ``REQ`` sockets:

``{"type": "get_info"[, "tp_rank": int]}``
    -> ``{"ok": True, "info": {...}}``: the compatibility fields and their hash, the lease
    duration, ``tp_size`` and ``total_num_kv_heads``, the server's wall clock (for clock offsets),
    and, for the TP rank named (default 0; rank 0 hosts the one side channel of an instance and
    answers for every rank), that rank's NIXL agent name and metadata, KV cache base address,
    ``block_bytes``, ``num_blocks``, memory type, device id, ``tp_rank`` and its global KV heads
    ``head_start``, ``num_heads``. A rank outside the instance is answered ``ok: False``.
``{"type": "claim", "request_id": str, "block_ids": [int], "num_tokens": int, "token_digest": str,
"reader": str[, "first_token_id": int]}``
    -> ``{"ok": bool, "reason": str, "lease_expiry_in": float, "instance_id": str[,
    "first_token_id": int]}``: before reading, the reader
    checks that the owner still holds exactly these blocks for that request, computed from the
    same first ``num_tokens`` tokens as the reader's (their SHA-256, ``remote_ref.token_digest``),
    and extends the lease for the read. A claim for a request the owner does not know yet (its lease is
    registered one engine step after the request finished) is answered when it appears, or
    rejected after ``claim_wait_s``. A granted claim of a prefiller's prompt carries the first
    token the prefiller sampled (the decoder uses it, not the one a client relayed). A claim of
    a decoder's turn lease whose blocks were demoted to its host tier waits while they are
    restored; its answer then carries ``"block_ids"``, the blocks that hold them now (the
    reader reads those).
    ``instance_id`` (also in ``get_info``'s info) is new at every process start: a reader whose
    handshake named another instance knows the remote restarted and handshakes again.
    ``reader`` is the reader id (:mod:`.readers`: the reader instance's ``instance_id`` and its
    request id, the same on all its TP ranks): the first granted claim binds the lease to it,
    and a claim from another reader is refused ("the blocks are leased to another reader").
    A claim without it (an older pdserve) is answered as before. ``first_token_id`` is the
    first token the reader's params relayed: a lease whose first token differs refuses the
    claim before binding it (params with a forged first token never take the lease from the
    honest reader).
``{"type": "claim", "transfer_id": str, "num_tokens": int, "token_digest": str, "wait_s": float,
"reader": str}``
    -> the claim answer above plus ``"request_id"`` and ``"block_ids"``: a *pending claim* of a
    concurrent hand-off (docs/proxy.md), naming the router's transfer id instead of a request
    and its blocks, which the reader does not know yet. It is answered when the lease of the
    request that came with that transfer id starts (the reader's tokens must match it), or
    rejected after ``wait_s`` seconds (at most :data:`MAX_PENDING_WAIT_S`) or at once when that
    lease already ended. Its ``reader`` binds the lease as a claim's does.
``{"type": "notify", "kind": "abort"|"heartbeat", "transfer_id": str[, "reader": str]}`` ->
    ``{"ok": True}``: about the lease of a pending claim's transfer. "abort": a reader gave up
    its pending claim; the lease is aborted (now, or when it starts), unless it is bound to
    another reader. "heartbeat": the reader's request still waits in its queue; the lease, once
    it has started, is renewed as by a heartbeat naming its blocks (before it starts there is
    nothing to renew).
``{"type": "notify", "kind": "abort"|"done"|"heartbeat", "request_id": str, "block_ids": [int][,
"tp_rank": int, "expected": int][, "reader": str]}``
    -> ``{"ok": True}``: the same control messages as the NIXL notifications, for readers
    that could not load this agent's metadata (for example after a compatibility mismatch).
    A notice acts only on a lease holding exactly ``block_ids`` (:mod:`.leases`).
    Without ``tp_rank`` a notice is for every TP rank of the instance (rank 0 forwards it);
    ``expected`` is the count a "done" carries (:mod:`.notifications`); ``reader`` the sender's
    reader id (a lease bound to another reader ignores its "done" and "abort"). Any other kind is
    answered ``{"ok": False, "reason": ...}`` and applied to nothing (the proxy's early release
    reaches the owner through its own engine core, :mod:`pdserve.kv_transfer.nixl.release`).

Clients: :func:`side_channel_request` (one blocking request on a fresh ``REQ`` socket) runs in
background threads only, never on the engine loop;
:class:`~pdserve.kv_transfer.nixl.side_channel_client.SideChannelClient` sends requests
tagged with a ``seq`` (echoed in the answer) without blocking over one persistent ``DEALER``
connection per remote, for the engine thread.

The engine thread's persistent client is :mod:`.side_channel_client`; the compatibility fields
the handshake compares are :mod:`.compat`.
"""

from __future__ import annotations

import ipaddress
import logging
import socket
import threading
import time
from typing import Any, Callable

import msgspec
import zmq

from pdserve.utils import phase_trace
from pdserve.kv_transfer.nixl.claim_answer import ClaimAnswer, ClaimStatus, is_token
from pdserve.kv_transfer.nixl.notifications import NOTIF_KINDS
from pdserve.kv_transfer.nixl.readers import is_reader

logger = logging.getLogger(__name__)

encoder = msgspec.msgpack.Encoder()
decoder = msgspec.msgpack.Decoder()

class SideChannelError(RuntimeError):
    """A side-channel request failed: no answer in time, or a malformed answer."""


class SideChannelTimeout(SideChannelError):
    """The remote side channel did not answer in time (remote down or unreachable)."""


class SideChannelBindError(RuntimeError):
    """The side channel could not listen on its host/port (for example: port in use)."""


def rank_info(info: dict[str, Any], tp_rank: Any) -> dict[str, Any] | str:
    """The ``get_info`` answer for one TP rank of an instance whose info lists its ranks
    (``info["ranks"]``, by rank); an info without that list answers as is. A reason string
    when the rank is not in the instance."""
    ranks = info.get("ranks")
    if ranks is None:
        return info
    if isinstance(tp_rank, bool) or not isinstance(tp_rank, int) or \
            not 0 <= tp_rank < len(ranks):
        return f"no TP rank {tp_rank!r} in an instance of TP size {len(ranks)}"
    out = {k: v for k, v in info.items() if k != "ranks"}
    out.update(ranks[tp_rank])
    return out


def _bind_address(host: str) -> str:
    try:
        return socket.gethostbyname(host)
    except OSError:
        return host


def _is_loopback(host: str) -> bool:
    """Whether ``host`` is ``localhost`` or a loopback address (127.x, ::1)."""
    try:
        return host == "localhost" or ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


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
        sock.send(encoder.encode(message))
        if not sock.poll(int(timeout_s * 1000), zmq.POLLIN):
            raise SideChannelTimeout(
                f"no answer from the NIXL side channel {endpoint} within {timeout_s:g} s "
                + (f"({host} is a loopback address: an instance on another host must advertise "
                   "an address this host can reach; set PDSERVE_NIXL_SIDE_CHANNEL_HOST on it)"
                   if _is_loopback(host) else
                   "(is the remote instance running with a kv-transfer config?)")
            )
        raw = sock.recv()
    except zmq.ZMQError as e:
        raise SideChannelError(f"side channel {endpoint}: {e}") from e
    finally:
        sock.close(linger=0)
    try:
        reply = decoder.decode(raw)
    except msgspec.DecodeError as e:
        raise SideChannelError(f"malformed answer from side channel {endpoint}: {e}") from e
    if not isinstance(reply, dict):
        raise SideChannelError(f"malformed answer from side channel {endpoint}")
    return reply


#: The longest a pending claim waits for its lease (seconds), whatever the reader asks.
MAX_PENDING_WAIT_S = 600.0


class SideChannelServer:
    """Serves this instance's side channel from a daemon thread.

    Args:
        host: host name or address to listen on (resolved to an address).
        port: TCP port.
        get_info: returns the ``get_info`` payload, or None while the KV cache is not
            registered yet.
        claim: ``claim(request_id, block_ids, num_tokens, token_digest, reader=...,
            first_token=...) ->`` :class:`~pdserve.kv_transfer.nixl.leases.ClaimAnswer` (all
            but the first two as the reader sent them, or None), whose status is a
            :class:`~pdserve.kv_transfer.nixl.leases.ClaimStatus`: ``OK``, ``WAIT`` (unknown
            yet, ask again) or ``REJECT``; called on the server thread, so it must be
            thread-safe.
        notify: ``notify(kind, request_id)``, or ``notify(kind, request_id, block_ids)`` when
            the notice carries block ids, or ``notify(kind, request_id, block_ids, tp_rank,
            expected)`` when it names TP fields; each with ``reader=`` when the notice names a
            reader id; thread-safe.
        claim_wait_s: how long a ``WAIT`` claim is retried before it is rejected.
        instance_id: this process's instance id, sent with every claim answer.
        claim_transfer: ``claim_transfer(transfer_id, num_tokens, token_digest, reader=...) ->``
            :class:`~pdserve.kv_transfer.nixl.leases.ClaimAnswer`, a pending claim's answer
            (thread-safe); None: pending claims are refused.
        transfer_notice: ``transfer_notice(kind, transfer_id)`` (with ``reader=`` when the
            notice names a reader id), a reader's "abort" or "heartbeat" by transfer id
            (thread-safe); None: refused.

    Raises:
        SideChannelBindError: the port is in use or the address cannot be bound.
    """

    def __init__(
        self,
        host: str,
        port: int,
        get_info: Callable[[], dict[str, Any] | None],
        claim: Callable[..., ClaimAnswer],
        notify: Callable[[str, str], None],
        claim_wait_s: float = 5.0,
        instance_id: str = "",
        claim_transfer: Callable[..., Any] | None = None,
        transfer_notice: Callable[..., None] | None = None,
    ):
        self.host = host
        self._claim_transfer = claim_transfer
        self._transfer_notice = transfer_notice
        self.instance_id = instance_id
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
        # claims answered WAIT: each retried by calling it (it re-queues itself if still
        # waiting)
        self._pending_claims: list[Callable[[], None]] = []
        # another thread makes this readable when a lease starts: waiting claims are retried
        # at once instead of at the next poll
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._thread = threading.Thread(
            target=self._serve, name=f"nixl-side-channel-{port}", daemon=True
        )
        self._thread.start()
        logger.info("NIXL side channel listening on %s", address)

    def _reply(self, ident: bytes, payload: dict[str, Any], seq: Any = None) -> None:
        if seq is not None:
            payload = dict(payload, seq=seq)
        self._sock.send_multipart([ident, b"", encoder.encode(payload)])

    def _handle(self, ident: bytes, raw: bytes) -> None:
        try:
            msg = decoder.decode(raw)
            kind = msg.get("type") if isinstance(msg, dict) else None
        except msgspec.DecodeError:
            kind = None
        # A client that multiplexes requests on one socket tags them with "seq"; echo it.
        seq = msg.get("seq") if kind is not None else None
        reader = msg.get("reader") if kind is not None else None  # None: an older pdserve's
        first = msg.get("first_token_id") if kind == "claim" else None
        if (reader is not None and not is_reader(reader)) or \
                (first is not None and not is_token(first)):
            self._reply(ident, {"ok": False, "reason": f"malformed {kind}"}, seq)
            return
        by_reader = {} if reader is None else {"reader": reader}
        if kind == "get_info":
            info = self._get_info()
            if info is None:
                self._reply(ident, {"ok": False, "reason": "KV cache not registered yet"}, seq)
                return
            answer = rank_info(info, msg.get("tp_rank", 0))
            if isinstance(answer, str):
                self._reply(ident, {"ok": False, "reason": answer}, seq)
            else:
                self._reply(ident, {"ok": True, "info": dict(answer, time=time.time())}, seq)
        elif kind == "claim" and "transfer_id" in msg:
            phase_trace.mark("sc.claim_in")
            transfer_id, wait_s = msg.get("transfer_id"), msg.get("wait_s", self._claim_wait_s)
            if self._claim_transfer is None or not isinstance(transfer_id, str) or \
                    isinstance(wait_s, bool) or not isinstance(wait_s, (int, float)):
                self._reply(ident, {"ok": False, "reason": "malformed claim"}, seq)
                return
            deadline = time.monotonic() + min(max(float(wait_s), 0.0), MAX_PENDING_WAIT_S)
            self._try_transfer_claim(ident, transfer_id, deadline, seq,
                                     (msg.get("num_tokens"), msg.get("token_digest")),
                                     {"reader": reader})
        elif kind == "claim":
            phase_trace.mark("sc.claim_in")
            request_id, block_ids = msg.get("request_id"), msg.get("block_ids")
            if not isinstance(request_id, str) or not isinstance(block_ids, list):
                self._reply(ident, {"ok": False, "reason": "malformed claim"}, seq)
                return
            self._try_claim(ident, request_id, block_ids, time.monotonic() + self._claim_wait_s, seq,
                            (msg.get("num_tokens"), msg.get("token_digest")),
                            {"reader": reader, "first_token": first})
        elif kind == "notify" and "transfer_id" in msg:
            transfer_id, note = msg.get("transfer_id"), msg.get("kind")
            if self._transfer_notice is None or note not in ("abort", "heartbeat") or \
                    not isinstance(transfer_id, str):
                self._reply(ident, {"ok": False, "reason": "malformed notify (a notice by "
                                    "transfer id is an abort or a heartbeat)"}, seq)
                return
            self._transfer_notice(note, transfer_id, **by_reader)
            self._reply(ident, {"ok": True}, seq)
        elif kind == "notify":
            request_id, note = msg.get("request_id"), msg.get("kind")
            block_ids = msg.get("block_ids")
            tp_rank, expected = msg.get("tp_rank"), msg.get("expected", 1)
            if isinstance(note, str) and note not in NOTIF_KINDS:
                self._reply(ident, {"ok": False, "reason": f"unknown notice kind {note!r} "
                                    f"(one of {', '.join(NOTIF_KINDS)})"}, seq)
            elif "tp_rank" in msg or "expected" in msg:  # a notice for some TP rank(s)
                if isinstance(request_id, str) and isinstance(note, str) and \
                        (tp_rank is None or isinstance(tp_rank, int)) and \
                        isinstance(expected, int) and expected >= 1:
                    self._notify(note, request_id, block_ids, tp_rank, expected, **by_reader)
                    self._reply(ident, {"ok": True}, seq)
                else:
                    self._reply(ident, {"ok": False, "reason": "malformed notify"}, seq)
            elif isinstance(request_id, str) and isinstance(note, str) and block_ids is None:
                self._notify(note, request_id, **by_reader)
                self._reply(ident, {"ok": True}, seq)
            elif isinstance(request_id, str) and isinstance(note, str) and \
                    isinstance(block_ids, list):
                self._notify(note, request_id, block_ids, **by_reader)
                self._reply(ident, {"ok": True}, seq)
            else:
                self._reply(ident, {"ok": False, "reason": "malformed notify"}, seq)
        else:
            self._reply(ident, {"ok": False, "reason": f"unknown request type {kind!r}"}, seq)

    def _try_claim(self, ident: bytes, request_id: str, block_ids: list[int], deadline: float,
                   seq: Any, tokens: tuple[Any, Any], named: dict[str, Any]) -> None:
        answer = self._claim(request_id, block_ids, *tokens, **named)
        self._answer_claim(ident, seq, answer, deadline, lambda: self._try_claim(
            ident, request_id, block_ids, deadline, seq, tokens, named))

    def _try_transfer_claim(self, ident: bytes, transfer_id: str, deadline: float, seq: Any,
                            tokens: tuple[Any, Any], named: dict[str, Any]) -> None:
        answer = self._claim_transfer(transfer_id, *tokens, **named)
        self._answer_claim(ident, seq, answer, deadline, lambda: self._try_transfer_claim(
            ident, transfer_id, deadline, seq, tokens, named), waited=" within the reader's wait")

    def _answer_claim(self, ident: bytes, seq: Any, answer: ClaimAnswer, deadline: float,
                      retry: Callable[[], None], waited: str = "") -> None:
        """Reply to a claim with ``answer``, or queue ``retry`` while it waits before
        ``deadline``; a claim still waiting then is refused (``waited`` follows its reason).
        A granted reply carries the first token, and a pending claim's request id and blocks
        or a restored turn lease's blocks, when the answer has them."""
        phase_trace.mark("sc.claim_" + answer.status.value)
        waits = answer.status is ClaimStatus.WAIT
        if waits and time.monotonic() < deadline:
            self._pending_claims.append(retry)
            return
        ok = answer.status is ClaimStatus.OK
        payload = {"ok": ok, "reason": answer.reason + waited if waits else answer.reason,
                   "lease_expiry_in": answer.lease_left_s, "instance_id": self.instance_id}
        if ok:
            if answer.request_id:
                payload["request_id"] = answer.request_id
            if answer.block_ids is not None:
                payload["block_ids"] = answer.block_ids
            if answer.first_token is not None:
                payload["first_token_id"] = answer.first_token
        self._reply(ident, payload, seq)

    def wake(self) -> None:
        """Retry the waiting claims now (any thread; a lease just started)."""
        try:
            self._wake_w.send(b"\0")
        except (BlockingIOError, OSError):
            pass  # already readable, or closed

    def _serve(self) -> None:
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        poller.register(self._wake_r.fileno(), zmq.POLLIN)
        while not self._stop.is_set():
            timeout_ms = 5 if self._pending_claims else 100
            try:
                events = dict(poller.poll(timeout_ms))
            except zmq.ZMQError:
                break
            if self._wake_r.fileno() in events:
                try:
                    while self._wake_r.recv(4096):
                        pass
                except (BlockingIOError, OSError):
                    pass
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
                for retry in pending:
                    retry()
        self._sock.close(linger=0)

    def close(self) -> None:
        """Stop the thread and release the port."""
        self._stop.set()
        self._thread.join(timeout=5)
        self._ctx.term()
        self._wake_r.close()
        self._wake_w.close()
