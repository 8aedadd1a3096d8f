"""Reader side of the NIXL connector: heartbeats that keep a remote owner's lease alive while a
request that will read its blocks still waits in this instance's queue."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from pdserve.kv_transfer.nixl.remotes import RemoteRegistry
from pdserve.types.remote_ref import RemoteKVRef


@dataclass
class _Heartbeat:
    remote: RemoteKVRef
    last_sent: float = field(default=-1e18)  # time.monotonic() of the last one sent


class Heartbeats:
    """Request id -> the remote request whose lease it keeps alive (engine thread).

    A heartbeat goes to the owner every third of its lease duration once its handshake is done
    (it is started when the heartbeat starts).

    Args:
        remotes: the handshaken remote engines (lease durations, handshakes to start).
        send: sends one notice of a kind (``"heartbeat"``) about a remote request.
    """

    def __init__(self, remotes: RemoteRegistry, send: Callable[[RemoteKVRef, str], None]):
        self._remotes = remotes
        self._send = send
        self._beats: dict[str, _Heartbeat] = {}

    def __len__(self) -> int:
        return len(self._beats)

    def start(self, request_id: str, ref: RemoteKVRef) -> None:
        """Keep ``ref``'s lease alive for ``request_id`` (its handshake starts now)."""
        self._beats[request_id] = _Heartbeat(ref)
        self._remotes.ensure(ref.endpoint)

    def stop(self, request_id: str) -> None:
        """Stop ``request_id``'s heartbeats (it loads now, or it was aborted); no-op if none."""
        self._beats.pop(request_id, None)

    def drop_remote(self, endpoint_key: tuple[str, str, int]) -> None:
        """Stop every heartbeat to the remote ``endpoint_key`` (its handshake failed)."""
        for request_id in [r for r, hb in self._beats.items()
                           if hb.remote.endpoint.key == endpoint_key]:
            del self._beats[request_id]

    def send_due(self, now: float | None = None) -> None:
        """Send the heartbeats that are due; start the handshake of a remote not ready yet."""
        now = time.monotonic() if now is None else now
        for hb in self._beats.values():
            remote = self._remotes.get(hb.remote.endpoint)
            if remote is None or not remote.ready:
                self._remotes.ensure(hb.remote.endpoint)
                continue
            if now - hb.last_sent >= self._remotes.lease_duration(remote) / 3:
                hb.last_sent = now
                self._send(hb.remote, "heartbeat")

    def waits(self, now: float) -> list[float]:
        """Seconds until each heartbeat to a handshaken remote is due (may be negative)."""
        waits = []
        for hb in self._beats.values():
            remote = self._remotes.get(hb.remote.endpoint)
            if remote is not None and remote.ready:
                waits.append(hb.last_sent + self._remotes.lease_duration(remote) / 3 - now)
        return waits
