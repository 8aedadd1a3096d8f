"""Local prefill (``--local-prefill-max-tokens N``, pdserve/router/local_prefill.py): a request
whose decoder holds all but at most N of its prompt tokens goes to that decoder alone.

* :meth:`KVAwareRouter.uncached_tokens` and :meth:`LocalPrefill.take` over KV indexes synced
  from snapshots: leading blocks held in the KV cache or a tier (CPU, DISK) count as held; more
  than N uncached tokens, an index not live, no token ids or no decoder -> no local prefill;
  ``pdserve:proxy_local_prefills_total`` counts the requests taken; a decision kv-aware
  routing scored carries the decoder's uncached tokens, and a request's ``PromptBlocks``
  keeps the hashes it computed, so the prompt is hashed once per request (through the proxy
  too, with kv-aware routing of both legs, either hand-off, local prefill on or off).
* ``pdserve proxy`` flags: the option needs ``--tokenizer`` and excludes ``--enforce-disagg``.
* Through the proxy with fake P/D instances (tests/support/router_fakes.py) and a byte-level
  tokenizer written to a temporary directory: a held prompt skips the prefiller and reaches the
  decoder without ``kv_transfer_params`` (sequential and concurrent hand-off, streamed or not);
  an empty, a partly held or a never-synced index sends it through the prefiller; a decoder
  failing the local attempt has the request retried through a prefiller on another decoder; in
  multi-turn mode a local turn releases the previous turn's lease on D; with the option on,
  requests that go through a prefiller are routed to the decoders as without it.
"""

from __future__ import annotations

import re
import time

import pytest
from aiohttp import web

from pdserve.router.config import parse_args
from pdserve.router.handoff import HandoffMode
from pdserve.router import kv_routing
from pdserve.router.kv_routing import (KVAwareRouter, PromptBlocks, RoutingDecision,
                                       RoutingReason)
from pdserve.router.local_prefill import LocalPrefill
from pdserve.router.metrics import ProxyMetrics
from pdserve.router.upstreams import UpstreamPool
from pdserve.types.block_hash import block_hashes
from pdserve.types.kv_events import KVSnapshot
from tests.support.handoff_fakes import SideChannels, info_for
from tests.support.router_fakes import wait_until

from .test_router_multi_turn import decoder_params

LOCAL = "pdserve:proxy_local_prefills_total"
D_URL, OTHER_URL = "http://d0", "http://d1"


# ------------------------------------------------------------------ the decision
def _setup(max_tokens: int = 8):
    """(router, decoder upstream, LocalPrefill, metrics) over two decoders, indexes unsynced."""
    urls = (D_URL, OTHER_URL)
    router = KVAwareRouter(urls, tokenizer=None, load_weight=0.5, stale_after=5.0)
    pool = UpstreamPool("decode", urls, "round-robin")
    metrics = ProxyMetrics((), urls)
    local = LocalPrefill(max_tokens, router, metrics.local_prefills)
    return router, pool.get(D_URL), local, metrics


def _to(up) -> RoutingDecision:
    """A decision routing to ``up`` (None: to no decoder) that kv-aware scoring did not make."""
    return RoutingDecision([up] if up is not None else [], RoutingReason.ROUND_ROBIN)


def _taken(metrics: ProxyMetrics) -> float:
    return metrics.registry.get_sample_value(LOCAL) or 0.0


def _sync(router: KVAwareRouter, url: str, block_size: int, gpu=(), **tiers) -> None:
    router.indexes[url].apply_snapshot(KVSnapshot(1, 0, block_size, list(gpu),
                                                  {m: list(h) for m, h in tiers.items()}))


def test_all_but_n_tokens_on_the_gpu_are_prefilled_locally_and_counted():
    router, d, local, metrics = _setup(max_tokens=8)
    ids = list(range(1000, 1040))  # 2 full blocks of 16, 8 tokens after them
    prompt = PromptBlocks(ids)
    _sync(router, D_URL, 16, block_hashes(ids, 16))
    assert router.uncached_tokens(d, prompt) == 8
    assert local.take(_to(d), prompt) is True and _taken(metrics) == 1
    # one more token than N: the prefill leg
    longer = PromptBlocks(ids + [7])
    assert local.take(_to(d), longer) is False and _taken(metrics) == 1
    assert router.uncached_tokens(d, longer) == 9
    # a block-aligned prompt held whole: nothing to compute
    aligned = PromptBlocks(ids[:32])
    assert router.uncached_tokens(d, aligned) == 0
    assert local.take(_to(d), aligned) is True and _taken(metrics) == 2


