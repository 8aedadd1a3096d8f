"""The concurrent hand-off through the proxy (docs/proxy.md, "the wire contract"), observed by
fake prefillers and decoders that speak it (tests/support/handoff_fakes.py): both legs at once
with the contract's bodies and rank header, D's answer relayed without waiting for P's, the
sequential flow where the contract cannot be used, stale endpoints, the hand-off metrics."""

import asyncio
import json

import pytest
from aiohttp import web

from pdserve.router.handoff import HandoffMode
from tests.support.handoff_fakes import BASE_PORT, SideChannels, engine_id, info_for
from tests.support.router_fakes import prefill_params, wait_until

from .test_router_flow import STATELESS

BODY = {"model": "m", "prompt": "Hello", "max_tokens": 5, "temperature": 0}


async def concurrent_cluster(make_cluster, ranks=1, **kwargs):
    c = await make_cluster(instance_info=info_for(ranks, tp_size=2), **kwargs)
    channels = SideChannels()
    channels.install(c.prefillers, c.decoders)
    return c, channels


def _count(c, leg):
    """Observations of ``pdserve:proxy_handoff_seconds{leg}``."""
    return c.proxy.proxy.metrics.registry.get_sample_value("pdserve:proxy_handoff_seconds_count",
                                                           {"leg": leg})


async def test_both_legs_carry_the_contract_and_d_waits_at_the_side_channel(make_cluster):
    c, channels = await concurrent_cluster(make_cluster, ranks=2)
    p, d = c.prefillers[0], c.decoders[0]

    async def prefill_after_decoder_arrived(inst, request, rec):
        await wait_until(lambda: len(d.received) == len(p.received))  # both legs in flight
        return await channels.prefill(inst, request, rec)

    p.handler = prefill_after_decoder_arrived
    ranks = []
    for i in range(2):
        status, headers, raw = await c.post("/v1/completions", BODY, {"X-Request-Id": f"r{i}"})
        assert status == 200 and json.loads(raw)["choices"][0]["text"] == "Hello world"
        p_req, d_req = p.received[i], d.received[i]
        transfer_id = p_req.body["kv_transfer_params"]["transfer_id"]
        assert len(transfer_id) == 32 and int(transfer_id, 16) >= 0
        assert p_req.body == {"model": "m", "prompt": "Hello", "max_tokens": 1, "temperature": 0,
                              "stream": False, "pdserve_decode_leg": {"max_tokens": 5},
                              "kv_transfer_params": dict(STATELESS, transfer_id=transfer_id)}
        rank = int(p_req.headers["X-data-parallel-rank"])
        ranks.append(rank)
        assert d_req.body == dict(BODY, kv_transfer_params={
            "do_remote_prefill": True, "do_remote_decode": False,
            "remote_engine_id": engine_id("p0", rank, 2), "remote_host": "127.0.0.1",
            "remote_port": BASE_PORT + rank, "remote_transfer_id": transfer_id, "tp_size": 2})
        assert "X-data-parallel-rank" not in d_req.headers
        assert p_req.request_id == d_req.request_id == headers["X-Request-Id"] == f"r{i}"
    assert sorted(ranks) == [0, 1]  # ties go round robin
    assert channels.claims == [r.body["kv_transfer_params"]["transfer_id"] for r in p.received]
    assert p.released == [] and c.proxy.proxy.metrics.retries.labels(leg="prefill")._value.get() == 0


async def test_single_rank_prefiller_gets_no_rank_header(make_cluster):
    c, _ = await concurrent_cluster(make_cluster)
    assert (await c.post("/v1/chat/completions", {
        "model": "m", "messages": [{"role": "user", "content": "x"}]}))[0] == 200
    (p_req,), (d_req,) = c.prefillers[0].received, c.decoders[0].received
    assert "X-data-parallel-rank" not in p_req.headers
    transfer_id = p_req.body["kv_transfer_params"]["transfer_id"]
    assert d_req.body["kv_transfer_params"]["remote_transfer_id"] == transfer_id
    assert d_req.body["kv_transfer_params"]["remote_engine_id"] == "engine-p0"


