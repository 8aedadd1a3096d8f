"""The command line of ``pdserve up``: its options, the pass-through of engine options, and the
"ready" banner with ready-to-paste ``curl`` / ``openai`` examples."""

from __future__ import annotations

import argparse
import importlib.util
import json
import shlex
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Sequence

from pdserve.commands.parser import (NEGATIVE_NUMBER, Parser, non_negative_float,
                                     non_negative_int, port_list, positive_float, positive_int,
                                     writable_dir)
from pdserve.types.engine_config import DEFAULT_MODEL
from pdserve.launcher.cuda_mps import CudaMps
from pdserve.launcher.errors import LaunchError
from pdserve.launcher.plan import (
    DEFAULT_PROXY_PORT,
    ChildCommands,
    build_plan,
    option_value,
)
from pdserve.launcher.restarts import (
    DEFAULT_MAX_RESTARTS,
    DEFAULT_RESTART_WINDOW_S,
    RestartPolicy,
)
from pdserve.launcher.supervisor import (
    DEFAULT_SHUTDOWN_TIMEOUT_S,
    DEFAULT_STARTUP_TIMEOUT_S,
    Launcher,
)
from pdserve.router.upstreams import ROUTING_POLICIES


def _engine_facts(url: str, fallback: str, api_key: str | None = None) -> tuple[str, bool]:
    """The first model id an engine lists on ``/v1/models`` (``fallback`` if that fails) and
    whether its model has a chat template (``GET /pdserve/instance``; True if that fails)."""
    import httpx

    from pdserve.types.instance_info import INSTANCE_INFO_PATH

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        data = httpx.get(url + "/v1/models", timeout=5, headers=headers).json()
        model = data["data"][0]["id"]
    except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError):
        model = fallback
    try:
        chat_template = httpx.get(url + INSTANCE_INFO_PATH, timeout=5).json()["chat_template"]
    except (httpx.HTTPError, ValueError, KeyError, TypeError):
        chat_template = True
    return model, chat_template is not False


def usage_banner(endpoint: str, model: str, api_key: str | None = None,
                 python: str | None = None, openai_installed: bool | None = None,
                 chat_template: bool = True, multi_turn: bool = False) -> str:
    """The ready-to-paste ``curl``, ``openai`` and ``pdserve chat`` examples for a running
    deployment (the Python example's here-document starts at the line start, so it runs as
    pasted into a shell).

    Args:
        python: the interpreter the Python example runs with (default: this one, that is the
            virtual environment pdserve runs in).
        openai_installed: whether ``openai`` is importable there (default: looked up).
        chat_template: whether the model has a chat template; without one (a base model) the
            examples use ``/v1/completions``, since ``/v1/chat/completions`` answers 400.
        multi_turn: the proxy is the multi-turn one: the chat examples send a
            ``conversation_id`` (without one it releases the turn's KV instead of keeping it
            for the next turn; ``pdserve chat`` sends one by itself).
    """
    python = python or sys.executable
    if openai_installed is None:
        openai_installed = importlib.util.find_spec("openai") is not None
    if openai_installed:
        needs = ("# Python: run with the virtual environment's interpreter, where the openai "
                 "package is installed")
    else:
        needs = ("# Python: needs the openai package in the virtual environment "
                 "('pip install openai' there first)")
    auth = f" -H 'Authorization: Bearer {api_key}'" if api_key else ""
    key = api_key or "EMPTY"
    chat_key = " --api-key " + api_key if api_key else ""
    if chat_template:
        path = "chat/completions"
        conversation = {"conversation_id": "demo-1"} if multi_turn else {}
        body = json.dumps({"model": model, "messages": [
            {"role": "user", "content": "What is the capital of France?"}], "max_tokens": 32,
            "temperature": 0, **conversation})
        extra = ("\n    # every turn of one chat sends the same id: its KV stays on the decoder"
                 "\n    extra_body={\"conversation_id\": \"demo-1\"},") if multi_turn else ""
        call = f"""reply = client.chat.completions.create(
    model="{model}",
    messages=[{{"role": "user", "content": "What is the capital of France?"}}],
    max_tokens=32,
    temperature=0,  # greedy: the small default model rambles when sampled{extra}
)
print(reply.choices[0].message.content)"""
        chat_line = f"pdserve chat --url {endpoint} --temperature 0{chat_key}"
    else:
        path = "completions"
        body = json.dumps({"model": model, "prompt": "The capital of France is",
                           "max_tokens": 32, "temperature": 0})
        call = f"""reply = client.completions.create(
    model="{model}",
    prompt="The capital of France is",
    max_tokens=32,
    temperature=0,
)
print(reply.choices[0].text)"""
        chat_line = (f"# {model} has no chat template: it continues text (/v1/completions)\n"
                     f"  pdserve chat --url {endpoint} --completions --temperature 0{chat_key}")
    return f"""\
Try it:

  curl -s {endpoint}/v1/{path} -H 'Content-Type: application/json'{auth} \\
    -d '{body}'

  {needs}
  {shlex.quote(python)} - <<'EOF'
from openai import OpenAI
client = OpenAI(base_url="{endpoint}/v1", api_key="{key}")
{call}
EOF

  {chat_line}
"""


