"""The plan of ``pdserve up``: which children to start, with which ports, GPUs, environment and
command lines (nothing is started here).

Every engine gets its own free HTTP port and its own free NIXL side-channel port
(``PDSERVE_NIXL_SIDE_CHANNEL_PORT``; an engine with ``--prefill-dp`` / ``--decode-dp`` ranks gets
that many consecutive free ports, rank ``r`` listening on ``base + r``); prefillers and decoders
are placed on separate GPUs when there are several (each data-parallel rank counts as one
engine). The child commands come from a :class:`ChildCommands` object, which tests
replace with fakes.

Free ports come from :mod:`pdserve.launcher.ports`.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass, field
from typing import Sequence

from pdserve.model_files.tp_precheck import TPShardingError, check_splits
from pdserve.launcher.errors import LaunchError
from pdserve.launcher.ports import (ENGINE_HOST, allocate_free_ports, allocate_port_ranges,
                                    connect_host, ensure_port_free)
from pdserve.router.upstreams import proxy_needs_tokenizer
from pdserve.utils.host_devices import detect_gpus, nixl_progress_thread_default

DEFAULT_PROXY_PORT = 8000
#: --migration-limit of the proxy that `pdserve up` starts (the proxy's own default is 0: off).
UP_MIGRATION_LIMIT = 3
# Fraction of a GPU's memory that the engines sharing it may use together when
# --gpu-memory-utilization is not given (vLLM's default for one engine alone); a given value is
# likewise split between the engines sharing a GPU.
SHARED_GPU_MEMORY_FRACTION = 0.9


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
        side_channel_port: NIXL side-channel port (engines only; of rank 0 with data parallelism).
        data_parallel_size: engine cores of the child (``--data-parallel-size``; rank ``r``'s
            side channel is ``side_channel_port + r``).
        gpu: the ``CUDA_VISIBLE_DEVICES`` value given to the child (one entry, or a
            comma-joined set for an engine with data-parallel ranks or tensor-parallel ranks;
            rank ``r`` of data-parallel rank ``d`` uses entry ``d * tp + r``), or None.
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
    data_parallel_size: int = 1
    gpu: str | None = None
    gpu_memory_share: float | None = None

    @property
    def url(self) -> str:
        """Base URL clients on this host use to reach the child."""
        return f"http://{connect_host(self.host)}:{self.port}"


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


def _engine_gpus(rank_gpus: Sequence[str | None]) -> str | None:
    """The ``CUDA_VISIBLE_DEVICES`` of an engine whose ranks got ``rank_gpus`` (each GPU once,
    in rank order; ranks beyond the list share it round robin), or None without GPUs."""
    if not rank_gpus or rank_gpus[0] is None:
        return None
    return ",".join(dict.fromkeys(g for g in rank_gpus if g is not None))
def assign_tp_gpus(num_prefillers: int, num_decoders: int, prefill_tp: int, decode_tp: int,
                   gpus: Sequence[str]) -> tuple[list[str | None], list[str | None]]:
    """Places tensor-parallel engines: each engine gets its own set of GPUs (its TP size of
    them, disjoint from every other engine's), prefillers first, as the comma-joined
    ``CUDA_VISIBLE_DEVICES`` value of the engine (its ranks use devices ``0..tp-1`` of it).
    Without GPUs every entry is None (CPU engines, any TP size).

    Returns:
        (GPUs per prefiller, GPUs per decoder).

    Raises:
        LaunchError: fewer GPUs than the engines need together (the message has the numbers).
    """
    if not gpus:
        return [None] * num_prefillers, [None] * num_decoders
    need = num_prefillers * prefill_tp + num_decoders * decode_tp
    if need > len(gpus):
        raise LaunchError(
            f"{num_prefillers} prefiller(s) x TP {prefill_tp} + {num_decoders} decoder(s) x TP "
            f"{decode_tp} need {need} GPUs, but {len(gpus)} are available "
            f"({','.join(gpus)}); lower --prefill-tp/--decode-tp or the engine counts")
    free = iter(gpus)
    sets = [",".join(next(free) for _ in range(tp))
            for tp in [prefill_tp] * num_prefillers + [decode_tp] * num_decoders]
    return sets[:num_prefillers], sets[num_prefillers:]


def kv_transfer_config(role: str, multi_turn: bool, progress_thread: bool = True) -> dict:
    """The ``--kv-transfer-config`` of one engine (keys: docs/configuration.md).

    Args:
        role: ``kv_producer`` (prefiller) or ``kv_consumer`` (decoder).
        multi_turn: turns on ``bidirectional_kv_xfer`` so the decoder's KV of one turn can be
            pulled back by a prefiller for the next turn (docs/architecture.md, KV connector).
        progress_thread: False turns NIXL's progress thread off (``nixl_progress_thread``), for
            an engine without a GPU: the thread keeps a CPU core busy, which the engines of a
            CPU-only host need.
    """
    config: dict = {"kv_connector": "NixlConnector", "kv_role": role}
    extra: dict = {}
    if multi_turn:
        extra["bidirectional_kv_xfer"] = True
    if not progress_thread:
        extra["nixl_progress_thread"] = False
    if extra:
        config["kv_connector_extra_config"] = extra
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
              api_key: str | None = None, local_prefill_max_tokens: int = 0,
              tokenizer: str | None = None, routing: str = "round-robin") -> list[str]:
        """``pdserve proxy`` in front of the given (host, HTTP port) engines, migrating a
        stream whose decoder fails mid-stream up to :data:`UP_MIGRATION_LIMIT` times.

        With ``api_key`` the proxy requires it from clients and forwards their ``Authorization``
        header to the engines, which were started with the same key. ``local_prefill_max_tokens``
        > 0 lets decoders prefill requests they hold all but that many prompt tokens of
        (``--local-prefill-max-tokens``); ``routing`` is the proxy's ``--routing`` policy
        (``kv-aware`` weighs the engines' KV events against load). Both need ``tokenizer``, the
        served model's, which goes to the proxy once.
        """
        argv = [self.python, "-m", "pdserve.cli", "proxy", "--host", host, "--port", str(port),
                "--prefiller-hosts", *[h for h, _ in prefillers],
                "--prefiller-ports", *[str(p) for _, p in prefillers],
                "--decoder-hosts", *[h for h, _ in decoders],
                "--decoder-ports", *[str(p) for _, p in decoders],
                "--migration-limit", str(UP_MIGRATION_LIMIT)]
        if multi_turn:
            argv.append("--multi-turn")
        if api_key:
            argv += ["--api-key", api_key]
        if routing != "round-robin":
            argv += ["--routing", routing]
        if local_prefill_max_tokens:
            argv += ["--local-prefill-max-tokens", str(local_prefill_max_tokens)]
        if proxy_needs_tokenizer(routing, local_prefill_max_tokens):
            argv += ["--tokenizer", tokenizer]
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
    for flag, value in (("--num-prefillers", n_p), ("--num-decoders", n_d),
                        ("--prefill-dp", opts.prefill_dp), ("--decode-dp", opts.decode_dp)):
        if value < 1:
            raise LaunchError(f"{flag} must be a positive integer (at least 1), got {value}")
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
    if _option_given(engine_args, "-tp", "--tensor-parallel-size"):
        raise LaunchError("the engines' tensor-parallel sizes are set by 'pdserve up'; use "
                          "--prefill-tp/--decode-tp")
    tp_sizes = {"prefill": opts.prefill_tp, "decode": opts.decode_tp}
    for role, tp in tp_sizes.items():
        try:  # torch-free: from the model's config.json or GGUF metadata
            check_splits(opts.model, tp)
        except TPShardingError as e:
            raise LaunchError(f"--{role}-tp {tp}: {e}") from None

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

    dp_p, dp_d = opts.prefill_dp, opts.decode_dp
    for flag, ports, dp in (("--prefill-side-channel-ports", opts.prefill_side_channel_ports, dp_p),
                            ("--decode-side-channel-ports", opts.decode_side_channel_ports, dp_d)):
        for base in ports or ():  # the other ranks' ports, base + 1 .. base + dp - 1
            for port in range(base + 1, base + dp):
                if port in seen:
                    raise LaunchError(f"port {port} of a data-parallel rank ({flag}) is also "
                                      f"given as {seen[port]}")
                ensure_port_free(ENGINE_HOST, port, flag)
                seen[port] = flag

    missing = sum(n for n, ports in ((n_p, opts.prefill_ports), (n_d, opts.decode_ports))
                  if ports is None)
    free = iter(allocate_free_ports(missing, ENGINE_HOST, exclude=list(seen)))

    def ports_for(given_ports: list[int] | None, count: int) -> list[int]:
        return list(given_ports) if given_ports is not None else [next(free) for _ in range(count)]

    p_ports, d_ports = ports_for(opts.prefill_ports, n_p), ports_for(opts.decode_ports, n_d)
    taken = [*seen, *p_ports, *d_ports]
    p_side = opts.prefill_side_channel_ports or allocate_port_ranges(n_p, dp_p, ENGINE_HOST, taken)
    taken += [b + r for b in p_side for r in range(dp_p)]
    d_side = opts.decode_side_channel_ports or allocate_port_ranges(n_d, dp_d, ENGINE_HOST, taken)
    taken += [b + r for b in d_side for r in range(dp_d)]

    if opts.device == "cpu":
        gpus = []
    elif gpus is None:
        gpus = detect_gpus()
    if opts.prefill_tp > 1 or opts.decode_tp > 1:
        # Tensor-parallel engines get disjoint GPU sets, tp GPUs per data-parallel rank.
        p_gpus, d_gpus = assign_tp_gpus(n_p, n_d, opts.prefill_tp * dp_p,
                                        opts.decode_tp * dp_d, gpus)
        p_rank_gpus, d_rank_gpus = [], []
    else:
        # Each data-parallel rank is placed like an engine of its own; an engine's ranks take
        # consecutive entries (rank r of engine i: entry i * dp + r).
        p_rank_gpus, d_rank_gpus = assign_gpus(n_p * dp_p, n_d * dp_d, gpus)
        p_gpus = [_engine_gpus(p_rank_gpus[i * dp_p:(i + 1) * dp_p]) for i in range(n_p)]
        d_gpus = [_engine_gpus(d_rank_gpus[i * dp_d:(i + 1) * dp_d]) for i in range(n_d)]
    sharing: dict[str, int] = {}
    for gpu in p_rank_gpus + d_rank_gpus:
        if gpu is not None:
            sharing[gpu] = sharing.get(gpu, 0) + 1
    # One GPU shared by several engines: each gets an equal part of --gpu-memory-utilization
    # (each engine's flag is its own share of the total, see pdserve/runner/memory_budget.py).
    kv_memory_given = _option_given(engine_args, "--kv-cache-memory")
    util_text = option_value(engine_args, "--gpu-memory-utilization")
    try:
        util_total = SHARED_GPU_MEMORY_FRACTION if util_text is None else float(util_text)
    except ValueError:
        raise LaunchError(f"--gpu-memory-utilization must be a number, got {util_text!r}") \
            from None

    # KV events: every engine publishes its prefix-cache changes for the proxy's
    # --routing kv-aware, on two free ports (events, snapshots) unless the user set the option.
    # (An engine with several data-parallel ranks publishes none: one endpoint per instance.)
    events_on = not _option_given(engine_args, "--kv-events-endpoint")
    num_publishing = (n_p if dp_p == 1 else 0) + (n_d if dp_d == 1 else 0)
    event_ports = iter(allocate_free_ports(2 * num_publishing, ENGINE_HOST, exclude=taken)
                       if events_on else ())

    specs: list[ChildSpec] = []
    for role, kv_role, count, ports, side_ports, gpu_list, dp in (
            ("prefill", "kv_producer", n_p, p_ports, p_side, p_gpus, dp_p),
            ("decode", "kv_consumer", n_d, d_ports, d_side, d_gpus, dp_d)):
        for i in range(count):
            args_i = list(engine_args)
            if dp > 1:
                args_i[:0] = ["--data-parallel-size", str(dp)]
            elif events_on:
                args_i[:0] = ["--kv-events-endpoint", f"tcp://{ENGINE_HOST}:{next(event_ports)}",
                              "--kv-events-snapshot-endpoint",
                              f"tcp://{ENGINE_HOST}:{next(event_ports)}"]
            if tp_sizes[role] > 1:
                args_i[:0] = ["--tensor-parallel-size", str(tp_sizes[role])]
            gpu = gpu_list[i]
            env = {"PDSERVE_NIXL_SIDE_CHANNEL_HOST": ENGINE_HOST,
                   "PDSERVE_NIXL_SIDE_CHANNEL_PORT": str(side_ports[i]),
                   "PYTHONUNBUFFERED": "1"}
            share = None
            if gpu is not None:
                env["CUDA_VISIBLE_DEVICES"] = gpu
                most = max(sharing.get(g, 1) for g in gpu.split(","))
                if most > 1 and not kv_memory_given:
                    share = round(util_total / most, 3)
                    args_i += ["--gpu-memory-utilization", f"{share:.3f}"]  # the last one wins
            argv = commands.engine(model=opts.model, role=role, host=ENGINE_HOST, port=ports[i],
                                   kv_config=kv_transfer_config(
                                       kv_role, opts.multi_turn,
                                       progress_thread=nixl_progress_thread_default(
                                           opts.device, [gpu] if gpu is not None else [])),
                                   device=opts.device, engine_args=args_i)
            specs.append(ChildSpec(name=f"{role}-{i}", role=role, argv=argv, env=env,
                                   host=ENGINE_HOST, port=ports[i],
                                   health_path=commands.health_path_engine,
                                   side_channel_port=side_ports[i], data_parallel_size=dp, gpu=gpu,
                                   gpu_memory_share=share))
    proxy_argv = commands.proxy(
        host=opts.host, port=opts.port,
        prefillers=[(ENGINE_HOST, p) for p in p_ports], decoders=[(ENGINE_HOST, p) for p in d_ports],
        multi_turn=opts.multi_turn, api_key=option_value(engine_args, "--api-key"),
        local_prefill_max_tokens=opts.local_prefill_max_tokens, routing=opts.routing,
        tokenizer=option_value(engine_args, "--tokenizer") or opts.model)
    specs.append(ChildSpec(name="proxy", role="proxy", argv=proxy_argv,
                           env={"PYTHONUNBUFFERED": "1", "CUDA_VISIBLE_DEVICES": ""},
                           host=opts.host, port=opts.port, health_path=commands.health_path_proxy))
    return specs

