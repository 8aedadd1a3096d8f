"""``POST /v1/kv_transfer/release``: the proxy frees a prefill lease its decode leg will not read;
the front end hands the release to the engine core of the data-parallel rank holding it."""

from __future__ import annotations

import dataclasses

import httpx
from tests.support.fake_engine_for_server import FakeEngine
from tests.support.ports import free_port

from pdserve.entrypoints.server import build_app
from pdserve.types.kv_transfer_config import KVTransferConfig

RELEASE = "/v1/kv_transfer/release"


async def test_release_reaches_the_engine_core_with_the_block_ids(monkeypatch) -> None:
    port = free_port()
    monkeypatch.setenv("PDSERVE_NIXL_SIDE_CHANNEL_HOST", "127.0.0.1")
    monkeypatch.setenv("PDSERVE_NIXL_SIDE_CHANNEL_PORT", str(port))
    kv = KVTransferConfig.from_dict({"kv_connector": "NixlConnector", "kv_role": "kv_producer",
                                     "engine_id": "eng-p"})
    engine = FakeEngine()
    engine.config = dataclasses.replace(engine.config, kv_transfer_config=kv)
    params = {"do_remote_prefill": True, "remote_engine_id": "eng-p", "remote_host": "127.0.0.1",
              "remote_port": port, "remote_request_id": "r1", "remote_block_ids": [4, 5]}
    transport = httpx.ASGITransport(app=build_app(engine))
    async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
        r = await c.post(RELEASE, json={"kv_transfer_params": params})
        assert r.status_code == 200 and r.json() == {"released": True}
        assert engine.released == [(0, "r1", [4, 5])]
        other = dict(params, remote_engine_id="eng-d")
        r = await c.post(RELEASE, json={"kv_transfer_params": other})
        assert r.status_code == 400 and r.json()["error"]["param"] == "kv_transfer_params"
        r = await c.post(RELEASE, json={"kv_transfer_params": {"remote_engine_id": "eng-p"}})
        assert r.status_code == 400
        # the release goes only to this instance's own engine core, never to a port the
        # client names
        elsewhere = dict(params, remote_port=free_port())
        r = await c.post(RELEASE, json={"kv_transfer_params": elsewhere})
        assert r.status_code == 400 and "side-channel port" in r.json()["error"]["message"]
        engine.dead = True
        r = await c.post(RELEASE, json={"kv_transfer_params": params})
        assert r.status_code == 503
    assert engine.released == [(0, "r1", [4, 5])]


async def test_release_goes_to_the_data_parallel_rank_holding_the_lease(monkeypatch) -> None:
    port = free_port()
    monkeypatch.setenv("PDSERVE_NIXL_SIDE_CHANNEL_PORT", str(port))
    kv = KVTransferConfig.from_dict({"kv_connector": "NixlConnector", "kv_role": "kv_producer",
                                     "engine_id": "eng-p"})
    engine = FakeEngine()
    engine.config = dataclasses.replace(engine.config, kv_transfer_config=kv,
                                        data_parallel_size=2)
    params = {"remote_engine_id": "eng-p_dp1", "remote_host": "127.0.0.1",
              "remote_port": port + 1, "remote_request_id": "r2", "remote_block_ids": [7]}
    transport = httpx.ASGITransport(app=build_app(engine))
    async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
        r = await c.post(RELEASE, json={"kv_transfer_params": params})
        assert r.status_code == 200 and r.json() == {"released": True}
        # rank 1's engine id with rank 0's port names no lease of this instance
        r = await c.post(RELEASE, json={"kv_transfer_params": dict(params, remote_port=port)})
        assert r.status_code == 400 and "side-channel port" in r.json()["error"]["message"]
    assert engine.released == [(1, "r2", [7])]


async def test_release_without_a_kv_connector_is_400(client: httpx.AsyncClient) -> None:
    r = await client.post(RELEASE, json={"kv_transfer_params": {}})
    assert r.status_code == 400
    assert "no KV transfer configuration" in r.json()["error"]["message"]