def test_the_threshold_is_inclusive():
    router, d, _, metrics = _setup()
    prompt = PromptBlocks(list(range(40)))
    _sync(router, D_URL, 16, prompt.hashes(16))
    assert LocalPrefill(7, router, metrics.local_prefills).take(_to(d), prompt) is False
    assert LocalPrefill(8, router, metrics.local_prefills).take(_to(d), prompt) is True
    assert _taken(metrics) == 1


def test_leading_blocks_held_in_a_tier_count_as_held():
    router, d, local, metrics = _setup(max_tokens=4)
    prompt = PromptBlocks(list(range(500, 540)))  # 10 blocks of 4
    hashes = block_hashes(prompt.token_ids, 4)
    # blocks 0-2 only in the host tier, 3-9 in the KV cache: all held
    _sync(router, D_URL, 4, hashes[3:], CPU=hashes[:3])
    assert router.uncached_tokens(d, prompt) == 0
    assert local.take(_to(d), prompt) is True
    # the host tier holds 6, the disk tier the next 2: the last 2 blocks (8 tokens) uncached
    _sync(router, D_URL, 4, (), CPU=hashes[:6], DISK=hashes[6:8])
    assert router.uncached_tokens(d, prompt) == 8
    assert local.take(_to(d), prompt) is False
    _sync(router, D_URL, 4, (), CPU=hashes[:6], DISK=hashes[6:9])
    assert router.uncached_tokens(d, prompt) == 4
    assert local.take(_to(d), prompt) is True
    assert _taken(metrics) == 2


def test_only_the_leading_held_blocks_count():
    router, d, local, metrics = _setup(max_tokens=16)
    prompt = PromptBlocks(list(range(64)))
    hashes = block_hashes(prompt.token_ids, 16)
    _sync(router, D_URL, 16, hashes[1:])  # all but the first block: a prefix miss
    assert router.uncached_tokens(d, prompt) == 64
    _sync(router, D_URL, 16, hashes[:2] + hashes[3:])  # a hole at block 2: 32 tokens to compute
    assert router.uncached_tokens(d, prompt) == 32
    assert local.take(_to(d), prompt) is False
    # another instance's blocks do not help this one
    _sync(router, D_URL, 16)
    _sync(router, OTHER_URL, 16, hashes)
    assert router.uncached_tokens(d, prompt) == 64 and local.take(_to(d), prompt) is False
    assert _taken(metrics) == 0


def test_more_than_n_uncached_tokens_use_a_prefiller():
    router, d, local, metrics = _setup(max_tokens=8)
    prompt = PromptBlocks(list(range(100)))
    _sync(router, D_URL, 16)  # live, nothing held
    assert router.uncached_tokens(d, prompt) == 100
    assert local.take(_to(d), prompt) is False
    _sync(router, D_URL, 16, block_hashes(prompt.token_ids, 16)[:5])  # 80 held, 20 to compute
    assert router.uncached_tokens(d, prompt) == 20
    assert local.take(_to(d), prompt) is False
    assert _taken(metrics) == 0


def test_an_index_that_is_not_live_never_takes_a_request():
    router, d, local, metrics = _setup(max_tokens=64)
    prompt = PromptBlocks(list(range(40)))
    held = block_hashes(prompt.token_ids, 16)
    assert router.uncached_tokens(d, prompt) is None  # never synced
    assert local.take(_to(d), prompt) is False
    _sync(router, D_URL, 16, held)
    index = router.indexes[D_URL]
    index.last_message = time.monotonic() - router.stale_after - 1.0  # no events for too long
    assert router.uncached_tokens(d, prompt) is None
    assert local.take(_to(d), prompt) is False
    _sync(router, D_URL, 16, held)  # heard from again
    index.synced = False  # a gap in the event stream: waiting for a new snapshot
    assert router.uncached_tokens(d, prompt) is None
    assert local.take(_to(d), prompt) is False
    assert _taken(metrics) == 0


