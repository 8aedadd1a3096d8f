"""Fixtures for proxy tests: fake P/D instances plus an in-process proxy in front of them."""

from __future__ import annotations

from dataclasses import dataclass, field

import aiohttp
from multidict import CIMultiDict
import pytest

from pdserve.router.config import ProxyConfig
from pdserve.router.proxy import RunningProxy, start_proxy
from tests.support.ports import free_port

from tests.support.router_fakes import FakeInstance


def unused_port() -> int:
    """A localhost TCP port nothing listens on (:func:`ports.free_port`: below the ephemeral
    range, so the proxy's connection attempts to it cannot connect to themselves)."""
    return free_port()


@dataclass
class Cluster:
    """Fake instances, the proxy in front of them and an HTTP client session."""

    prefillers: list[FakeInstance]
    decoders: list[FakeInstance]
    proxy: RunningProxy
    session: aiohttp.ClientSession
    extra: list = field(default_factory=list)

    @property
    def url(self) -> str:
        return self.proxy.url

    async def post(self, path: str, body, headers: dict | None = None) -> tuple[int, CIMultiDict, bytes]:
        """POST ``body`` (JSON-encoded unless bytes or text, which go as they are, sent as
        ``application/json`` unless ``headers`` say otherwise) through the proxy: (status,
        headers, body)."""
        kwargs = {"data": body} if isinstance(body, (bytes, str)) else {"json": body}
        if "data" in kwargs and not any(k.lower() == "content-type" for k in headers or {}):
            headers = {**(headers or {}), "Content-Type": "application/json"}
        async with self.session.post(self.url + path, headers=headers, **kwargs) as r:
            return r.status, r.headers.copy(), await r.read()


@pytest.fixture
async def make_cluster():
    """Factory: ``await make_cluster(n_prefill=1, n_decode=1, prefill_urls=(), decode_urls=(),
    instance_info=None, **ProxyConfig fields)``; extra URLs (e.g. dead ports) are appended to the
    fakes' URLs; ``instance_info(fake)`` gives each fake's ``GET /pdserve/instance`` body before
    the proxy's role check asks it (None: the route answers 404)."""
    made: list[Cluster] = []

    async def make(n_prefill: int = 1, n_decode: int = 1, prefill_urls=(), decode_urls=(),
                   instance_info=None, **overrides) -> Cluster:
        ps = [FakeInstance(f"p{i}", "prefill") for i in range(n_prefill)]
        ds = [FakeInstance(f"d{i}", "decode") for i in range(n_decode)]
        for inst in ps + ds:
            if instance_info is not None:
                inst.info = instance_info(inst)
            await inst.start()
        config = ProxyConfig(host="127.0.0.1", port=0,
                             prefillers=tuple(p.url for p in ps) + tuple(prefill_urls),
                             decoders=tuple(d.url for d in ds) + tuple(decode_urls), **overrides)
        proxy = await start_proxy(config)
        session = aiohttp.ClientSession()
        cluster = Cluster(ps, ds, proxy, session)
        made.append(cluster)
        return cluster

    yield make
    for c in made:
        await c.session.close()
        await c.proxy.close()
        for inst in c.prefillers + c.decoders:
            await inst.close()
