"""The proxy's role check (a prefiller that is a decoder, a decoder that is a prefiller, one
instance in both lists) and its pass-through of vLLM's /tokenize, /detokenize and /version."""

from __future__ import annotations

import json

import aiohttp
import pytest
from aiohttp import web

from pdserve.router.config import ProxyConfig, check_disjoint, parse_args
from pdserve.router.proxy import start_proxy
from pdserve.router.role_check import RoleMismatch

from tests.support.router_fakes import FakeInstance


class InfoInstance(FakeInstance):
    """A fake instance that answers ``/pdserve/instance`` with ``kv_role`` (and ``engine_id``)
    and serves ``/tokenize``, ``/detokenize``, ``/version``."""

    def __init__(self, name: str, role: str, kv_role: str | None, engine_id: str | None = None):
        super().__init__(name, role)
        self.kv_role = kv_role
        self.engine_id = engine_id or f"engine-{name}"
        self.tokenized: list[dict] = []
        self.info_status = 200  # another status: not ready to say its role yet
        self.model = "m"  # the served model name it reports

    async def start(self) -> str:
        app = web.Application()
        app.router.add_post("/v1/completions", self._generate)
        app.router.add_post("/v1/chat/completions", self._generate)
        app.router.add_get("/health", self._health)
        app.router.add_get("/pdserve/instance", self._info)
        app.router.add_post("/tokenize", self._tokenize)
        app.router.add_post("/detokenize", self._detokenize)
        app.router.add_get("/version", self._version)
        self._runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self.url = f"http://127.0.0.1:{self._runner.addresses[0][1]}"
        return self.url

    async def _info(self, request: web.Request) -> web.Response:
        if self.info_status != 200:
            return web.Response(status=self.info_status)
        return web.json_response({"model": self.model, "kv_role": self.kv_role,
                                  "engine_id": self.engine_id, "chat_template": True})

    async def _tokenize(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.tokenized.append(body)
        if body.get("model") not in (None, "m"):
            return web.json_response({"error": {"message": "no such model", "type":
                                                "NotFoundError", "param": "model", "code": 404}},
                                     status=404)
        return web.json_response({"count": 2, "max_model_len": 64, "tokens": [5, 6],
                                  "token_strs": None, "by": self.name})

    async def _detokenize(self, request: web.Request) -> web.Response:
        return web.json_response({"prompt": "ab", "by": self.name})

    async def _version(self, request: web.Request) -> web.Response:
        return web.json_response({"version": "9.9", "by": self.name})


@pytest.fixture
async def instances():
    made: list[FakeInstance] = []

    async def make(name: str, role: str, kv_role: str | None, engine_id: str | None = None):
        inst = InfoInstance(name, role, kv_role, engine_id)
        await inst.start()
        made.append(inst)
        return inst

    yield make
    for inst in made:
        await inst.close()


def _config(ps, ds) -> ProxyConfig:
    return ProxyConfig(host="127.0.0.1", port=0, prefillers=tuple(p.url for p in ps),
                       decoders=tuple(d.url for d in ds))


async def test_swapped_roles_are_refused_at_start_up(instances):
    p = await instances("p0", "prefill", "kv_consumer")
    d = await instances("d0", "decode", "kv_producer")
    with pytest.raises(RoleMismatch, match="--prefiller-hosts/--prefiller-ports") as exc:
        await start_proxy(_config([p], [d]))
    assert p.url in str(exc.value) and "--decoder-hosts/--decoder-ports" in str(exc.value)


async def test_a_decoder_that_is_a_prefiller_is_refused(instances):
    p = await instances("p0", "prefill", "kv_producer")
    d = await instances("d0", "decode", "kv_producer")
    with pytest.raises(RoleMismatch, match="is given as a decode instance") as exc:
        await start_proxy(_config([p], [d]))
    assert d.url in str(exc.value)


async def test_one_engine_under_two_urls_in_both_lists_is_refused(instances):
    p = await instances("p0", "prefill", "kv_both", engine_id="same")
    d = await instances("d0", "decode", "kv_both", engine_id="same")
    with pytest.raises(RoleMismatch, match="both prefiller .* and decoder"):
        await start_proxy(_config([p], [d]))


async def test_instances_serving_different_models_are_refused(instances):
    """A request names one model and both of its legs must serve it: a prefiller and a decoder
    with different models would answer every request with a 404 from one leg."""
    p = await instances("p0", "prefill", "kv_producer")
    d = await instances("d0", "decode", "kv_consumer")
    d.model = "other"
    with pytest.raises(RoleMismatch, match="serves the model 'm' but .* serves 'other'") as exc:
        await start_proxy(_config([p], [d]))
    assert p.url in str(exc.value) and d.url in str(exc.value)
    assert "--served-model-name" in str(exc.value)


def test_one_url_in_both_lists_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as exc:
        parse_args(["--prefiller-ports", "8100", "--decoder-ports", "8100"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "http://127.0.0.1:8100 is given as both prefiller" in err
    assert "--prefiller-hosts/--prefiller-ports" in err and "--decoder-hosts/--decoder-ports" in err
    check_disjoint(("http://a:1",), ("http://a:2",))  # different instances pass


async def test_mismatch_found_at_first_contact_fails_requests(instances):
    p = await instances("p0", "prefill", "kv_producer")
    d = await instances("d0", "decode", "kv_producer")
    d.info_status = 503  # not ready at the proxy's start-up: asked again at the first request
    running = await start_proxy(_config([p], [d]))
    try:
        assert not running.proxy.role_check.done
        d.info_status = 200
        async with aiohttp.ClientSession() as s:
            for _ in range(2):  # refused again, without asking again
                async with s.post(running.url + "/v1/completions",
                                  json={"model": "m", "prompt": "hi", "max_tokens": 2}) as r:
                    body = json.loads(await r.read())
                    assert r.status == 502
                assert "is given as a decode instance" in body["error"]["message"]
                assert "--decoder-hosts/--decoder-ports" in body["error"]["message"]
        assert not p.received  # nothing was prefilled
    finally:
        await running.close()


async def test_matching_roles_and_unknown_ones_pass(instances):
    p = await instances("p0", "prefill", "kv_producer")
    d = await instances("d0", "decode", "kv_consumer")
    plain = FakeInstance("d1", "decode")  # no /pdserve/instance (a vLLM engine): accepted
    await plain.start()
    running = await start_proxy(_config([p], [d, plain]))
    try:
        assert running.proxy.role_check.done
        async with aiohttp.ClientSession() as s:
            async with s.post(running.url + "/v1/completions",
                              json={"model": "m", "prompt": "hi", "max_tokens": 2}) as r:
                assert r.status == 200
    finally:
        await running.close()
        await plain.close()


async def test_tokenize_detokenize_version_pass_through(instances):
    p = await instances("p0", "prefill", "kv_producer")
    d = await instances("d0", "decode", "kv_consumer")
    running = await start_proxy(_config([p], [d]))
    try:
        async with aiohttp.ClientSession() as s:
            async with s.post(running.url + "/tokenize", json={"model": "m", "prompt": "ab"}) as r:
                assert r.status == 200
                assert (await r.json()) == {"count": 2, "max_model_len": 64, "tokens": [5, 6],
                                            "token_strs": None, "by": "p0"}
            assert p.tokenized == [{"model": "m", "prompt": "ab"}]
            async with s.post(running.url + "/tokenize", json={"model": "x", "prompt": "a"}) as r:
                assert r.status == 404 and (await r.json())["error"]["param"] == "model"
            async with s.post(running.url + "/detokenize", json={"tokens": [5, 6]}) as r:
                assert r.status == 200 and (await r.json())["prompt"] == "ab"
            async with s.get(running.url + "/version") as r:
                assert r.status == 200 and (await r.json())["version"] == "9.9"
            async with s.get(running.url + "/tokenize") as r:
                assert r.status == 405
    finally:
        await running.close()


async def test_pass_through_without_any_instance_is_503():
    dead = ProxyConfig(host="127.0.0.1", port=0, prefillers=("http://127.0.0.1:9",),
                       decoders=("http://127.0.0.1:7",))
    running = await start_proxy(dead)
    try:
        async with aiohttp.ClientSession() as s:
            async with s.post(running.url + "/tokenize", json={"prompt": "a"}) as r:
                assert r.status == 503
                assert "unreachable" in (await r.json())["error"]["message"]
    finally:
        await running.close()


async def test_pass_through_needs_no_api_key_as_on_the_engines(instances):
    p = await instances("p0", "prefill", "kv_producer")
    d = await instances("d0", "decode", "kv_consumer")
    config = ProxyConfig(host="127.0.0.1", port=0, prefillers=(p.url,), decoders=(d.url,),
                         api_key="k")
    running = await start_proxy(config)
    try:
        async with aiohttp.ClientSession() as s:
            async with s.post(running.url + "/tokenize", json={"prompt": "a"}) as r:
                assert r.status == 200
            async with s.post(running.url + "/v1/completions", json={"prompt": "a"}) as r:
                assert r.status == 401
    finally:
        await running.close()


async def test_concurrent_first_requests_share_one_role_check(instances):
    import asyncio

    p = await instances("p0", "prefill", "kv_producer")
    d = await instances("d0", "decode", "kv_consumer")
    p.info_status = d.info_status = 503  # not ready at start-up
    running = await start_proxy(_config([p], [d]))
    try:
        p.info_status = d.info_status = 200
        async with aiohttp.ClientSession() as s:
            async def one() -> int:
                async with s.post(running.url + "/v1/completions",
                                  json={"model": "m", "prompt": "hi", "max_tokens": 2}) as r:
                    await r.read()
                    return r.status

            assert await asyncio.gather(*(one() for _ in range(8))) == [200] * 8
        assert running.proxy.role_check.done
    finally:
        await running.close()


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_real_engines_swapped_are_refused_and_tokenize_passes(server_pool, tmp_path):
    """Real ``pdserve serve`` P and D (tiny model, CPU) and ``pdserve proxy`` processes: ports
    swapped, the proxy exits 2 naming the flags; in order, vLLM's /tokenize answers through it."""
    import subprocess
    import sys

    import httpx

    servers = server_pool.get("p", "d_rec")
    p, d = servers["p"], servers["d_rec"]
    swapped = subprocess.run(
        [sys.executable, "-m", "pdserve.cli", "proxy", "--port", "0",
         "--prefiller-ports", str(d.port), "--decoder-ports", str(p.port)],
        capture_output=True, text=True, timeout=120)
    assert swapped.returncode == 2, swapped.stderr
    assert "--decoder-hosts/--decoder-ports instead" in swapped.stderr
    assert f"http://127.0.0.1:{d.port} is given as a prefill instance" in swapped.stderr
    proxy = server_pool.proxy("first-use", ["p"], ["d_rec"])
    r = httpx.post(proxy.url + "/tokenize", json={"prompt": "hello world"}, timeout=60)
    assert r.status_code == 200, r.text
    direct = httpx.post(p.url + "/tokenize", json={"prompt": "hello world"}, timeout=60).json()
    assert r.json() == direct and direct["count"] == len(direct["tokens"]) > 0
