"""``pdserve up``: a whole disaggregated deployment on one host with one command.

Starts N prefillers (``pdserve serve MODEL`` with ``kv_role=kv_producer``), M decoders
(``kv_role=kv_consumer``) and the proxy (``pdserve proxy``) as separate child processes, each with
its own free HTTP port and its own free NIXL side-channel port
(``PDSERVE_NIXL_SIDE_CHANNEL_PORT``). It waits until every part answers ``GET /health`` with a
progress bar, prints the endpoint with ready-to-paste ``curl`` and ``openai`` examples, and then
supervises the children:

* Ctrl-C / SIGTERM / SIGHUP is forwarded to every child (a second one sends SIGKILL); children that
  have not exited after ``--shutdown-timeout`` seconds are killed.
* If a child dies, the others are stopped and ``pdserve up`` exits non-zero, printing that child's
  last log lines.
* Every child runs in its own session (process group), and the whole group is signalled, so the
  engine-core processes that ``pdserve serve`` spawns are stopped too. Children also get
  ``PR_SET_PDEATHSIG`` (Linux), so they are terminated even when the launcher itself is killed with
  SIGKILL.

Child logs go to ``--log-dir`` (default: a new temporary directory), one file per part, and a
machine-readable ``pdserve-up.json`` there lists the parts with their PIDs, ports and URLs.

The child commands come from a :class:`ChildCommands` object, which tests replace with fakes.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections import deque
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Sequence, TextIO

from pdserve.config import DEFAULT_MODEL

DEFAULT_PROXY_PORT = 8000
DEFAULT_STARTUP_TIMEOUT_S = 900.0
DEFAULT_SHUTDOWN_TIMEOUT_S = 30.0
ENGINE_HOST = "127.0.0.1"
STATUS_FILE_NAME = "pdserve-up.json"
LOG_TAIL_LINES = 40
# Seconds processes left behind in a stopped child's process group get between SIGTERM and SIGKILL.
LEFTOVER_GRACE_S = 5.0
# Seconds between "still waiting" lines while starting, when stderr is not a terminal.
PROGRESS_LINE_INTERVAL_S = 15.0
# Fraction of a GPU's memory that the engines sharing it may use together when
# --gpu-memory-utilization is not given (vLLM's default for one engine alone); a given value is
# likewise split between the engines sharing a GPU.
SHARED_GPU_MEMORY_FRACTION = 0.9

_PR_SET_PDEATHSIG = 1  # from <linux/prctl.h>


class LaunchError(Exception):
    """A configuration problem found before any child starts (bad ports, bad options)."""


# --------------------------------------------------------------------------------------------
# Plan: which children to start, with which ports, GPUs and environment
# --------------------------------------------------------------------------------------------


@dataclass
class ChildSpec:
    """One child process of the deployment.

    Attributes:
        name: unique short name, e.g. ``prefill-0``, ``decode-1``, ``proxy``; also the log file
            stem.
        role: ``prefill``, ``decode`` or ``proxy``.
        argv: command line.
        env: variables added to (or overriding) the launcher's environment.
        host: address the child's HTTP server binds.
        port: the child's HTTP port.
        health_path: path that answers 200 once the child is ready.
        side_channel_port: NIXL side-channel port (engines only).
        gpu: the ``CUDA_VISIBLE_DEVICES`` entry given to the child, or None.
        gpu_memory_share: the ``--gpu-memory-utilization`` given to an engine that shares its
            GPU with others (None: not shared, or sized by ``--kv-cache-memory``).
    """

    name: str
    role: str
    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)
    host: str = ENGINE_HOST
    port: int = 0
    health_path: str = "/health"
    side_channel_port: int | None = None
    gpu: str | None = None
    gpu_memory_share: float | None = None

    @property
    def url(self) -> str:
        """Base URL clients on this host use to reach the child."""
        return f"http://{connect_host(self.host)}:{self.port}"


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


def detect_gpus() -> list[str]:
    """GPUs this process may use, as ``CUDA_VISIBLE_DEVICES`` entries (indices or UUIDs).

    Honours an existing ``CUDA_VISIBLE_DEVICES`` (entries up to the first invalid one, as CUDA
    does); otherwise asks ``nvidia-smi -L``. Returns ``[]`` when there is no NVIDIA GPU. Does not
    import torch, so ``pdserve up`` starts fast.
    """
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        gpus = []
        for entry in visible.split(","):
            entry = entry.strip()
            if not entry or entry.startswith("-"):
                break
            gpus.append(entry)
        return gpus
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=20,
                             check=False)
    except (OSError, subprocess.TimeoutExpired):
        return []
    if out.returncode != 0:
        return []
    return [str(i) for i, line in enumerate(l for l in out.stdout.splitlines()
                                            if l.startswith("GPU "))]


def assign_gpus(num_prefillers: int, num_decoders: int,
                gpus: Sequence[str]) -> tuple[list[str | None], list[str | None]]:
    """Places engines on GPUs so that prefillers and decoders never share one when possible.

    With two or more GPUs the list is split into a prefill part and a decode part, sized in
    proportion to the number of engines of each kind (each part at least one GPU); engines take
    the GPUs of their part round-robin. With one GPU everything shares it; with none every entry is
    None.

    Returns:
        (GPU per prefiller, GPU per decoder).
    """
    if not gpus:
        return [None] * num_prefillers, [None] * num_decoders
    if len(gpus) == 1 or num_prefillers == 0 or num_decoders == 0:
        pool = list(gpus)
        return ([pool[i % len(pool)] for i in range(num_prefillers)],
                [pool[i % len(pool)] for i in range(num_decoders)])
    total = num_prefillers + num_decoders
    num_p_gpus = round(len(gpus) * num_prefillers / total)
    num_p_gpus = min(max(num_p_gpus, 1), len(gpus) - 1)
    p_pool, d_pool = list(gpus[:num_p_gpus]), list(gpus[num_p_gpus:])
    return ([p_pool[i % len(p_pool)] for i in range(num_prefillers)],
            [d_pool[i % len(d_pool)] for i in range(num_decoders)])


def kv_transfer_config(role: str, multi_turn: bool) -> dict:
    """The ``--kv-transfer-config`` of one engine (DESIGN §4).

    Args:
        role: ``kv_producer`` (prefiller) or ``kv_consumer`` (decoder).
        multi_turn: turns on ``bidirectional_kv_xfer`` so the decoder's KV of one turn can be
            pulled back by a prefiller for the next turn (DESIGN §3).
    """
    config: dict = {"kv_connector": "NixlConnector", "kv_role": role}
    if multi_turn:
        config["kv_connector_extra_config"] = {"bidirectional_kv_xfer": True}
    return config


class ChildCommands:
    """Builds the command lines of the children; tests substitute fakes.

    The commands run ``python -m pdserve.cli`` with the launcher's own interpreter, so they work
    whether or not the ``pdserve`` script is on ``PATH``.
    """

    def __init__(self, python: str | None = None):
        self.python = python or sys.executable

    def engine(self, *, model: str, role: str, host: str, port: int, kv_config: dict,
               device: str | None, engine_args: Sequence[str]) -> list[str]:
        """``pdserve serve`` for a prefiller (``role="prefill"``) or a decoder (``"decode"``)."""
        argv = [self.python, "-m", "pdserve.cli", "serve", model, "--host", host,
                "--port", str(port), "--kv-transfer-config", json.dumps(kv_config)]
        if device:
            argv += ["--device", device]
        return argv + list(engine_args)

    def proxy(self, *, host: str, port: int, prefillers: Sequence[tuple[str, int]],
              decoders: Sequence[tuple[str, int]], multi_turn: bool,
              api_key: str | None = None) -> list[str]:
        """``pdserve proxy`` in front of the given (host, HTTP port) engines.

        With ``api_key`` the proxy requires it from clients and forwards their ``Authorization``
        header to the engines, which were started with the same key.
        """
        argv = [self.python, "-m", "pdserve.cli", "proxy", "--host", host, "--port", str(port),
                "--prefiller-hosts", *[h for h, _ in prefillers],
                "--prefiller-ports", *[str(p) for _, p in prefillers],
                "--decoder-hosts", *[h for h, _ in decoders],
                "--decoder-ports", *[str(p) for _, p in decoders]]
        if multi_turn:
            argv.append("--multi-turn")
        if api_key:
            argv += ["--api-key", api_key]
        return argv

    health_path_engine = "/health"
    health_path_proxy = "/health"


def _option_given(args: Sequence[str], *names: str) -> bool:
    return any(a == n or a.startswith(n + "=") or a.startswith(n + ".")
               for a in args for n in names)


def option_value(args: Sequence[str], name: str) -> str | None:
    """The value of ``name`` in an argument list (``--name V`` or ``--name=V``; last one wins)."""
    value = None
    for i, a in enumerate(args):
        if a == name and i + 1 < len(args):
            value = args[i + 1]
        elif a.startswith(name + "="):
            value = a.split("=", 1)[1]
    return value


def build_plan(opts: argparse.Namespace, commands: ChildCommands,
               gpus: Sequence[str] | None = None) -> list[ChildSpec]:
    """Chooses ports, GPUs and environment for every child; returns prefillers, decoders, proxy.

    Raises:
        LaunchError: a given port is busy or repeated, or the numbers of ports do not match.
    """
    n_p, n_d = opts.num_prefillers, opts.num_decoders
    if n_p < 1 or n_d < 1:
        raise LaunchError("--num-prefillers and --num-decoders must be at least 1")
    engine_args = list(opts.engine_args)
    if _option_given(engine_args, "--host", "--port"):
        raise LaunchError("--host/--port of the engines are chosen by 'pdserve up'; "
                          "use --prefill-ports/--decode-ports to fix them")
    if "--kv-transfer-config" in engine_args or any(
            a.startswith("--kv-transfer-config=") for a in engine_args):
        raise LaunchError("'pdserve up' sets --kv-transfer-config itself; pass single keys instead, "
                          "e.g. -- --kv-transfer-config.kv_connector_extra_config.kv_lease_duration 60")
    if _option_given(engine_args, "--kv-transfer-config.kv_role",
                     "--kv-transfer-config.kv_connector"):
        raise LaunchError("kv_role and kv_connector are set by 'pdserve up' (prefillers are "
                          "kv_producer, decoders kv_consumer)")

    if opts.port == 0:  # any free port for the proxy
        opts.port = allocate_free_ports(1, opts.host if opts.host not in ("", "::") else ENGINE_HOST)[0]
    given: list[tuple[str, int]] = []
    for flag, ports, count in (("--prefill-ports", opts.prefill_ports, n_p),
                               ("--decode-ports", opts.decode_ports, n_d),
                               ("--prefill-side-channel-ports", opts.prefill_side_channel_ports, n_p),
                               ("--decode-side-channel-ports", opts.decode_side_channel_ports, n_d)):
        if ports is not None:
            if len(ports) != count:
                raise LaunchError(f"{flag} needs {count} port(s), got {len(ports)}")
            given += [(flag, p) for p in ports]
    given.append(("--port", opts.port))
    seen: dict[int, str] = {}
    for flag, port in given:
        if port in seen:
            raise LaunchError(f"port {port} is given twice ({seen[port]} and {flag})")
        seen[port] = flag
    for flag, port in given:
        ensure_port_free(opts.host if flag == "--port" else ENGINE_HOST, port, flag)

    missing = sum(n for n, ports in ((n_p, opts.prefill_ports), (n_d, opts.decode_ports),
                                      (n_p, opts.prefill_side_channel_ports),
                                      (n_d, opts.decode_side_channel_ports)) if ports is None)
    free = iter(allocate_free_ports(missing, ENGINE_HOST, exclude=list(seen)))

    def ports_for(given_ports: list[int] | None, count: int) -> list[int]:
        return list(given_ports) if given_ports is not None else [next(free) for _ in range(count)]

    p_ports, d_ports = ports_for(opts.prefill_ports, n_p), ports_for(opts.decode_ports, n_d)
    p_side = ports_for(opts.prefill_side_channel_ports, n_p)
    d_side = ports_for(opts.decode_side_channel_ports, n_d)

    if opts.device == "cpu":
        gpus = []
    elif gpus is None:
        gpus = detect_gpus()
    p_gpus, d_gpus = assign_gpus(n_p, n_d, gpus)
    sharing: dict[str, int] = {}
    for gpu in p_gpus + d_gpus:
        if gpu is not None:
            sharing[gpu] = sharing.get(gpu, 0) + 1
    # One GPU shared by several engines: each gets an equal part of --gpu-memory-utilization
    # (each engine's flag is its own share of the total, see pdserve/memory_budget.py).
    kv_memory_given = _option_given(engine_args, "--kv-cache-memory")
    util_text = option_value(engine_args, "--gpu-memory-utilization")
    try:
        util_total = SHARED_GPU_MEMORY_FRACTION if util_text is None else float(util_text)
    except ValueError:
        raise LaunchError(f"--gpu-memory-utilization must be a number, got {util_text!r}") \
            from None

    specs: list[ChildSpec] = []
    for role, kv_role, count, ports, side_ports, gpu_list in (
            ("prefill", "kv_producer", n_p, p_ports, p_side, p_gpus),
            ("decode", "kv_consumer", n_d, d_ports, d_side, d_gpus)):
        for i in range(count):
            args_i = list(engine_args)
            gpu = gpu_list[i]
            env = {"PDSERVE_NIXL_SIDE_CHANNEL_HOST": ENGINE_HOST,
                   "PDSERVE_NIXL_SIDE_CHANNEL_PORT": str(side_ports[i]),
                   "PYTHONUNBUFFERED": "1"}
            share = None
            if gpu is not None:
                env["CUDA_VISIBLE_DEVICES"] = gpu
                if sharing[gpu] > 1 and not kv_memory_given:
                    share = round(util_total / sharing[gpu], 3)
                    args_i += ["--gpu-memory-utilization", f"{share:.3f}"]  # the last one wins
            argv = commands.engine(model=opts.model, role=role, host=ENGINE_HOST, port=ports[i],
                                   kv_config=kv_transfer_config(kv_role, opts.multi_turn),
                                   device=opts.device, engine_args=args_i)
            specs.append(ChildSpec(name=f"{role}-{i}", role=role, argv=argv, env=env,
                                   host=ENGINE_HOST, port=ports[i],
                                   health_path=commands.health_path_engine,
                                   side_channel_port=side_ports[i], gpu=gpu,
                                   gpu_memory_share=share))
    proxy_argv = commands.proxy(
        host=opts.host, port=opts.port,
        prefillers=[(ENGINE_HOST, p) for p in p_ports], decoders=[(ENGINE_HOST, p) for p in d_ports],
        multi_turn=opts.multi_turn, api_key=option_value(engine_args, "--api-key"))
    specs.append(ChildSpec(name="proxy", role="proxy", argv=proxy_argv,
                           env={"PYTHONUNBUFFERED": "1", "CUDA_VISIBLE_DEVICES": ""},
                           host=opts.host, port=opts.port, health_path=commands.health_path_proxy))
    return specs


# --------------------------------------------------------------------------------------------
# Running children
# --------------------------------------------------------------------------------------------


def _load_prctl():
    try:
        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):  # not Linux: rely on the launcher's own cleanup
        return None


_PRCTL = _load_prctl()  # looked up in the parent: the forked child should do as little as possible


def _die_with_parent(parent_pid: int) -> None:
    """``preexec_fn`` of every child: SIGTERM when the launcher dies, even by SIGKILL (Linux)."""
    if _PRCTL is None:
        return
    _PRCTL(_PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0)
    if os.getppid() != parent_pid:  # the launcher died before prctl took effect
        os._exit(1)


def tail_lines(path: Path, n: int = LOG_TAIL_LINES) -> list[str]:
    """The last ``n`` lines of a text file (``[]`` if it does not exist)."""
    try:
        with open(path, errors="replace") as f:
            return [line.rstrip("\n") for line in deque(f, maxlen=n)]
    except OSError:
        return []


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class Child:
    """A started child: its spec, ``Popen`` handle and log file."""

    def __init__(self, spec: ChildSpec, log_path: Path):
        self.spec = spec
        self.log_path = log_path
        self.proc: subprocess.Popen | None = None
        self.ready = False

    def start(self) -> None:
        env = dict(os.environ)
        env.update(self.spec.env)
        parent = os.getpid()
        with open(self.log_path, "ab") as log:
            log.write(f"$ {shlex.join(self.spec.argv)}\n".encode())
            log.flush()
            self.proc = subprocess.Popen(
                self.spec.argv, env=env, stdin=subprocess.DEVNULL, stdout=log,
                stderr=subprocess.STDOUT, start_new_session=True,
                preexec_fn=lambda: _die_with_parent(parent))

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def poll(self) -> int | None:
        return None if self.proc is None else self.proc.poll()

    def signal(self, sig: int) -> None:
        """Sends ``sig`` to the child process itself."""
        if self.proc is not None and self.proc.poll() is None:
            try:
                self.proc.send_signal(sig)
            except ProcessLookupError:
                pass

    def signal_group(self, sig: int) -> None:
        """Sends ``sig`` to the child's whole process group (the child and what it spawned)."""
        if self.proc is None:
            return
        try:
            os.killpg(self.proc.pid, sig)
        except ProcessLookupError:
            pass

    def group_alive(self) -> bool:
        """True while the child or any process of its group exists."""
        if self.proc is None:
            return False
        return self.proc.poll() is None or _group_alive(self.proc.pid)