async def test_the_rank_with_fewest_prefill_legs_in_flight_is_picked(make_cluster):
    c, channels = await concurrent_cluster(make_cluster, ranks=3)
    gate = asyncio.Event()

    async def held_prefill(inst, request, rec):
        await gate.wait()
        return await channels.prefill(inst, request, rec)

    c.prefillers[0].handler = held_prefill
    tasks = [asyncio.create_task(c.post("/v1/completions", BODY)) for _ in range(3)]
    await wait_until(lambda: len(c.prefillers[0].received) == 3)
    ranks = sorted(r.headers["X-data-parallel-rank"] for r in c.prefillers[0].received)
    assert ranks == ["0", "1", "2"]  # each in-flight leg on its own rank
    gate.set()
    assert [t[0] for t in await asyncio.gather(*tasks)] == [200] * 3
    target = c.proxy.proxy.handoff_targets.prefill(c.proxy.proxy.prefillers.upstreams[0])
    assert target.in_flight == [0, 0, 0]


async def test_decoder_answer_is_relayed_without_waiting_for_the_prefiller(make_cluster):
    c, channels = await concurrent_cluster(make_cluster)
    p = c.prefillers[0]
    answer_sent = asyncio.Event()

    async def prefill_answering_late(inst, request, rec):
        params = prefill_params(inst.name, rec.request_id)
        channels.hold(rec.body["kv_transfer_params"]["transfer_id"], params)  # KV held
        await answer_sent.wait()  # P's HTTP answer comes only after the client has D's
        return web.json_response({"choices": [{"text": "H"}], "kv_transfer_params": params})

    p.handler = prefill_answering_late
    for stream in (False, True):
        status, _, raw = await c.post("/v1/completions", dict(BODY, stream=stream))
        assert status == 200 and b"world" in raw
        up = c.proxy.proxy.prefillers.upstreams[0]
        assert up.in_flight == 1  # P's leg is still open, read in the background
        answer_sent.set()
        await wait_until(lambda: up.in_flight == 0)
        answer_sent.clear()
    assert p.released == [] and p.cancelled == []
    # prefill: leg sent -> P's answer; decode: leg sent -> D's first token
    assert _count(c, "prefill") == 2 and _count(c, "decode") == 2


async def test_chat_stream_opening_chunk_and_tokens_are_relayed_once(make_cluster):
    c, _ = await concurrent_cluster(make_cluster)
    status, _, raw = await c.post("/v1/chat/completions", {
        "model": "m", "messages": [{"role": "user", "content": "x"}], "stream": True})
    assert status == 200
    events = [json.loads(e[6:]) for e in raw.decode().split("\n\n") if e.startswith("data: {")]
    assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert "".join(e["choices"][0]["delta"].get("content", "") for e in events) == "Hello world"
    assert raw.endswith(b"data: [DONE]\n\n") and raw.count(b'"role"') == 1


async def test_sequential_handoff_keeps_the_sequential_wire_form(make_cluster):
    c, _ = await concurrent_cluster(make_cluster, ranks=2, handoff=HandoffMode.SEQUENTIAL)
    assert (await c.post("/v1/completions", BODY, {"X-Request-Id": "q"}))[0] == 200
    (p_req,), (d_req,) = c.prefillers[0].received, c.decoders[0].received
    assert p_req.body["kv_transfer_params"] == STATELESS
    assert "X-data-parallel-rank" not in p_req.headers
    assert d_req.body["kv_transfer_params"] == dict(prefill_params("p0", "q"),
                                                    remote_engine_id="engine-p0_dp0")
    assert _count(c, "prefill") == 1 and _count(c, "decode") == 1


@pytest.mark.parametrize("case", ["prefiller_without_endpoints", "vllm_engines",
                                  "vllm_decoder"])
async def test_instances_without_the_contract_are_served_sequentially(make_cluster, case):
    def info(inst):
        full = info_for()(inst)
        if case == "prefiller_without_endpoints":  # an older pdserve prefiller
            return dict(full, kv_endpoints=None) if inst.role == "prefill" else full
        if case == "vllm_engines":  # no /pdserve/instance at all
            return None
        return None if inst.role == "decode" else full

    c = await make_cluster(instance_info=info)
    assert (await c.post("/v1/completions", BODY, {"X-Request-Id": "s"}))[0] == 200
    (p_req,), (d_req,) = c.prefillers[0].received, c.decoders[0].received
    assert p_req.body["kv_transfer_params"] == STATELESS
    assert d_req.body["kv_transfer_params"] == prefill_params("p0", "s")


