"""The deployments the fault matrix (benchmarks/fault_matrix.py) injects faults into: ``pdserve
up`` with 2 prefillers, 2 decoders and two proxy replicas on loopback, and a prefiller and a
decoder in network namespaces of their own (tests/support/netns.py) behind two proxy replicas,
for faults of the link between them.

Both have the same face to the load: ``model``, ``replica_urls``, ``replicas`` (the proxy
replicas' processes), ``engine(name)``, ``migrations()``, ``restore(timeout_s)``, ``close()``.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

from pdserve.launcher.plan import UP_MIGRATION_LIMIT

ENGINE_ARGS = ["--dtype", "float32", "--max-model-len", "1024", "--block-size", "16",
               "--num-gpu-blocks-override", "1024"]


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_http(url: str, proc: subprocess.Popen | None, timeout_s: float, what: str) -> None:
    """Waits until ``url`` answers 200.

    Raises:
        SystemExit: ``proc`` exited or ``timeout_s`` passed.
    """
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise SystemExit(f"{what} exited with code {proc.returncode}")
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    raise SystemExit(f"{what} not ready after {timeout_s:.0f} s ({url})")


def stop(proc: subprocess.Popen | None, sig: int = signal.SIGTERM, timeout_s: float = 60) -> None:
    """Stops ``proc`` with ``sig`` (SIGKILL after ``timeout_s``) and reaps it."""
    if proc is None or proc.poll() is not None:
        return
    proc.send_signal(sig)
    try:
        proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()



class Replicas:
    """Two ``pdserve proxy --multi-turn --migration-limit 3`` replicas in this namespace, sharing a
    ``redis-server`` of their own when one is installed.

    Args:
        model: model path; work: directory for logs.
    """

    def __init__(self, model: str, work: Path):
        self.model, self.work = model, work
        self.redis: subprocess.Popen | None = None
        self.redis_port = free_port()
        self.replicas: list[subprocess.Popen | None] = [None, None]
        self.replica_ports = [free_port(), free_port()]
        self.engines: tuple[list[tuple[str, int]], list[tuple[str, int]]] = ([], [])
        self.tag = "replica"

    @property
    def replica_urls(self) -> list[str]:
        return [f"http://127.0.0.1:{p}" for p in self.replica_ports]

    @property
    def state_store(self) -> str | None:
        return None if self.redis is None else f"redis://127.0.0.1:{self.redis_port}/0"

    def start_replicas(self, prefill: list[tuple[str, int]],
                       decode: list[tuple[str, int]]) -> None:
        """Starts redis (when installed) and both replicas in front of (host, port) engines."""
        self.engines = (prefill, decode)
        if shutil.which("redis-server"):
            self.start_redis()
        for i in range(2):
            self.start_replica(i)

    def start_redis(self) -> None:
        self.redis = subprocess.Popen(
            ["redis-server", "--port", str(self.redis_port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no"], stdout=open(self.work / "redis.log", "ab"),
            stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                socket.create_connection(("127.0.0.1", self.redis_port), timeout=1).close()
                return
            except OSError:
                time.sleep(0.1)
        raise SystemExit("redis-server did not start")

    def start_replica(self, i: int) -> None:
        prefill, decode = self.engines
        argv = [sys.executable, "-m", "pdserve.cli", "proxy", "--port",
                str(self.replica_ports[i]), "--multi-turn",
                "--migration-limit", str(UP_MIGRATION_LIMIT),  # as the proxy of pdserve up
                "--prefiller-hosts", *[h for h, _ in prefill],
                "--prefiller-ports", *[str(p) for _, p in prefill],
                "--decoder-hosts", *[h for h, _ in decode],
                "--decoder-ports", *[str(p) for _, p in decode]]
        if self.state_store:
            argv += ["--state-store", self.state_store]
        self.replicas[i] = subprocess.Popen(
            argv, stdout=open(self.work / f"{self.tag}-{i}.log", "ab"), stderr=subprocess.STDOUT)
        wait_http(self.replica_urls[i] + "/health", self.replicas[i], 120, f"proxy replica {i}")

    def restore_replicas(self) -> None:
        """Starts again a replica or redis that a fault stopped."""
        if self.redis is not None and self.redis.poll() is not None:
            self.start_redis()
        for i, proc in enumerate(self.replicas):
            if proc is None or proc.poll() is not None:
                self.start_replica(i)

    def migrations(self) -> int | None:
        """Sum of ``pdserve:proxy_migrations_total`` over the live replicas (None: no metric)."""
        total, seen = 0.0, False
        for url in self.replica_urls:
            try:
                text = httpx.get(url + "/metrics", timeout=5).text
            except httpx.HTTPError:
                continue
            for line in text.splitlines():
                m = re.match(r"^pdserve:proxy_migrations_total(?:\{[^}]*\})? ([0-9.eE+-]+)$",
                             line)
                if m:
                    total += float(m.group(1))
                    seen = True
        return int(total) if seen else None

    def close_replicas(self) -> None:
        for proc in self.replicas:
            stop(proc)
        stop(self.redis)


class UpDeployment(Replicas):
    """``pdserve up`` (2 P, 2 D, ``--multi-turn``) and two proxy replicas in front of its
    engines (its own proxy is not used: a replica can be killed without stopping ``pdserve up``).

    Args:
        model: model path; device: the engines' ``--device``; work: directory for logs;
        startup_timeout_s: seconds ``pdserve up`` may take to be ready.
    """

    def __init__(self, model: str, device: str, work: Path, startup_timeout_s: float):
        super().__init__(model, work)
        self.device, self.startup_timeout_s = device, startup_timeout_s
        self.up: subprocess.Popen | None = None
        self.status: dict = {}
        self.replaced: dict[str, int] = {}  # engine name -> the PID a fault ended

    def launch(self) -> None:
        """Starts ``pdserve up`` without waiting for it (it may start while other work runs)."""
        if self.up is not None:
            return
        log_dir = self.work / "up"
        self.up = subprocess.Popen(
            [sys.executable, "-m", "pdserve.cli", "up", self.model, "--num-prefillers", "2",
             "--num-decoders", "2", "--multi-turn", "--device", self.device, "--port", "0",
             "--log-dir", str(log_dir), "--restart-window", "600", "--", *ENGINE_ARGS],
            stdout=open(self.work / "up.out", "wb"), stderr=subprocess.STDOUT)

    def start(self) -> None:
        """Starts everything (``pdserve up`` unless :meth:`launch` did) and waits until it
        serves.

        Raises:
            SystemExit: a part did not come up.
        """
        self.launch()
        deadline = time.monotonic() + self.startup_timeout_s
        while self.read_status().get("state") != "ready":
            if self.up.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"pdserve up did not become ready; see {self.work / 'up.out'}")
            time.sleep(0.5)
        children = self.status["children"]
        self.start_replicas([("127.0.0.1", c["port"]) for c in children if c["role"] == "prefill"],
                            [("127.0.0.1", c["port"]) for c in children if c["role"] == "decode"])

    def read_status(self) -> dict:
        try:
            self.status = json.loads((self.work / "up" / "pdserve-up.json").read_text())
        except (FileNotFoundError, json.JSONDecodeError):
            pass
        return self.status

    def engine(self, name: str) -> dict:
        """The status entry of engine ``name`` (``prefill-1``, ``decode-1``)."""
        return next(c for c in self.read_status()["children"] if c["name"] == name)

    def engines_serving(self) -> bool:
        status = self.read_status()
        return status.get("state") == "ready" and all(
            c.get("state", "serving") == "serving" and self.replaced.get(c["name"]) != c["pid"]
            for c in status["children"])

    def restore(self, timeout_s: float) -> None:
        """Brings back what a fault took down: a replica, redis; waits for the engines."""
        self.restore_replicas()
        deadline = time.monotonic() + timeout_s
        while not self.engines_serving():
            if self.up.poll() is not None:
                raise SystemExit(f"pdserve up stopped (exit {self.up.returncode}); see "
                                 f"{self.work / 'up.out'}")
            if time.monotonic() > deadline:
                raise SystemExit("the engines did not come back")
            time.sleep(0.3)

    def close(self) -> None:
        self.close_replicas()
        stop(self.up, signal.SIGINT, 90)




def _netns_link(netns: str) -> str:
    """The name of the one interface (not ``lo``) of namespace ``netns``."""
    out = subprocess.run(["ip", "-n", netns, "-o", "link", "show"], capture_output=True,
                         text=True, check=True).stdout
    for line in out.splitlines():
        name = line.split(":")[1].strip().split("@")[0]
        if name != "lo":
            return name
    raise RuntimeError(f"no interface in namespace {netns}")


def _tc(netns: str, *args: str) -> None:
    subprocess.run(["ip", "netns", "exec", netns, "tc", *args], capture_output=True, text=True,
                   check=True)


class NetnsPair(Replicas):
    """A prefiller in namespace ``p`` and a decoder in namespace ``d`` (KV over UCX's TCP
    transport between them), two proxy replicas in this namespace; the link faults are
    a ``tc`` rate limit on the prefiller's interface and a route in the decoder's namespace.
    The prefiller's side channel listens on a second address of its own (``.101`` of the
    subnet), so that it can be made unreachable while its HTTP address still answers.

    Args:
        model: model path; work: directory for logs; hosts: a
            :class:`tests.support.netns.Hosts` with hosts ``p`` and ``d`` (closed by the
            caller).
    """

    def __init__(self, model: str, work: Path, hosts, startup_timeout_s: float):
        super().__init__(model, work)
        self.tag = "netns-replica"
        self.hosts, self.startup_timeout_s = hosts, startup_timeout_s
        self.procs: dict[str, subprocess.Popen] = {}
        self.ports = {"p": free_port(), "d": free_port()}
        self.side_ports = {"p": free_port(), "d": free_port()}
        self.link: dict[str, str] = {}
        self.side_address = hosts.address["p"].rsplit(".", 1)[0] + ".101"

    def _engine(self, host: str, role: str) -> subprocess.Popen:
        addr, ns = self.hosts.address[host], self.hosts.netns[host]
        kv = {"kv_connector": "NixlConnector", "kv_role": role,
              "kv_connector_extra_config": {"nixl_progress_thread": False,
                                            "bidirectional_kv_xfer": True}}
        argv = ["ip", "netns", "exec", ns, sys.executable, "-m", "pdserve.cli", "serve",
                self.model, "--host", addr, "--port", str(self.ports[host]), "--device", "cpu",
                "--kv-transfer-config", json.dumps(kv), *ENGINE_ARGS]
        side = self.side_address if host == "p" else addr
        env = {**os.environ, "PDSERVE_NIXL_SIDE_CHANNEL_HOST": side,
               "PDSERVE_NIXL_SIDE_CHANNEL_PORT": str(self.side_ports[host]), "UCX_TLS": "tcp"}
        return subprocess.Popen(argv, env=env, stdout=open(self.work / f"netns-{host}.log", "ab"),
                                stderr=subprocess.STDOUT)

    def start(self) -> None:
        """Starts P, D and the replicas and waits until they serve.

        Raises:
            SystemExit: a part did not come up.
        """
        dev = _netns_link(self.hosts.netns["p"])
        subprocess.run(["ip", "-n", self.hosts.netns["p"], "addr", "add",
                        f"{self.side_address}/24", "dev", dev], capture_output=True, text=True,
                       check=True)
        self.procs = {"p": self._engine("p", "kv_producer"), "d": self._engine("d", "kv_consumer")}
        for host, proc in self.procs.items():
            wait_http(f"http://{self.hosts.address[host]}:{self.ports[host]}/health", proc,
                      self.startup_timeout_s, f"the engine in namespace {host}")
            self.link[host] = _netns_link(self.hosts.netns[host])
        self.start_replicas([(self.hosts.address["p"], self.ports["p"])],
                            [(self.hosts.address["d"], self.ports["d"])])

    def slow_link(self, rate: str) -> None:
        """Limits what the prefiller sends (KV reads, its answers) to ``rate`` (``tc`` token
        bucket, e.g. ``"2mbit"``; netem delays need a module many kernels lack)."""
        _tc(self.hosts.netns["p"], "qdisc", "add", "dev", self.link["p"], "root", "tbf",
            "rate", rate, "burst", "16kbit", "latency", "2s")

    def block_side_channel(self) -> None:
        """Makes the prefiller's side-channel address unreachable from the decoder (an
        ``unreachable`` route there): handshakes and lease claims fail, HTTP still works."""
        subprocess.run(["ip", "-n", self.hosts.netns["d"], "route", "add", "unreachable",
                        f"{self.side_address}/32"], capture_output=True, text=True, check=True)

    def clear_link(self) -> None:
        """Removes the link faults (no error when there are none)."""
        subprocess.run(["ip", "netns", "exec", self.hosts.netns["p"], "tc", "qdisc", "del", "dev",
                        self.link["p"], "root"], capture_output=True)
        subprocess.run(["ip", "-n", self.hosts.netns["d"], "route", "del", "unreachable",
                        f"{self.side_address}/32"], capture_output=True)

    def restore(self, timeout_s: float) -> None:
        """Removes the link faults and starts again a replica a fault stopped."""
        self.clear_link()
        self.restore_replicas()

    def close(self) -> None:
        self.close_replicas()
        for proc in self.procs.values():
            stop(proc)
