"""Free localhost TCP ports for tests (the one helper every test that needs a port calls)."""

from __future__ import annotations

import random
import socket
from pathlib import Path

_HANDED_OUT: set[int] = set()


def _ephemeral_low() -> int:
    """The first port of the kernel's ephemeral range (Linux's default 32768 elsewhere)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port() -> int:
    """A free localhost TCP port below the kernel's ephemeral range, never the same one twice in
    a process (bound once, then released).

    The kernel gives a connecting socket its own end from the ephemeral range. A client that
    keeps reconnecting to a port in that range while nothing listens there (a server being
    restarted on its old port) can be given that very port and connect to itself; it then holds
    the port and the restarted server's bind fails with "address already in use" (seen in
    tests/kv_transfer/test_nixl_peer_restart.py). Ports below the range cannot be taken so.
    """
    low = _ephemeral_low()
    rng = random.SystemRandom()
    for _ in range(1000) if low > 11000 else ():
        port = rng.randrange(10000, low)
        if port in _HANDED_OUT or not _bindable(port):
            continue
        _HANDED_OUT.add(port)
        return port
    with socket.socket() as s:  # an unusual range: any free port
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def free_consecutive_ports(count: int) -> int:
    """The first of ``count`` consecutive free localhost TCP ports below the ephemeral range
    (as :func:`free_port`, none handed out before); for tests of port ranges (a base port plus
    one per data-parallel rank)."""
    for _ in range(1000):
        base = free_port()
        rest = range(base + 1, base + count)
        if any(port in _HANDED_OUT for port in rest) or not all(map(_bindable, rest)):
            continue
        _HANDED_OUT.update(rest)
        return base
    raise RuntimeError(f"no {count} consecutive free ports found")


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True