def test_no_token_ids_or_no_decoder_never_takes_a_request():
    router, d, local, metrics = _setup(max_tokens=64)
    prompt = PromptBlocks(list(range(40)))
    _sync(router, D_URL, 16, block_hashes(prompt.token_ids, 16))
    assert local.take(_to(d), None) is False
    assert local.take(_to(d), PromptBlocks([])) is False
    assert local.take(_to(None), prompt) is False
    unknown = UpstreamPool("decode", ("http://elsewhere",), "round-robin").upstreams[0]
    assert router.uncached_tokens(unknown, prompt) is None
    assert local.take(_to(unknown), prompt) is False
    assert _taken(metrics) == 0


def count_hashing(monkeypatch) -> list[int]:
    """The block sizes of every prompt hashing in :mod:`pdserve.router.kv_routing` from now on."""
    calls: list[int] = []

    def counted(token_ids, block_size, *args):
        calls.append(block_size)
        return block_hashes(token_ids, block_size, *args)

    monkeypatch.setattr(kv_routing, "block_hashes", counted)
    return calls


def test_a_prompt_is_hashed_once_per_block_size(monkeypatch):
    """:class:`PromptBlocks` hashes on the first use of a block size and keeps the hashes:
    the engines' own (:func:`block_hashes`), of full blocks only."""
    ids = list(range(1000, 1042))
    prompt = PromptBlocks(ids)
    calls = count_hashing(monkeypatch)
    assert calls == []  # nothing hashed before it is asked for
    assert prompt.hashes(16) == block_hashes(ids, 16) and len(prompt.hashes(16)) == 2
    assert prompt.hashes(16) is prompt.hashes(16)
    assert prompt.hashes(4) == block_hashes(ids, 4) and len(prompt.hashes(4)) == 10
    assert prompt.hashes(64) == [] and prompt.token_ids is ids
    assert calls == [16, 4, 64]


def test_a_decision_scored_by_kv_aware_routing_is_taken_without_hashing_again(monkeypatch):
    router, d, local, metrics = _setup(max_tokens=8)
    pool = UpstreamPool("decode", (D_URL, OTHER_URL), "kv-aware")
    ids = list(range(1000, 1040))  # 2 full blocks of 16, 8 tokens after them
    _sync(router, D_URL, 16, block_hashes(ids, 16))
    _sync(router, OTHER_URL, 16)
    calls = count_hashing(monkeypatch)
    prompt = PromptBlocks(ids)
    decision = router.route(pool, prompt)
    assert (decision.order[0].url, decision.uncached_tokens) == (D_URL, 8)
    assert local.take(decision, prompt) is True and _taken(metrics) == 1
    assert calls == [16]  # once, for both instances (one block size) and the decision
    # routing the same request again (the other leg, a retry) reuses the prompt's hashes
    assert router.route(pool, prompt).uncached_tokens == 8 and calls == [16]
    # a decision routing did not score (round-robin, least-loaded, affinity): a new request's
    # prompt is hashed here, once
    calls.clear()
    prompt = PromptBlocks(ids)
    assert local.take(_to(d), prompt) is True and calls == [16]
    assert router.uncached_tokens(d, prompt) == 8 and calls == [16]


@pytest.mark.parametrize("max_tokens", [0, -1])
def test_max_tokens_must_be_positive(max_tokens):
    router, _, _, metrics = _setup()
    with pytest.raises(ValueError, match="max_tokens"):
        LocalPrefill(max_tokens, router, metrics.local_prefills)


# ------------------------------------------------------------------ the flags
PORTS = ["--prefiller-ports", "1", "--decoder-ports", "2"]


