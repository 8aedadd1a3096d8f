"""A file descriptor other threads use to wake the engine loop.

The engine core blocks in ``zmq.Poller.poll`` on its input socket; a KV connector that gets
work from its own threads (a side-channel message, a finished handshake) registers a
:class:`Waker`'s descriptor in that poller so the loop runs at once instead of at its next
timeout. The same pattern as asyncio's self-pipe.
"""

from __future__ import annotations

import os
from typing import Any


class Waker:
    """A non-blocking pipe: :meth:`wake` from any thread, :meth:`drain` on the woken thread.

    The read end (:meth:`fileno`) is readable from the first :meth:`wake` until :meth:`drain`.
    """

    def __init__(self) -> None:
        self._r, self._w = os.pipe()
        os.set_blocking(self._r, False)
        os.set_blocking(self._w, False)
        self._closed = False

    def fileno(self) -> int:
        """The read end, for ``poll``/``select`` (readable while a wake-up is pending)."""
        return self._r

    def wake(self) -> None:
        """Make :meth:`fileno` readable (thread-safe, never blocks; a full pipe is already
        readable, so the byte is simply dropped)."""
        if self._closed:
            return
        try:
            os.write(self._w, b"\0")
        except (BlockingIOError, OSError):
            pass

    def drain(self) -> bool:
        """Consume pending wake-ups. Returns True when there was at least one."""
        woke = False
        while True:
            try:
                data = os.read(self._r, 4096)
            except (BlockingIOError, OSError):
                return woke
            if not data:
                return woke
            woke = True

    def close(self) -> None:
        """Close both ends (idempotent)."""
        if self._closed:
            return
        self._closed = True
        for fd in (self._r, self._w):
            try:
                os.close(fd)
            except OSError:
                pass


def sync_poller(poller: Any, registered: list[Any], handles: list[Any]) -> list[Any]:
    """(Un)register in a ``zmq.Poller`` the wake-up handles (sockets or file descriptors) that
    changed since ``registered``; returns the list now registered (``handles``)."""
    import zmq

    if handles == registered:
        return registered
    for h in registered:
        if not any(h is x for x in handles):
            poller.unregister(h)
    for h in handles:
        if not any(h is x for x in registered):
            poller.register(h, zmq.POLLIN)
    return list(handles)
