"""The ``--kv-tiers`` mode of ``benchmarks/pd_multi_turn.py``: two ``pdserve up --multi-turn``
deployments with a small device KV cache on P and D, without and with the host-memory KV tier.

Both deployments get the same engine options on P and on D (``pdserve up`` passes them to every
``pdserve serve``): ``--num-gpu-blocks-override`` sized so that the conversations' total KV is
``--overcommit`` times one engine's cache (below 1: the working set fits), ``--max-model-len``
and ``--block-size``; the second adds ``--kv-offloading-size GiB --kv-offloading-backend
native`` (room for every conversation's KV and a quarter more). The workload is a
``generate_conversations`` spec written here: ``--conversations`` conversations of ``--turns``
turns, all of them open at once and taken round-robin by ``--num-clients`` clients (so the
others' turns run between two turns of one conversation and evict its history); turn 1 is
``--first-tokens`` tokens of text, every later turn ``--user-tokens`` new ones, every answer
exactly ``--output-tokens`` tokens (``--limit-min-tokens`` = ``--limit-max-tokens``).

Token counts are those of the message texts; the chat template adds about
``--template-tokens`` per message (SmolLM2's: ``<|im_start|>role\\n ... <|im_end|>\\n``, and a
default system message), counted in the conversation length the cache is sized from.

The lease TTL. Without a tier, a bidirectional D does not give a held turn's blocks back when
its cache runs short: new requests wait until a lease is pulled or reaches its TTL
(``decoder_kv_blocks_ttl``, docs/architecture.md). When the open conversations' last turns do
not fit D's cache, the no-tier deployment therefore stalls for up to the TTL at a time (and P's
prompt leases, 30 s, may expire meanwhile); with the tier, D demotes those turns instead. Both
deployments get ``--lease-ttl`` (15 s: well above the time between two turns of a
conversation here, far below pdserve's 480 s default, which would stall the no-tier run for
minutes). Under pressure the no-tier figures thus include these stalls; the expired-lease
counters and the turns-2+ maximum TTFT show them.

Printed per case: TTFT of turn 1 and of turns 2+ (p50 / p90, ms), output tokens per second,
P's prompt tokens (computed, from its prefix cache, pulled from D; the pulls given up because
D's answer took longer than computing them), the host tier's counters on
P and D (blocks stored, hits, prompt tokens loaded) and D's demoted / restored / lost turn
leases; then the turns-2+ p50 and p90 ratios (no tier / host tier).

``--device-cache-run`` adds a third deployment, ``device cache``: no tier, and a device cache
on P and on D that holds every conversation and the requests in flight
(:func:`plan`'s ``device_cache_blocks``), so nothing is evicted. Its turns 2+ are what a tier could give
at best (every history is where a tier would put it back), and the summary prints the ratios
no tier / device cache beside the tier's: on a workload whose later turns cost little more to
recompute than the P/D path costs anyway, even a free tier is bounded there.

``--depth-first-run`` adds two deployments, ``no tier, depth-first`` and ``host tier,
depth-first``: the same two cases with ``--prefix-cache-eviction depth-first`` on P and D
(:mod:`pdserve.engine.free_blocks`), which keeps the leading blocks of every history in the
device cache instead of evicting whole histories in turn; the summary prints their ratio and
the host tier's (depth first) against the no-tier deployment of the default order.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import Iterable

from prometheus_client.parser import text_string_to_metric_families

GiB = 1 << 30

# Prometheus series read from P and D (name with its labels, as rendered): summed over engines
# of a role, reported as this run's increase.
P_SERIES = (
    "pdserve:prompt_tokens_total",
    "pdserve:prompt_tokens_computed_total",
    "pdserve:prompt_tokens_cached_total",
    "pdserve:prompt_tokens_transferred_total",
    "pdserve:nixl_num_pulls_given_up",
)
TIER_SERIES = (
    'pdserve:kv_offload_stored_blocks_total{medium="CPU"}',
    'pdserve:kv_offload_hits_total{medium="CPU"}',
    "pdserve:kv_offload_prompt_tokens_loaded_total",
    'pdserve:kv_offload_bytes_total{medium="CPU"}',
    "pdserve:kv_offload_copy_seconds_sum",
    "pdserve:kv_offload_copy_seconds_count",
)
# leases that ended unread: P's prompt leases (D did not read in time) and D's turn leases
EXPIRED_SERIES = (
    "pdserve:nixl_num_kv_expired_reqs",
    "pdserve:nixl_num_kv_turns_expired",
)
D_TURN_SERIES = (
    "pdserve:kv_offload_turns_demoted_total",
    "pdserve:kv_offload_turns_restored_total",
    'pdserve:kv_offload_turn_blocks_restored_total{medium="TIER"}',
    "pdserve:kv_offload_turns_lost_total",
)
# requests the proxy sent to D alone (--local-prefill-max-tokens)
LOCAL_PREFILLS = "pdserve:proxy_local_prefills_total"


def add_arguments(ap: argparse.ArgumentParser) -> None:
    """The options of the ``--kv-tiers`` mode (token counts in tokens, sizes in GiB)."""
    g = ap.add_argument_group("--kv-tiers mode (host KV tier on P and D, small device cache)")
    g.add_argument("--kv-tiers", action="store_true",
                   help="compare two 'pdserve up --multi-turn' deployments without and with the "
                        "host KV tier instead of recompute against bidirectional")
    g.add_argument("--overcommit", type=float, default=1.75,
                   help="total KV of all conversations / one engine's device cache (below 1: "
                        "the working set fits); default 1.75")
    g.add_argument("--conversations", type=int, default=16, help="default 16, all open at once")
    g.add_argument("--turns", type=int, default=3, help="user turns per conversation, default 3")
    g.add_argument("--first-tokens", type=int, default=192,
                   help="turn 1's message (tokens), default 192")
    g.add_argument("--user-tokens", type=int, default=48,
                   help="each later turn's message (tokens), default 48")
    g.add_argument("--output-tokens", type=int, default=16,
                   help="every answer (tokens), default 16")
    g.add_argument("--block-size", type=int, default=16,
                   help="tokens per KV block, given to the engines too (default 16)")
    g.add_argument("--template-tokens", type=int, default=12,
                   help="chat-template tokens per message (estimate; default 12)")
    g.add_argument("--lease-ttl", type=float, default=15.0,
                   help="decoder_kv_blocks_ttl of both deployments (seconds D keeps a finished "
                        "turn's blocks for the next turn's pull; default 15, pdserve's 480 would "
                        "stall the no-tier deployment for minutes, see the module docstring)")
    g.add_argument("--tier-first", action="store_true",
                   help="run the host-tier deployment first (to tell an order effect from the "
                        "tier's own cost)")
    g.add_argument("--device-cache-run", action="store_true",
                   help="a third deployment without a tier whose device cache holds every "
                        "conversation (nothing evicted): the most a tier could give")
    g.add_argument("--depth-first-run", action="store_true",
                   help="two more deployments, without and with the tier, whose engines evict "
                        "the deepest free cached block first (--prefix-cache-eviction "
                        "depth-first)")
    g.add_argument("--offload-gib", type=float, default=None,
                   help="host tier size per engine (default: every conversation's KV x 1.25, "
                        "from the model's config.json)")


def check(args: argparse.Namespace) -> str | None:
    """Why the ``--kv-tiers`` options cannot run (None: they can)."""
    for name in ("conversations", "turns", "first_tokens", "user_tokens", "output_tokens",
                 "block_size", "num_clients"):
        if getattr(args, name) < 1:
            return f"--{name.replace('_', '-')} must be >= 1"
    if args.template_tokens < 0:
        return "--template-tokens must be >= 0"
    if args.overcommit <= 0:
        return "--overcommit must be > 0 (below 1: the working set fits the device cache)"
    if args.first_tokens < args.user_tokens:
        return "--first-tokens must be >= --user-tokens (turn 1 is a prefix plus a message)"
    if args.lease_ttl <= 0:
        return "--lease-ttl must be > 0"
    if args.offload_gib is not None and args.offload_gib <= 0:
        return "--offload-gib must be > 0"
    p = plan(args)
    if p["num_blocks"] < p["min_blocks"]:
        return (f"the device cache ({p['num_blocks']} blocks) cannot hold --num-clients "
                f"{args.num_clients} conversations of {p['conversation_tokens']} tokens "
                f"({p['min_blocks']} blocks); add conversations or lower --overcommit / "
                "--num-clients")
    return None


def plan(args: argparse.Namespace) -> dict:
    """Sizes of the run, in tokens and blocks.

    Returns:
        ``conversation_tokens`` (one conversation's final length: all messages and answers plus
        the template's tokens), ``total_tokens`` (all conversations), ``num_blocks`` (each
        engine's ``--num-gpu-blocks-override``: ``total / overcommit``, rounded up),
        ``min_blocks`` (what ``--num-clients`` conversations in flight need at their longest)
        ``max_model_len`` (the final length plus one block), ``device_cache_blocks`` (every
        conversation at its final length and the requests in flight: the cache of the
        ``--device-cache-run`` deployment on P and on D) and ``fits`` (whether one cache of
        ``num_blocks`` holds that much: a no-tier D then never waits for a lease's TTL).
    """
    messages = 2 * args.turns + 1  # user and assistant per turn, and the system message
    conv = (args.first_tokens + (args.turns - 1) * args.user_tokens
            + args.turns * args.output_tokens + messages * args.template_tokens)
    total = args.conversations * conv
    num_blocks = math.ceil(total / args.overcommit / args.block_size)
    min_blocks = args.num_clients * -(-(conv + args.block_size) // args.block_size)
    every = args.conversations * -(-conv // args.block_size) + min_blocks
    return {
        "conversation_tokens": conv,
        "total_tokens": total,
        "num_blocks": num_blocks,
        "min_blocks": min_blocks,
        "max_model_len": conv + args.block_size,
        "device_cache_blocks": every,
        "fits": num_blocks >= every,
    }


def spec(args: argparse.Namespace) -> dict:
    """The ``pdserve bench multi-turn`` ``generate_conversations`` spec of the workload."""
    prompt_input = {"num_turns": {"distribution": "constant", "value": 2 * args.turns},
                    "num_tokens": {"distribution": "constant", "value": args.user_tokens}}
    if args.first_tokens > args.user_tokens:
        prompt_input["prefix_num_tokens"] = {"distribution": "constant",
                                             "value": args.first_tokens - args.user_tokens}
    return {"filetype": "generate_conversations", "num_conversations": args.conversations,
            "prompt_input": prompt_input,
            "prompt_output": {"num_tokens": {"distribution": "constant",
                                             "value": args.output_tokens}}}


def bench_args(args: argparse.Namespace) -> list[str]:
    """``pdserve bench multi-turn`` options of the workload: every conversation open at once
    (round-robin over the clients) and answers of exactly ``--output-tokens`` tokens."""
    return ["-k", str(max(args.conversations, args.num_clients)),
            "--limit-min-tokens", str(args.output_tokens),
            "--limit-max-tokens", str(args.output_tokens)]


def kv_bytes_per_token(model_dir: str | Path, device: str, engine_args: Iterable[str]) -> int:
    """Bytes of one token's KV (all layers, K and V, in the engine's own cache geometry:
    :func:`pdserve.models.loader.arch_config_from_hf` of ``config.json``): 4 bytes per element
    on CPU or with ``--dtype float32``, else 2 (an upper bound for an fp8 cache).

    Raises:
        ValueError: a ``config.json`` the engine cannot serve.
    """
    from pdserve.models.loader import arch_config_from_hf

    arch = arch_config_from_hf(json.loads((Path(model_dir) / "config.json").read_text()))
    words = list(engine_args)
    fp32 = device == "cpu" or any(w in ("float32", "--dtype=float32") for w in words)
    return 2 * arch.num_layers * arch.num_kv_heads * arch.head_dim * (4 if fp32 else 2)


def offload_gib(args: argparse.Namespace, model_dir: str | Path) -> float:
    """The host tier of each engine (GiB): ``--offload-gib``, else every conversation's KV and
    a quarter more."""
    if args.offload_gib is not None:
        return args.offload_gib
    per_token = kv_bytes_per_token(model_dir, args.device, args.engine_args.split())
    return 1.25 * plan(args)["total_tokens"] * per_token / GiB


def engine_args(args: argparse.Namespace, tier_gib: float | None,
                num_blocks: int | None = None) -> list[str]:
    """The ``pdserve serve`` options of one case (given to P and D alike), before the user's
    ``--engine-args``; ``num_blocks`` replaces :func:`plan`'s cache size (the device-cache
    case)."""
    p = plan(args)
    blocks = p["num_blocks"] if num_blocks is None else num_blocks
    out = ["--num-gpu-blocks-override", str(blocks), "--block-size", str(args.block_size),
           "--max-model-len", str(p["max_model_len"]),
           "--kv-transfer-config.kv_connector_extra_config.decoder_kv_blocks_ttl",
           f"{args.lease_ttl:g}"]
    if tier_gib is not None:
        out += ["--kv-offloading-size", f"{tier_gib:.6f}", "--kv-offloading-backend", "native"]
    return out


def cases(args: argparse.Namespace, tier_gib: float) -> list[tuple[str, list[str], bool]]:
    """The deployments to run, in order: ``(name, engine options, whether it is the
    device-cache case)`` for ``no tier`` and ``host tier`` (reversed with ``--tier-first``),
    their ``..., depth-first`` twins with ``--depth-first-run`` and ``device cache`` with
    ``--device-cache-run``."""
    pair = [("no tier", engine_args(args, None)), ("host tier", engine_args(args, tier_gib))]
    if args.tier_first:
        pair.reverse()
    out = [(name, opts, False) for name, opts in pair]
    if args.depth_first_run:
        out += [(f"{name}, depth-first", opts + ["--prefix-cache-eviction", "depth-first"], False)
                for name, opts in pair]
    if args.device_cache_run:
        out.append(("device cache", engine_args(args, None, plan(args)["device_cache_blocks"]),
                    True))
    return out


def parse_series(text: str) -> dict[str, float]:
    """Every ``pdserve:`` sample of a ``/metrics`` page (prometheus-client's parser), keyed by
    name with its labels as rendered (``name{k="v"}``), and each labelled family's sum over its
    labels under its bare name. A counter rendered without ``_total`` (the connector's
    ``pdserve:nixl_num_*``) keeps its name (the parser names its sample ``..._total``)."""
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if not sample.name.startswith("pdserve:"):
                continue
            name = sample.name
            if family.type == "counter" and name == family.name + "_total" and \
                    f"\n{family.name} " in f"\n{text}":
                # rendered without "_total" (pdserve:nixl_num_*): the parser adds it
                name = family.name
            labels = ",".join(f'{k}="{v}"' for k, v in sample.labels.items())
            keys = {name, f"{name}{{{labels}}}" if labels else name}
            for key in keys:
                out[key] = out.get(key, 0.0) + float(sample.value)
    return out


def delta(after: list[dict[str, float]], before: list[dict[str, float]],
          names: Iterable[str]) -> dict[str, float]:
    """Increase of each series in ``names``, summed over engines (0 where absent)."""
    return {n: sum(a.get(n, 0.0) - b.get(n, 0.0) for a, b in zip(after, before)) for n in names}


def ttft_percentiles(summary: dict) -> dict:
    """TTFT p50 / p90 (ms) and count of turn 1 and of turns 2+, output tokens and requests per
    second, and failed requests, from a ``--stats-json-output`` summary."""
    out = {}
    for key, section in (("turn1", "turn 1"), ("later", "turns 2+")):
        s = summary["sections"].get(section, {}).get("ttft_ms", {})
        out[key] = [s.get("p50"), s.get("p90"), s.get("count", 0), s.get("max")]
    out["output_tok_s"] = summary.get("output_tokens_per_sec")
    out["requests_s"] = summary.get("requests_per_sec")
    out["failed"] = summary.get("num_failed", 0)
    return out


def _f(v: float | None, digits: int = 1) -> str:
    return "-" if v is None else f"{v:,.{digits}f}"


def _copy_line(c: dict[str, float]) -> str:
    """An engine's tier copies: batches (one per step with copies), their summed time (the copy
    stream's, stores and loads together), and GiB stored to the host tier."""
    n, total = c.get(TIER_SERIES[5], 0.0), c.get(TIER_SERIES[4], 0.0)
    mean = f", mean {1e3 * total / n:.2f} ms" if n else ""
    return (f"{n:.0f} batches, {total:.2f} s{mean}; stored "
            f"{c.get(TIER_SERIES[3], 0.0) / 2**30:.2f} GiB")


def _summary_line(base: list, other: list, label: str) -> str:
    """One ``summary:`` line: turns 2+ TTFT p50 and p90 of ``base`` -> ``other`` (ms, from
    :func:`ttft_percentiles`' ``later``) and their ratios ``base / other``."""
    ratios = [b / o if b and o else None for b, o in zip(base[:2], other[:2])]
    return (f"summary: turns 2+ TTFT p50 {_f(base[0])} -> {_f(other[0])} ms "
            f"({_f(ratios[0], 2)}x), p90 {_f(base[1])} -> {_f(other[1])} ms "
            f"({_f(ratios[1], 2)}x); {label}")


def report(results: dict[str, dict]) -> list[str]:
    """The printed lines of both cases and the turns-2+ ratios."""
    lines = []
    for name, r in results.items():
        t, p, d = r["ttft"], r["prefill"], r["decode"]
        lines.append(
            f"{name:>9}: TTFT turn 1 p50/p90 {_f(t['turn1'][0])}/{_f(t['turn1'][1])} ms, turns "
            f"2+ p50/p90/max {_f(t['later'][0])}/{_f(t['later'][1])}/{_f(t['later'][3])} ms "
            f"({t['later'][2]} turns, "
            f"{t['failed']} failed); {_f(t['output_tok_s'])} output tok/s, "
            f"{_f(t['requests_s'], 2)} requests/s")
        lines.append(
            f"{'':>9}  P prompt tokens {p.get('pdserve:prompt_tokens_total', 0.0):.0f}: computed "
            f"{p.get('pdserve:prompt_tokens_computed_total', 0.0):.0f}, prefix cache "
            f"{p.get('pdserve:prompt_tokens_cached_total', 0.0):.0f}, pulled from D "
            f"{p.get('pdserve:prompt_tokens_transferred_total', 0.0):.0f} (pulls given up "
            f"{p.get('pdserve:nixl_num_pulls_given_up', 0.0):.0f})")
        for role, c in (("P", p), ("D", d)):
            lines.append(
                f"{'':>9}  {role} host tier: stored {c.get(TIER_SERIES[0], 0.0):.0f} blocks, "
                f"hits {c.get(TIER_SERIES[1], 0.0):.0f} blocks, prompt tokens loaded "
                f"{c.get(TIER_SERIES[2], 0.0):.0f}; copies {_copy_line(c)}")
        lines.append(
            f"{'':>9}  D turn leases: demoted {d.get(D_TURN_SERIES[0], 0.0):.0f}, restored "
            f"{d.get(D_TURN_SERIES[1], 0.0):.0f} ({d.get(D_TURN_SERIES[2], 0.0):.0f} blocks from "
            f"the tier), lost "
            f"{d.get(D_TURN_SERIES[3], 0.0):.0f}; leases expired unread: P "
            f"{p.get(EXPIRED_SERIES[0], 0.0):.0f}, D {d.get(EXPIRED_SERIES[0], 0.0):.0f} (turns "
            f"{d.get(EXPIRED_SERIES[1], 0.0):.0f})")
        local = r.get("proxy", {}).get(LOCAL_PREFILLS, 0.0)
        if local:
            lines.append(f"{'':>9}  prefilled by D itself (--local-prefill-max-tokens): "
                         f"{local:.0f} requests")
    pairs = [("no tier", "host tier", "no tier / host tier")]
    pairs += [("no tier", name, f"no tier / {name}")
              for name in ("no tier, depth-first", "host tier, depth-first") if name in results]
    if "no tier, depth-first" in results and "host tier, depth-first" in results:
        pairs.append(("no tier, depth-first", "host tier, depth-first",
                      "both depth-first: no tier / host tier"))
    if "device cache" in results:
        pairs.append(("no tier", "device cache",
                      "no tier / device cache (the most a tier could give)"))
    for base, other, label in pairs:
        lines.append(_summary_line(results[base]["ttft"]["later"],
                                   results[other]["ttft"]["later"], label))
    return lines