def _check_health(url: str, timeout: float = 2.0) -> bool:
    import httpx

    try:
        return httpx.get(url, timeout=timeout).status_code == 200
    except httpx.HTTPError:
        return False


class Launcher:
    """Starts the children of a plan, waits for readiness, supervises and stops them.

    Args:
        specs: the children, started in this order.
        log_dir: directory for ``<name>.log`` and :data:`STATUS_FILE_NAME`.
        startup_timeout: seconds to wait for all parts to become healthy.
        shutdown_timeout: seconds to wait for children after the stop signal before SIGKILL.
        health_check: ``url -> bool``; replaceable in tests.
        out: where the banner and messages go.
    """

    def __init__(self, specs: Sequence[ChildSpec], log_dir: Path, *,
                 startup_timeout: float = DEFAULT_STARTUP_TIMEOUT_S,
                 shutdown_timeout: float = DEFAULT_SHUTDOWN_TIMEOUT_S,
                 health_check: Callable[[str], bool] = _check_health,
                 poll_interval: float = 0.25, out: TextIO | None = None):
        self.log_dir = Path(log_dir)
        self.children = [Child(s, self.log_dir / f"{s.name}.log") for s in specs]
        self.startup_timeout = startup_timeout
        self.shutdown_timeout = shutdown_timeout
        self.health_check = health_check
        self.poll_interval = poll_interval
        self.out = out or sys.stdout
        self.stop_signal: int | None = None
        self._signal_count = 0
        self._old_handlers: dict[int, object] = {}
        self.started_at = time.monotonic()

    # ---- messages -----------------------------------------------------------------------
    def say(self, msg: str = "") -> None:
        print(msg, file=self.out, flush=True)

    def status_path(self) -> Path:
        return self.log_dir / STATUS_FILE_NAME

    def write_status(self, state: str, **extra) -> None:
        """Writes ``pdserve-up.json``: launcher PID, state and every child's PID/ports/log."""
        data = {
            "launcher_pid": os.getpid(),
            "state": state,
            "children": [
                {**asdict(c.spec), "pid": c.proc.pid if c.proc else None,
                 "url": c.spec.url, "log": str(c.log_path), "ready": c.ready}
                for c in self.children],
            **extra,
        }
        tmp = self.status_path().with_suffix(".tmp")
        tmp.write_text(json.dumps(data, indent=2))
        tmp.replace(self.status_path())

    # ---- signals ------------------------------------------------------------------------
    def _on_signal(self, signum: int, _frame) -> None:
        self._signal_count += 1
        if self.stop_signal is None:
            self.stop_signal = signum
        if self._signal_count > 1:  # impatient user: kill right away
            for child in self.children:
                child.signal_group(signal.SIGKILL)

    def install_signal_handlers(self) -> None:
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            self._old_handlers[sig] = signal.signal(sig, self._on_signal)

    def restore_signal_handlers(self) -> None:
        for sig, handler in self._old_handlers.items():
            signal.signal(sig, handler)
        self._old_handlers.clear()

    # ---- lifecycle ----------------------------------------------------------------------
    def start_all(self) -> None:
        """Starts every child (logs to ``<log_dir>/<name>.log``) and writes the status file.

        Raises:
            LaunchError: a child's command cannot be executed.
        """
        self.log_dir.mkdir(parents=True, exist_ok=True)
        for child in self.children:
            try:
                child.start()
            except OSError as exc:
                raise LaunchError(f"cannot start {child.spec.name} "
                                  f"({shlex.join(child.spec.argv)}): {exc}") from None
        self.write_status("starting")

    def dead_child(self) -> Child | None:
        for child in self.children:
            if child.poll() is not None:
                return child
        return None

    def wait_until_ready(self) -> bool:
        """Polls every child's health URL until all answer 200, showing progress.

        On a terminal a progress bar shows how many parts are ready, the elapsed time and the
        parts still starting; otherwise (CI logs) one line is printed per ready part and a
        "still waiting" line every :data:`PROGRESS_LINE_INTERVAL_S` seconds.

        Returns False (after reporting why) if a child exits, a stop signal arrives, or the
        startup timeout passes.
        """
        from tqdm import tqdm

        deadline = time.monotonic() + self.startup_timeout
        interactive = sys.stderr.isatty()
        bar = tqdm(total=len(self.children), file=sys.stderr, disable=not interactive,
                   dynamic_ncols=True, leave=False, bar_format="{bar:20} {n}/{total} parts ready "
                   "[{elapsed}] {desc}")
        next_line = time.monotonic() + PROGRESS_LINE_INTERVAL_S

        def note(msg: str) -> None:
            if interactive:
                bar.write(msg, file=sys.stderr)
            else:
                self.say(msg)

        try:
            while True:
                for child in self.children:
                    if not child.ready and child.poll() is None and self.health_check(
                            child.spec.url + child.spec.health_path):
                        child.ready = True
                        bar.update(1)
                        note(f"  {child.spec.name} ready at {child.spec.url} after "
                             f"{time.monotonic() - self.started_at:.1f} s")
                waiting = [c.spec.name for c in self.children if not c.ready]
                bar.set_description_str("waiting for " + ", ".join(waiting) if waiting else "")
                if not waiting:
                    return True
                if self.stop_signal is not None:
                    note(f"received {signal.Signals(self.stop_signal).name} during startup")
                    return False
                dead = self.dead_child()
                if dead is not None:
                    bar.close()
                    self.report_death(dead)
                    return False
                now = time.monotonic()
                if now > deadline:
                    bar.close()
                    self.say(f"pdserve up: not ready after {self.startup_timeout:.0f} s: "
                             + ", ".join(waiting))
                    for child in self.children:
                        if not child.ready:
                            self.print_log_tail(child)
                    return False
                if not interactive and now >= next_line:
                    self.say(f"  waiting for {', '.join(waiting)} "
                             f"({now - self.started_at:.0f} s)")
                    next_line = now + PROGRESS_LINE_INTERVAL_S
                time.sleep(self.poll_interval)
        finally:
            bar.close()

    def supervise(self) -> int:
        """After startup: sleeps until a stop signal (returns 0) or a child's death (returns 1)."""
        while True:
            if self.stop_signal is not None:
                self.say(f"\nreceived {signal.Signals(self.stop_signal).name}, stopping ...")
                return 0
            dead = self.dead_child()
            if dead is not None:
                self.report_death(dead)
                return 1
            time.sleep(self.poll_interval)

    def report_death(self, child: Child) -> None:
        code = child.poll()
        how = (f"was killed by {signal.Signals(-code).name}" if code is not None and code < 0
               else f"exited with code {code}")
        self.say(f"pdserve up: {child.spec.name} (pid {child.pid}) {how}; stopping the others.")
        self.print_log_tail(child)

    def print_log_tail(self, child: Child) -> None:
        lines = tail_lines(child.log_path)
        self.say(f"---- last {len(lines)} lines of {child.log_path} ----")
        for line in lines:
            self.say(f"  {line}")
        self.say("----")

    def stop_all(self, sig: int = signal.SIGTERM) -> list[str]:
        """Stops every child and everything it started.

        ``sig`` goes to each child itself first, so that a server can shut down its own
        processes in order. Children still running after ``shutdown_timeout`` get SIGKILL, with
        their whole process group. Processes a child left behind in its group after it exited
        get SIGTERM, then SIGKILL after :data:`LEFTOVER_GRACE_S`.

        Returns:
            The names of the children that had to be killed.
        """
        for child in self.children:
            if child.poll() is None:
                child.signal(sig)
        deadline = time.monotonic() + self.shutdown_timeout
        while time.monotonic() < deadline and any(c.poll() is None for c in self.children):
            time.sleep(0.05)
        killed = [c.spec.name for c in self.children if c.poll() is None]
        for child in self.children:
            if child.poll() is None:
                child.signal_group(signal.SIGKILL)
        for child in self.children:
            if child.proc is not None:
                child.proc.wait()
        leftovers = [c for c in self.children if c.group_alive()]
        for child in leftovers:
            child.signal_group(signal.SIGTERM)
        deadline = time.monotonic() + LEFTOVER_GRACE_S
        while time.monotonic() < deadline and any(c.group_alive() for c in leftovers):
            time.sleep(0.05)
        for child in leftovers:
            if child.group_alive():
                child.signal_group(signal.SIGKILL)
        if killed:
            self.say(f"pdserve up: killed (no exit after {self.shutdown_timeout:.0f} s): "
                     + ", ".join(killed))
        if leftovers:
            self.say("pdserve up: stopped processes left behind by "
                     + ", ".join(c.spec.name for c in leftovers))
        return killed

    def run(self, on_ready: Callable[["Launcher"], None] | None = None) -> int:
        """Starts, waits for readiness, supervises, and always stops every child.

        Returns:
            0 after a requested stop, 1 if a child died or startup failed.
        """
        self.install_signal_handlers()
        try:
            self.start_all()
            for child in self.children:
                extra = f", side channel {child.spec.side_channel_port}" \
                    if child.spec.side_channel_port else ""
                gpu = f", GPU {child.spec.gpu}" if child.spec.gpu is not None else ""
                if child.spec.gpu_memory_share is not None:
                    gpu += (f" (shared: --gpu-memory-utilization "
                            f"{child.spec.gpu_memory_share:.3f} of its total memory)")
                self.say(f"  started {child.spec.name:<10} pid {child.pid}, port "
                         f"{child.spec.port}{extra}{gpu}, log {child.log_path}")
            if not self.wait_until_ready():
                rc = 0 if self.stop_signal is not None and self.dead_child() is None else 1
                self.write_status("failed" if rc else "stopping")
                return rc
            ready_after_s = round(time.monotonic() - self.started_at, 2)
            if on_ready is not None:
                on_ready(self)
            # Written after the banner, so a reader that sees "ready" also finds the endpoint
            # lines in the output.
            self.write_status("ready", ready_after_s=ready_after_s)
            rc = self.supervise()
            self.write_status("stopping")
            return rc
        except LaunchError as exc:
            self.say(f"pdserve up: error: {exc}")
            return 1
        finally:
            self.stop_all(self.stop_signal or signal.SIGTERM)
            if self.log_dir.exists():
                self.write_status("stopped")
            self.restore_signal_handlers()


