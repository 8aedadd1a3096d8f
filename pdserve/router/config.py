"""Command-line surface of ``pdserve proxy`` and the validated :class:`ProxyConfig`.

Instances are named by host lists and port lists per role. Pairing rule (documented in
docs/proxy.md): equal-length lists pair position by position; a single host is used for every
port (several instances on one machine); a single port is used for every host (one instance per
machine on the same port); any other mismatch is a startup error.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from pdserve import cli_types

#: Default lifetime of a multi-turn entry in seconds; equals the decoder's default
#: ``decoder_kv_blocks_ttl`` (DESIGN.md §4), after which D has freed the blocks anyway.
DEFAULT_CONVERSATION_TTL_S = 480.0
#: Default bound on the number of remembered conversations (least recently used are dropped).
DEFAULT_MAX_CONVERSATIONS = 100_000
#: Default per-leg timeout in seconds (wait for a response or for the next streamed chunk).
DEFAULT_TIMEOUT_S = 600.0


@dataclass(frozen=True)
class ProxyConfig:
    """Validated proxy settings.

    Attributes:
        host, port: where the proxy listens (port 0 = any free port; the bound one is printed).
        prefillers, decoders: base URLs of the instances, e.g. ``"http://127.0.0.1:8100"``.
        routing: ``"round-robin"`` or ``"least-loaded"`` (fewest requests in flight).
        multi_turn: remember D's ``kv_transfer_params`` per ``conversation_id`` (DESIGN.md §3).
        api_key: key clients must send as ``Authorization: Bearer <key>``; None = open.
        upstream_api_key: key sent to P and D as ``Authorization: Bearer <key>``; None = forward
            the client's ``Authorization`` header unchanged (if any).
        max_conversations: LRU bound on remembered conversations.
        conversation_ttl: seconds a conversation entry lives after its last turn.
        timeout: seconds to wait for an upstream's response, and between streamed chunks.
    """

    host: str = "127.0.0.1"
    port: int = 8000
    prefillers: tuple[str, ...] = ()
    decoders: tuple[str, ...] = ()
    routing: str = "round-robin"
    multi_turn: bool = False
    api_key: str | None = None
    upstream_api_key: str | None = None
    max_conversations: int = DEFAULT_MAX_CONVERSATIONS
    conversation_ttl: float = DEFAULT_CONVERSATION_TTL_S
    timeout: float = DEFAULT_TIMEOUT_S


def base_url(host: str, port: int) -> str:
    """``http://host:port`` for a host given as a name, an IP (v4 or v6) or ``http(s)://host``."""
    scheme = "http"
    for prefix in ("http://", "https://"):
        if host.startswith(prefix):
            scheme, host = prefix[:-3], host[len(prefix):]
            break
    host = host.rstrip("/")
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"  # bare IPv6 literal
    return f"{scheme}://{host}:{port}"


def pair_instances(hosts: list[str] | None, ports: list[int] | None, role: str) -> tuple[str, ...]:
    """Base URLs for one role from its host and port lists (pairing rule in the module docstring).

    Raises:
        ValueError: no port given, or host and port counts that cannot be paired.
    """
    if not ports:
        raise ValueError(f"at least one {role} port is required (--{role}-ports)")
    hosts = hosts or ["127.0.0.1"]
    if len(hosts) == 1:
        hosts = hosts * len(ports)
    elif len(ports) == 1:
        ports = ports * len(hosts)
    if len(hosts) != len(ports):
        raise ValueError(
            f"--{role}-hosts has {len(hosts)} entries but --{role}-ports has {len(ports)}; "
            "give one host per port, a single host for all ports, or a single port for all hosts"
        )
    urls = tuple(base_url(h, p) for h, p in zip(hosts, ports))
    if len(set(urls)) != len(urls):
        raise ValueError(f"duplicate {role} instance in {list(urls)}")
    return urls


def build_parser() -> argparse.ArgumentParser:
    """The ``pdserve proxy`` argument parser."""
    p = argparse.ArgumentParser(
        prog="pdserve proxy",
        description="OpenAI-compatible P->D disaggregation proxy: each request is prefilled on a "
        "prefiller (max_tokens=1) and decoded on a decoder that pulls the KV cache.",
        allow_abbrev=False,
    )
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="port to listen on (default 8000; 0 = any free port)")
    for role, what in (("prefiller", "prefill (kv_producer)"), ("decoder", "decode (kv_consumer)")):
        p.add_argument(f"--{role}-hosts", f"--{role}-host", dest=f"{role}_hosts", nargs="+",
                       action="extend", metavar="HOST",
                       help=f"hosts of the {what} instances (default 127.0.0.1); one per port, or "
                            "one for all ports; repeatable")
        p.add_argument(f"--{role}-ports", f"--{role}-port", dest=f"{role}_ports", nargs="+",
                       action="extend", type=cli_types.port, metavar="PORT",
                       help=f"HTTP ports of the {what} instances; repeatable")
    p.add_argument("--routing", choices=("round-robin", "least-loaded"), default="round-robin",
                   help="how to pick an instance per leg (default round-robin; least-loaded = fewest "
                        "requests in flight)")
    p.add_argument("--multi-turn", action="store_true",
                   help="remember the decoder's kv_transfer_params per conversation_id (body field or "
                        "X-Session-ID header) and send them to the prefiller with the next turn")
    p.add_argument("--api-key", default=None, help="key clients must send as 'Authorization: Bearer KEY'")
    p.add_argument("--upstream-api-key", default=None,
                   help="key sent to the instances as 'Authorization: Bearer KEY' (default: forward "
                        "the client's Authorization header)")
    p.add_argument("--max-conversations", type=cli_types.positive_int, default=DEFAULT_MAX_CONVERSATIONS,
                   help=f"LRU bound of --multi-turn entries (default {DEFAULT_MAX_CONVERSATIONS})")
    p.add_argument("--conversation-ttl", type=cli_types.positive_float, default=DEFAULT_CONVERSATION_TTL_S,
                   help="seconds a --multi-turn entry lives after its last turn (default 480 = the "
                        "decoder's decoder_kv_blocks_ttl); a sooner remote_blocks_expiry_time from the "
                        "decoder wins")
    p.add_argument("--timeout", type=cli_types.positive_float, default=DEFAULT_TIMEOUT_S,
                   help="seconds to wait for an instance's response or next streamed chunk "
                        f"(default {DEFAULT_TIMEOUT_S:g})")
    return p


def parse_args(argv: list[str]) -> ProxyConfig:
    """Parse ``pdserve proxy`` arguments.

    Raises:
        SystemExit: (code 2, with a usage message on stderr) for bad or inconsistent arguments.
    """
    parser = build_parser()
    ns = parser.parse_args(argv)
    if not 0 <= ns.port <= 65535:
        parser.error(f"--port {ns.port}: must be 0..65535")
    try:
        prefillers = pair_instances(ns.prefiller_hosts, ns.prefiller_ports, "prefiller")
        decoders = pair_instances(ns.decoder_hosts, ns.decoder_ports, "decoder")
    except ValueError as e:
        parser.error(str(e))
    return ProxyConfig(
        host=ns.host, port=ns.port, prefillers=prefillers, decoders=decoders, routing=ns.routing,
        multi_turn=ns.multi_turn, api_key=ns.api_key or None,
        upstream_api_key=ns.upstream_api_key or None, max_conversations=ns.max_conversations,
        conversation_ttl=ns.conversation_ttl, timeout=ns.timeout,
    )
