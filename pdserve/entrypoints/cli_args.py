"""Command-line options of ``pdserve serve`` and their translation into :class:`EngineConfig`."""

from __future__ import annotations

import argparse
import enum
from typing import Any, Callable, Sequence

from pdserve.model_files.builtin_models import BUILTIN_NAMES
from pdserve.types.kv_tiers import KVOffloadingBackend, KVOffloadingConfig
from pdserve.types.kv_transfer_config import KVTransferConfig
from pdserve.utils.host_devices import detect_gpus, nixl_progress_thread_default

from pdserve.commands.parser import (Parser, bind_port, fraction, non_negative_int, parse_size, port,
                               positive_float, positive_int, writable_dir)
from pdserve.types.engine_config import (
    DEFAULT_MODEL, KV_CACHE_DTYPE_CHOICES, EngineConfig, EvictionPolicy, KVCacheDtype,
)


def enum_option(parse: Callable[[str], enum.Enum], flag: str) -> Callable[[str], str]:
    """An argparse ``type`` for ``flag``: the value of the member ``parse(text)`` names, checked
    when the options are parsed (so ``pdserve up`` refuses a bad value before starting).

    Args:
        parse: the enum's ``parse`` (raises ValueError naming ``flag`` for an unknown value).
        flag: the option, dropped from the front of ``parse``'s message (argparse names it).

    Returns:
        The check; it raises ``argparse.ArgumentTypeError`` for an unknown value.
    """
    def check(text: str) -> str:
        try:
            return parse(text).value
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e).removeprefix(f"{flag} ")) from None
    return check