# --------------------------------------------------------------------------------------------
# Banner
# --------------------------------------------------------------------------------------------


def _served_model_name(url: str, fallback: str, api_key: str | None = None) -> str:
    """The first model id an engine lists on ``/v1/models`` (``fallback`` if that fails)."""
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        data = httpx.get(url + "/v1/models", timeout=5, headers=headers).json()
        return data["data"][0]["id"]
    except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError):
        return fallback


def usage_banner(endpoint: str, model: str, api_key: str | None = None) -> str:
    """The ready-to-paste ``curl`` and ``openai`` examples for a running deployment."""
    auth = f" -H 'Authorization: Bearer {api_key}'" if api_key else ""
    body = json.dumps({"model": model, "messages": [
        {"role": "user", "content": "What is the capital of France?"}], "max_tokens": 32,
        "temperature": 0})
    key = api_key or "EMPTY"
    return f"""\
Try it:

  curl -s {endpoint}/v1/chat/completions -H 'Content-Type: application/json'{auth} \\
    -d '{body}'

  python - <<'EOF'
  from openai import OpenAI
  client = OpenAI(base_url="{endpoint}/v1", api_key="{key}")
  reply = client.chat.completions.create(
      model="{model}",
      messages=[{{"role": "user", "content": "What is the capital of France?"}}],
      max_tokens=32,
      temperature=0,  # greedy: the small default model rambles when sampled
  )
  print(reply.choices[0].message.content)
  EOF

  pdserve chat --url {endpoint}{" --api-key " + api_key if api_key else ""}
"""


