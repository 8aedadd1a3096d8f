"""``pdserve proxy``: run the disaggregation proxy (see docs/proxy.md).

``main(argv)`` parses the flags (:mod:`pdserve.router.config`), starts the aiohttp server on the
uvloop event loop when uvloop is installed, prints ``pdserve proxy listening on http://HOST:PORT``
(with the port actually bound, so ``--port 0`` is usable) and serves until SIGINT/SIGTERM.
:func:`start_proxy` runs the same server inside an existing event loop (tests, benchmarks).
"""

from __future__ import annotations

import asyncio
import logging
import signal
import sys

from aiohttp import web
from aiohttp.http_exceptions import BadHttpMessage

from pdserve.utils import phase_trace
from pdserve.model_files.client_tokenizer import TokenizerLoadError
from pdserve.router.app import DisaggProxy
from pdserve.router.config import ProxyConfig, parse_args
from pdserve.router.role_check import RoleMismatch

logger = logging.getLogger("pdserve.router")


class RunningProxy:
    """A proxy serving inside the current event loop.

    Attributes:
        proxy: the :class:`DisaggProxy` (pools, conversation store, metrics).
        url: ``http://host:port`` it listens on.
    """

    def __init__(self, proxy: DisaggProxy, runner: web.AppRunner, url: str):
        self.proxy = proxy
        self.url = url
        self._runner = runner

    async def close(self) -> None:
        """Stop listening, close client connections and the upstream connection pool."""
        await self._runner.cleanup()


class _ClientHttpErrors(logging.Filter):
    """Makes aiohttp's report of a malformed request (a duplicate ``Content-Type`` header, a
    non-numeric ``Content-Length``: :class:`BadHttpMessage`, answered 400 by aiohttp before any
    handler runs) a one-line warning instead of an ERROR with a traceback: the client is at
    fault, the proxy is fine (uvicorn, in front of vLLM, logs such requests as a warning too)."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if isinstance(exc, BadHttpMessage):
            record.levelno, record.levelname = logging.WARNING, "WARNING"
            record.msg = f"{record.getMessage()}: {exc.message}"
            record.args = None
            record.exc_info = record.exc_text = None
        return True


_CLIENT_HTTP_ERRORS = _ClientHttpErrors()


async def start_proxy(config: ProxyConfig) -> RunningProxy:
    """Start the proxy for ``config`` in the running event loop.

    Handler cancellation is on: when a client disconnects, its request handler is cancelled at
    once, which closes the open upstream request (the instance then aborts it).

    Raises:
        OSError: the address cannot be bound.
        RoleMismatch: an instance that answers is given for a leg its role cannot serve
            (:mod:`pdserve.router.role_check`).
    """
    proxy = DisaggProxy(config)
    logging.getLogger("aiohttp.server").addFilter(_CLIENT_HTTP_ERRORS)  # once: a set
    runner = web.AppRunner(proxy.build_app(), handler_cancellation=True, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, config.host, config.port, backlog=1024)
    try:
        await site.start()
    except BaseException:
        await runner.cleanup()
        raise
    port = runner.addresses[0][1]
    host = f"[{config.host}]" if ":" in config.host else config.host
    return RunningProxy(proxy, runner, f"http://{host}:{port}")


async def _serve(config: ProxyConfig) -> int:
    try:
        running = await start_proxy(config)
    except OSError as e:
        print(f"pdserve proxy: cannot listen on {config.host}:{config.port}: {e}", file=sys.stderr)
        return 1
    except RoleMismatch as e:
        print(f"pdserve proxy: error: {e}", file=sys.stderr)
        return 2
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        try:
            loop.add_signal_handler(sig, stop.set)
        except (NotImplementedError, RuntimeError):  # not the main thread / platform
            pass
    mode = "multi-turn" if config.multi_turn else "stateless"
    logger.info("prefill instances: %s", ", ".join(config.prefillers))
    logger.info("decode instances: %s", ", ".join(config.decoders))
    store = f", state in {config.state_store}" if config.multi_turn else ""
    logger.info("routing %s, %s mode%s, %s hand-off", config.routing, mode, store,
                config.handoff.value)
    print(f"pdserve proxy listening on {running.url}", flush=True)
    try:
        await stop.wait()
    finally:
        await running.close()
    return 0


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``pdserve proxy``; returns the process exit code (2 for bad flags)."""
    config = parse_args(list(sys.argv[1:] if argv is None else argv))
    phase_trace.set_role("proxy")
    logging.basicConfig(level=config.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        import uvloop
        run = uvloop.run
    except ImportError:
        run = asyncio.run
    try:
        return run(_serve(config))
    except TokenizerLoadError as e:  # --tokenizer (kv-aware routing, local prefill)
        print(f"pdserve proxy: error: --tokenizer: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
