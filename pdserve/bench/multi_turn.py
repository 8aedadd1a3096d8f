"""``pdserve bench multi-turn``: multi-turn chat load against any OpenAI-compatible endpoint.

Exit status: 0 when every request succeeded, 1 when some failed (the results are still printed
and written), 2 for bad arguments or input.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

import httpx

from pdserve.bench.conversations import EXAMPLE_SPEC_FILE, load_conversations
from pdserve.bench.distributions import SpecError
from pdserve.bench.plot import StatsFileError, load_stats_file, plot_ttft_by_turn
from pdserve.bench.runner import RunConfig, RunResult, run_benchmark
from pdserve.bench.stats import format_summary, format_ttft_comparison, summarize
from pdserve.model_files.builtin_models import BUILTIN_NAME
from pdserve.model_files.client_tokenizer import TokenizerLoadError, load_tokenizer
from pdserve.commands.parser import Parser, non_negative_float, positive_float

PROG = "pdserve bench multi-turn"


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``pdserve bench multi-turn``."""
    p = Parser(
        prog=PROG,
        description="Replay multi-turn chats against an OpenAI-compatible /v1/chat/completions "
        "endpoint and report TTFT, TPOT, latency and throughput, split into turn 1 and turns 2+.",
    )
    p.add_argument("-i", "--input-file", default=str(EXAMPLE_SPEC_FILE),
                   help="JSON list of conversations or a generate_conversations spec "
                   "(default: the example spec shipped in pdserve/data)")
    p.add_argument("-m", "--model", default=BUILTIN_NAME,
                   help=f"tokenizer source: '{BUILTIN_NAME}', a local model directory or a .gguf "
                   "file (default: %(default)s)")
    p.add_argument("--served-model-name", default=None,
                   help="'model' field of the requests (default: the first id of GET /v1/models, "
                   "else the -m value)")
    p.add_argument("-u", "--url", default="http://localhost:8000",
                   help="server base URL; /v1/chat/completions is appended (default: %(default)s)")
    p.add_argument("-p", "--num-clients", type=int, default=1,
                   help="concurrent clients, each with one request in flight (default: 1)")
    p.add_argument("-k", "--max-active-conversations", type=int, default=None,
                   help="conversations open at once over all clients (default: the number of clients)")
    p.add_argument("-n", "--max-num-requests", type=int, default=None,
                   help="stop after this many requests (default: all turns of all conversations)")
    p.add_argument("--max-turns", type=int, default=None,
                   help="use at most this many user turns of each conversation")
    p.add_argument("--request-rate", type=non_negative_float, default=0.0,
                   help="requests/s per client, Poisson arrivals; 0 = back to back (default: 0)")
    p.add_argument("--seed", type=int, default=0,
                   help="seed for conversation generation and arrival times (default: 0)")
    p.add_argument("--limit-min-tokens", type=int, default=None,
                   help="lower bound for each answer's length (min_tokens)")
    p.add_argument("--limit-max-tokens", type=int, default=None,
                   help="upper bound for each answer's length (max_tokens)")
    p.add_argument("--request-timeout-sec", type=positive_float, default=300.0,
                   help="limit for one request; a timeout is a failed request (default: 300)")
    p.add_argument("--no-stream", action="store_true",
                   help="non-streaming requests (TTFT and TPOT are then not measured)")
    p.add_argument("--api-key", default=None,
                   help="sent as 'Authorization: Bearer KEY' (default: $OPENAI_API_KEY if set)")
    p.add_argument("--header", action="append", default=[], metavar="K=V",
                   help="extra HTTP header, repeatable")
    p.add_argument("--warmup-step", action="store_true",
                   help="first send turn 1 of every conversation, unmeasured; measure turns 2+")
    p.add_argument("-o", "--output-file", default=None,
                   help="write the conversations with the server's answers (JSON)")
    p.add_argument("--stats-json-output", default=None,
                   help="write statistics and every request's measurements (JSON)")
    p.add_argument("--send-conversation-id", action="store_true",
                   help="add 'conversation_id' to each body and the X-Session-ID header, so a "
                   "multi-turn proxy can link the turns of a conversation")
    p.add_argument("--plot", default=None, metavar="FILE.png",
                   help="write a chart of TTFT (mean and p90) by turn number")
    p.add_argument("--compare", default=None, metavar="STATS.json",
                   help="another run's --stats-json-output, shown next to this run (table and plot)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p


def _validate(parser: argparse.ArgumentParser, args: argparse.Namespace) -> dict[str, str]:
    def positive(name: str, value: int | None) -> None:
        if value is not None and value <= 0:
            parser.error(f"{name} must be > 0, got {value}")

    def output_path(name: str, path: str | None) -> None:
        """Refuse ``path`` before the run when its file could not be written after it."""
        if path is None:
            return
        if os.path.isdir(path):
            parser.error(f"{name} {path}: is a directory (give a file name)")
        parent = os.path.dirname(os.path.abspath(path))
        if not os.path.isdir(parent):
            parser.error(f"{name} {path}: directory {parent} does not exist")
        if not os.access(parent, os.W_OK | os.X_OK):
            parser.error(f"{name} {path}: directory {parent} is not writable")

    positive("--num-clients", args.num_clients)
    positive("--max-active-conversations", args.max_active_conversations)
    positive("--max-num-requests", args.max_num_requests)
    positive("--max-turns", args.max_turns)
    positive("--limit-max-tokens", args.limit_max_tokens)
    if args.limit_min_tokens is not None and args.limit_min_tokens < 0:
        parser.error("--limit-min-tokens must be >= 0")
    output_path("-o/--output-file", args.output_file)
    output_path("--stats-json-output", args.stats_json_output)
    output_path("--plot", args.plot)
    if (args.max_active_conversations is not None
            and args.max_active_conversations < args.num_clients):
        parser.error("--max-active-conversations must be >= --num-clients (each client needs one)")
    if (args.limit_min_tokens is not None and args.limit_max_tokens is not None
            and args.limit_min_tokens > args.limit_max_tokens):
        parser.error("--limit-min-tokens must be <= --limit-max-tokens")
    headers: dict[str, str] = {}
    for item in args.header:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            parser.error(f"--header expects K=V, got {item!r}")
        headers[key.strip()] = value.strip()
    api_key = args.api_key if args.api_key is not None else os.environ.get("OPENAI_API_KEY")
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    return headers


def endpoint_url(base: str, path: str) -> str:
    """``base`` + ``/v1/<path>``, accepting a base that already ends in ``/v1`` or the full path."""
    base = base.rstrip("/")
    if base.endswith("/" + path):
        return base
    if base.endswith("/v1"):
        return f"{base}/{path}"
    return f"{base}/v1/{path}"


def discover_model_name(base_url: str, headers: dict[str, str], timeout_s: float = 10.0) -> str | None:
    """First model id listed by ``GET /v1/models``, or None when the server does not answer it."""
    url = endpoint_url(base_url, "models")
    try:
        response = httpx.get(url, headers=headers, timeout=timeout_s)
        data = response.json().get("data") if response.status_code == 200 else None
        if isinstance(data, list) and data and isinstance(data[0], dict) and data[0].get("id"):
            return str(data[0]["id"])
    except (httpx.HTTPError, ValueError, AttributeError):
        return None
    return None


def _conversations_with_answers(result: RunResult) -> list[dict[str, Any]]:
    out = []
    for state in result.states:
        if not state.history and state.error is None:
            continue
        conv = state.conversation
        item: dict[str, Any] = {"id": conv.id, "messages": [*conv.system, *state.history]}
        if state.error is not None:
            item["error"] = state.error
            item["failed_turn"] = state.next_turn + 1
            item["messages"].append({"role": "user", "content": conv.turns[state.next_turn].user})
        out.append(item)
    return out


def _write_json(path: str, data: Any) -> None:
    Path(path).write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; returns the exit status (see the module docstring)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    headers = _validate(parser, args)

    def fail(message: str) -> int:
        print(f"{PROG}: error: {message}", file=sys.stderr)
        return 2

    compare = None
    if args.compare:
        try:
            compare = load_stats_file(args.compare)
        except StatsFileError as exc:
            return fail(str(exc))
    try:
        tokenizer = load_tokenizer(args.model)
        conversations = load_conversations(args.input_file, tokenizer, args.seed)
    except TokenizerLoadError as exc:
        return fail(f"-m/--model: {exc}")
    except SpecError as exc:
        return fail(str(exc))

    model_name = args.served_model_name or discover_model_name(args.url, headers) or args.model
    config = RunConfig(
        url=endpoint_url(args.url, "chat/completions"),
        model=model_name,
        headers=headers,
        stream=not args.no_stream,
        num_clients=args.num_clients,
        max_active_conversations=args.max_active_conversations,
        max_num_requests=args.max_num_requests,
        max_turns=args.max_turns,
        request_rate=args.request_rate,
        seed=args.seed,
        limit_min_tokens=args.limit_min_tokens,
        limit_max_tokens=args.limit_max_tokens,
        request_timeout_s=args.request_timeout_sec,
        send_conversation_id=args.send_conversation_id,
        warmup=args.warmup_step,
        show_progress=not args.no_progress,
    )
    num_turns = sum(len(c.turns) for c in conversations)
    print(
        f"{len(conversations)} conversations, {num_turns} user turns; model {model_name!r} at "
        f"{config.url}; {config.num_clients} client(s), "
        f"{config.max_active_conversations or config.num_clients} active conversation(s)",
        flush=True,
    )
    try:
        result = run_benchmark(conversations, config, tokenizer)
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted; no results written", file=sys.stderr)
        return 130

    summary = summarize(result.records, result.runtime_s)
    warmup_summary = (
        summarize(result.warmup_records, result.warmup_runtime_s or 0.0)
        if result.warmup_runtime_s is not None else None
    )
    print(format_summary(summary, warmup_summary))
    label = Path(args.stats_json_output).stem if args.stats_json_output else "this run"
    runs = [(label, summary["per_turn"])]
    if compare is not None:
        runs.append(compare)
        print(format_ttft_comparison(runs))

    if args.output_file:
        _write_json(args.output_file, _conversations_with_answers(result))
    if args.stats_json_output:
        _write_json(args.stats_json_output, {
            "label": label,
            "run_id": result.run_id,
            "config": {
                "url": config.url,
                "model": config.model,
                "tokenizer": args.model,
                "input_file": args.input_file,
                "header_names": sorted(headers),
                **{k: getattr(config, k) for k in (
                    "stream", "num_clients", "max_active_conversations", "max_num_requests",
                    "max_turns", "request_rate", "seed", "limit_min_tokens", "limit_max_tokens",
                    "request_timeout_s", "send_conversation_id", "warmup")},
            },
            "summary": summary,
            "warmup_summary": warmup_summary,
            "requests": [r.to_dict() for r in result.records],
            "warmup_requests": [r.to_dict() for r in result.warmup_records],
        })
    if args.plot:
        plot_ttft_by_turn(runs, args.plot)
        print(f"TTFT-by-turn chart written to {args.plot}")
    failed = summary["num_failed"] + (warmup_summary["num_failed"] if warmup_summary else 0)
    return 1 if failed else 0
