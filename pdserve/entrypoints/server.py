"""``pdserve serve``: the OpenAI-compatible HTTP server in front of one engine.

:func:`build_app` is the FastAPI app factory (usable with any object that has the
:class:`pdserve.engine.async_engine.AsyncEngine` interface, e.g. a fake in tests);
:func:`main` parses the command line, binds the port, starts the engine and serves with uvicorn
until SIGINT/SIGTERM, then shuts the engine down.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import signal
import socket
import sys
from typing import Any, AsyncIterator, Iterator

import uvicorn

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from pdserve import __version__
from pdserve.utils import phase_trace
from pdserve.types.engine_config import EngineConfig
from pdserve.engine.async_engine import EngineDeadError
from pdserve.types.kv_events import default_snapshot_endpoint
from pdserve.entrypoints.auth import APIKeyMiddleware
from pdserve.entrypoints.body_limit import BodySizeLimitMiddleware
from pdserve.entrypoints.chat_completions import ChatCompletionsHandler
from pdserve.entrypoints.cli_args import build_parser, engine_config_from_args, with_host_defaults
from pdserve.entrypoints.completions import CompletionsHandler
from pdserve.entrypoints.errors import OpenAIError, bad_request, install_error_handlers
from pdserve.entrypoints.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    ModelCard,
    ModelList,
)
from pdserve.entrypoints.instance_info import instance_info_router, prefill_endpoints
from pdserve.entrypoints.serving import OpenAIServing
from pdserve.entrypoints.tokenize_routes import tokenize_router
from pdserve.kv_transfer.nixl import release as kv_release
from pdserve.types.remote_ref import KVTransferParamsError
from pdserve.entrypoints.metrics import ServerMetrics
from pdserve.types.openai_errors import MAX_BODY_BYTES
from pdserve.utils.process_gc import freeze_start_up_objects

logger = logging.getLogger("pdserve.server")

# Seconds between engine liveness checks while serving; a dead engine stops the server.
ENGINE_WATCHDOG_INTERVAL_S = 2.0
#: Seconds uvicorn lets requests in flight finish after a shutdown signal before it cancels them
#: (its ``timeout_graceful_shutdown``).
GRACEFUL_SHUTDOWN_S = 5
#: Seconds after a shutdown signal at which the requests still in flight are ended with a 503
#: (or an error event in their stream): before uvicorn cancels them, which would log tracebacks
#: and answer a client 500, or nothing.
END_REQUESTS_AFTER_S = GRACEFUL_SHUTDOWN_S - 1.0
# Seconds allowed for the engine to shut down after the HTTP server stopped.
ENGINE_SHUTDOWN_TIMEOUT_S = 30.0


def build_app(engine: Any, api_key: str | None = None) -> FastAPI:
    """The FastAPI app serving ``engine``.

    Routes: ``POST /v1/completions``, ``POST /v1/chat/completions``, ``GET /v1/models``,
    ``GET /health`` (200 while the engine lives, else 503), ``GET /metrics`` (Prometheus text),
    ``POST /v1/kv_transfer/release`` (the proxy frees a prefill lease its decode leg will not
    read: :mod:`pdserve.kv_transfer.nixl.release`; the engine core of the rank holding it
    ends the lease, :meth:`AsyncEngine.release_early
    <pdserve.engine.async_engine.AsyncEngine.release_early>`), vLLM's ``POST /tokenize``,
    ``POST /detokenize`` and ``GET /version`` (:mod:`pdserve.entrypoints.tokenize_routes`),
    ``GET /pdserve/instance`` (:mod:`pdserve.entrypoints.instance_info`). The generation
    routes honour the ``X-data-parallel-rank`` header (the rank that serves the request;
    :func:`pdserve.types.kv_endpoints.parse_data_parallel_rank`).

    Args:
        engine: an ``AsyncEngine`` or an object with the same interface.
        api_key: when set, ``/v1/*`` requires ``Authorization: Bearer <api_key>``.
    """
    metrics = ServerMetrics(engine)
    serving = OpenAIServing(engine, metrics)
    completions = CompletionsHandler(serving)
    chat = ChatCompletionsHandler(serving)

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        yield
        serving.close()

    app = FastAPI(title="pdserve", version=__version__, lifespan=lifespan)
    app.state.engine = engine
    app.state.metrics = metrics
    app.state.serving = serving
    install_error_handlers(app)
    app.add_middleware(BodySizeLimitMiddleware, max_bytes=MAX_BODY_BYTES)
    if api_key:  # added last: checked first, before the body's size
        app.add_middleware(APIKeyMiddleware, api_key=api_key)

    @app.post("/v1/completions")
    async def create_completion(request: CompletionRequest, raw_request: Request) -> Response:
        return await completions(request, raw_request)

    @app.post("/v1/chat/completions")
    async def create_chat_completion(request: ChatCompletionRequest,
                                     raw_request: Request) -> Response:
        return await chat(request, raw_request)

    @app.get("/v1/models")
    async def list_models() -> JSONResponse:
        card = ModelCard(id=serving.model_name, root=getattr(engine.config, "model", None),
                         max_model_len=serving.max_model_len)
        return JSONResponse(ModelList(data=[card]).model_dump())

    @app.get("/health")
    async def health() -> Response:
        try:
            await engine.check_health()
        except Exception as e:  # noqa: BLE001 - any failure means "not healthy"
            return OpenAIError(f"The engine is not running: {e}", 503).response()
        return JSONResponse({"status": "ok"})

    @app.get("/kv_events")
    async def kv_events_info() -> Response:
        """Where this instance publishes KV events (``pdserve/engine/kv_events.py``); 404 when
        ``--kv-events-endpoint`` is off. The proxy's ``--routing kv-aware`` reads it."""
        config = engine.config
        if not config.kv_events_endpoint:
            return OpenAIError("KV events are off (start with --kv-events-endpoint)",
                               404).response()
        snapshot = (config.kv_events_snapshot_endpoint
                    or default_snapshot_endpoint(config.kv_events_endpoint))
        return JSONResponse({"endpoint": config.kv_events_endpoint,
                             "snapshot_endpoint": snapshot, "block_size": config.block_size})

    @app.post("/v1/kv_transfer/release")
    async def release_kv(raw_request: Request) -> JSONResponse:
        try:
            body = await raw_request.json()
        except ValueError:
            body = None
        config = engine.config.kv_transfer_config
        try:
            ref = kv_release.parse_release(
                config, body.get("kv_transfer_params") if isinstance(body, dict) else None,
                engine.config.data_parallel_size)
        except KVTransferParamsError as e:
            raise bad_request(str(e), param="kv_transfer_params") from None
        try:
            released = await engine.release_early(kv_release.release_rank(config, ref),
                                                  ref.request_id, list(ref.block_ids))
        except EngineDeadError as e:
            raise OpenAIError(f"the engine did not take the release: {e}", 503) from None
        return JSONResponse({"released": released})

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        body, content_type = metrics.render()
        return Response(content=body, media_type=content_type)

    app.include_router(tokenize_router(engine.tokenizer, serving.model_name, serving.max_model_len,
                                       serving._in_tokenizer_thread))
    kv = engine.config.kv_transfer_config
    app.include_router(instance_info_router(serving.model_name, kv and kv.kv_role,
                                            kv and kv.engine_id, engine.tokenizer,
                                            prefill_endpoints(engine.config)))
    return app


# ---------------------------------------------------------------------------------------------
# Process entry point
# ---------------------------------------------------------------------------------------------


class StartupError(Exception):
    """A startup problem to print as one line (no traceback)."""


def bind_socket(host: str, port: int) -> socket.socket:
    """Binds (without listening) a TCP socket, so a port in use fails before the model loads.

    Raises:
        StartupError: the address cannot be resolved or bound.
    """
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise StartupError(f"cannot resolve --host {host!r}: {e.strerror}") from None
    family, socktype, proto, _, addr = infos[0]
    sock = socket.socket(family, socktype, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if family == socket.AF_INET6:
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        sock.bind(addr)
    except OSError as e:
        sock.close()
        raise StartupError(f"cannot bind {host}:{port}: {e.strerror or e}"
                           + (" (is another server running there?)"
                              if e.errno in (98, 48) else "")) from None
    return sock


def check_paths(config: EngineConfig) -> None:
    """Fails early, with a clear message, on a model or tokenizer path that does not exist.

    Raises:
        StartupError: ``model`` is neither the built-in name nor an existing path, is a
            directory without ``config.json`` or a file that is not ``.gguf`` (what the model
            loader accepts), or ``tokenizer`` is given and does not exist.
    """
    from pdserve.model_files.builtin_models import BUILTIN_NAMES, is_builtin

    if not is_builtin(config.model) and not os.path.exists(os.path.expanduser(config.model)):
        raise StartupError(
            f"model {config.model!r} not found: give a local Hugging Face directory, a .gguf "
            f"file, or a built-in name ({', '.join(map(repr, BUILTIN_NAMES))}; nothing is "
            "downloaded)")
    model = "" if is_builtin(config.model) else os.path.expanduser(config.model)
    if os.path.isdir(model) and not os.path.isfile(os.path.join(model, "config.json")):
        raise StartupError(
            f"model {config.model!r} is not a model: a Hugging Face model directory has a "
            "config.json (or give a .gguf file)")
    if os.path.isfile(model) and not model.endswith(".gguf"):
        raise StartupError(
            f"model {config.model!r} is not a model: expected a Hugging Face directory or a "
            ".gguf file")
    if config.tokenizer is not None and not os.path.exists(os.path.expanduser(config.tokenizer)):
        raise StartupError(f"tokenizer {config.tokenizer!r} not found (a local directory)")


class _Server(uvicorn.Server):
    """uvicorn server whose signals are handled by :func:`serve` (uvicorn's own handler would
    re-raise SIGTERM after it stops, killing the process before the engine is shut down)."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


async def serve(config: EngineConfig, sock: socket.socket, api_key: str | None,
                log_level: str) -> int:
    """Starts the engine, serves HTTP on ``sock`` until a signal or engine death, shuts down.

    Returns:
        the process exit code: 0 after a signal, 1 when the engine failed to start or died.
    """
    loop = asyncio.get_running_loop()
    main_task = asyncio.current_task()
    server: Any = None
    signals_seen = 0

    def on_signal(sig: signal.Signals) -> None:
        nonlocal signals_seen
        signals_seen += 1
        logger.info("received %s, shutting down", sig.name)
        if server is None:
            main_task.cancel()  # still starting: abandon the startup
        else:
            server.should_exit = True
            if signals_seen == 1:
                loop.call_later(END_REQUESTS_AFTER_S, engine.end_requests,
                                "the server is shutting down")
            else:
                server.force_exit = True

    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, on_signal, sig)

    engine = None
    engine_died = False
    try:
        from pdserve.engine.async_engine import AsyncEngine

        try:
            engine = await AsyncEngine.start(config)
        except asyncio.CancelledError:
            print("pdserve serve: interrupted during startup", file=sys.stderr)
            return 1
        except Exception as e:  # noqa: BLE001 - one clear line instead of a traceback
            logger.debug("engine startup failed", exc_info=True)
            print(f"pdserve serve: could not start the engine: {e or type(e).__name__}",
                  file=sys.stderr)
            return 1

        app = build_app(engine, api_key=api_key)
        # What start-up built lives as long as the process: the garbage collector skips it from
        # now on (shorter collections while serving, and no full pass over it at exit).
        freeze_start_up_objects()
        uv_config = uvicorn.Config(app, log_config=None, log_level=log_level,
                                   access_log=log_level == "debug",
                                   timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S)
        server = _Server(uv_config)

        async def watchdog() -> None:
            nonlocal engine_died
            while True:
                await asyncio.sleep(ENGINE_WATCHDOG_INTERVAL_S)
                try:
                    await engine.check_health()
                except Exception as e:  # noqa: BLE001
                    logger.error("engine died (%s); stopping the server", e)
                    engine_died = True
                    server.should_exit = True
                    return

        host, port = sock.getsockname()[:2]
        logger.info("serving %s on http://%s:%d", config.name,
                    f"[{host}]" if ":" in host else host, port)
        watch = asyncio.create_task(watchdog())
        try:
            await server.serve(sockets=[sock])
        finally:
            watch.cancel()
        return 1 if engine_died or not server.started else 0
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)
        if engine is not None:
            try:
                await asyncio.wait_for(engine.shutdown(), ENGINE_SHUTDOWN_TIMEOUT_S)
            except Exception as e:  # noqa: BLE001
                logger.warning("engine shutdown did not complete cleanly: %s", e)
        sock.close()


def run_server(args: argparse.Namespace) -> int:
    """Runs ``pdserve serve`` for parsed ``args`` (``args.kv_transfer_config`` set by
    :func:`main`); returns the exit code."""
    logging.basicConfig(
        level=getattr(logging, args.log_level.upper()),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    try:
        config = engine_config_from_args(args, getattr(args, "kv_transfer_config", None))
    except ValueError as e:  # e.g. the KV cache tier flags
        print(f"pdserve serve: error: {e}", file=sys.stderr)
        return 2
    api_key = args.api_key or os.environ.get("PDSERVE_API_KEY") or None
    from pdserve.engine import data_parallel

    try:
        data_parallel.validate(config)
    except data_parallel.DataParallelConfigError as e:
        print(f"pdserve serve: {e}", file=sys.stderr)
        return 2
    from pdserve.model_files.tp_precheck import TPShardingError, check_splits

    try:  # before any engine process starts
        check_splits(config.model, config.tensor_parallel_size)
    except TPShardingError as e:
        print(f"pdserve serve: error: {e}", file=sys.stderr)
        return 2
    kv = config.kv_transfer_config
    phase_trace.set_role(phase_trace.kv_role_prefix(kv.kv_role if kv is not None else None)
                         + ".api")
    if (kv is not None and not data_parallel.is_loopback(args.host)
            and data_parallel.is_loopback(kv.side_channel_host)):
        logger.warning(
            "serving on %s, but PDSERVE_NIXL_SIDE_CHANNEL_HOST is %s: instances on other hosts "
            "cannot reach this side channel; set PDSERVE_NIXL_SIDE_CHANNEL_HOST to this host's "
            "address if they read KV from (or hand KV to) it", args.host, kv.side_channel_host)
    try:  # a model or tokenizer that is missing or not a model: before any engine starts
        check_paths(config)
    except StartupError as e:
        print(f"pdserve serve: {e}", file=sys.stderr)
        return 2
    if config.headless:
        return data_parallel.run_headless(config)
    try:
        sock = bind_socket(args.host, args.port)
    except StartupError as e:
        print(f"pdserve serve: {e}", file=sys.stderr)
        return 2 if "not found" in str(e) else 1
    try:
        return asyncio.run(serve(config, sock, api_key, args.log_level))
    except KeyboardInterrupt:
        return 130
    except SystemExit as e:  # uvicorn exits on startup failure
        return int(e.code) if isinstance(e.code, int) else 1


def main(argv: list[str] | None = None) -> int:
    """``pdserve serve [MODEL] [options]``; returns the process exit code (2: bad arguments,
    1: startup or runtime failure, 0: clean shutdown)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    from pdserve.types.kv_transfer_config import KVTransferConfigError
    from pdserve.kv_transfer.config_cli import extract_kv_transfer_args

    try:
        kv_transfer_config, rest = extract_kv_transfer_args(argv)
    except KVTransferConfigError as e:
        print(f"pdserve serve: error: {e}", file=sys.stderr)
        return 2
    try:
        args = build_parser().parse_args(rest)
    except SystemExit as e:  # --help (0) or a usage error (2, message already printed)
        return int(e.code) if isinstance(e.code, int) else 2
    args.kv_transfer_config = with_host_defaults(kv_transfer_config, argv, args.device)
    return run_server(args)


if __name__ == "__main__":
    sys.exit(main())
