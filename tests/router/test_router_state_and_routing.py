"""--state-store redis (shared multi-turn table: single-use params, Redis down = recompute),
--session-affinity, KV-aware scoring, and the new flags' validation; fake P/D instances."""

from __future__ import annotations

import asyncio
import time

import pytest

from pdserve.types.block_hash import block_hashes
from pdserve.types.kv_events import BlockRemoved, BlockStored, KVEventBatch, KVSnapshot
from pdserve.router.config import ProxyConfig, parse_args
from pdserve.router.kv_routing import KVAwareRouter, PromptBlocks, RoutingReason
from pdserve.router.proxy import start_proxy
from pdserve.router.state_store import RedisStateStore
from pdserve.router.upstreams import UpstreamPool

from tests.support.servers import RedisServer

from .test_router_multi_turn import chat, decoder_params


@pytest.fixture
def redis_server(tmp_path):
    server = RedisServer(tmp_path / "redis.log")
    try:
        server.wait_ready()
        yield server
    finally:
        server.stop()


def counter(proxy, name: str, **labels) -> float:
    return proxy.metrics.registry.get_sample_value(name, labels or None) or 0.0


# ------------------------------------------------------------------ state store
@pytest.mark.slow
async def test_redis_store_params_are_single_use_and_expire(redis_server):
    errors = []
    store = RedisStateStore(redis_server.url, ttl=30.0, on_error=errors.append)
    try:
        assert await store.load("c") is None
        params = {"remote_block_ids": [[1, 2]], "remote_blocks_expiry_time": time.time() + 60}
        await store.record_turn("c", "http://p", "http://d", params)
        state = await store.load("c")
        assert (state.prefiller_url, state.decoder_url, state.kv_transfer_params) == (
            "http://p", "http://d", params)
        again = await store.load("c")  # params taken; routing kept
        assert again.kv_transfer_params is None and again.decoder_url == "http://d"
        # a turn without params leaves none, as in the in-process table
        await store.record_turn("c", "http://p", "http://d", params)
        await store.record_turn("c", "http://p", "http://d2", None)
        state = await store.load("c")
        assert state.kv_transfer_params is None and state.decoder_url == "http://d2"
        # already expired params are not stored
        await store.record_turn("c", "http://p", "http://d",
                                {"remote_blocks_expiry_time": time.time() - 1})
        assert (await store.load("c")).kv_transfer_params is None
        # two loads racing: exactly one gets the params
        await store.record_turn("r", "http://p", "http://d", {"x": 1})
        got = await asyncio.gather(*(store.load("r") for _ in range(8)))
        assert sum(s.kv_transfer_params is not None for s in got) == 1
        assert errors == []
    finally:
        await store.close()


async def test_redis_store_unreachable_counts_and_returns_nothing(tmp_path):
    from tests.support.ports import free_port

    errors = []
    store = RedisStateStore(f"redis://127.0.0.1:{free_port()}/0", ttl=30.0, on_error=errors.append)
    try:
        t0 = time.monotonic()
        assert await store.load("c") is None
        await store.record_turn("c", "http://p", "http://d", {"x": 1})
        assert await store.load("c") is None
        assert errors == ["load", "record", "load"]
        assert time.monotonic() - t0 < 2.0
    finally:
        await store.close()


def two_replicas_config(c, redis_url, **extra):
    return ProxyConfig(host="127.0.0.1", port=0, prefillers=tuple(p.url for p in c.prefillers),
                       decoders=tuple(d.url for d in c.decoders), multi_turn=True,
                       state_store=redis_url, **extra)


@pytest.mark.slow
async def test_two_replicas_share_conversations_and_race_hands_params_once(make_cluster,
                                                                           redis_server):
    c = await make_cluster(n_prefill=1, n_decode=1, multi_turn=True, state_store=redis_server.url)
    c.decoders[0].decoder_params = decoder_params("d0")
    replica_b = await start_proxy(two_replicas_config(c, redis_server.url))
    try:
        async def post(url, turn, conv):
            async with c.session.post(url + "/v1/chat/completions",
                                      json=chat(turn, conversation_id=conv)) as r:
                assert r.status == 200, await r.text()

        await post(c.url, 1, "conv")          # turn 1 through replica A
        await post(replica_b.url, 2, "conv")  # turn 2 through replica B finds D's params
        p_params = [r.body["kv_transfer_params"] for r in c.prefillers[0].received]
        assert p_params[1]["remote_request_id"] == "d0-turn1"
        # race: the next turn through both replicas at once; exactly one hands D's params to P
        await asyncio.gather(post(c.url, 3, "conv"), post(replica_b.url, 3, "conv"))
        p_params = [r.body["kv_transfer_params"] for r in c.prefillers[0].received[2:]]
        assert sorted(p.get("remote_request_id", "") for p in p_params) == ["", "d0-turn2"]
        forwarded = (counter(c.proxy.proxy, "pdserve:proxy_kv_params_forwarded_total")
                     + counter(replica_b.proxy, "pdserve:proxy_kv_params_forwarded_total"))
        assert forwarded == 2  # turn 2, and one of the racing turn-3 requests
    finally:
        await replica_b.close()