async def test_vllm_decoder_is_left_out_of_the_concurrent_order(make_cluster):
    def info(inst):
        return None if inst.name == "d1" else info_for()(inst)

    c = await make_cluster(instance_info=info, n_decode=2)
    SideChannels().install(c.prefillers, c.decoders[:1])
    for i in range(2):  # round robin: d0 first, then d1 first
        assert (await c.post("/v1/completions", BODY, {"X-Request-Id": f"v{i}"}))[0] == 200
    (d0_req,), (d1_req,) = c.decoders[0].received, c.decoders[1].received
    assert "remote_transfer_id" in d0_req.body["kv_transfer_params"]
    assert d1_req.body["kv_transfer_params"] == prefill_params("p0", "v1")


async def test_a_restarted_prefiller_is_asked_again_and_served_sequentially_meanwhile(make_cluster):
    c, channels = await concurrent_cluster(make_cluster)
    p, d = c.prefillers[0], c.decoders[0]
    assert p.info_asked == 1
    p.info = dict(p.info, engine_id="engine-p0-new", kv_endpoints=[
        {"engine_id": "engine-p0-new", "host": "127.0.0.1", "port": BASE_PORT}])

    async def restarted(inst, request, rec):  # answers as its new engine
        params = dict(prefill_params(inst.name, rec.request_id), remote_engine_id="engine-p0-new")
        transfer_id = (rec.body.get("kv_transfer_params") or {}).get("transfer_id")
        if transfer_id:
            channels.hold(transfer_id, params)
        return web.json_response({"choices": [{"text": "H"}], "kv_transfer_params": params})

    async def decoder_checking_the_engine(inst, request, rec):
        kv = rec.body["kv_transfer_params"]
        if kv.get("remote_engine_id") != "engine-p0-new":  # the handshake finds another engine
            return web.json_response({"error": {
                "message": "invalid kv_transfer_params: the side channel belongs to another "
                           "engine", "type": "BadRequestError", "param": "kv_transfer_params",
                "code": 400}}, status=400)
        return await channels.decode(inst, request, rec)

    p.handler, d.handler = restarted, decoder_checking_the_engine
    status, _, raw = await c.post("/v1/completions", BODY)
    assert status == 200 and json.loads(raw)["served_by"] == "d0"
    first, second = d.received
    assert first.body["kv_transfer_params"]["remote_engine_id"] == "engine-p0"  # stale
    assert "remote_transfer_id" not in second.body["kv_transfer_params"]  # sequential retry
    assert second.body["kv_transfer_params"]["remote_engine_id"] == "engine-p0-new"
    metrics = c.proxy.proxy.metrics
    assert metrics.retries.labels(leg="decode")._value.get() == 0  # the proxy's fault: free
    await wait_until(lambda: p.info_asked == 2)  # asked again, in the background
    await wait_until(lambda: c.proxy.proxy.handoff_targets.prefill(
        c.proxy.proxy.prefillers.upstreams[0]) is not None)
    assert (await c.post("/v1/completions", BODY))[0] == 200
    assert d.received[-1].body["kv_transfer_params"]["remote_engine_id"] == "engine-p0-new"
    assert "remote_transfer_id" in d.received[-1].body["kv_transfer_params"]


async def test_multi_turn_prefill_leg_carries_the_decoders_fields_and_a_transfer_id(make_cluster):
    c, _ = await concurrent_cluster(make_cluster, multi_turn=True)
    d_params = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": "d0",
                "remote_block_ids": [[4]], "remote_host": "127.0.0.1", "remote_port": 5700,
                "remote_request_id": "d0-1"}
    c.decoders[0].decoder_params = lambda n: d_params
    for _ in range(2):
        status, _, raw = await c.post("/v1/completions", dict(BODY, conversation_id="c1"))
        assert status == 200 and json.loads(raw)["kv_transfer_params"] is None
    second = c.prefillers[0].received[1].body["kv_transfer_params"]
    transfer_id = second.pop("transfer_id")
    assert second == dict(STATELESS, **d_params)
    assert c.decoders[0].received[1].body["kv_transfer_params"]["remote_transfer_id"] == transfer_id
    assert c.proxy.proxy.conversations.get("c1").kv_transfer_params == d_params
