"""Bidirectional KV transfer decisions (no NIXL, no processes): block-hash prefix matching,
P's pull plan (threshold, own prefix cache, expiry margin, clock offset) and D's kept blocks."""

from __future__ import annotations

import pytest

from pdserve.types.block_hash import block_hashes
from pdserve.types.request import Request, RequestStatus
from pdserve.types.sampling_params import SamplingParams
from pdserve.types.kv_transfer_config import KVTransferConfig
from pdserve.kv_transfer.nixl.bidirectional import (
    PULL_SAFETY_MARGIN_S,
    decoder_hold_blocks,
    plan_pull,
)
from pdserve.types.remote_ref import KVTransferParamsError, RemoteKVRef
from pdserve.kv_transfer.nixl.prefix_match import matched_prefix_tokens
from pdserve.types.block_hash import BlockHashError, encode_block_hashes, parse_block_hashes
from pdserve.kv_transfer.nixl.scheduler import NixlConnectorScheduler
from pdserve.types.kv_params import KVTransferParams
from pdserve.types.remote_ref import PackedTokens

B = 16
NOW = 1_000_000.0


def d_params(tokens: list[int], num_tokens: int | None = None, expiry: float = NOW + 480,
             engine_id: str = "d-engine") -> dict:
    n = len(tokens) if num_tokens is None else num_tokens
    return {
        "do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": engine_id,
        "remote_block_ids": list(range(100, 100 + -(-n // B))), "remote_num_tokens": n,
        "remote_block_hashes": encode_block_hashes(block_hashes(tokens[:n], B)),
        "remote_blocks_expiry_time": expiry, "remote_host": "127.0.0.1", "remote_port": 5601,
        "remote_request_id": "d-req", "tp_size": 1,
    }


def test_hashes_round_trip_as_hex_and_ints():
    hashes = block_hashes(list(range(40)), B)
    assert parse_block_hashes(encode_block_hashes(hashes)) == hashes
    assert parse_block_hashes(hashes) == hashes
    for bad in ("x", [True], ["zz"], [2**64], [1.5]):
        with pytest.raises(BlockHashError):
            parse_block_hashes(bad)
    with pytest.raises(KVTransferParamsError):
        RemoteKVRef.from_params(dict(d_params(list(range(40))), remote_block_hashes=["nothex"]))


def test_match_stops_at_the_first_changed_block():
    remote = list(range(1000, 1100))
    hashes = block_hashes(remote, B)
    assert matched_prefix_tokens(remote + [1, 2], B, hashes) == 96  # 6 full blocks of 100
    changed = list(remote)
    changed[40] = 7  # inside block 2
    assert matched_prefix_tokens(changed, B, hashes) == 32
    changed[0] = 7
    assert matched_prefix_tokens(changed, B, hashes) == 0
    assert matched_prefix_tokens(remote, B, hashes, remote_num_tokens=50) == 48


def test_plan_pull_threshold_local_cache_and_last_token():
    history = list(range(2000, 2200))  # D holds 200 tokens
    prompt = history + list(range(5, 25))
    params = d_params(history)
    full = plan_pull(params, prompt, 0, B, 64, "p-engine", now=NOW)
    assert full.num_tokens == 192 and full.num_matched_tokens == 192
    # P's own prefix cache already has 160 tokens: only 32 are left, below the threshold
    assert plan_pull(params, prompt, 160, B, 64, "p-engine", now=NOW).num_tokens == 0
    assert plan_pull(params, prompt, 160, B, 16, "p-engine", now=NOW).num_tokens == 32
    # a prompt that is all history (block-aligned): the last prompt token stays to compute
    aligned = history + list(range(5, 29))  # 224 tokens = 14 blocks
    assert plan_pull(d_params(aligned), aligned, 0, B, 0, "p-engine", now=NOW).num_tokens == 223
    # never from itself, never without hashes
    assert plan_pull(params, prompt, 0, B, 0, "d-engine", now=NOW).ref is None
    no_hashes = dict(params)
    del no_hashes["remote_block_hashes"]
    assert plan_pull(no_hashes, prompt, 0, B, 0, "p-engine", now=NOW).num_tokens == 0


def test_plan_pull_expiry_margin_uses_the_clock_offset():
    history = list(range(3000, 3200))
    prompt = history + [1, 2, 3]
    soon = d_params(history, expiry=NOW + PULL_SAFETY_MARGIN_S - 1)
    d = plan_pull(soon, prompt, 0, B, 64, "p", now=NOW)
    assert d.num_tokens == 0 and d.expired
    later = d_params(history, expiry=NOW + 60)
    assert plan_pull(later, prompt, 0, B, 64, "p", now=NOW).num_tokens == 192
    # D's clock runs 58 s ahead of P's: its blocks live only 2 more seconds on P's clock
    d = plan_pull(later, prompt, 0, B, 64, "p", clock_offset_s=58.0, now=NOW)
    assert d.num_tokens == 0 and d.expired


def _request(rid: str, prompt: list[int], params: dict | None) -> Request:
    return Request(request_id=rid, prompt_token_ids=prompt,
                   sampling_params=SamplingParams(max_tokens=8),
                   kv_transfer_params=KVTransferParams.parse(params))


def _config(role: str, **extra) -> KVTransferConfig:
    return KVTransferConfig.from_dict({
        "kv_connector": "NixlConnector", "kv_role": role,
        "kv_connector_extra_config": {"bidirectional_kv_xfer": True, **extra}})


def test_decoder_keeps_finished_turn_and_returns_its_params():
    req = _request("d1", list(range(50)), {"do_remote_prefill": False})
    req.output_token_ids = [7, 8, 9]
    req.num_computed_tokens = 52  # the last sampled token has no KV yet
    req.status = RequestStatus.FINISHED_STOPPED
    blocks = [4, 5, 6, 9]
    spec, params = decoder_hold_blocks(req, blocks, B, 480.0, "d", "h", 5601, now=NOW)
    assert params["remote_num_tokens"] == 52
    assert params["remote_block_ids"] == [blocks]  # one KV-cache group; ceil(52 / 16) = 4 blocks
    assert params["remote_blocks_expiry_time"] == NOW + 480.0
    assert parse_block_hashes(params["remote_block_hashes"]) == \
        block_hashes(req.all_token_ids[:52], B)
    assert spec.block_ids == blocks and not spec.renew_on_heartbeat and spec.lease_duration == 480

    sched = NixlConnectorScheduler(_config("kv_consumer", decoder_kv_blocks_ttl=30.0), B)
    delay, out = sched.request_finished(req, blocks)
    assert delay and out["do_remote_decode"] and out["remote_request_id"] == "d1"
    meta = sched.build_connector_meta(None)
    assert meta.reqs_to_send["d1"].lease_duration == 30.0
    # aborted requests and requests without P/D params keep nothing
    req2 = _request("d2", list(range(50)), {"do_remote_prefill": False})
    req2.num_computed_tokens = 50
    req2.status = RequestStatus.FINISHED_ABORTED
    assert sched.request_finished(req2, blocks) == (False, None)
    req3 = _request("d3", list(range(50)), None)
    req3.num_computed_tokens = 50
    req3.status = RequestStatus.FINISHED_STOPPED
    assert sched.request_finished(req3, blocks) == (False, None)


def test_prefiller_plans_pull_and_overrides_failure_policy():
    history = list(range(4000, 4200))
    prompt = history + list(range(10, 30))
    sched = NixlConnectorScheduler(_config("kv_producer"), B)
    import time

    params = d_params(history, expiry=time.time() + 480)
    req = _request("p1", prompt, params)
    sched.request_added(req)
    assert sched.load_failure_policy(req) is None
    n, load_async = sched.get_num_new_matched_tokens(req, 32)  # 32 tokens in P's own cache
    assert (n, load_async) == (160, True)
    assert sched.load_failure_policy(req) == "recompute"
    blocks = list(range(20, 34))
    sched.update_state_after_alloc(req, blocks, n)
    meta = sched.build_connector_meta(None)
    recv = meta.reqs_to_recv["p1"]
    assert recv.local_block_ids == blocks[2:12]
    assert recv.remote_read_block_ids == params["remote_block_ids"][2:12]
    assert recv.min_lease_left_s == PULL_SAFETY_MARGIN_S
    assert meta.handshakes  # started when the request arrived

    # below the threshold: no pull, and D is told to free its blocks
    req2 = _request("p2", history[:40] + [1, 2, 3], d_params(history[:40] + [9] * 30))
    assert sched.get_num_new_matched_tokens(req2, 0) == (0, False)
    meta = sched.build_connector_meta(None)
    assert [(n.kind, n.remote.request_id) for n in meta.notices] == [("abort", "d-req")]
    # expired: no pull, counted
    req3 = _request("p3", prompt, d_params(history, expiry=time.time() - 1))
    assert sched.get_num_new_matched_tokens(req3, 0) == (0, False)
    assert sched.build_connector_meta(None).expired_pulls == 1
    # without bidirectional_kv_xfer the decoder's fields are ignored
    plain = NixlConnectorScheduler(KVTransferConfig.from_dict(
        {"kv_connector": "NixlConnector", "kv_role": "kv_producer"}), B)
    assert plain.get_num_new_matched_tokens(_request("p4", prompt, params), 0) == (0, False)


def pulling_prefiller(kv: KVTransferConfig):
    """The engine scheduler with P's connector side (config ``kv``) and request ``p1`` parked
    for its pull of 160 history tokens from D; returns ``(scheduler, step output, prompt)``."""
    import time

    from pdserve.types.engine_config import EngineConfig
    from pdserve.engine.scheduler import Scheduler

    config = EngineConfig(model="fake", block_size=B, max_num_batched_tokens=512,
                          kv_transfer_config=kv)
    sched = Scheduler(config, num_blocks=64, connector=NixlConnectorScheduler(kv, B))
    history = list(range(5000, 5160))
    prompt = history + [1, 2, 3]
    sched.add_request(_request("p1", prompt, d_params(history, expiry=time.time() + 480)))
    out = sched.schedule()
    assert not out.scheduled and "p1" in out.kv_connector_metadata.reqs_to_recv
    return sched, out, prompt


def test_failed_pull_is_recomputed_even_under_fail_policy():
    """The engine scheduler with P's connector side: a pull whose blocks come back invalid
    puts the request back to compute its whole prompt instead of failing it."""
    from pdserve.types.outputs import KVConnectorOutput, ModelRunnerOutput

    sched, out, prompt = pulling_prefiller(KVTransferConfig.from_dict({
        "kv_connector": "NixlConnector", "kv_role": "kv_producer",
        "kv_load_failure_policy": "fail",
        "kv_connector_extra_config": {"bidirectional_kv_xfer": True}}))
    assert sched.stats()["num_waiting_for_remote_kvs"] == 1
    blocks = out.kv_connector_metadata.reqs_to_recv["p1"].local_block_ids
    failed = KVConnectorOutput(finished_recving={"p1"}, invalid_block_ids=set(blocks))
    outputs = sched.update_from_output(out, ModelRunnerOutput(kv_connector_output=failed))
    assert not any(o.finish_reason for o in outputs)  # not failed
    out = sched.schedule()
    assert [(s.request_id, s.num_computed_tokens, len(s.token_ids)) for s in out.scheduled] == \
        [("p1", 0, len(prompt))]
    assert sched.stats()["num_kv_load_failures_total"] == 1


def test_lease_claim_checks_the_readers_tokens():
    """A lease that knows its tokens only answers a claim that carries the digest of the same
    first ``num_tokens`` tokens."""
    from pdserve.kv_transfer.nixl.leases import ClaimStatus, LeaseTable
    from pdserve.types.remote_ref import token_digest

    table = LeaseTable()
    tokens = list(range(100, 140))
    table.add("r", [3, 4, 5], 30.0, tokens=PackedTokens.of(tokens))
    assert table.claim("r", [3, 4, 5], 40, token_digest(tokens))[0] is ClaimStatus.OK
    assert table.claim("r", [3, 4, 5], 17, token_digest(tokens[:17]))[0] is ClaimStatus.OK
    other = tokens[:16] + [7] + tokens[17:]
    for num, digest in ((40, token_digest(other)), (41, token_digest(tokens + [1])),
                        (0, token_digest([])), (None, None), ("40", token_digest(tokens)),
                        (40, None), (True, token_digest(tokens[:1]))):
        status, reason, _ = table.claim("r", [3, 4, 5], num, digest)
        assert status is ClaimStatus.REJECT and "tokens differ" in reason, (num, status)
    table.add("plain", [1], 30.0)  # no tokens known: the block ids alone decide
    assert table.claim("plain", [1])[0] is ClaimStatus.OK


def test_a_demoted_turn_lease_waits_then_answers_the_blocks_it_was_restored_into():
    from pdserve.kv_transfer.nixl.leases import ClaimStatus, LeaseBlocks, LeaseTable
    from pdserve.types.remote_ref import token_digest

    tokens = list(range(10))
    digest = token_digest(tokens[:8])
    leases = LeaseTable()
    leases.add("t", [3, 4, 5], 60.0, renewable=False, tokens=PackedTokens.of(tokens))
    assert not leases.demote("unknown")
    assert leases.demote("t") and not leases.demote("t")
    # foreign tokens are refused as ever; the right ones wait (reported once) while demoted
    assert leases.claim_answer("t", [3, 4, 5], 8, token_digest([9] * 8)).status is ClaimStatus.REJECT
    assert leases.claim_answer("t", [3, 4, 5], 8, digest).status is ClaimStatus.WAIT
    assert leases.has_restore_wanted()
    assert leases.take_restore_wanted() == ["t"] and leases.take_restore_wanted() == []
    assert leases.claim_answer("t", [3, 4, 5], 8, digest).status is ClaimStatus.WAIT
    assert not leases.restore("unknown", [8, 9])
    assert leases.restore("t", [8, 9])
    answer = leases.claim_answer("t", [3, 4, 5], 8, digest)
    assert (answer.status, answer.block_ids) == (ClaimStatus.OK, [8, 9]) and answer.lease_left_s > 0
    assert not leases.demote("t")  # claimed: its READ may be under way
    # notices may name the advertised blocks or the restored ones; other ids are ignored
    assert not leases.done("t", block_ids=[8])
    assert leases.done("t", block_ids=[8, 9])
    assert len(leases) == 0 and LeaseBlocks.HELD.value == "held"


def test_a_prompt_lease_is_never_demoted():
    from pdserve.kv_transfer.nixl.leases import LeaseTable

    leases = LeaseTable()
    leases.add("p", [1, 2], 30.0, renewable=True)
    assert not leases.demote("p")
    assert leases.claim_answer("p", [1, 2]).block_ids is None  # answers name no other blocks
