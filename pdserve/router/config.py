"""Command-line surface of ``pdserve proxy`` and the validated :class:`ProxyConfig`.

Instances are named by host lists and port lists per role. Pairing rule (documented in
docs/proxy.md): equal-length lists pair position by position; a single host is used for every
port (several instances on one machine); a single port is used for every host (one instance per
machine on the same port); any other mismatch is a startup error.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from pdserve.commands import parser as cli_types
from pdserve.router.handoff import HandoffMode
from pdserve.router.health import DEFAULT_BREAKER_BACKOFF_S, DEFAULT_BREAKER_FAILURES
from pdserve.router.kv_index import DEFAULT_STALE_AFTER_S
from pdserve.router.kv_routing import DEFAULT_KV_LOAD_WEIGHT
from pdserve.router.migration import DEFAULT_STALL_TIMEOUT_S
from pdserve.router.state_store import check_state_store_url
from pdserve.router.upstreams import ROUTING_POLICIES, proxy_needs_tokenizer

#: Default lifetime of a multi-turn entry in seconds; equals the decoder's default
#: ``decoder_kv_blocks_ttl`` (docs/proxy.md), after which D has freed the blocks anyway.
DEFAULT_CONVERSATION_TTL_S = 480.0
#: Default bound on the number of remembered conversations (least recently used are dropped).
DEFAULT_MAX_CONVERSATIONS = 100_000
#: Default per-leg timeout in seconds (wait for a response or for the next streamed chunk).
DEFAULT_TIMEOUT_S = 600.0
#: Default retries per request before its first token, both legs together (``--max-retries``).
DEFAULT_MAX_RETRIES = 2


@dataclass(frozen=True)
class ProxyConfig:
    """Validated proxy settings.

    Attributes:
        host, port: where the proxy listens (port 0 = any free port; the bound one is printed).
        prefillers, decoders: base URLs of the instances, e.g. ``"http://127.0.0.1:8100"``.
        routing: ``"round-robin"``, ``"least-loaded"`` (fewest requests in flight) or
            ``"kv-aware"`` (prompt blocks cached per instance against load; docs/proxy.md).
        multi_turn: remember D's ``kv_transfer_params`` per ``conversation_id`` (docs/proxy.md).
        api_key: key clients must send as ``Authorization: Bearer <key>``; None = open.
        upstream_api_key: key sent to P and D as ``Authorization: Bearer <key>``; None = forward
            the client's ``Authorization`` header unchanged (if any).
        max_conversations: LRU bound on remembered conversations.
        conversation_ttl: seconds a conversation entry lives after its last turn.
        timeout: seconds to wait for an upstream's response, and between streamed chunks.
        tokenizer: the served model (built-in name, directory or ``.gguf``) whose tokenizer
            kv-aware routing and local prefill use; required with ``routing="kv-aware"`` and
            with ``local_prefill_max_tokens`` > 0.
        kv_load_weight: kv-aware cost of one request in flight against a whole cached prompt.
        kv_events_stale_after: seconds without KV events after which an instance's cache view
            is ignored (kv-aware falls back to least-loaded).
        state_store: ``"memory"`` or ``"redis://HOST:PORT/DB"`` (the multi-turn table).
        log_level: ``critical`` .. ``debug`` (``debug`` logs every routing decision).
        session_affinity: a conversation's next turn prefers its previous decoder while that
            decoder's load allows (``pdserve.router.kv_routing.AFFINITY_MAX_EXTRA_IN_FLIGHT``).
        max_retries: sends of a leg again, on another instance, after an instance failed before
            the request's first token (both legs of a request share it; 0 = never). Connection
            failures, where nothing was sent, move on to the next instance without counting.
        breaker_failures: consecutive failures that take an instance out of rotation (0 = never).
        breaker_backoff: seconds an instance stays out of rotation before its first
            ``/health`` probe (doubled per failed probe, up to 60 s).
        enforce_disagg: with no prefill instance available, answer 503 instead of letting a
            decoder prefill the request itself (decode-only fallback).
        migration_limit: the most times one streamed request's decode leg is moved to another
            P/D pair after it failed mid-stream (0 = never; :mod:`pdserve.router.migration`).
        stall_timeout: seconds without a byte from a streaming decoder after which it has
            failed (with ``migration_limit`` > 0).
        handoff: how a turn's two legs are sent (``--handoff``): both at once (concurrent,
            :mod:`pdserve.router.concurrent_legs`) or the decode leg after P's answer
            (sequential, :mod:`pdserve.router.legs`).
        local_prefill_max_tokens: a request whose decoder holds all but at most this many of
            its prompt tokens (in its KV cache or its KV cache tiers, from its KV events) is
            prefilled by that decoder, without a prefill leg (0 = never;
            :mod:`pdserve.router.local_prefill`).
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
    tokenizer: str | None = None
    kv_load_weight: float = DEFAULT_KV_LOAD_WEIGHT
    kv_events_stale_after: float = DEFAULT_STALE_AFTER_S
    state_store: str = "memory"
    session_affinity: bool = False
    log_level: str = "info"
    max_retries: int = DEFAULT_MAX_RETRIES
    breaker_failures: int = DEFAULT_BREAKER_FAILURES
    breaker_backoff: float = DEFAULT_BREAKER_BACKOFF_S
    enforce_disagg: bool = False
    migration_limit: int = 0
    stall_timeout: float = DEFAULT_STALL_TIMEOUT_S
    handoff: HandoffMode = HandoffMode.CONCURRENT
    local_prefill_max_tokens: int = 0


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


