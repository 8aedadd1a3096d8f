"""Real ``pdserve`` processes for end-to-end tests: the one helper every such test goes through.

- :class:`EngineServer` (``pdserve serve``), :class:`ProxyServer` (``pdserve proxy``) and
  :class:`UpDeployment` (``pdserve up``) start a child process on free localhost ports, log its
  stdout+stderr to a file and stop it (SIGTERM, then SIGKILL) in :meth:`Process.stop`.
- Readiness waits scale to the machine (:func:`processes.wait_progressing`): they fail when a
  process exits or stops making progress, not after a fixed time.
- :class:`ServerPool` keeps named instances (specs in :data:`POOL_SPECS`) running for the whole
  session, so tests that only need a running P/D pair share one (the ``server_pool`` fixture of
  ``tests/conftest.py``). Tests on shared instances compare counters before and after, never
  absolute values.
- :func:`generate`, :func:`prefill_leg` and :func:`decode_leg` send one request, or play the
  two legs of the proxy by hand.

One module of about 470 lines: it is the one place that knows how each real process is started
and stopped, which every end-to-end test relies on.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import httpx
from tests.support.ports import free_port
from tests.support.processes import (MAX_WAIT_S, STALL_TIMEOUT_S, Process, descendants, still_running,
                       stop_together, wait_progressing)

__all__ = ["BIDIR_TTL_S", "BLOCK_SIZE", "HANDSHAKE_TIMEOUT_S", "LOAD_FACTOR", "MAX_WAIT_S",
           "POOL_COMMON", "POOL_SPECS", "SHORT_LEASE_S", "STALL_TIMEOUT_S", "EngineServer",
           "Process", "ProxyServer", "RedisServer", "ServerPool", "Spec", "UpDeployment", "decode_leg",
           "descendants", "generate", "nixl_config", "prefill_leg", "sse_events",
           "start_all", "still_running", "stop_together", "wait_progressing", "TIER_BLOCKS",
           "TIER_COMMON", "TIER_DISK_DIR"]


#: Arguments shared by the pooled tiny-model instances (greedy outputs do not depend on them).
BLOCK_SIZE = 16
POOL_COMMON = ["--block-size", str(BLOCK_SIZE), "--num-gpu-blocks-override", "1024",
               "--max-model-len", "1024"]
#: KV cache blocks of the pooled instances with KV cache tiers (``*_tier*``): 640 tokens, so a
#: few conversations' histories do not fit and come back from the tiers.
TIER_BLOCKS = 40
TIER_COMMON = ["--block-size", str(BLOCK_SIZE), "--num-gpu-blocks-override", str(TIER_BLOCKS),
               "--max-model-len", str(TIER_BLOCKS * BLOCK_SIZE)]
#: Where the disk tier of ``d_tier`` writes (a subdirectory per process, removed at its exit).
TIER_DISK_DIR = os.path.join(tempfile.gettempdir(), "pdserve-test-kv-disk")


def _load_factor() -> float:
    """How oversubscribed the CPUs are as the session starts: the larger of the 1- and 5-minute
    load averages per core, kept within 1 to 8."""
    load = max(os.getloadavg()[:2])
    return min(8.0, max(1.0, load / (os.cpu_count() or 1)))


#: The pooled instances' time settings are stretched by this factor: on a busy machine each
#: step between two events takes longer, and a lease, TTL or handshake timeout must still
#: outlast it (1 on an idle machine).
LOAD_FACTOR = _load_factor()
#: ``kv_lease_duration`` of the pool's short-lease producer ``p_short`` (s): short, yet long
#: enough that a test sees its blocks held between its prefill and the lease's end.
SHORT_LEASE_S = 1.0 * LOAD_FACTOR
#: ``kv_handshake_timeout`` of the pooled decoders (s): a dead side channel fails fast, a live
#: one answers in time.
HANDSHAKE_TIMEOUT_S = 2.0 * LOAD_FACTOR
#: ``decoder_kv_blocks_ttl`` of the pool's bidirectional decoder (s): above P's 5 s pull safety
#: margin (``PULL_SAFETY_MARGIN_S``) plus the time between D finishing one turn and P planning
#: the next (the client's next turn and its oracle request).
BIDIR_TTL_S = 15.0 * LOAD_FACTOR


def nixl_config(role: str, **extra: Any) -> dict:
    """A ``--kv-transfer-config`` dict for the NIXL connector in ``role`` (``kv_producer`` /
    ``kv_consumer``); ``kv_load_failure_policy`` goes at the top level, any other keyword into
    ``kv_connector_extra_config``. NIXL's progress thread is off unless a test asks for it: it
    keeps one core busy per instance, and the suite's engines progress their transfers when they
    poll (docs/configuration.md, ``nixl_progress_thread``). A pull's wait is not bounded
    (``kv_pull_wait_factor`` 0) unless a test asks for it: the suite's tiny models compute a
    turn's history in less time than a busy 2-core machine takes to answer a claim, and the
    tests that count the tokens P pulls would find pulls given up."""
    cfg: dict[str, Any] = {"kv_connector": "NixlConnector", "kv_role": role}
    policy = extra.pop("kv_load_failure_policy", None)
    if policy:
        cfg["kv_load_failure_policy"] = policy
    cfg["kv_connector_extra_config"] = {"nixl_progress_thread": False,
                                        "kv_pull_wait_factor": 0, **extra}
    return cfg


# ---------------------------------------------------------------------------------- servers

#: The tests' HTTP clients drop an idle pooled connection after 2 s, before the servers' own
#: keep-alive timeout (uvicorn's default, 5 s), which httpx's default expiry (5 s) equals: a
#: request sent on a connection the server was closing at that moment failed with "Connection
#: reset by peer" (seen once in CI, tests/kv_transfer/test_pd_disaggregation_e2e.py).
CLIENT_LIMITS = httpx.Limits(keepalive_expiry=2.0)


class EngineServer(Process):
    """``pdserve serve MODEL`` on a free port, with its own NIXL side-channel port and an HTTP
    ``client`` on its URL.

    Args:
        model: model directory.
        log_path: file receiving the process's output.
        kv_config: ``--kv-transfer-config`` dict (e.g. :func:`nixl_config`), or None for a plain
            instance.
        args: extra CLI arguments.
        host: the address it listens on and advertises its side channel on (another network
            namespace's address with ``netns``).
        netns: run it inside this network namespace (``ip netns exec``; ``tests/support/netns.py``).
        env: variables added to its environment (after the side-channel ones).
    """

    def __init__(self, model: str, log_path: Path, kv_config: dict | None = None,
                 args: list[str] | None = None, host: str = "127.0.0.1",
                 netns: str | None = None, env: dict[str, str] | None = None):
        self.host = host
        self.port = free_port()
        self.side_channel_port = free_port()
        self.url = f"http://{host}:{self.port}"
        cmd = [sys.executable, "-m", "pdserve.cli", "serve", model, "--port", str(self.port),
               *(["--host", host] if host != "127.0.0.1" else []), *(args or [])]
        if kv_config is not None:
            cmd += ["--kv-transfer-config", json.dumps(kv_config)]
        if netns is not None:
            cmd = ["ip", "netns", "exec", netns, *cmd]
        super().__init__(cmd, log_path, {"PDSERVE_NIXL_SIDE_CHANNEL_HOST": host,
                                         "PDSERVE_NIXL_SIDE_CHANNEL_PORT":
                                             str(self.side_channel_port), **(env or {})})
        self.client = httpx.Client(base_url=self.url, timeout=300, limits=CLIENT_LIMITS)

    def is_ready(self) -> bool:
        """True when ``/health`` answers 200."""
        try:
            return self.client.get("/health", timeout=5).status_code == 200
        except httpx.HTTPError:
            return False

    def wait_ready(self) -> None:
        """Polls ``/health`` until 200 (see :func:`wait_progressing` for when it gives up)."""
        wait_progressing(self.is_ready, [self], self.url)

    def metrics(self) -> dict[str, float]:
        """``/metrics`` as metric name -> value, summed over label sets."""
        values: dict[str, float] = {}
        for line in self.client.get("/metrics", timeout=30).text.splitlines():
            if line and not line.startswith("#"):
                name_part, _, value = line.rpartition(" ")
                name = name_part.split("{", 1)[0]
                try:
                    values[name] = values.get(name, 0.0) + float(value)
                except ValueError:
                    pass
        return values

    def wait_metrics(self, predicate: Callable[[dict[str, float]], bool],
                     timeout_s: float = 30.0) -> dict[str, float]:
        """Polls ``/metrics`` until ``predicate`` holds; returns the last scrape.

        Raises:
            AssertionError: not within ``timeout_s``.
        """
        deadline = time.monotonic() + timeout_s
        while True:
            m = self.metrics()
            if predicate(m):
                return m
            if time.monotonic() > deadline:
                raise AssertionError(
                    f"metrics condition not met in {timeout_s} s: "
                    f"{ {k: v for k, v in m.items() if 'nixl' in k or 'kv_cache' in k or 'prompt' in k} }")
            time.sleep(0.05)

    def wait_all_blocks_free(self, timeout_s: float = 30.0) -> dict[str, float]:
        """Waits until every KV block is free; returns the last scrape."""
        return self.wait_metrics(
            lambda m: m.get("pdserve:kv_cache_free_blocks") == m.get("pdserve:kv_cache_total_blocks"),
            timeout_s,
        )

    def stop(self) -> None:
        super().stop()
        self.client.close()


def start_all(servers: list[EngineServer]) -> None:
    """Waits until every server is ready (see :func:`wait_progressing`)."""
    pending = list(servers)

    def ready() -> bool:
        pending[:] = [s for s in pending if not s.is_ready()]
        return not pending

    wait_progressing(ready, list(servers), ", ".join(s.log_path.stem for s in servers),
                     poll_s=0.3)


class ProxyServer(Process):
    """``pdserve proxy --port 0`` in front of the given instances; ``url`` and an HTTP ``client``
    once it listens.

    Args:
        prefillers, decoders: the instances (on this host).
        log_path: file receiving the proxy's output.
        extra: extra CLI arguments (e.g. ``["--multi-turn"]``).
        host: the address it listens on; netns: run it inside this network namespace.
    """

    def __init__(self, prefillers: list[EngineServer], decoders: list[EngineServer], log_path: Path,
                 extra: list[str] | None = None, host: str = "127.0.0.1",
                 netns: str | None = None):
        cmd = [sys.executable, "-m", "pdserve.cli", "proxy", "--port", "0", "--host", host,
               "--prefiller-hosts", *(s.host for s in prefillers),
               "--prefiller-ports", *(str(s.port) for s in prefillers),
               "--decoder-hosts", *(s.host for s in decoders),
               "--decoder-ports", *(str(s.port) for s in decoders), *(extra or [])]
        if netns is not None:
            cmd = ["ip", "netns", "exec", netns, *cmd]
        super().__init__(cmd, log_path)
        self.url = ""
        self.client: httpx.Client | None = None

    def _listening(self) -> bool:
        m = re.search(r"listening on (\S+)", self.log_text())
        if m:
            self.url = m.group(1)
        return bool(m)

    def wait_ready(self) -> None:
        """Waits for the ``listening on URL`` line and sets ``url`` and ``client``.

        Raises:
            RuntimeError: the process exited. TimeoutError: it stopped progressing.
        """
        wait_progressing(self._listening, [self], "proxy", poll_s=0.05)
        self.client = httpx.Client(base_url=self.url, timeout=300, limits=CLIENT_LIMITS)

    def stop(self) -> None:
        if self.client is not None:
            self.client.close()
        super().stop()


class RedisServer(Process):
    """``redis-server`` on a free localhost port, without persistence (for the proxy's
    ``--state-store``); ``url`` is ``redis://127.0.0.1:PORT/0``. Skips the test when
    ``redis-server`` is not installed (``.ci/run`` installs it).

    Args:
        log_path: file receiving the server's output.
        port: the port to listen on (default: a free one; give the old one to restart).
    """

    def __init__(self, log_path: Path, port: int | None = None):
        import shutil

        import pytest

        exe = shutil.which("redis-server")
        if exe is None:
            pytest.skip("redis-server is not installed")
        self.port = port or free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        super().__init__([exe, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
                          "--appendonly", "no"], log_path)

    def _accepting(self) -> bool:
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=1):
                return True
        except OSError:
            return False

    def wait_ready(self) -> None:
        """Waits until the port accepts connections.

        Raises:
            RuntimeError: the process exited. TimeoutError: it stopped progressing.
        """
        wait_progressing(self._accepting, [self], "redis-server", poll_s=0.05)


class UpDeployment(Process):
    """``pdserve up ... --port PORT --log-dir DIR ARGS`` with what its status file says.

    Args:
        args: arguments after ``pdserve up`` (the model, ``--multi-turn``, ``--`` engine args).
        log_dir: the launcher's ``--log-dir``; its own output goes to ``log_dir/../up.out``.
    """

    def __init__(self, args: list[str], log_dir: Path):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_dir = log_dir
        self.status: dict = {}
        self.processes: dict[int, int] = {}
        super().__init__([sys.executable, "-m", "pdserve.cli", "up", "--port", str(self.port),
                          "--log-dir", str(log_dir), *args], log_dir.parent / "up.out")

    def _read_status(self) -> bool:
        try:
            self.status = json.loads((self.log_dir / "pdserve-up.json").read_text())
        except (FileNotFoundError, json.JSONDecodeError):
            self.status = {}
        return self.status.get("state") == "ready"

    def wait_ready(self) -> None:
        """Waits until the status file says ``ready``; records every process started."""
        wait_progressing(self._read_status, [self], "pdserve up", poll_s=0.3)
        self.processes = descendants(self.proc.pid)

    def child(self, role: str) -> dict:
        """The status file's entry of the child with ``role`` (``prefill``, ``decode``, ...)."""
        return next(c for c in self.status["children"] if c["role"] == role)

    def signal_and_wait(self, sig: int, timeout_s: float = 90.0) -> int:
        """Sends ``sig`` to the launcher; returns its exit code."""
        self.proc.send_signal(sig)
        return self.proc.wait(timeout=timeout_s)

    def kill_everything(self) -> None:
        """SIGKILL the launcher and every process it started (also those already orphaned)."""
        if self.proc.poll() is None:
            self.processes.update(descendants(self.proc.pid))
            self.proc.kill()
            self.proc.wait()
        for pid in still_running(self.processes):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self._log.close()


# ------------------------------------------------------------------------------ shared pool
@dataclass(frozen=True)
class Spec:
    """How a pooled instance is started: ``--kv-transfer-config`` (None: plain) and CLI args."""

    kv_config: dict | None = None
    args: tuple[str, ...] = tuple(POOL_COMMON)


#: The session's shared instances of the tiny Llama, by name.
POOL_SPECS: dict[str, Spec] = {
    # the oracle: one plain instance whose greedy output P/D must reproduce
    "single": Spec(),
    "p": Spec(nixl_config("kv_producer")),
    "p2": Spec(nixl_config("kv_producer")),
    "p_short": Spec(nixl_config("kv_producer", kv_lease_duration=SHORT_LEASE_S)),
    "d_fail": Spec(nixl_config("kv_consumer", kv_handshake_timeout=HANDSHAKE_TIMEOUT_S)),
    # one request at a time, so a second one waits in the queue (abort-before-read test)
    "d_rec": Spec(nixl_config("kv_consumer", kv_load_failure_policy="recompute",
                              kv_handshake_timeout=HANDSHAKE_TIMEOUT_S),
                  (*POOL_COMMON, "--max-num-seqs", "1")),
    # bidirectional pair: P without its own prefix cache, so history it does not compute was
    # pulled from D
    "p_bidir": Spec(nixl_config("kv_producer", bidirectional_kv_xfer=True),
                    (*POOL_COMMON, "--no-enable-prefix-caching")),
    "d_bidir": Spec(nixl_config("kv_consumer", decoder_kv_blocks_ttl=BIDIR_TTL_S,
                                bidirectional_kv_xfer=True)),
    # an fp8 KV cache (--kv-cache-dtype fp8): the oracle, a producer and a decoder
    "single_fp8": Spec(None, (*POOL_COMMON, "--kv-cache-dtype", "fp8")),
    "p_fp8": Spec(nixl_config("kv_producer"), (*POOL_COMMON, "--kv-cache-dtype", "fp8")),
    "d_fp8": Spec(nixl_config("kv_consumer", kv_handshake_timeout=HANDSHAKE_TIMEOUT_S),
                  (*POOL_COMMON, "--kv-cache-dtype", "fp8")),
    # KV cache tiers behind small KV caches (TIER_BLOCKS blocks): a P with a host tier, a D
    # with a tiny host tier over a disk tier, and a bidirectional P with a host tier
    "p_tier": Spec(nixl_config("kv_producer"), (*TIER_COMMON, "--kv-offloading-size", "0.004")),
    "d_tier": Spec(nixl_config("kv_consumer", kv_handshake_timeout=HANDSHAKE_TIMEOUT_S),
                   (*TIER_COMMON, "--kv-offloading-size", "0.0001",
                    "--kv-offloading-disk-dir", TIER_DISK_DIR, "--kv-offloading-disk-size", "0.01")),
    "p_tier_bidir": Spec(nixl_config("kv_producer", bidirectional_kv_xfer=True),
                         (*TIER_COMMON, "--kv-offloading-size", "0.004")),
    # a bidirectional D whose small KV cache cannot keep the live conversations' last turns:
    # they are demoted to its host tier and come back when P pulls them
    "d_tier_bidir": Spec(nixl_config("kv_consumer", decoder_kv_blocks_ttl=BIDIR_TTL_S,
                                     bidirectional_kv_xfer=True),
                         (*TIER_COMMON, "--kv-offloading-size", "0.01")),
}
@dataclass
class ServerPool:
    """Named instances of ``model`` (specs in :data:`POOL_SPECS`) started on first use and kept
    for the session; :meth:`close` stops them.

    Args:
        model: model directory.
        log_dir: where each instance logs (``NAME.log``).
        prefetch: names started (not waited for) together with the first ones asked for, so
            they boot while other tests run.
    """

    model: str
    log_dir: Path
    prefetch: tuple[str, ...] = ()
    servers: dict[str, EngineServer] = field(default_factory=dict)
    proxies: dict[str, ProxyServer] = field(default_factory=dict)

    def start(self, *names: str) -> None:
        """Starts the named instances that are not running yet; does not wait for them."""
        for name in names:
            if name not in self.servers:
                spec = POOL_SPECS[name]
                self.servers[name] = EngineServer(self.model, self.log_dir / f"{name}.log",
                                                  spec.kv_config, list(spec.args))

    def get(self, *names: str) -> dict[str, EngineServer]:
        """The named instances, started if not running yet, once all are ready."""
        self.start(*names, *self.prefetch)
        start_all([self.servers[n] for n in names])
        return {n: self.servers[n] for n in names}

    def proxy(self, name: str, prefillers: list[str], decoders: list[str],
              extra: list[str] | None = None) -> ProxyServer:
        """A ``pdserve proxy`` (kept for the session under ``name``) in front of pooled
        instances."""
        if name not in self.proxies:
            servers = self.get(*prefillers, *decoders)
            proxy = ProxyServer([servers[n] for n in prefillers], [servers[n] for n in decoders],
                                self.log_dir / f"proxy-{name}.log", extra)
            self.proxies[name] = proxy
            proxy.wait_ready()
        return self.proxies[name]

    def close(self) -> None:
        """Stops every proxy, then every instance (all signalled first, then waited for)."""
        stop_together(list(self.proxies.values()))
        stop_together(list(self.servers.values()))


# --------------------------------------------------------------------------------- requests
def greedy_chat_body(model: str, messages: list[dict], max_tokens: int,
                     conversation_id: str | None = None) -> dict:
    """A greedy chat completion body whose answer is exactly ``max_tokens`` tokens
    (``ignore_eos``), with the multi-turn proxy's ``conversation_id`` when one is given."""
    body = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True}
    if conversation_id is not None:
        body["conversation_id"] = conversation_id
    return body