def _print_ready(launcher: Launcher, opts: argparse.Namespace) -> None:
    proxy = launcher.children[-1].spec
    first_engine = launcher.children[0].spec
    api_key = option_value(opts.engine_args, "--api-key")
    fallback = option_value(opts.engine_args, "--served-model-name") or opts.model
    model = _served_model_name(first_engine.url, fallback, api_key)
    elapsed = time.monotonic() - launcher.started_at
    mode = "multi-turn" if opts.multi_turn else "stateless"
    launcher.say("")
    launcher.say(f"pdserve is up in {elapsed:.1f} s: {opts.num_prefillers} prefiller(s), "
                 f"{opts.num_decoders} decoder(s), {mode} proxy")
    launcher.say(f"  endpoint  {proxy.url}/v1   (OpenAI-compatible)")
    launcher.say(f"  model     {model}")
    launcher.say(f"  logs      {launcher.log_dir}")
    launcher.say(f"  status    {launcher.status_path()}")
    launcher.say("")
    launcher.say(usage_banner(proxy.url, model, api_key))
    launcher.say("Press Ctrl-C to stop.")


# --------------------------------------------------------------------------------------------
# Command line
# --------------------------------------------------------------------------------------------


def _port_list(text: str) -> list[int]:
    try:
        return [int(p) for p in text.replace(",", " ").split()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a list of ports: {text!r}") from None


def build_parser() -> argparse.ArgumentParser:
    """The ``pdserve up`` argument parser (engine options are not declared: they pass through)."""
    p = argparse.ArgumentParser(
        prog="pdserve up", allow_abbrev=False,
        description="Start prefiller(s), decoder(s) and the proxy on this host, wait until they "
                    "are healthy, and keep them running until Ctrl-C.",
        epilog="Options not listed here, and everything after '--', are passed to every "
               "'pdserve serve' (e.g. 'pdserve up -- --dtype float32 --max-model-len 2048'). "
               "Put boolean engine flags after '--' or after MODEL.")
    p.add_argument("model", nargs="?", default=DEFAULT_MODEL,
                   help=f"model: built-in name, Hugging Face directory or .gguf (default "
                        f"{DEFAULT_MODEL})")
    p.add_argument("--num-prefillers", type=int, default=1, metavar="N",
                   help="prefiller engines (kv_producer), default 1")
    p.add_argument("--num-decoders", type=int, default=1, metavar="M",
                   help="decoder engines (kv_consumer), default 1")
    p.add_argument("--multi-turn", action="store_true",
                   help="bidirectional KV transfer on P and D and the multi-turn proxy")
    p.add_argument("--device", default=None, choices=["auto", "cpu", "cuda"],
                   help="engine device (default: the engine's own default, auto)")
    p.add_argument("--host", default="127.0.0.1",
                   help="address the proxy binds (engines bind 127.0.0.1), default 127.0.0.1")
    p.add_argument("--port", type=int, default=DEFAULT_PROXY_PORT,
                   help=f"proxy port (0 = any free port), default {DEFAULT_PROXY_PORT}")
    p.add_argument("--prefill-ports", type=_port_list, default=None, metavar="P1,P2",
                   help="HTTP ports of the prefillers (default: free ports)")
    p.add_argument("--decode-ports", type=_port_list, default=None, metavar="P1,P2",
                   help="HTTP ports of the decoders (default: free ports)")
    p.add_argument("--prefill-side-channel-ports", type=_port_list, default=None,
                   metavar="P1,P2", help="NIXL side-channel ports of the prefillers "
                                         "(default: free ports)")
    p.add_argument("--decode-side-channel-ports", type=_port_list, default=None,
                   metavar="P1,P2", help="NIXL side-channel ports of the decoders "
                                         "(default: free ports)")
    p.add_argument("--log-dir", type=Path, default=None,
                   help="directory for child logs and pdserve-up.json (default: a new temp dir)")
    p.add_argument("--startup-timeout", type=float, default=DEFAULT_STARTUP_TIMEOUT_S,
                   metavar="SECONDS", help="give up if not all parts are healthy by then "
                                           f"(default {DEFAULT_STARTUP_TIMEOUT_S:.0f})")
    p.add_argument("--shutdown-timeout", type=float, default=DEFAULT_SHUTDOWN_TIMEOUT_S,
                   metavar="SECONDS", help="SIGKILL children still running this long after the "
                                           f"stop signal (default {DEFAULT_SHUTDOWN_TIMEOUT_S:.0f})")
    return p


def _engine_option_takes_value(option: str) -> bool | None:
    """Whether ``pdserve serve`` option ``option`` takes a value (None: not a known option)."""
    try:
        from pdserve.entrypoints.cli_args import build_parser as serve_parser
    except ImportError:  # server not installed in this build: fall back to the word heuristic
        return None
    action = serve_parser()._option_string_actions.get(option)
    if action is None:
        return None
    return action.nargs != 0


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    """Parses ``pdserve up`` options; unknown options and everything after ``--`` end up in
    ``engine_args``.

    Whether an engine option takes a value is looked up in the ``pdserve serve`` parser, so
    ``pdserve up --dtype float32 --enforce-eager MODEL`` works; for options it does not know
    (``--kv-transfer-config.*`` dotted keys) the next word is taken as the value unless it starts
    with ``-``.
    """
    argv = list(argv)
    passthrough: list[str] = []
    if "--" in argv:
        cut = argv.index("--")
        argv, passthrough = argv[:cut], argv[cut + 1:]
    parser = build_parser()
    known = parser._option_string_actions  # option string -> action
    ours: list[str] = []
    unknown: list[str] = []
    i = 0
    while i < len(argv):
        word = argv[i]
        name = word.split("=", 1)[0]
        if word.startswith("-") and len(word) > 1 and name not in known:
            unknown.append(word)
            takes_value = _engine_option_takes_value(name)
            if takes_value is None:
                takes_value = i + 1 < len(argv) and not argv[i + 1].startswith("-")
            if "=" not in word and takes_value and i + 1 < len(argv):
                unknown.append(argv[i + 1])
                i += 1
        else:
            ours.append(word)
        i += 1
    opts = parser.parse_args(ours)
    opts.engine_args = unknown + passthrough
    return opts


def main(argv: Sequence[str] | None = None, *, commands: ChildCommands | None = None,
         gpus: Sequence[str] | None = None) -> int:
    """Entry point of ``pdserve up``; returns the exit code.

    Args:
        argv: arguments after ``up``.
        commands: builder of the child command lines (tests pass fakes).
        gpus: GPUs to place engines on (default: :func:`detect_gpus`).
    """
    opts = parse_args(sys.argv[1:] if argv is None else argv)
    commands = commands or ChildCommands()
    try:
        specs = build_plan(opts, commands, gpus=gpus)
    except LaunchError as exc:
        print(f"pdserve up: error: {exc}", file=sys.stderr)
        return 2
    log_dir = opts.log_dir or Path(tempfile.mkdtemp(prefix="pdserve-up-"))
    print(f"pdserve up: model {opts.model}, logs in {log_dir}", flush=True)
    launcher = Launcher(specs, log_dir, startup_timeout=opts.startup_timeout,
                        shutdown_timeout=opts.shutdown_timeout)
    rc = launcher.run(on_ready=lambda la: _print_ready(la, opts))
    print(f"pdserve up: stopped (exit code {rc}); logs in {log_dir}", flush=True)
    return rc


if __name__ == "__main__":
    sys.exit(main())
