"""The concurrent hand-off at the engine's front end: the ``X-data-parallel-rank`` header pins
a generation request to a rank (400 naming the header for a bad value), and a prefiller's
``GET /pdserve/instance`` lists its KV endpoints, one per rank (docs/proxy.md)."""

from __future__ import annotations

import dataclasses

import httpx
import pytest
from tests.support.fake_engine_for_server import FakeEngine

from pdserve.entrypoints.instance_info import prefill_endpoints
from pdserve.entrypoints.server import build_app
from pdserve.types.kv_endpoints import (KVEndpoint, KVEndpointsError, PrefillEndpoints,
                                        parse_data_parallel_rank)
from pdserve.types.kv_transfer_config import KVTransferConfig

HEADER = "X-data-parallel-rank"


def engine_with(data_parallel_size: int = 1, kv_role: str | None = None, **config) -> FakeEngine:
    engine = FakeEngine()
    kv = (KVTransferConfig.from_dict({"kv_role": kv_role, "engine_id": "eng"})
          if kv_role else None)
    engine.config = dataclasses.replace(engine.config, data_parallel_size=data_parallel_size,
                                        kv_transfer_config=kv, **config)
    return engine


def client(engine: FakeEngine) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=build_app(engine)),
                             base_url="http://t")


@pytest.mark.parametrize("path,body", [
    ("/v1/completions", {"prompt": "hi", "max_tokens": 2}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}),
])
async def test_the_header_pins_the_rank_and_bad_values_are_400(path, body):
    engine = engine_with(data_parallel_size=3)
    async with client(engine) as c:
        for value, rank in (("2", 2), (" 0 ", 0), (None, None)):
            headers = {HEADER: value} if value is not None else {}
            before = set(engine.calls)
            r = await c.post(path, json=body, headers=headers)
            assert r.status_code == 200, r.text
            (new,) = set(engine.calls) - before
            assert engine.calls[new]["rank"] == rank
        for value in ("3", "-1", "one", "1.0", ""):
            for stream in (False, True):
                r = await c.post(path, json=dict(body, stream=stream), headers={HEADER: value})
                assert r.status_code == 400, (value, r.text)
                error = r.json()["error"]
                assert error["param"] == HEADER and HEADER in error["message"]
                assert "0 to 2" in error["message"]
    assert len(engine.calls) == 3  # no refused request reached the engine


async def test_without_data_parallelism_only_rank_0_is_accepted():
    engine = engine_with()
    async with client(engine) as c:
        r = await c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1},
                         headers={HEADER: "0"})
        assert r.status_code == 200 and [v["rank"] for v in engine.calls.values()] == [0]
        r = await c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1},
                         headers={HEADER: "1"})
        assert r.status_code == 400 and "must be 0" in r.json()["error"]["message"]


async def test_a_prefiller_lists_one_kv_endpoint_per_rank(monkeypatch):
    monkeypatch.setenv("PDSERVE_NIXL_SIDE_CHANNEL_HOST", "10.0.0.7")
    monkeypatch.setenv("PDSERVE_NIXL_SIDE_CHANNEL_PORT", "6100")
    for role in ("kv_producer", "kv_both"):
        engine = engine_with(data_parallel_size=2, kv_role=role, tensor_parallel_size=2)
        async with client(engine) as c:
            info = (await c.get("/pdserve/instance")).json()
        assert info["kv_endpoints"] == [
            {"engine_id": "eng_dp0", "host": "10.0.0.7", "port": 6100},
            {"engine_id": "eng_dp1", "host": "10.0.0.7", "port": 6101}]
        assert info["tp_size"] == 2 and info["engine_id"] == "eng"
    async with client(engine_with(kv_role="kv_producer")) as c:
        info = (await c.get("/pdserve/instance")).json()
    assert info["kv_endpoints"] == [{"engine_id": "eng", "host": "10.0.0.7", "port": 6100}]
    for engine in (engine_with(kv_role="kv_consumer"), engine_with()):
        async with client(engine) as c:
            info = (await c.get("/pdserve/instance")).json()
        assert "kv_endpoints" not in info and "tp_size" not in info


def test_ranks_on_other_hosts_list_no_endpoints():
    config = engine_with(data_parallel_size=4, kv_role="kv_producer",
                         data_parallel_size_local=2).config
    assert prefill_endpoints(config) == PrefillEndpoints((), 1)
    assert PrefillEndpoints.from_info(prefill_endpoints(config).to_info()) is None


def test_endpoints_round_trip_and_malformed_ones_are_refused():
    good = PrefillEndpoints((KVEndpoint("e_dp0", "h", 5600), KVEndpoint("e_dp1", "h", 5601)), 2)
    assert PrefillEndpoints.from_info(good.to_info()) == good
    assert PrefillEndpoints.from_info({"kv_endpoints": None}) is None
    assert PrefillEndpoints.from_info({}) is None
    for bad in ({"kv_endpoints": [{"engine_id": "e", "host": "h", "port": 0}], "tp_size": 1},
                {"kv_endpoints": [{"engine_id": "e", "host": "h", "port": 1}], "tp_size": 0},
                {"kv_endpoints": [{"engine_id": "", "host": "h", "port": 1}], "tp_size": 1},
                {"kv_endpoints": ["e"], "tp_size": 1},
                {"kv_endpoints": {"engine_id": "e"}, "tp_size": 1}):
        with pytest.raises(KVEndpointsError):
            PrefillEndpoints.from_info(bad)


def test_rank_header_parsing():
    assert parse_data_parallel_rank(None, 2) is None
    assert parse_data_parallel_rank("1", 2) == 1
    for bad in ("2", "+1", "1_0", " ", "0x1", "\u0662"):  # the last: ARABIC-INDIC DIGIT TWO
        with pytest.raises(ValueError, match=HEADER):
            parse_data_parallel_rank(bad, 2)