@pytest.mark.parametrize("argv, needle", [
    (["--local-prefill-max-tokens", "256"], "--tokenizer"),
    (["--local-prefill-max-tokens", "256", "--tokenizer", "m", "--enforce-disagg"],
     "--enforce-disagg"),
    (["--local-prefill-max-tokens", "-1", "--tokenizer", "m"], "--local-prefill-max-tokens"),
])
def test_bad_local_prefill_flags_exit_2_with_a_message(argv, needle, capsys):
    with pytest.raises(SystemExit) as e:
        parse_args([*PORTS, *argv])
    err = capsys.readouterr().err
    assert e.value.code == 2 and needle in err, err
    assert "--local-prefill-max-tokens" in err


def test_local_prefill_flags_parse():
    cfg = parse_args([*PORTS, "--local-prefill-max-tokens", "256", "--tokenizer", "m"])
    assert (cfg.local_prefill_max_tokens, cfg.tokenizer, cfg.routing) == (256, "m", "round-robin")
    assert parse_args(PORTS).local_prefill_max_tokens == 0
    # 0 is the default's "never", and needs no tokenizer
    assert parse_args([*PORTS, "--local-prefill-max-tokens", "0"]).local_prefill_max_tokens == 0


# ------------------------------------------------------------------ through the proxy
MAX_TOKENS = 16
BLOCK = 4


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory) -> str:
    """A byte-level tokenizer (one token per byte) with a small chat template, on disk: the
    proxy's ``--tokenizer`` without any model installed."""
    from pdserve.model_files.tokenizer import byte_level_tokenizer

    tok = byte_level_tokenizer()
    tok.chat_template = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n"
                         "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}")
    out = tmp_path_factory.mktemp("byte-tokenizer")
    tok.save_pretrained(str(out))
    return str(out)


def chat(text: str = "Tell me about the old harbour town and its lighthouse keepers.", **extra):
    return {"model": "m", "messages": [{"role": "user", "content": text}], "max_tokens": 5,
            **extra}


def prompt_ids(c, body) -> list[int]:
    """The prompt token ids the proxy computes for a chat ``body``."""
    ids = c.proxy.proxy.kv_router.tokenizer.token_ids("chat_completions", body)
    assert len(ids) > MAX_TOKENS + BLOCK  # an empty cache leaves too many to compute
    return ids


def hold(c, fake, ids=(), blocks: int | None = None) -> None:
    """Make ``fake``'s KV index live, holding the first ``blocks`` full blocks of ``ids``
    (all of them by default) in its KV cache (the fakes publish no KV events themselves)."""
    hashes = block_hashes(list(ids), BLOCK)
    c.proxy.proxy.kv_router.indexes[fake.url].apply_snapshot(
        KVSnapshot(1, 0, BLOCK, hashes if blocks is None else hashes[:blocks]))


async def scraped(c, name: str = LOCAL, labels: str = "") -> float:
    """A sample of the proxy's ``/metrics`` (0 when absent)."""
    async with c.session.get(c.url + "/metrics") as r:
        assert r.status == 200
        text = await r.text()
    m = re.search(rf"^{re.escape(name + labels)} (\S+)$", text, re.M)
    return float(m.group(1)) if m else 0.0


def retries(c, leg: str) -> float:
    return c.proxy.proxy.metrics.retries.labels(leg=leg)._value.get()


@pytest.mark.parametrize("handoff", [HandoffMode.SEQUENTIAL, HandoffMode.CONCURRENT])
@pytest.mark.parametrize("stream", [False, True])
async def test_a_held_prompt_goes_to_the_decoder_alone(make_cluster, tokenizer_dir, handoff,
                                                       stream):
    c = await make_cluster(local_prefill_max_tokens=MAX_TOKENS, tokenizer=tokenizer_dir,
                           handoff=handoff)
    body = chat(stream=stream)
    hold(c, c.decoders[0], prompt_ids(c, body))
    status, _, raw = await c.post("/v1/chat/completions", body)
    assert status == 200, raw
    assert b"Hel" in raw
    assert c.prefillers[0].received == []
    (d_req,) = c.decoders[0].received
    assert "kv_transfer_params" not in d_req.body
    assert d_req.body["messages"] == body["messages"] and d_req.body.get("stream") == body.get(
        "stream")
    assert await scraped(c) == 1
    assert await scraped(c, "pdserve:proxy_decode_only_fallback_total") == 0


