"""Command-line options of ``pdserve serve`` and their translation into :class:`EngineConfig`."""

from __future__ import annotations

import argparse
import re
from typing import Any

from pdserve.config import DEFAULT_MODEL, EngineConfig

# Size suffixes: binary (KiB, MiB, GiB, TiB) and decimal (K/KB, M/MB, G/GB, T/TB), any case.
_SIZE_UNITS = {
    "": 1, "b": 1,
    "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6,
    "g": 10**9, "gb": 10**9, "t": 10**12, "tb": 10**12,
    "ki": 2**10, "kib": 2**10, "mi": 2**20, "mib": 2**20,
    "gi": 2**30, "gib": 2**30, "ti": 2**40, "tib": 2**40,
}
_SIZE_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z]*)\s*$")


def parse_size(text: str) -> int:
    """Parses a byte count such as ``2GiB``, ``512MiB``, ``1.5G``, ``1e9`` or ``4096``.

    Binary suffixes (KiB, MiB, GiB, TiB) are powers of 1024, decimal ones (K, KB, M, MB, G, GB,
    T, TB) powers of 1000.

    Raises:
        argparse.ArgumentTypeError: not a positive size.
    """
    m = _SIZE_RE.match(str(text))
    unit = m.group(2).lower() if m else None
    if m is None or unit not in _SIZE_UNITS:
        raise argparse.ArgumentTypeError(
            f"invalid size {text!r}: use bytes or a number with a suffix such as 512MiB, 2GiB, 4G")
    value = int(float(m.group(1)) * _SIZE_UNITS[unit])
    if value <= 0:
        raise argparse.ArgumentTypeError(f"size must be positive, got {text!r}")
    return value


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def _fraction(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number in (0, 1], got {text!r}") from None
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"expected a number in (0, 1], got {text!r}")
    return value


def _port(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid port {text!r}") from None
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"port must be in 0..65535, got {value}")
    return value


def build_parser() -> argparse.ArgumentParser:
    """The ``pdserve serve`` parser (``--kv-transfer-config`` is extracted before it runs)."""
    p = argparse.ArgumentParser(
        prog="pdserve serve",
        description="OpenAI-compatible server for one engine instance (single, prefiller or "
                    "decoder).",
        epilog="KV transfer: --kv-transfer-config JSON, or dotted keys such as "
               "--kv-transfer-config.kv_role kv_producer.",
        allow_abbrev=False,
    )
    p.add_argument("model", nargs="?", default=DEFAULT_MODEL,
                   help=f"local Hugging Face directory, .gguf file, or the built-in "
                        f"'{DEFAULT_MODEL}' (default)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    p.add_argument("--port", type=_port, default=8000, help="HTTP port (default 8000; 0 = any)")
    p.add_argument("--served-model-name", default=None,
                   help="name clients send in 'model' (default: MODEL)")
    p.add_argument("--tokenizer", default=None, help="tokenizer directory if not MODEL's")
    p.add_argument("--load-format", choices=["auto", "dummy"], default="auto",
                   help="'dummy' = random weights with the model's config (speed work)")
    p.add_argument("--dtype", choices=["auto", "float32", "bfloat16", "float16"], default="auto")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--block-size", type=_positive_int, default=16, help="tokens per KV block")
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction,
                   default=True, help="automatic prefix caching (default on)")
    p.add_argument("--max-model-len", type=_positive_int, default=None,
                   help="longest prompt + output in tokens (default: the model's limit)")
    p.add_argument("--max-num-batched-tokens", type=_positive_int, default=None,
                   help="token budget of one engine step (chunked prefill)")
    p.add_argument("--max-num-seqs", type=_positive_int, default=None,
                   help="most requests running at once")
    p.add_argument("--gpu-memory-utilization", type=_fraction, default=None,
                   help="fraction of GPU memory this instance may use (CUDA)")
    p.add_argument("--kv-cache-memory", type=parse_size, default=None,
                   help="bytes for the KV cache, e.g. 2GiB (CPU; on CUDA overrides the fraction)")
    p.add_argument("--num-gpu-blocks-override", type=_positive_int, default=None,
                   help="fixed number of KV cache blocks")
    p.add_argument("--enforce-eager", action="store_true", help="disable CUDA graphs")
    p.add_argument("--num-scheduler-steps", type=_positive_int, default=None,
                   help="decode steps per scheduling round when all running requests decode "
                        "(multi-step scheduling; tokens stream in bursts of this many; default 1)")
    p.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' on /v1/* "
                        "(default: $PDSERVE_API_KEY if set)")
    p.add_argument("--log-level", default="info",
                   choices=["critical", "error", "warning", "info", "debug"])
    p.add_argument("--trust-remote-code", action="store_true")
    p.add_argument("--kv-events-endpoint", default=None, metavar="ZMQ_ENDPOINT",
                   help="publish prefix-cache changes (KV events, for the proxy's --routing "
                        "kv-aware) on this ZMQ PUB endpoint, e.g. tcp://*:5557 (default: off)")
    p.add_argument("--kv-events-snapshot-endpoint", default=None, metavar="ZMQ_ENDPOINT",
                   help="ZMQ REP endpoint serving KV event snapshots (default: the events "
                        "endpoint's port + 1)")
    return p


def engine_config_from_args(args: argparse.Namespace, kv_transfer_config: Any) -> EngineConfig:
    """Builds the :class:`EngineConfig`; options left unset keep the dataclass defaults."""
    kwargs: dict[str, Any] = dict(
        model=args.model,
        served_model_name=args.served_model_name,
        tokenizer=args.tokenizer,
        load_format=args.load_format,
        dtype=args.dtype,
        device=args.device,
        seed=args.seed,
        block_size=args.block_size,
        enable_prefix_caching=args.enable_prefix_caching,
        max_model_len=args.max_model_len,
        kv_cache_memory=args.kv_cache_memory,
        num_gpu_blocks_override=args.num_gpu_blocks_override,
        enforce_eager=args.enforce_eager,
        kv_transfer_config=kv_transfer_config,
        trust_remote_code=args.trust_remote_code,
        kv_events_endpoint=args.kv_events_endpoint,
        kv_events_snapshot_endpoint=args.kv_events_snapshot_endpoint,
    )
    for name in ("max_num_batched_tokens", "max_num_seqs", "gpu_memory_utilization",
                 "num_scheduler_steps"):
        value = getattr(args, name)
        if value is not None:
            kwargs[name] = value
    return EngineConfig(**kwargs)