def sse_events(response: httpx.Response) -> list[dict]:
    """The JSON ``data:`` events of a streamed response (without ``[DONE]``)."""
    events = []
    for line in response.iter_lines():
        if line.startswith("data: ") and line != "data: [DONE]":
            events.append(json.loads(line[len("data: "):]))
    return events


def generate(server: EngineServer, endpoint: str, body: dict) -> dict:
    """Run one request; returns ``{"status", "text", "kv_transfer_params", "error", "body"}``
    for both streaming and non-streaming bodies."""
    path = f"/v1/{endpoint}"
    if body.get("stream"):
        with server.client.stream("POST", path, json=body) as r:
            if r.status_code != 200:
                r.read()
                return {"status": r.status_code, "text": None, "error": r.json(),
                        "kv_transfer_params": None, "body": None}
            events = sse_events(r)
        text, params, error = "", None, None
        for ev in events:
            if "error" in ev:
                error = ev
                continue
            for ch in ev.get("choices") or []:
                text += (ch.get("text") or (ch.get("delta") or {}).get("content") or "")
            if ev.get("kv_transfer_params") is not None:
                params = ev["kv_transfer_params"]
        return {"status": 200 if error is None else 500, "text": None if error else text,
                "error": error, "kv_transfer_params": params, "body": events}
    r = server.client.post(path, json=body)
    data = r.json()
    if r.status_code != 200:
        return {"status": r.status_code, "text": None, "error": data, "kv_transfer_params": None,
                "body": data}
    ch = data["choices"][0]
    text = ch["text"] if endpoint == "completions" else ch["message"]["content"]
    return {"status": 200, "text": text, "error": None,
            "kv_transfer_params": data.get("kv_transfer_params"), "body": data}


def prefill_leg(p: EngineServer, endpoint: str, body: dict, leg_min_tokens: bool = True) -> dict:
    """The proxy's request to P: ``max_tokens=1``, not streamed, ``do_remote_decode``, and
    ``min_tokens`` 1 when the body asks for more (``leg_min_tokens`` False: without it, as a
    proxy that drops it sends the leg). Returns P's ``kv_transfer_params``."""
    leg = dict(body, max_tokens=1, stream=False,
               kv_transfer_params={"do_remote_decode": True, "do_remote_prefill": False})
    leg.pop("stream_options", None)
    if leg.pop("min_tokens", 0) >= 1 and leg_min_tokens:
        leg["min_tokens"] = 1
    out = generate(p, endpoint, leg)
    assert out["status"] == 200, out
    params = out["kv_transfer_params"]
    assert params and params["do_remote_prefill"] is True, out
    return params


def decode_leg(d: EngineServer, endpoint: str, body: dict, params: dict) -> dict:
    """The proxy's request to D: the original body plus P's params."""
    return generate(d, endpoint, dict(body, kv_transfer_params=params))
