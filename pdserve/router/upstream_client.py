"""The proxy's HTTP client side: pooled aiohttp connections to the instances, one leg's request.

:class:`UpstreamClient` opens a request on an instance of a leg (trying the next instance when
one cannot be connected to), reads whole bodies, and turns upstream failures into the proxy's
errors (status codes in docs/proxy.md):

* an instance that cannot be connected to (nothing was sent) -> the next instance of the same leg
  is tried; when none can be reached -> 503 naming each instance tried;
* an instance that times out -> 504; that drops the connection or answers garbage -> 502; the
  error names the instance (``ProxyError.upstream``), and :mod:`pdserve.router.legs` decides
  whether the leg is retried elsewhere (within ``--max-retries``);
* an instance's own HTTP error (4xx/5xx) -> :class:`UpstreamHTTPError`, passed to the client with
  its status; a 5xx may be retried elsewhere, a 4xx never.

Every outcome is also reported to the instance's circuit breaker (:mod:`pdserve.router.health`):
a connection failure, a timeout, a dropped connection, an invalid answer or a 5xx as a failure,
any answer below 500 as a success.
"""

from __future__ import annotations

import asyncio
import logging
import os
from time import perf_counter

import aiohttp
from yarl import URL

from pdserve.router.errors import (UPSTREAM_ERROR, UPSTREAM_TIMEOUT, UPSTREAM_UNAVAILABLE,
                                   ProxyError, normalize_upstream_error)
from pdserve.router.health import UpstreamHealth
from pdserve.router.metrics import ProxyMetrics
from pdserve.router.upstreams import Upstream, UpstreamPool

logger = logging.getLogger("pdserve.router")

#: Upper bound on the TCP connect timeout to an instance (s); --timeout applies when smaller.
CONNECT_TIMEOUT_S = 10.0
#: Seconds an idle pooled connection to an instance is kept. Below uvicorn's default keep-alive
#: (5 s) so the proxy never sends a request on a connection the server is about to close.
UPSTREAM_KEEPALIVE_S = 3.0
#: Timeout of one /health probe of an instance (s).
HEALTH_PROBE_TIMEOUT_S = 5.0


class UpstreamHTTPError(Exception):
    """An instance answered with HTTP >= 400; ``body`` is the (OpenAI-shaped) body to relay;
    ``upstream`` the instance's base URL."""

    def __init__(self, status: int, body: bytes, upstream: str | None = None):
        super().__init__(status)
        self.status = status
        self.body = body
        self.upstream = upstream


class Turn:
    """Per-request bookkeeping: id, timing (s, ``perf_counter``) and the answered status.

    ``done_sent``: a stream's ``[DONE]`` was written to the client. A client that closes after
    it (SDK clients stop reading there) got the whole answer: the turn keeps its status
    instead of 499 (:meth:`client_left`).
    """

    __slots__ = ("request_id", "t0", "upstream_wait", "status", "done_sent")

    def __init__(self, request_id: str, t0: float):
        self.request_id = request_id
        self.t0 = t0
        self.upstream_wait = 0.0
        self.status = 499  # until something is answered: the client went away
        self.done_sent = False

    def client_left(self) -> None:
        """The client's connection closed: 499, unless the stream's end had reached it."""
        if not self.done_sent:
            self.status = 499