def check_disjoint(prefillers: tuple[str, ...], decoders: tuple[str, ...]) -> None:
    """Refuse an instance given as both prefiller and decoder (a decoder cannot pull KV from
    itself: every request would fail).

    Raises:
        ValueError: naming the instance and the flags.
    """
    both = [url for url in prefillers if url in decoders]
    if both:
        raise ValueError(
            f"{', '.join(both)} is given as both prefiller (--prefiller-hosts/--prefiller-ports) "
            "and decoder (--decoder-hosts/--decoder-ports); an instance is one or the other "
            "(its --kv-transfer-config kv_role): give each in one list only")


def build_parser() -> cli_types.Parser:
    """The ``pdserve proxy`` argument parser."""
    p = cli_types.Parser(
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
    p.add_argument("--routing", choices=ROUTING_POLICIES, default="round-robin",
                   help="how to pick an instance per leg (default round-robin; least-loaded = fewest "
                        "requests in flight; kv-aware = most prompt blocks already cached, from the "
                        "instances' KV events, against load: needs --tokenizer and instances started "
                        "with --kv-events-endpoint)")
    p.add_argument("--tokenizer", default=None, metavar="MODEL",
                   help="the served model (built-in name, directory or .gguf) whose tokenizer and "
                        "chat template --routing kv-aware and --local-prefill-max-tokens use to "
                        "hash prompts")
    p.add_argument("--kv-load-weight", type=cli_types.positive_float, default=DEFAULT_KV_LOAD_WEIGHT,
                   help="kv-aware: cost of one request in flight, against a whole prompt found in "
                        f"an instance's cache (default {DEFAULT_KV_LOAD_WEIGHT:g})")
    p.add_argument("--kv-events-stale-after", type=cli_types.positive_float, default=DEFAULT_STALE_AFTER_S,
                   help="kv-aware: seconds without KV events after which an instance's cache view is "
                        f"ignored (default {DEFAULT_STALE_AFTER_S:g})")
    p.add_argument("--state-store", default="memory", metavar="URL",
                   help="where --multi-turn keeps its conversation table: 'memory' (default, this "
                        "process) or redis://HOST:PORT/DB (shared by proxy replicas)")
    p.add_argument("--session-affinity", action="store_true",
                   help="--multi-turn: a conversation's next turn goes to the decoder of its previous "
                        "turn while that decoder's load allows")
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
    p.add_argument("--max-retries", type=cli_types.non_negative_int, default=DEFAULT_MAX_RETRIES,
                   metavar="N",
                   help="times a request is sent again, on another instance, when an instance "
                        "fails before the first token (5xx, timeout, dropped connection; both legs "
                        f"share it; default {DEFAULT_MAX_RETRIES}; 0 = never); an instance's 4xx is "
                        "never retried, a refused connection moves on without counting")
    p.add_argument("--breaker-failures", type=cli_types.non_negative_int,
                   default=DEFAULT_BREAKER_FAILURES, metavar="N",
                   help="consecutive failures that take an instance out of rotation until a "
                        f"/health probe brings it back (default {DEFAULT_BREAKER_FAILURES}; 0 = never)")
    p.add_argument("--breaker-backoff", type=cli_types.positive_float,
                   default=DEFAULT_BREAKER_BACKOFF_S, metavar="S",
                   help="seconds an instance stays out of rotation before its first probe, doubled "
                        f"per failed probe up to 60 (default {DEFAULT_BREAKER_BACKOFF_S:g})")
    p.add_argument("--enforce-disagg", action="store_true",
                   help="with no prefill instance available, answer 503 instead of letting a decoder "
                        "prefill the request itself (decode-only fallback, the default)")
    p.add_argument("--migration-limit", type=cli_types.non_negative_int, default=0, metavar="N",
                   help="move a streamed request whose decoder fails mid-stream to another "
                        "prefiller/decoder pair, at most N times (default 0 = off)")
    p.add_argument("--stall-timeout", type=cli_types.positive_float,
                   default=DEFAULT_STALL_TIMEOUT_S, metavar="S",
                   help="with --migration-limit: seconds without a byte from a streaming "
                        f"decoder after which it has failed (default {DEFAULT_STALL_TIMEOUT_S:g})")
    p.add_argument("--handoff", choices=[m.value for m in HandoffMode],
                   default=HandoffMode.CONCURRENT.value,
                   help="concurrent (default): send the decode leg together with the prefill leg "
                        "(the decoder waits at the prefiller's side channel; prefillers that list "
                        "no KV endpoints are served sequentially); sequential: send it after the "
                        "prefiller's answer, with the params it returned")
    p.add_argument("--local-prefill-max-tokens", type=cli_types.non_negative_int, default=0,
                   metavar="N",
                   help="prefill a request on its decoder, without a prefill leg, when the decoder "
                        "holds all but at most N of its prompt tokens in its KV cache or its KV "
                        "cache tiers (from its KV events; needs --tokenizer and decoders started "
                        "with --kv-events-endpoint; default 0 = always use a prefiller)")
    p.add_argument("--log-level", default="info",
                   choices=["critical", "error", "warning", "info", "debug"],
                   help="log level (default info; debug logs every routing decision)")
    return p


def parse_args(argv: list[str]) -> ProxyConfig:
    """Parse ``pdserve proxy`` arguments.

    Raises:
        SystemExit: (code 2) for bad arguments (argparse's, with a usage line on stderr) or
            inconsistent ones (one line).
    """
    parser = build_parser()
    ns = parser.parse_args(argv)
    if not 0 <= ns.port <= 65535:
        parser.fail(f"--port {ns.port}: must be 0..65535")
    try:
        prefillers = pair_instances(ns.prefiller_hosts, ns.prefiller_ports, "prefiller")
        decoders = pair_instances(ns.decoder_hosts, ns.decoder_ports, "decoder")
        check_disjoint(prefillers, decoders)
        check_state_store_url(ns.state_store)
    except ValueError as e:
        parser.fail(str(e))
    if proxy_needs_tokenizer(ns.routing, ns.local_prefill_max_tokens) and not ns.tokenizer:
        option = ("--routing kv-aware" if ns.routing == "kv-aware"
                  else "--local-prefill-max-tokens")
        parser.fail(f"{option} needs --tokenizer MODEL (the served model's built-in name, "
                    "directory or .gguf file) to hash prompts as the instances do")
    if ns.local_prefill_max_tokens and ns.enforce_disagg:
        parser.fail("--local-prefill-max-tokens lets decoders prefill requests, which "
                    "--enforce-disagg forbids: give one of them")
    if ns.state_store != "memory" and not ns.multi_turn:
        parser.fail("--state-store keeps the --multi-turn table: give --multi-turn too")
    if ns.session_affinity and not ns.multi_turn:
        parser.fail("--session-affinity applies to --multi-turn conversations: give "
                    "--multi-turn too")
    return ProxyConfig(
        host=ns.host, port=ns.port, prefillers=prefillers, decoders=decoders, routing=ns.routing,
        multi_turn=ns.multi_turn, api_key=ns.api_key or None,
        upstream_api_key=ns.upstream_api_key or None, max_conversations=ns.max_conversations,
        conversation_ttl=ns.conversation_ttl, timeout=ns.timeout, tokenizer=ns.tokenizer,
        kv_load_weight=ns.kv_load_weight, kv_events_stale_after=ns.kv_events_stale_after,
        state_store=ns.state_store, session_affinity=ns.session_affinity, log_level=ns.log_level,
        max_retries=ns.max_retries, breaker_failures=ns.breaker_failures,
        breaker_backoff=ns.breaker_backoff, enforce_disagg=ns.enforce_disagg,
        migration_limit=ns.migration_limit, stall_timeout=ns.stall_timeout,
        handoff=HandoffMode(ns.handoff), local_prefill_max_tokens=ns.local_prefill_max_tokens,
    )