@pytest.mark.parametrize("routing", ["kv-aware", "round-robin"])
async def test_the_prompt_is_hashed_once_per_request(make_cluster, tokenizer_dir, monkeypatch,
                                                     routing):
    """With kv-aware routing the decoder's routing decision carries its tokens to compute:
    local prefill does not hash the prompt a second time; without it, local prefill hashes
    it once."""
    c = await make_cluster(n_decode=2, routing=routing, local_prefill_max_tokens=MAX_TOKENS,
                           tokenizer=tokenizer_dir)
    body = chat()
    ids = prompt_ids(c, body)
    for d in c.decoders:
        hold(c, d, ids)
    calls = count_hashing(monkeypatch)
    for n in (1, 2):
        status, _, raw = await c.post("/v1/chat/completions", body)
        assert status == 200, raw
        assert calls == [BLOCK] * n
    assert c.prefillers[0].received == [] and await scraped(c) == 2


@pytest.mark.parametrize("local_prefill", [0, MAX_TOKENS])
@pytest.mark.parametrize("handoff", ["sequential", "concurrent", "concurrent-side-channel"])
async def test_a_kv_aware_request_through_both_legs_is_hashed_once(make_cluster, tokenizer_dir,
                                                                   monkeypatch, handoff,
                                                                   local_prefill):
    """Kv-aware routing of both legs (prefillers and decoders live, one block size) hashes a
    request's prompt once: the decoders' decision, the prefillers' and local prefill's check
    share the request's :class:`~pdserve.router.kv_routing.PromptBlocks`. The concurrent
    hand-off without side channels serves the request sequentially after routing P."""
    side = handoff == "concurrent-side-channel"
    c = await make_cluster(n_prefill=2, n_decode=2, routing="kv-aware", tokenizer=tokenizer_dir,
                           local_prefill_max_tokens=local_prefill,
                           handoff=HandoffMode.SEQUENTIAL if handoff == "sequential"
                           else HandoffMode.CONCURRENT,
                           instance_info=info_for() if side else None)
    if side:
        SideChannels().install(c.prefillers, c.decoders)
    body = chat()
    ids = prompt_ids(c, body)
    for fake in c.prefillers + c.decoders:
        hold(c, fake)  # live, nothing held
    # p1 and d1 hold the first blocks (d1 too few for a local prefill): both legs score a hit
    hold(c, c.prefillers[1], ids, 4)
    hold(c, c.decoders[1], ids, 2)
    calls = count_hashing(monkeypatch)
    for n in (1, 2):
        status, _, raw = await c.post("/v1/chat/completions", body)
        assert status == 200, raw
        assert calls == [BLOCK] * n
    assert [len(f.received) for f in c.prefillers + c.decoders] == [0, 2, 0, 2]
    if not side:
        assert all("kv_transfer_params" in r.body for r in c.decoders[1].received)
    assert await scraped(c) == 0