class UpstreamClient:
    """Pooled HTTP client to the instances of both legs.

    Args:
        timeout: seconds to wait for a response or the next streamed chunk (``--timeout``).
        pools: the leg pools (their instance URLs are pre-parsed per path).
        paths: the generation paths the proxy forwards.
        metrics: in-flight gauges and error counters are updated here.
        health: the instances' circuit breakers (every outcome is reported to them).

    Attributes:
        session: the aiohttp session, between :meth:`start` and :meth:`close`.
    """

    def __init__(self, timeout: float, pools: tuple[UpstreamPool, ...], paths: tuple[str, ...],
                 metrics: ProxyMetrics, health: UpstreamHealth):
        self.timeout = timeout
        self.metrics = metrics
        self.health = health
        self.session: aiohttp.ClientSession | None = None
        # Parsed upstream URLs per (instance, path): parsing a URL string per request costs more
        # than the rest of building the request.
        self._urls = {(up.url, path): URL(up.url + path)
                      for pool in pools for up in pool.upstreams for path in paths}

    async def start(self) -> None:
        """Create the connection pool (inside the running event loop)."""
        timeout = aiohttp.ClientTimeout(total=None,
                                        sock_connect=min(self.timeout, CONNECT_TIMEOUT_S),
                                        sock_read=self.timeout)
        connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=UPSTREAM_KEEPALIVE_S,
                                         ttl_dns_cache=300)
        # No cookie jar: the proxy must not carry one client's cookies to another's request (and
        # skipping cookie handling saves CPU per request).
        self.session = aiohttp.ClientSession(connector=connector, timeout=timeout,
                                             cookie_jar=aiohttp.DummyCookieJar())

    async def close(self) -> None:
        """Close the connection pool."""
        if self.session is not None:
            await self.session.close()

    def enter(self, up: Upstream) -> None:
        """Count one more request in flight on ``up``."""
        up.in_flight += 1
        self.metrics.in_flight_child[(up.leg, up.url)].inc()

    def leave(self, up: Upstream) -> None:
        """Count one request fewer in flight on ``up``."""
        up.in_flight -= 1
        self.metrics.in_flight_child[(up.leg, up.url)].dec()

    def failure(self, up: Upstream, exc: BaseException) -> ProxyError:
        """Count and describe an upstream failure after the request may have reached it."""
        self.metrics.count_error(up.url, up.leg)
        self.health.failure(up)
        if isinstance(exc, asyncio.TimeoutError):
            err = ProxyError(504, f"{up.leg} instance {up.url} timed out after "
                             f"{self.timeout:g} s", UPSTREAM_TIMEOUT, upstream=up.url)
        else:
            err = ProxyError(502, f"{up.leg} instance {up.url} failed: "
                             f"{type(exc).__name__}: {exc}".rstrip(": "), UPSTREAM_ERROR,
                             upstream=up.url)
        logger.warning("%s", err.message)
        return err

    async def open(self, order: list[Upstream], pool: UpstreamPool, path: str, data: bytes,
                   headers: dict[str, str], turn: Turn) -> tuple[Upstream, aiohttp.ClientResponse]:
        """POST ``data`` to the first instance of ``order`` that accepts a connection.

        Args:
            order: the instances to try, routing decision first (``pool.order(...)``).
            pool: their pool (marks instances down / up).

        Returns:
            The instance and its response (headers read). The instance's in-flight count is
            raised; the caller must lower it (:meth:`leave`) and release or close the response.

        Raises:
            ProxyError: 503 when no instance accepted a connection, 502/504 on other failures.
        """
        unreachable = []
        for up in order:
            self.enter(up)
            t = perf_counter()
            try:
                resp = await self.session.post(self._urls[(up.url, path)], data=data, headers=headers)
            except (aiohttp.ClientConnectorError, aiohttp.ConnectionTimeoutError) as e:
                # Nothing was sent: safe to try the next instance of the same leg.
                turn.upstream_wait += perf_counter() - t
                self.leave(up)
                pool.mark_down(up)
                self.metrics.count_error(up.url, up.leg)
                self.health.failure(up)
                reason = connect_reason(e)
                logger.warning("%s instance %s unreachable (%s)", up.leg, up.url, reason)
                unreachable.append(f"{up.leg} instance {up.url} unreachable ({reason})")
                continue
            except (aiohttp.ClientError, asyncio.TimeoutError) as e:
                self.leave(up)
                raise self.failure(up, e) from e
            except BaseException:
                self.leave(up)
                raise
            turn.upstream_wait += perf_counter() - t
            pool.mark_up(up)
            if resp.status < 500:  # a 5xx is reported by check_status, once its body is read
                self.health.success(up)
            return up, resp
        raise ProxyError(503, "; ".join(unreachable), UPSTREAM_UNAVAILABLE)

    async def read_body(self, up: Upstream, resp: aiohttp.ClientResponse, turn: Turn) -> bytes:
        """Read a whole upstream body, then release the connection and the in-flight slot.

        Raises:
            ProxyError: 502/504 when reading fails.
        """
        t = perf_counter()
        try:
            raw = await resp.read()
        except (aiohttp.ClientError, asyncio.TimeoutError) as e:
            resp.close()
            raise self.failure(up, e) from e
        except BaseException:
            resp.close()  # client went away: closing makes the instance abort the request
            raise
        finally:
            turn.upstream_wait += perf_counter() - t
            self.leave(up)
        resp.release()
        return raw

    def check_status(self, up: Upstream, resp: aiohttp.ClientResponse, raw: bytes,
                     breaker: bool = True) -> None:
        """Raise :class:`UpstreamHTTPError` for an HTTP error answer (5xx counted as failures,
        also by the instance's circuit breaker unless ``breaker`` is False: the failure is
        another instance's, e.g. a decoder whose KV read from the prefiller failed)."""
        if resp.status >= 400:
            raise self.http_error(up, resp.status, raw, breaker)

    def http_error(self, up: Upstream, status: int, raw: bytes,
                   breaker: bool = True) -> UpstreamHTTPError:
        """Count and describe an instance's error answer (``status`` >= 400, ``raw`` its body;
        also an in-band error event of a stream the client has not seen yet); a 5xx counts as
        a failure, by the circuit breaker too unless ``breaker`` is False."""
        if status >= 500:
            self.metrics.count_error(up.url, up.leg)
            if breaker:
                self.health.failure(up)
        return UpstreamHTTPError(status, normalize_upstream_error(status, raw, up.leg, up.url),
                                 up.url)

    def invalid_response(self, up: Upstream, what: str) -> ProxyError:
        """Count and describe an answer the proxy cannot use (502)."""
        self.metrics.count_error(up.url, up.leg)
        self.health.failure(up)
        err = ProxyError(502, f"{up.leg} instance {up.url} returned an invalid response: {what}",
                         UPSTREAM_ERROR, upstream=up.url)
        logger.warning("%s", err.message)
        return err

    async def probe(self, up: Upstream, auth: str | None) -> bool:
        """True when ``up``'s ``GET /health`` answers 200 within :data:`HEALTH_PROBE_TIMEOUT_S`."""
        timeout = aiohttp.ClientTimeout(total=min(self.timeout, HEALTH_PROBE_TIMEOUT_S))
        headers = {"Authorization": auth} if auth else None
        try:
            async with self.session.get(up.url + "/health", timeout=timeout, headers=headers) as resp:
                await resp.read()
                return resp.status == 200
        except (aiohttp.ClientError, asyncio.TimeoutError):
            return False


def connect_reason(exc: BaseException) -> str:
    """A short human reason for a failed connection (``"Connection refused"``, ...)."""
    if isinstance(exc, asyncio.TimeoutError):
        return "connect timed out"
    os_error = getattr(exc, "os_error", None)
    errno = getattr(os_error, "errno", None)
    if errno:
        return os.strerror(errno)
    return str(exc) or type(exc).__name__