@pytest.mark.slow
async def test_redis_down_serves_turns_as_recompute_and_counts(make_cluster, redis_server):
    c = await make_cluster(multi_turn=True, state_store=redis_server.url)
    c.decoders[0].decoder_params = decoder_params("d0")
    status, _, _ = await c.post("/v1/chat/completions", chat(1, conversation_id="c"))
    assert status == 200
    redis_server.stop()
    for turn in (2, 3):
        status, _, raw = await c.post("/v1/chat/completions", chat(turn, conversation_id="c"))
        assert status == 200, raw
    p_params = [r.body["kv_transfer_params"] for r in c.prefillers[0].received]
    assert all("remote_request_id" not in p for p in p_params[1:])  # recomputed
    proxy = c.proxy.proxy
    assert (counter(proxy, "pdserve:proxy_state_store_errors_total", op="load")
            + counter(proxy, "pdserve:proxy_state_store_errors_total", op="record")) >= 2


# ------------------------------------------------------------------ session affinity
async def test_session_affinity_keeps_the_decoder_and_counts_the_reason(make_cluster):
    c = await make_cluster(n_decode=2, multi_turn=True, session_affinity=True)
    for d in c.decoders:
        d.decoder_params = decoder_params(d.name)
    for turn in (1, 2, 3):
        status, _, _ = await c.post("/v1/chat/completions", chat(turn, conversation_id="c"))
        assert status == 200
    assert sorted(len(d.received) for d in c.decoders) == [0, 3]
    assert counter(c.proxy.proxy, "pdserve:proxy_routing_decisions_total", leg="decode",
                   reason="affinity") == 2
    busy = next(d for d in c.decoders if d.received)
    up = c.proxy.proxy.decoders.get(busy.url)
    up.in_flight += 3  # too busy: the next turn goes to the other decoder
    try:
        status, _, _ = await c.post("/v1/chat/completions", chat(4, conversation_id="c"))
    finally:
        up.in_flight -= 3
    assert status == 200 and sorted(len(d.received) for d in c.decoders) == [1, 3]


# ------------------------------------------------------------------ kv-aware scoring
def live_router(urls, cached: dict[str, list[int]], block_size=4) -> KVAwareRouter:
    router = KVAwareRouter(urls, tokenizer=None, load_weight=0.5, stale_after=5.0)
    for url, hashes in cached.items():
        router.indexes[url].apply_snapshot(KVSnapshot(1, 0, block_size, hashes))
    return router


def test_kv_aware_prefers_cached_prefix_against_load():
    urls = ("http://a", "http://b")
    pool = UpstreamPool("prefill", urls, "kv-aware")
    prompt = PromptBlocks(list(range(40)))  # 10 blocks of 4
    router = live_router(urls, {"http://a": [], "http://b": block_hashes(prompt.token_ids[:24], 4)})
    d = router.route(pool, prompt)
    # the chosen instance's tokens to compute come with the decision (local prefill's input)
    assert (d.order[0].url, d.reason, d.hit_blocks, d.prompt_blocks, d.uncached_tokens) == (
        "http://b", RoutingReason.KV_HIT, 6, 10, 16)
    assert d.uncached_tokens == router.uncached_tokens(d.order[0], prompt)
    pool.get("http://b").in_flight = 2  # 0.4 + 0.5 * 2 > 1.0: load wins
    d = router.route(pool, prompt)
    assert (d.order[0].url, d.reason, d.uncached_tokens) == (
        "http://a", RoutingReason.LEAST_LOADED, 40)
    pool.get("http://b").in_flight = 0
    d = router.route(pool, PromptBlocks([7] * 41))
    assert d.reason == RoutingReason.LEAST_LOADED and d.uncached_tokens == 41  # nothing cached


def test_kv_aware_weighs_a_hit_by_its_tier():
    urls = ("http://gpu", "http://cpu", "http://disk")
    pool = UpstreamPool("prefill", urls, "kv-aware")
    prompt = PromptBlocks(list(range(40)))  # 10 blocks of 4
    hashes = block_hashes(prompt.token_ids, 4)
    router = live_router(urls, {u: [] for u in urls})
    # 4 blocks in the KV cache of "gpu"; all 10 in the host tier of "cpu" (KV events with
    # medium CPU), 8 in the disk tier of "disk" after 2 in its KV cache
    ixs = router.indexes
    ixs["http://gpu"].apply_batch(KVEventBatch(1, 1, 0.0, [BlockStored(hashes[:4], medium="GPU")]))
    ixs["http://cpu"].apply_batch(KVEventBatch(1, 1, 0.0, [BlockStored(hashes, medium="CPU")]))
    ixs["http://disk"].apply_batch(KVEventBatch(1, 1, 0.0, [BlockStored(hashes[:2]),
                                                          BlockStored(hashes[2:], medium="DISK")]))
    assert ixs["http://disk"].hit_media(hashes) == ["GPU"] * 2 + ["DISK"] * 8
    # costs: gpu 6/10 = 0.6; cpu 10 * 0.1 / 10 = 0.1; disk 8 * 0.5 / 10 = 0.4
    d = router.route(pool, prompt)
    assert [u.url for u in d.order][:1] == ["http://cpu"] and d.hit_blocks == 10
    ixs["http://cpu"].apply_batch(KVEventBatch(1, 2, 0.0, [BlockRemoved(hashes[5:], medium="CPU")]))
    d = router.route(pool, prompt)  # cpu: (5 * 0.1 + 5) / 10 = 0.55 > disk's 0.4
    assert d.order[0].url == "http://disk" and d.hit_blocks == 10
    ixs["http://disk"].apply_snapshot(KVSnapshot(1, 5, 4, [], {"DISK": hashes[:3]}))
    d = router.route(pool, prompt)  # disk: (3 * 0.5 + 7) / 10 = 0.85; cpu's 0.55 wins
    assert d.order[0].url == "http://cpu" and d.hit_blocks == 5


