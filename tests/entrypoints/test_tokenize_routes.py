"""vLLM's /tokenize, /detokenize and /version, and pdserve's /pdserve/instance, on an engine's
server (in process, with the fake engine)."""

from __future__ import annotations

import httpx
import pytest

from pdserve import __version__
from pdserve.entrypoints.server import build_app
from pdserve.types.kv_transfer_config import KVTransferConfig


async def test_tokenize_prompt_in_vllm_shape(client, fake_engine):
    r = await client.post("/tokenize", json={"model": "fake-model", "prompt": "abc"})
    assert r.status_code == 200, r.text
    body = r.json()
    ids = fake_engine.tokenizer.encode("abc", add_special_tokens=True)
    assert body == {"count": len(ids), "max_model_len": fake_engine.max_model_len,
                    "tokens": ids, "token_strs": None}


async def test_tokenize_returns_token_strs_and_respects_add_special_tokens(client, fake_engine):
    r = await client.post("/tokenize", json={"prompt": "ab", "add_special_tokens": False,
                                             "return_token_strs": True})
    assert r.status_code == 200, r.text
    ids = fake_engine.tokenizer.encode("ab", add_special_tokens=False)
    assert r.json()["tokens"] == ids
    assert r.json()["token_strs"] == fake_engine.tokenizer.convert_ids_to_tokens(ids)


async def test_tokenize_messages_renders_the_chat_template(client, fake_engine):
    messages = [{"role": "user", "content": "hi"}]
    r = await client.post("/tokenize", json={"messages": messages})
    assert r.status_code == 200, r.text
    text = fake_engine.tokenizer.apply_chat_template(messages, tokenize=False,
                                                     add_generation_prompt=True)
    assert r.json()["tokens"] == fake_engine.tokenizer.encode(text, add_special_tokens=False)


async def test_tokenize_messages_without_chat_template_is_400(client, fake_engine):
    fake_engine.tokenizer.chat_template = None
    r = await client.post("/tokenize", json={"messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 400
    assert "/v1/completions" in r.json()["error"]["message"]


async def test_detokenize_round_trips(client, fake_engine):
    ids = fake_engine.tokenizer.encode("hello", add_special_tokens=False)
    r = await client.post("/detokenize", json={"model": "fake-model", "tokens": ids})
    assert r.status_code == 200, r.text
    assert r.json() == {"prompt": fake_engine.tokenizer.decode(ids)}


@pytest.mark.parametrize("path,body", [("/tokenize", {"model": "other", "prompt": "a"}),
                                       ("/detokenize", {"model": "other", "tokens": [1]})])
async def test_wrong_model_is_404(client, path, body):
    r = await client.post(path, json=body)
    assert r.status_code == 404
    assert r.json()["error"]["param"] == "model"


@pytest.mark.parametrize("path,body", [("/tokenize", {"prompt": 3}), ("/tokenize", {}),
                                       ("/detokenize", {"tokens": "x"}),
                                       ("/detokenize", {"tokens": [10 ** 9]}),
                                       ("/tokenize", [1, 2])])
async def test_bad_body_is_400_openai_style(client, path, body):
    r = await client.post(path, json=body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["message"]


async def test_malformed_json_is_400(client):
    r = await client.post("/tokenize", content=b"{", headers={"Content-Type": "application/json"})
    assert r.status_code == 400


@pytest.mark.parametrize("path", ["/tokenize", "/detokenize"])
async def test_json_nested_too_deeply_is_400_not_500(client, path):
    raw = b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    r = await client.post(path, content=raw, headers={"Content-Type": "application/json"})
    assert r.status_code == 400
    assert "nested too deeply" in r.json()["error"]["message"]


async def test_version(client):
    r = await client.get("/version")
    assert r.status_code == 200 and r.json() == {"version": __version__}


async def test_instance_info_names_role_and_chat_template(fake_engine, monkeypatch):
    monkeypatch.setenv("PDSERVE_NIXL_SIDE_CHANNEL_HOST", "10.1.2.3")
    monkeypatch.setenv("PDSERVE_NIXL_SIDE_CHANNEL_PORT", "5610")
    fake_engine.config.kv_transfer_config = KVTransferConfig(kv_role="kv_producer", engine_id="e1")
    transport = httpx.ASGITransport(app=build_app(fake_engine))
    async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
        r = await c.get("/pdserve/instance")
    assert r.status_code == 200
    # a prefiller also lists its KV endpoint (the concurrent hand-off: docs/proxy.md)
    assert r.json() == {"model": "fake-model", "kv_role": "kv_producer", "engine_id": "e1",
                        "chat_template": True, "version": __version__,
                        "kv_endpoints": [{"engine_id": "e1", "host": "10.1.2.3", "port": 5610}],
                        "tp_size": 1}


async def test_instance_info_without_kv_transfer_or_chat_template(client, fake_engine):
    fake_engine.tokenizer.chat_template = None
    transport = httpx.ASGITransport(app=build_app(fake_engine))
    async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
        body = (await c.get("/pdserve/instance")).json()
    assert body["kv_role"] is None and body["chat_template"] is False


def _engine(kv_role: str):
    from tests.support.fake_engine_for_server import FakeEngine

    engine = FakeEngine()
    engine.config.kv_transfer_config = KVTransferConfig(kv_role=kv_role)
    return engine


async def test_proxy_refuses_swapped_engines_and_passes_tokenize_through():
    """The engine's route and the proxy's role check agree (both apps served in process)."""
    import aiohttp
    from tests.support.live_server import live_server

    from pdserve.router.config import ProxyConfig
    from pdserve.router.proxy import start_proxy
    from pdserve.router.role_check import RoleMismatch

    p_engine, d_engine = _engine("kv_producer"), _engine("kv_consumer")
    async with live_server(build_app(p_engine)) as p_url, \
            live_server(build_app(d_engine)) as d_url:
        with pytest.raises(RoleMismatch, match="--decoder-hosts/--decoder-ports instead"):
            await start_proxy(ProxyConfig(port=0, prefillers=(d_url,), decoders=(p_url,)))
        running = await start_proxy(ProxyConfig(port=0, prefillers=(p_url,), decoders=(d_url,)))
        try:
            async with aiohttp.ClientSession() as s:
                async with s.post(running.url + "/tokenize",
                                  json={"model": "fake-model", "prompt": "abc"}) as r:
                    assert r.status == 200
                    ids = p_engine.tokenizer.encode("abc", add_special_tokens=True)
                    assert (await r.json())["tokens"] == ids
                async with s.post(running.url + "/detokenize",
                                  json={"model": "other", "tokens": [1]}) as r:
                    assert r.status == 404
                async with s.get(running.url + "/version") as r:
                    assert (await r.json()) == {"version": __version__}
        finally:
            await running.close()