def build_parser() -> argparse.ArgumentParser:
    """The ``pdserve serve`` parser (``--kv-transfer-config`` is extracted before it runs)."""
    p = Parser(
        prog="pdserve serve",
        description="OpenAI-compatible server for one engine instance (single, prefiller or "
                    "decoder).",
        epilog="KV transfer: --kv-transfer-config JSON, or dotted keys such as "
               "--kv-transfer-config.kv_role kv_producer.",
        allow_abbrev=False,
    )
    builtins = " or ".join(f"'{name}'" for name in BUILTIN_NAMES)
    p.add_argument("model", nargs="?", default=DEFAULT_MODEL,
                   help=f"local Hugging Face directory, .gguf file, or a built-in model: "
                        f"{builtins} (default '{DEFAULT_MODEL}')")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    p.add_argument("--port", type=bind_port, default=8000, help="HTTP port (default 8000; 0 = any)")
    p.add_argument("--served-model-name", default=None,
                   help="name clients send in 'model' (default: MODEL)")
    p.add_argument("--tokenizer", default=None, help="tokenizer directory if not MODEL's")
    p.add_argument("--load-format", choices=["auto", "dummy"], default="auto",
                   help="'dummy' = random weights with the model's config (speed work)")
    p.add_argument("--dtype", choices=["auto", "float32", "bfloat16", "float16"], default="auto")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    p.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPE_CHOICES, default="auto",
                   help="what the KV cache stores: 'auto' = the model's dtype; 'fp8' (= "
                        "'fp8_e4m3') = float8 e4m3 with per-layer scales, half the bytes of "
                        "bf16 (default auto)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--block-size", type=positive_int, default=16, help="tokens per KV block")
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction,
                   default=True, help="automatic prefix caching (default on)")
    p.add_argument("--prefix-cache-eviction", default="lru", metavar="{lru,depth-first}",
                   type=enum_option(EvictionPolicy.parse, "--prefix-cache-eviction"),
                   help="which free cached block is reused first: 'lru' = least recently freed "
                        "(vLLM's order); 'depth-first' = the deepest block of a prompt first, "
                        "keeping the leading blocks of every recent history (multi-turn "
                        "working sets larger than the cache; default lru)")
    p.add_argument("--max-model-len", type=positive_int, default=None,
                   help="longest prompt + output in tokens (default: the model's limit)")
    p.add_argument("--max-num-batched-tokens", type=positive_int, default=None,
                   help="token budget of one engine step (chunked prefill)")
    p.add_argument("--max-num-seqs", type=positive_int, default=None,
                   help="most requests running at once")
    p.add_argument("--gpu-memory-utilization", type=fraction, default=None,
                   help="fraction of GPU memory this instance may use (CUDA)")
    p.add_argument("--kv-cache-memory", type=parse_size, default=None,
                   help="bytes for the KV cache, e.g. 2GiB (CPU; on CUDA overrides the fraction)")
    p.add_argument("--num-gpu-blocks-override", type=positive_int, default=None,
                   help="fixed number of KV cache blocks")
    p.add_argument("--enforce-eager", action="store_true", help="disable CUDA graphs")
    p.add_argument("--piecewise-cuda-graph-max-tokens", type=non_negative_int, default=None,
                   metavar="N",
                   help="steps with prefills of at most N tokens replay the stages between "
                        "attention calls from CUDA graphs (default 8192; 0: eager)")
    p.add_argument("--num-scheduler-steps", type=positive_int, default=None,
                   help="decode steps per scheduling round when all running requests decode "
                        "(multi-step scheduling; tokens stream in bursts of this many; default 1)")
    p.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None,
                   help="async scheduling: prepare and launch step n+1 while the device "
                        "runs step n; each token reaches the client one step later (default: "
                        "on; --no-async-scheduling runs every step synchronously)")
    p.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' on /v1/* "
                        "(default: $PDSERVE_API_KEY if set)")
    p.add_argument("--log-level", default="info",
                   choices=["critical", "error", "warning", "info", "debug"])
    p.add_argument("--trust-remote-code", action="store_true")
    # Listed for --help only: pdserve.kv_transfer.config_cli takes every form of it out of the
    # command line before this parser runs.
    p.add_argument("--kv-transfer-config", metavar="JSON", default=None,
                   help="P/D role and KV connector, e.g. '{\"kv_connector\":\"NixlConnector\","
                        "\"kv_role\":\"kv_producer\"}' (prefiller; 'kv_consumer': decoder); "
                        "single keys as --kv-transfer-config.KEY VALUE (docs/configuration.md; "
                        "default: no KV transfer)")
    p.add_argument("--kv-events-endpoint", default=None, metavar="ZMQ_ENDPOINT",
                   help="publish prefix-cache changes (KV events, for the proxy's --routing "
                        "kv-aware) on this ZMQ PUB endpoint, e.g. tcp://*:5557 (default: off)")
    p.add_argument("--kv-events-snapshot-endpoint", default=None, metavar="ZMQ_ENDPOINT",
                   help="ZMQ REP endpoint serving KV event snapshots (default: the events "
                        "endpoint's port + 1)")
    p.add_argument("--kv-offloading-size", type=positive_float, default=None, metavar="GiB",
                   help="KV cache tier in host memory behind the prefix cache, in GiB over all "
                        "TP ranks: cached blocks evicted from the KV cache are kept there and "
                        "copied back on a prefix hit (default: off)")
    p.add_argument("--kv-offloading-backend", default=None, metavar="native",
                   type=enum_option(KVOffloadingBackend.parse, "--kv-offloading-backend"),
                   help="offloading backend: 'native' (the only one; default)")
    p.add_argument("--kv-offloading-disk-dir", default=None, type=writable_dir, metavar="DIR",
                   help="a disk tier below the host tier: block files under DIR (needs "
                        "--kv-offloading-disk-size)")
    p.add_argument("--kv-offloading-disk-size", type=positive_float, default=None, metavar="GiB",
                   help="size of the disk tier in GiB over all TP ranks")
    # --- tensor parallelism
    p.add_argument("-tp", "--tensor-parallel-size", type=positive_int, default=1,
                   help="shard the model over N devices, one process per rank (default 1)")
    _add_data_parallel_args(p)
    return p


