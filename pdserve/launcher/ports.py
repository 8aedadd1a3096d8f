"""Free ports for the children of ``pdserve up``: the engines' HTTP and side-channel ports, and
the check that a port the user gave is free."""

from __future__ import annotations

import socket
from typing import Sequence

from pdserve.launcher.errors import LaunchError

ENGINE_HOST = "127.0.0.1"


def connect_host(host: str) -> str:
    """The address to connect to for a server bound to ``host`` (wildcards become loopback)."""
    if host in ("", "0.0.0.0"):
        return "127.0.0.1"
    if host == "::":
        return "[::1]"
    if ":" in host and not host.startswith("["):
        return f"[{host}]"
    return host


def allocate_free_ports(count: int, host: str = ENGINE_HOST,
                        exclude: Sequence[int] = ()) -> list[int]:
    """Returns ``count`` distinct TCP ports that are free on ``host`` right now.

    All sockets stay bound until every port is chosen, so the ports are distinct from each other;
    ports in ``exclude`` are skipped. Another process may still take a port before the child binds
    it (unavoidable without passing sockets to children).
    """
    sockets: list[socket.socket] = []
    ports: list[int] = []
    try:
        while len(ports) < count:
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sockets.append(sock)
            sock.bind((host, 0))
            port = sock.getsockname()[1]
            if port not in exclude and port not in ports:
                ports.append(port)
    finally:
        for sock in sockets:
            sock.close()
    return ports


def allocate_port_ranges(count: int, width: int, host: str = ENGINE_HOST,
                         exclude: Sequence[int] = ()) -> list[int]:
    """Returns ``count`` base ports such that ``base .. base + width - 1`` are all free on
    ``host`` right now, none in ``exclude`` and no two ranges overlapping (``width`` 1:
    :func:`allocate_free_ports`)."""
    if width == 1:
        return allocate_free_ports(count, host, exclude)
    sockets: list[socket.socket] = []
    bases: list[int] = []
    taken = set(exclude)
    try:
        while len(bases) < count:
            probe = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sockets.append(probe)
            probe.bind((host, 0))
            base = probe.getsockname()[1]
            block = range(base, base + width)
            if base + width > 65536 or taken & set(block):
                continue
            held: list[socket.socket] = []
            try:
                for port in block[1:]:
                    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                    held.append(sock)
                    sock.bind((host, port))
            except OSError:
                for sock in held:
                    sock.close()
                continue
            sockets += held
            taken |= set(block)
            bases.append(base)
    finally:
        for sock in sockets:
            sock.close()
    return bases


def ensure_port_free(host: str, port: int, what: str) -> None:
    """Raises :class:`LaunchError` if ``port`` cannot be bound on ``host``."""
    if not 0 < port < 65536:
        raise LaunchError(f"{what}: port {port} is out of range 1..65535")
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError as exc:
            raise LaunchError(f"{what}: port {port} on {host} is not free ({exc.strerror})") from None
