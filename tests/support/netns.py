"""Network namespaces as separate hosts for multi-host tests (``ip netns``; needs root).

:class:`Hosts` makes one namespace per named host, each with a veth pair into a bridge in a
switch namespace and its own address in a private /24; a last veth pair joins the test process's
own namespace to the switch, so the test reaches every host (nothing else of this machine's
network is changed). :meth:`Hosts.close` deletes the namespaces (which deletes their
interfaces); the fixture that creates a :class:`Hosts` closes it in a finalizer, so a failing
test leaves nothing behind.
"""

from __future__ import annotations

import random
import shutil
import subprocess
import uuid


class NetnsUnavailable(RuntimeError):
    """``ip netns`` cannot be used here (not root, no ``ip``, no namespace support)."""


def _ip(*args: str, netns: str | None = None) -> None:
    cmd = ["ip", *(["-n", netns] if netns else []), *args]
    out = subprocess.run(cmd, capture_output=True, text=True)
    if out.returncode != 0:
        raise NetnsUnavailable(f"{' '.join(cmd)}: {out.stderr.strip()}")


class Hosts:
    """Namespaces ``pd<tag>-<name>`` for ``names``, addressed ``10.<a>.<b>.<i + 1>/24``; the
    test's own namespace gets ``.254``.

    Attributes:
        address: host name -> its address.
        netns: host name -> its namespace name (for ``ip netns exec``).

    Raises:
        NetnsUnavailable: a namespace or interface could not be created (what was made is
            deleted again).
    """

    def __init__(self, names: list[str]):
        if shutil.which("ip") is None:
            raise NetnsUnavailable("the 'ip' command is not installed")
        tag = uuid.uuid4().hex[:6]
        subnet = f"10.{random.randrange(100, 250)}.{random.randrange(0, 250)}"
        self.address = {name: f"{subnet}.{i + 1}" for i, name in enumerate(names)}
        self.netns = {name: f"pd{tag}-{name}" for name in names}
        self._switch = f"pd{tag}-sw"
        self._root_if = f"pd{tag}r"
        self._made: list[str] = []
        try:
            self._add_ns(self._switch)
            _ip("link", "add", "br0", "type", "bridge", netns=self._switch)
            _ip("link", "set", "br0", "up", netns=self._switch)
            for i, name in enumerate(names):
                ns = self.netns[name]
                self._add_ns(ns)
                self._wire(f"pd{tag}{i}a", ns, f"{self.address[name]}/24")
            self._wire(self._root_if, None, f"{subnet}.254/24")
        except BaseException:
            self.close()
            raise

    def _add_ns(self, ns: str) -> None:
        _ip("netns", "add", ns)
        self._made.append(ns)
        _ip("link", "set", "lo", "up", netns=ns)

    def _wire(self, inner: str, ns: str | None, cidr: str) -> None:
        """A veth pair: ``inner`` in ``ns`` (None: the test's namespace) with address ``cidr``,
        its peer on the switch's bridge."""
        outer = inner[:-1] + "b" if inner.endswith("a") else inner + "b"
        _ip("link", "add", inner, "type", "veth", "peer", "name", outer, "netns", self._switch)
        if ns is not None:
            _ip("link", "set", inner, "netns", ns)
        _ip("addr", "add", cidr, "dev", inner, netns=ns)
        _ip("link", "set", inner, "up", netns=ns)
        _ip("link", "set", outer, "master", "br0", netns=self._switch)
        _ip("link", "set", outer, "up", netns=self._switch)

    def close(self) -> None:
        """Delete every namespace made (their interfaces go with them, also the test
        namespace's veth, whose peer was in the switch)."""
        for ns in reversed(self._made):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        self._made = []
        subprocess.run(["ip", "link", "del", self._root_if], capture_output=True)