def _print_ready(launcher: Launcher, opts: argparse.Namespace) -> None:
    proxy = launcher.children[-1].spec
    first_engine = launcher.children[0].spec
    api_key = option_value(opts.engine_args, "--api-key")
    fallback = option_value(opts.engine_args, "--served-model-name") or opts.model
    model, chat_template = _engine_facts(first_engine.url, fallback, api_key)
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
    launcher.say(usage_banner(proxy.url, model, api_key, chat_template=chat_template,
                              multi_turn=opts.multi_turn))
    launcher.say("Press Ctrl-C to stop.")



def log_dir_path(text: str) -> Path:
    """``--log-dir``: a directory that exists and is writable or can be created.

    Raises:
        argparse.ArgumentTypeError: an existing file, or a directory that cannot be written.
    """
    return Path(writable_dir(text))


def build_parser() -> argparse.ArgumentParser:
    """The ``pdserve up`` argument parser (engine options are not declared: they pass through)."""
    p = Parser(
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
    p.add_argument("--prefill-dp", type=int, default=1, metavar="N",
                   help="data-parallel ranks of each prefiller (one API server, N engine cores, "
                        "side channels base .. base + N - 1), default 1")
    p.add_argument("--decode-dp", type=int, default=1, metavar="M",
                   help="data-parallel ranks of each decoder, default 1")
    p.add_argument("--prefill-tp", type=positive_int, default=1, metavar="N",
                   help="tensor-parallel size of each prefiller (its own N GPUs per "
                        "data-parallel rank), default 1")
    p.add_argument("--decode-tp", type=positive_int, default=1, metavar="M",
                   help="tensor-parallel size of each decoder (its own M GPUs per "
                        "data-parallel rank), default 1")
    p.add_argument("--multi-turn", action="store_true",
                   help="bidirectional KV transfer on P and D and the multi-turn proxy")
    p.add_argument("--local-prefill-max-tokens", type=non_negative_int, default=0, metavar="N",
                   help="the proxy lets a decoder prefill a request itself, without a prefill leg, "
                        "when it holds all but at most N of the prompt tokens in its KV cache or "
                        "its KV cache tiers (default 0 = always use a prefiller; docs/proxy.md)")
    p.add_argument("--routing", choices=ROUTING_POLICIES, default="round-robin",
                   help="how the proxy picks each leg's instance: round-robin (default), "
                        "least-loaded (fewest requests in flight) or kv-aware (where the "
                        "prompt's KV cache is, from the engines' KV events, against load; "
                        "docs/proxy.md)")
    p.add_argument("--cuda-mps", action="store_true",
                   help="run the engines under a CUDA MPS control daemon of this deployment's own "
                        "(pipe and log in --log-dir), so that engines sharing a GPU run their "
                        "kernels concurrently instead of time-sliced; needs "
                        "nvidia-cuda-mps-control on PATH (docs/deployment.md)")
    p.add_argument("--device", default=None, choices=["auto", "cpu", "cuda"],
                   help="engine device (default: the engine's own default, auto)")
    p.add_argument("--host", default="127.0.0.1",
                   help="address the proxy binds (engines bind 127.0.0.1), default 127.0.0.1")
    p.add_argument("--port", type=int, default=DEFAULT_PROXY_PORT,
                   help=f"proxy port (0 = any free port), default {DEFAULT_PROXY_PORT}")
    p.add_argument("--prefill-ports", type=port_list, default=None, metavar="P1,P2",
                   help="HTTP ports of the prefillers (default: free ports)")
    p.add_argument("--decode-ports", type=port_list, default=None, metavar="P1,P2",
                   help="HTTP ports of the decoders (default: free ports)")
    p.add_argument("--prefill-side-channel-ports", type=port_list, default=None,
                   metavar="P1,P2", help="NIXL side-channel ports of the prefillers "
                                         "(default: free ports)")
    p.add_argument("--decode-side-channel-ports", type=port_list, default=None,
                   metavar="P1,P2", help="NIXL side-channel ports of the decoders "
                                         "(default: free ports)")
    p.add_argument("--log-dir", type=log_dir_path, default=None,
                   help="directory for child logs and pdserve-up.json (default: a new temp dir)")
    p.add_argument("--startup-timeout", type=positive_float, default=DEFAULT_STARTUP_TIMEOUT_S,
                   metavar="SECONDS", help="give up if not all parts are healthy by then "
                                           f"(default {DEFAULT_STARTUP_TIMEOUT_S:.0f})")
    p.add_argument("--shutdown-timeout", type=non_negative_float,
                   default=DEFAULT_SHUTDOWN_TIMEOUT_S,
                   metavar="SECONDS", help="SIGKILL children still running this long after the "
                                           f"stop signal (default {DEFAULT_SHUTDOWN_TIMEOUT_S:.0f})")
    p.add_argument("--restart-limit", type=int, default=DEFAULT_MAX_RESTARTS, metavar="K",
                   help="restart a dead prefiller/decoder (while another instance of its role "
                        "serves) at most K times within --restart-window, with a back-off of "
                        "1, 2, 4 ... s (at most 30 s); 0 = never restart, any death stops "
                        f"everything (default {DEFAULT_MAX_RESTARTS})")
    p.add_argument("--restart-window", type=positive_float, default=DEFAULT_RESTART_WINDOW_S,
                   metavar="SECONDS", help="the window --restart-limit counts deaths in "
                                           f"(default {DEFAULT_RESTART_WINDOW_S:.0f})")
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


class _EngineArgError(Exception):
    """An engine option ``pdserve serve`` would refuse."""


def engine_args_error(model: str, engine_args: Sequence[str]) -> str | None:
    """The error ``pdserve serve`` would exit with (code 2) on ``engine_args``, found before
    anything starts; None when they parse (or the server is not installed in this build).

    ``--kv-transfer-config.*`` keys are left to the engines: ``pdserve up`` completes that
    configuration itself (role, connector), so it is checked there.
    """
    try:
        from pdserve.entrypoints.cli_args import build_parser as serve_parser
    except ImportError:
        return None
    rest: list[str] = []
    i = 0
    while i < len(engine_args):
        word = engine_args[i]
        if word.startswith("--kv-transfer-config"):
            i += 1 if "=" in word else 2
            continue
        rest.append(word)
        i += 1
    parser = serve_parser()

    def refuse(message: str):
        raise _EngineArgError(message)

    parser.error = refuse  # type: ignore[method-assign]
    try:
        parser.parse_args([model, *rest])
    except _EngineArgError as e:
        return str(e)
    return None


def model_error(model: str, tokenizer: str | None = None) -> str | None:
    """Why ``pdserve serve`` would refuse ``model`` (or ``--tokenizer``) as not found, found
    before anything starts (its own check, :func:`pdserve.entrypoints.server.check_paths`);
    None when they exist."""
    from pdserve.entrypoints.server import StartupError, check_paths
    from pdserve.types.engine_config import EngineConfig

    try:
        check_paths(EngineConfig(model=model, tokenizer=tokenizer))
    except StartupError as e:
        return str(e)
    return None


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
        if word.startswith("-") and len(word) > 1 and name not in known \
                and not NEGATIVE_NUMBER.match(word):  # "-1" is a value (refused by its type)
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
    if opts.restart_limit < 0 or opts.restart_window <= 0:  # before anything is looked at
        print("pdserve up: error: --restart-limit must be 0 or more and --restart-window "
              "positive", file=sys.stderr)
        return 2
    error = engine_args_error(opts.model, opts.engine_args)
    if error is not None:
        print(f"usage: pdserve up [options] (see pdserve up --help)\n"
              f"pdserve up: error: engine option: {error}", file=sys.stderr)
        return 2
    error = model_error(opts.model, option_value(opts.engine_args, "--tokenizer"))
    if error is not None:
        print(f"pdserve up: error: {error}", file=sys.stderr)
        return 2
    commands = commands or ChildCommands()
    try:
        specs = build_plan(opts, commands, gpus=gpus)
    except LaunchError as exc:
        print(f"pdserve up: error: {exc}", file=sys.stderr)
        return 2
    if opts.cuda_mps and all(s.gpu is None for s in specs if s.role != "proxy"):
        print("pdserve up: error: --cuda-mps needs engines on GPUs (none was found, or "
              "--device cpu)", file=sys.stderr)
        return 2
    log_dir = opts.log_dir or Path(tempfile.mkdtemp(prefix="pdserve-up-"))
    mps = CudaMps(log_dir / "cuda-mps") if opts.cuda_mps else None
    if mps is not None:
        try:
            env = mps.start()
        except LaunchError as exc:
            print(f"pdserve up: error: {exc}", file=sys.stderr)
            return 2
        specs = [s if s.role == "proxy" else replace(s, env={**s.env, **env}) for s in specs]
    print(f"pdserve up: model {opts.model}, logs in {log_dir}"
          f"{', CUDA MPS daemon in ' + str(mps.directory) if mps else ''}", flush=True)
    try:
        policy = RestartPolicy(max_restarts=opts.restart_limit, window_s=opts.restart_window,
                               startup_timeout_s=opts.startup_timeout)
        launcher = Launcher(specs, log_dir, startup_timeout=opts.startup_timeout,
                            shutdown_timeout=opts.shutdown_timeout, restart_policy=policy)
        rc = launcher.run(on_ready=lambda la: _print_ready(la, opts))
    finally:
        if mps is not None:
            mps.stop()
    print(f"pdserve up: stopped (exit code {rc}); logs in {log_dir}", flush=True)
    return rc