def _add_data_parallel_args(p: argparse.ArgumentParser) -> None:
    """Data parallelism (vLLM's option names; pdserve/engine/data_parallel.py)."""
    g = p.add_argument_group("data parallelism")
    g.add_argument("--data-parallel-size", "-dp", type=positive_int, default=1,
                   help="engine cores (ranks) behind this API server, over all hosts; rank r "
                        "uses NIXL side-channel port base + r (default 1)")
    g.add_argument("--data-parallel-size-local", "-dpl", type=positive_int, default=None,
                   help="ranks started on this host (default: all)")
    g.add_argument("--data-parallel-start-rank", "-dpr", type=int, default=0,
                   help="first rank started on this host (--headless hosts; default 0)")
    g.add_argument("--data-parallel-address", "-dpa", default=None,
                   help="the head's address that every rank host can reach (multi-host)")
    g.add_argument("--data-parallel-rpc-port", "-dpp", type=port, default=13345,
                   help="the head's port where ranks of other hosts join (default 13345)")
    g.add_argument("--headless", action="store_true",
                   help="run ranks only (no API server); they join the head at "
                        "--data-parallel-address:--data-parallel-rpc-port")
    g.add_argument("--data-parallel-join-timeout", type=positive_float, default=60.0,
                   help="seconds a --headless host keeps trying to reach the head (default 60)")


def engine_config_from_args(args: argparse.Namespace, kv_transfer_config: Any) -> EngineConfig:
    """Builds the :class:`EngineConfig`; options left unset keep the dataclass defaults."""
    kwargs: dict[str, Any] = dict(
        model=args.model,
        served_model_name=args.served_model_name,
        tokenizer=args.tokenizer,
        load_format=args.load_format,
        dtype=args.dtype,
        device=args.device,
        kv_cache_dtype=KVCacheDtype.parse(args.kv_cache_dtype),
        seed=args.seed,
        block_size=args.block_size,
        enable_prefix_caching=args.enable_prefix_caching,
        prefix_cache_eviction=EvictionPolicy.parse(args.prefix_cache_eviction),
        max_model_len=args.max_model_len,
        kv_cache_memory=args.kv_cache_memory,
        num_gpu_blocks_override=args.num_gpu_blocks_override,
        enforce_eager=args.enforce_eager,
        kv_transfer_config=kv_transfer_config,
        kv_offloading=KVOffloadingConfig.from_flags(
            args.kv_offloading_size, args.kv_offloading_backend, args.kv_offloading_disk_dir,
            args.kv_offloading_disk_size),
        trust_remote_code=args.trust_remote_code,
        kv_events_endpoint=args.kv_events_endpoint,
        kv_events_snapshot_endpoint=args.kv_events_snapshot_endpoint,
        tensor_parallel_size=args.tensor_parallel_size,
        # data parallelism
        data_parallel_size=args.data_parallel_size,
        data_parallel_size_local=args.data_parallel_size_local,
        data_parallel_start_rank=args.data_parallel_start_rank,
        data_parallel_address=args.data_parallel_address,
        data_parallel_rpc_port=args.data_parallel_rpc_port,
        headless=args.headless,
        data_parallel_join_timeout=args.data_parallel_join_timeout,
    )
    for name in ("max_num_batched_tokens", "max_num_seqs", "gpu_memory_utilization",
                 "num_scheduler_steps", "async_scheduling", "piecewise_cuda_graph_max_tokens"):
        value = getattr(args, name)
        if value is not None:
            kwargs[name] = value
    return EngineConfig(**kwargs)


def with_host_defaults(config: KVTransferConfig | None, argv: Sequence[str],
                       device: str | None) -> KVTransferConfig | None:
    """``config`` with the defaults that depend on this host: NIXL's progress thread off for an
    engine without a GPU (:func:`pdserve.utils.host_devices.nixl_progress_thread_default`, the
    rule ``pdserve up`` applies too), unless the command line sets ``nixl_progress_thread``.

    Args:
        config: the parsed ``--kv-transfer-config`` (None: no KV transfer, returned as is).
        argv: the command line it was parsed from (an explicit value always wins).
        device: the engine's ``--device``.
    """
    if config is None:
        return None
    words = list(argv)
    words = words[:words.index("--")] if "--" in words else words
    if any("nixl_progress_thread" in word for word in words):
        return config
    if nixl_progress_thread_default(device, detect_gpus()):
        return config
    data = config.to_dict()
    data["kv_connector_extra_config"]["nixl_progress_thread"] = False
    return KVTransferConfig.from_dict(data)