async def test_a_prompt_the_decoder_does_not_hold_goes_through_the_prefiller(make_cluster,
                                                                             tokenizer_dir):
    c = await make_cluster(local_prefill_max_tokens=MAX_TOKENS, tokenizer=tokenizer_dir)
    p, d = c.prefillers[0], c.decoders[0]
    body = chat()
    ids = prompt_ids(c, body)
    # never synced, live but empty, then held but for more than N tokens at the end
    full = len(ids) // BLOCK
    cases = [None, 0, full - (MAX_TOKENS // BLOCK + 1)]
    for n, blocks in enumerate(cases, start=1):
        if blocks is not None:
            hold(c, d, ids, blocks)
        status, _, raw = await c.post("/v1/chat/completions", body)
        assert status == 200, raw
        assert len(p.received) == n and len(d.received) == n
        d_params = d.received[-1].body["kv_transfer_params"]
        assert d_params["remote_request_id"] == f"p0-{p.received[-1].request_id}"
    assert await scraped(c) == 0
    # the same prompt held whole: local
    hold(c, d, ids)
    assert (await c.post("/v1/chat/completions", body))[0] == 200
    assert len(p.received) == len(cases) and len(d.received) == len(cases) + 1
    assert await scraped(c) == 1


async def test_without_the_option_a_held_prompt_still_goes_through_the_prefiller(
        make_cluster, tokenizer_dir):
    c = await make_cluster(routing="kv-aware", tokenizer=tokenizer_dir)
    body = chat()
    hold(c, c.decoders[0], prompt_ids(c, body))
    assert (await c.post("/v1/chat/completions", body))[0] == 200
    assert len(c.prefillers[0].received) == 1
    assert "kv_transfer_params" in c.decoders[0].received[0].body
    assert c.proxy.proxy.local_prefill is None and await scraped(c) == 0


def fails_local_attempts(status: int):
    """A decoder handler: a request without ``kv_transfer_params`` (a local prefill) is
    answered ``status``; a decode leg after a prefill is served."""

    async def handler(inst, request, rec):
        if "kv_transfer_params" not in rec.body:
            return web.json_response({"error": {"message": "local prefill failed",
                                                "type": "upstream_error", "param": None,
                                                "code": status}}, status=status)
        return await inst._decode(request, rec)

    return handler


@pytest.mark.parametrize("stream", [False, True])
async def test_a_failed_local_attempt_is_retried_through_a_prefiller(make_cluster, tokenizer_dir,
                                                                      stream):
    c = await make_cluster(n_decode=2, local_prefill_max_tokens=MAX_TOKENS,
                           tokenizer=tokenizer_dir, handoff=HandoffMode.SEQUENTIAL)
    body = chat(stream=stream)
    ids = prompt_ids(c, body)
    for d in c.decoders:
        hold(c, d, ids)
        d.handler = fails_local_attempts(500)
    status, _, raw = await c.post("/v1/chat/completions", body)
    assert status == 200, raw
    (p_req,) = c.prefillers[0].received
    # the local attempt on one decoder, then the other one after P's prefill
    (local_req,), (retry_req,) = sorted((d.received for d in c.decoders),
                                        key=lambda got: "kv_transfer_params" in got[0].body)
    assert "kv_transfer_params" not in local_req.body
    assert retry_req.body["kv_transfer_params"]["remote_request_id"] == f"p0-{p_req.request_id}"
    assert retries(c, "decode") == 1
    assert await scraped(c) == 1  # the decision, made once
    assert [u.in_flight for u in c.proxy.proxy.decoders.upstreams] == [0, 0]


async def test_a_single_decoder_failing_the_local_attempt_answers_the_error(make_cluster,
                                                                            tokenizer_dir):
    c = await make_cluster(local_prefill_max_tokens=MAX_TOKENS, tokenizer=tokenizer_dir)
    body = chat()
    hold(c, c.decoders[0], prompt_ids(c, body))
    c.decoders[0].handler = fails_local_attempts(500)
    status, _, raw = await c.post("/v1/chat/completions", body)
    assert status == 500 and b"local prefill failed" in raw
    assert c.prefillers[0].received == []  # no decoder left for a retry: nothing prefilled


async def test_a_local_turn_releases_the_previous_turns_lease_on_the_decoder(make_cluster,
                                                                            tokenizer_dir):
    c = await make_cluster(multi_turn=True, local_prefill_max_tokens=MAX_TOKENS,
                           tokenizer=tokenizer_dir)
    p, d = c.prefillers[0], c.decoders[0]
    d.decoder_params = decoder_params("d0")
    turn1 = chat("What is the harbour town known for?", conversation_id="conv")
    status, _, raw = await c.post("/v1/chat/completions", turn1)  # nothing held: through P
    assert status == 200, raw
    assert len(p.received) == 1 and d.released == []
    held_params = c.proxy.proxy.conversations.get("conv").kv_transfer_params
    assert held_params["remote_request_id"] == "d0-turn1"
    turn2 = chat("What is the harbour town known for?", conversation_id="conv")
    turn2["messages"] += [{"role": "assistant", "content": "Hello world"},
                          {"role": "user", "content": "And its lighthouse?"}]
    ids = prompt_ids(c, turn2)
    hold(c, d, ids)
    status, _, raw = await c.post("/v1/chat/completions", turn2)
    assert status == 200, raw
    assert len(p.received) == 1 and len(d.received) == 2  # turn 2 on D alone
    assert "kv_transfer_params" not in d.received[1].body
    assert "conversation_id" not in d.received[1].body
    # nobody will pull turn 1's blocks from D any more: their lease is released
    await wait_until(lambda: d.released == [held_params])
    assert await scraped(c) == 1
    assert await scraped(c, "pdserve:proxy_kv_params_forwarded_total") == 0
    state = c.proxy.proxy.conversations.get("conv")
    assert state.decoder_url == d.url and state.prefiller_url is None


async def test_a_prefilled_turn_does_not_release_the_previous_lease(make_cluster, tokenizer_dir):
    c = await make_cluster(multi_turn=True, local_prefill_max_tokens=MAX_TOKENS,
                           tokenizer=tokenizer_dir)
    p, d = c.prefillers[0], c.decoders[0]
    d.decoder_params = decoder_params("d0")
    for turn in (1, 2):  # the decoder's index never live: both turns through P
        status, _, raw = await c.post("/v1/chat/completions", chat(f"turn {turn} " * 10,
                                                                  conversation_id="conv"))
        assert status == 200, raw
    assert len(p.received) == 2
    # turn 2's prefill carries D's params of turn 1 (P pulls them), none released
    assert p.received[1].body["kv_transfer_params"]["remote_request_id"] == "d0-turn1"
    assert d.released == [] and await scraped(c) == 0


async def test_requests_through_a_prefiller_are_routed_as_without_the_option(make_cluster,
                                                                             tokenizer_dir):
    """The decoder routing picked for the local-prefill decision serves the request when it
    goes through a prefiller: round-robin alternates, one decision counted per request."""
    for handoff in (HandoffMode.SEQUENTIAL, HandoffMode.CONCURRENT):
        c = await make_cluster(n_decode=2, local_prefill_max_tokens=MAX_TOKENS,
                               tokenizer=tokenizer_dir, handoff=handoff)
        for _ in range(4):
            assert (await c.post("/v1/chat/completions", chat()))[0] == 200
        assert [len(d.received) for d in c.decoders] == [2, 2], handoff
        decisions = c.proxy.proxy.metrics.registry.get_sample_value(
            "pdserve:proxy_routing_decisions_total", {"leg": "decode", "reason": "round_robin"})
        assert decisions == 4, handoff
        assert await scraped(c) == 0


async def test_concurrent_hand_off_with_local_prefill(make_cluster, tokenizer_dir):
    """Prefillers that speak the concurrent hand-off: a prompt the decoder does not hold goes
    both ways at once to the decoder routing picked; a held one goes to the decoder alone."""
    c = await make_cluster(n_decode=2, instance_info=info_for(), tokenizer=tokenizer_dir,
                           local_prefill_max_tokens=MAX_TOKENS)
    channels = SideChannels()
    channels.install(c.prefillers, c.decoders)
    body = chat()
    ids = prompt_ids(c, body)
    for _ in range(2):
        status, _, raw = await c.post("/v1/chat/completions", body)
        assert status == 200, raw
    assert len(c.prefillers[0].received) == 2
    assert [len(d.received) for d in c.decoders] == [1, 1]
    for d in c.decoders:
        assert d.received[0].body["kv_transfer_params"]["remote_transfer_id"]
    hold(c, c.decoders[1], ids)
    for _ in range(2):  # round-robin puts d0 first for one of them: local only on d1
        status, _, raw = await c.post("/v1/chat/completions", body)
        assert status == 200, raw
    assert len(c.prefillers[0].received) == 3
    assert "kv_transfer_params" not in c.decoders[1].received[-1].body
    assert [len(d.received) for d in c.decoders] == [2, 2]
    assert await scraped(c) == 1


def test_a_prompt_longer_than_the_model_takes_is_not_tokenized(tokenizer_dir):
    """The proxy's tokenizer skips a text the engines refuse as too long (one worker thread
    tokenizes every request's prompt: a 30 MB one held the others for ~30 s), and honours a
    null ``add_generation_prompt`` as the engines do (the default, True)."""
    from pdserve.router.kv_routing import PromptTokenizer

    tok = PromptTokenizer(tokenizer_dir)
    try:
        limit = tok.max_chars
        assert 0 < limit < 10**8
        assert tok.token_ids("chat_completions", chat("x" * (limit + 1))) is None
        assert tok.token_ids("completions", {"prompt": "x" * (limit + 1)}) is None
        assert tok.token_ids("completions", {"prompt": "x" * 8}) is not None
        short = tok.token_ids("chat_completions", chat("x" * 8))
        assert short is not None
        assert tok.token_ids("chat_completions", chat("x" * 8, add_generation_prompt=None)) == short
        assert len(tok.token_ids("chat_completions",
                                 chat("x" * 8, add_generation_prompt=False))) < len(short)
    finally:
        tok.close()


def test_the_prompt_bound_is_the_models_context_when_the_tokenizer_names_none(tokenizer_dir,
                                                                              tmp_path):
    """A tokenizer without a length (SmolLM2's says 1e30) bounds prompts by the model's
    ``max_position_embeddings``, as the engines do, not by the 131072-token fallback: a prompt
    between the two (0.66 M to 10.6 M characters for SmolLM2) held the proxy's one tokenizer
    thread, and every other request's routing, for seconds before an engine refused it."""
    import json
    import shutil

    from pdserve.model_files.client_tokenizer import model_context_length
    from pdserve.router.kv_routing import MAX_TOKENIZER_CONTEXT, PromptTokenizer

    assert model_context_length(tokenizer_dir) is None  # a tokenizer alone: no config
    bounds = {}
    for name, config in (("plain", {"max_position_embeddings": 2048}),
                         ("multimodal", {"text_config": {"max_position_embeddings": 1024}}),
                         ("none", None)):
        model = tmp_path / name
        shutil.copytree(tokenizer_dir, model)
        if config is not None:
            (model / "config.json").write_text(json.dumps(config))
        tok = PromptTokenizer(str(model))
        bounds[name] = tok.max_chars
        tok.close()
    assert model_context_length(str(tmp_path / "plain")) == 2048
    assert model_context_length(str(tmp_path / "multimodal")) == 1024
    assert bounds["plain"] == 2 * bounds["multimodal"]
    assert bounds["none"] == bounds["plain"] * MAX_TOKENIZER_CONTEXT // 2048


def test_the_built_in_models_context_is_read_from_its_packaged_gguf():
    from pdserve.model_files import builtin_models
    from pdserve.model_files.client_tokenizer import model_context_length

    try:
        path = builtin_models.builtin_gguf_path()
    except FileNotFoundError:
        pytest.skip("the built-in model package is not installed")
    assert model_context_length(str(path)) == 8192


def test_a_tokenizer_that_cannot_load_is_a_one_line_error(capsys, tmp_path):
    """``pdserve proxy --tokenizer`` naming nothing loadable exits 2 with one line naming the
    flag (it ended in a traceback and exit 1)."""
    from pdserve.router.proxy import main

    rc = main([*PORTS, "--port", "0", "--local-prefill-max-tokens", "16",
               "--tokenizer", str(tmp_path / "no-such-model")])
    err = capsys.readouterr().err
    assert rc == 2
    assert err.startswith("pdserve proxy: error: --tokenizer: ") and "no-such-model" in err
    assert "Traceback" not in err


def test_every_built_in_model_name_is_a_tokenizer_source(monkeypatch, tokenizer_dir):
    """``pdserve up gemma3-270m --local-prefill-max-tokens N`` hands the proxy ``--tokenizer
    gemma3-270m``: every built-in name resolves as the engines resolve it (only SmolLM2's did,
    so that deployment's proxy exited 2)."""
    from pdserve.model_files import builtin_models
    from pdserve.model_files.client_tokenizer import TokenizerLoadError, load_tokenizer

    asked = []
    monkeypatch.setattr(builtin_models, "resolve_model_path",
                        lambda name: asked.append(name) or tokenizer_dir)
    for name in builtin_models.BUILTIN_NAMES:
        assert load_tokenizer(name.upper()) is not None
    assert [a.lower() for a in asked] == list(builtin_models.BUILTIN_NAMES)
    with pytest.raises(TokenizerLoadError, match="gemma3-270m"):  # the message names them all
        load_tokenizer("no-such-built-in")
