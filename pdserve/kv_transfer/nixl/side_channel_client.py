"""The engine thread's side-channel client: non-blocking requests over one persistent ZMQ
connection per remote side channel (the protocol is :mod:`.side_channel`'s)."""

from __future__ import annotations

import logging
import time
from typing import Any

import msgspec
import zmq

from pdserve.kv_transfer.nixl.side_channel import (
    SideChannelError,
    SideChannelTimeout,
    decoder,
    encoder,
)

logger = logging.getLogger("pdserve.kv_transfer.nixl.side_channel")


class SideChannelClient:
    """Non-blocking side-channel requests for the engine thread.

    Requests to one remote side channel share one persistent ZMQ ``DEALER`` connection and are
    matched to their answers by a ``seq`` field the server echoes. Used for the per-request
    messages on a transfer's critical path (the lease claim before a READ): sending costs no
    thread hand-off, the TCP connection is reused, and the engine loop polls :meth:`sockets`
    alongside its input socket, so an answer wakes it at once.

    Not thread-safe: one thread (the engine thread) uses an instance.

    Args:
        context: a ZMQ context (the global instance by default).
    """

    def __init__(self, context: zmq.Context | None = None):
        self._ctx = context or zmq.Context.instance()
        self._socks: dict[tuple[str, int], zmq.Socket] = {}
        self._seq = 0
        # seq -> (address, deadline (time.monotonic()))
        self._pending: dict[int, tuple[tuple[str, int], float]] = {}
        self._results: dict[int, dict[str, Any] | SideChannelError] = {}

    def sockets(self) -> list[zmq.Socket]:
        """The open connections (register them in the engine loop's poller)."""
        return list(self._socks.values())

    def connect(self, host: str, port: int) -> None:
        """Open the connection to a side channel ahead of the first request (idempotent; an
        address ZMQ refuses is left for :meth:`send` to report)."""
        try:
            self._socket(host, port)
        except zmq.ZMQError:
            pass

    def _socket(self, host: str, port: int) -> zmq.Socket:
        """The connection to ``host:port``, opened now if needed.

        Raises:
            zmq.ZMQError: ZMQ refuses the address.
        """
        key = (host, port)
        sock = self._socks.get(key)
        if sock is None:
            sock = self._ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            try:
                sock.connect(f"tcp://{host}:{port}")
            except zmq.ZMQError:
                sock.close(linger=0)
                raise
            self._socks[key] = sock
        return sock

    def send(self, host: str, port: int, message: dict[str, Any], timeout_s: float) -> int:
        """Send one request (never blocks).

        Returns:
            A ticket for :meth:`result`. A request that cannot be queued fails at once (its
            result is a :class:`SideChannelError`).
        """
        self._seq += 1
        seq = self._seq
        try:
            sock = self._socket(host, port)
            sock.send_multipart([b"", encoder.encode(dict(message, seq=seq))], zmq.NOBLOCK)
        except zmq.ZMQError as e:
            self._results[seq] = SideChannelError(f"side channel tcp://{host}:{port}: {e}")
            return seq
        self._pending[seq] = ((host, port), time.monotonic() + timeout_s)
        return seq

    def poll(self, now: float | None = None) -> None:
        """Collect the answers that arrived and time out overdue requests (never blocks)."""
        for key, sock in list(self._socks.items()):
            while True:
                try:
                    frames = sock.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
                except zmq.ZMQError:
                    break
                self._accept(key, frames[-1])
        if not self._pending:
            return
        now = time.monotonic() if now is None else now
        for seq, (key, deadline) in list(self._pending.items()):
            if now >= deadline:
                del self._pending[seq]
                host, port = key
                self._results[seq] = SideChannelTimeout(
                    f"no answer from the NIXL side channel tcp://{host}:{port} in time "
                    f"(is the remote instance running with a kv-transfer config?)"
                )
                if not any(k == key for k, _ in self._pending.values()):
                    # drop messages queued for a dead peer; the next request reconnects
                    self._socks.pop(key).close(linger=0)

    def _accept(self, key: tuple[str, int], raw: bytes) -> None:
        try:
            reply = decoder.decode(raw)
        except msgspec.DecodeError:
            logger.warning("NIXL side channel: undecodable answer from %s:%d", *key)
            return
        seq = reply.get("seq") if isinstance(reply, dict) else None
        if not isinstance(seq, int) or seq not in self._pending:
            return  # an answer to a request that timed out
        del self._pending[seq]
        self._results[seq] = reply

    def result(self, ticket: int) -> dict[str, Any] | None:
        """The answer of a request, or None while it is pending (call :meth:`poll` first).
        A returned answer is forgotten.

        Raises:
            SideChannelTimeout: no answer in time.
            SideChannelError: the request could not be sent.
        """
        res = self._results.pop(ticket, None)
        if isinstance(res, SideChannelError):
            raise res
        return res

    def cancel(self, ticket: int) -> None:
        """Forget a request (its answer is ignored)."""
        self._pending.pop(ticket, None)
        self._results.pop(ticket, None)

    def next_deadline(self) -> float | None:
        """The earliest ``time.monotonic()`` deadline of a pending request, or None."""
        return min((d for _, d in self._pending.values()), default=None)

    def close(self) -> None:
        """Close every connection; pending requests are dropped."""
        for sock in self._socks.values():
            sock.close(linger=0)
        self._socks.clear()
        self._pending.clear()
        self._results.clear()