def test_kv_aware_decision_carries_the_first_instances_tokens_to_compute():
    """``uncached_tokens`` is that of the instance tried first, whichever it is: the best one,
    the least-loaded one while the best cools down, or None when its index is not live."""
    urls = ("http://a", "http://b")
    pool = UpstreamPool("decode", urls, "kv-aware")
    ids = list(range(42))  # 10 blocks of 4, 2 tokens after them
    prompt = PromptBlocks(ids)
    router = live_router(urls, {"http://a": block_hashes(ids[:8], 4),
                                "http://b": block_hashes(ids, 4)})
    d = router.route(pool, prompt)
    assert (d.order[0].url, d.uncached_tokens) == ("http://b", 2)
    pool.mark_down(pool.get("http://b"))  # the best one cools down: "a" is tried first
    d = router.route(pool, prompt)
    assert (d.order[0].url, d.reason, d.uncached_tokens) == (
        "http://a", RoutingReason.LEAST_LOADED, 34)
    pool.mark_up(pool.get("http://b"))
    router.indexes["http://b"].synced = False  # waiting for a snapshot: not live
    pool.get("http://a").in_flight = 1
    d = router.route(pool, prompt)  # "a" scores 0.8 + 0.5 > "b"'s unscored 1.0
    assert (d.order[0].url, d.uncached_tokens) == ("http://b", None)


def test_kv_aware_without_live_events_is_least_loaded():
    urls = ("http://a", "http://b")
    pool = UpstreamPool("decode", urls, "kv-aware")
    router = KVAwareRouter(urls, tokenizer=None, load_weight=0.5, stale_after=5.0)
    pool.get("http://a").in_flight = 1
    d = router.route(pool, PromptBlocks(list(range(40))))
    assert (d.order[0].url, d.reason, d.uncached_tokens) == (
        "http://b", RoutingReason.NO_EVENTS, None)


@pytest.mark.parametrize("argv, message", [
    (["--routing", "kv-aware"], "--routing kv-aware needs --tokenizer"),
    (["--local-prefill-max-tokens", "64"], "--local-prefill-max-tokens needs --tokenizer"),
    (["--routing", "kv-aware", "--local-prefill-max-tokens", "64"],
     "--routing kv-aware needs --tokenizer"),
    (["--state-store", "redis://h:1/0"], "give --multi-turn too"),
    (["--multi-turn", "--state-store", "mysql://h"], "expected 'memory' or redis://"),
    (["--multi-turn", "--state-store", "redis://h:1/x"], "must be a number"),
    (["--session-affinity"], "give --multi-turn too"),
])
def test_bad_new_flags_exit_with_a_message(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        parse_args(["--prefiller-ports", "1", "--decoder-ports", "2", *argv])
    err = capsys.readouterr().err
    assert e.value.code == 2 and message in err
    assert err.count("\n") == 1 and err.startswith("pdserve proxy: error: "), err  # one line


def test_new_flags_parse():
    cfg = parse_args(["--prefiller-ports", "1", "--decoder-ports", "2", "--routing", "kv-aware",
                      "--tokenizer", "m", "--multi-turn", "--state-store", "redis://h:6379/2",
                      "--session-affinity", "--kv-load-weight", "0.25"])
    assert (cfg.routing, cfg.tokenizer, cfg.state_store, cfg.session_affinity,
            cfg.kv_load_weight) == ("kv-aware", "m", "redis://h:6379/2", True, 0.25)


async def test_every_decision_is_counted_and_logged_at_debug(make_cluster, caplog):
    import logging

    caplog.set_level(logging.DEBUG, logger="pdserve.router")
    c = await make_cluster(n_prefill=2, routing="least-loaded")
    status, headers, _ = await c.post("/v1/completions", {"model": "m", "prompt": "x"})
    assert status == 200
    rid = headers["X-Request-Id"]
    assert f"request {rid}: prefill leg -> {c.prefillers[0].url} (least_loaded" in caplog.text
    assert f"request {rid}: decode leg -> {c.decoders[0].url} (least_loaded" in caplog.text
    for leg in ("prefill", "decode"):
        assert counter(c.proxy.proxy, "pdserve:proxy_routing_decisions_total", leg=leg,
                       reason="least_loaded") == 1
