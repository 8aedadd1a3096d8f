"""NIXL connector scheduler side: the P/D bookkeeping of docs/architecture.md, "Request flow of one P/D turn" (no processes, no torch)."""

from __future__ import annotations

import pytest

from pdserve.types.engine_config import EngineConfig
from pdserve.types.kv_params import KVTransferParams
from pdserve.types.outputs import KVConnectorOutput
from pdserve.types.request import Request, RequestStatus
from pdserve.types.sampling_params import SamplingParams
from pdserve.types.kv_transfer_config import KVTransferConfig
from pdserve.kv_transfer.factory import create_connector
from pdserve.kv_transfer.nixl.scheduler import NixlConnectorScheduler
from pdserve.types.remote_ref import token_digest

B = 4


def _EngineConfig() -> EngineConfig:
    return EngineConfig(block_size=B)


@pytest.fixture
def env(monkeypatch):
    monkeypatch.setenv("PDSERVE_NIXL_SIDE_CHANNEL_HOST", "10.1.2.3")
    monkeypatch.setenv("PDSERVE_NIXL_SIDE_CHANNEL_PORT", "6100")


def make(role: str, **extra) -> NixlConnectorScheduler:
    cfg = KVTransferConfig.from_dict({"kv_role": role, "engine_id": f"eng-{role}",
                                      "kv_connector_extra_config": extra})
    sched = create_connector(cfg, "scheduler", _EngineConfig())
    assert isinstance(sched, NixlConnectorScheduler)
    return sched


def request(request_id: str, n: int, params: dict | None) -> Request:
    return Request(request_id, list(range(100, 100 + n)), SamplingParams(),
                   kv_transfer_params=KVTransferParams.parse(params))


def p_params(n_blocks: int, **kw) -> dict:
    params = {"do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": "eng-P",
              "remote_block_ids": list(range(50, 50 + n_blocks)), "remote_host": "127.0.0.1",
              "remote_port": 6200, "remote_request_id": "p-1", "tp_size": 1}
    params.update(kw)
    return params


def test_producer_keeps_prompt_blocks_and_returns_params(env):
    s = make("kv_producer", kv_lease_duration=7)
    req = request("r1", 2 * B + 1, {"do_remote_decode": True, "do_remote_prefill": False,
                                     "extra_field": 1})
    req.status = RequestStatus.FINISHED_LENGTH
    delay, params = s.request_finished(req, [7, 3, 9, 11])
    assert delay is True
    assert params == {
        "do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": "eng-kv_producer",
        "remote_block_ids": [[7, 3, 9]], "remote_host": "10.1.2.3", "remote_port": 6100,
        "remote_request_id": "r1", "tp_size": 1,
    }
    assert s.has_pending_work()
    meta = s.build_connector_meta(None)
    assert meta.reqs_to_send["r1"].block_ids == [7, 3, 9]
    assert meta.reqs_to_send["r1"].lease_duration == 7.0
    s.update_connector_output(KVConnectorOutput(finished_sending={"r1"}))
    assert not s.has_pending_work()


def test_producer_releases_a_lease_whose_client_left_after_the_finish(env):
    """The front end aborts a finished prefill only when its client left before getting the
    params: the lease is released at once (``release_sends``), once; other ids do nothing."""
    s = make("kv_producer")
    req = request("r1", 2 * B + 1, {"do_remote_decode": True})
    req.status = RequestStatus.FINISHED_LENGTH
    assert s.request_finished(req, [7, 3, 9])[0] is True
    s.release_held_blocks("r1")
    s.release_held_blocks("never-leased")
    meta = s.build_connector_meta(None)
    assert "r1" in meta.reqs_to_send and meta.release_sends == {"r1"}
    s.update_connector_output(KVConnectorOutput(finished_sending={"r1"}))
    s.release_held_blocks("r1")  # the lease is over: nothing more to release
    assert not s.build_connector_meta(None).release_sends and not s.has_pending_work()


def test_producer_returns_its_prompt_ids_when_the_params_carry_the_prompt_digest(env):
    """The returned params are built complete here: a prefill leg whose front end put the
    rendered prompt's digest in the params gets its prompt ids handed on with them."""
    from pdserve.types import prompt_handoff

    s = make("kv_producer")
    digest = prompt_handoff.text_digest("the rendered chat", 1000)
    req = Request("r1", list(range(100, 100 + 2 * B + 1)), SamplingParams(),
                  kv_transfer_params=KVTransferParams.parse(
                      {"do_remote_decode": True}).with_prompt_digest(digest))
    req.status = RequestStatus.FINISHED_LENGTH
    _, params = s.request_finished(req, [7, 3, 9])
    assert prompt_handoff.decode(params[prompt_handoff.KEY], digest) == req.prompt_token_ids
    assert params["remote_block_ids"] == [[7, 3, 9]]
    plain = request("r2", 2 * B + 1, {"do_remote_decode": True})
    plain.status = RequestStatus.FINISHED_LENGTH
    assert prompt_handoff.KEY not in s.request_finished(plain, [1, 2, 4])[1]
    # a concurrent hand-off's prefill leg: its decoder tokenized the prompt while P prefilled
    concurrent = Request("r3", list(range(100, 100 + 2 * B + 1)), SamplingParams(),
                         kv_transfer_params=KVTransferParams.parse(
                             {"do_remote_decode": True, "transfer_id": "t-1"}
                         ).with_prompt_digest(digest))
    concurrent.status = RequestStatus.FINISHED_LENGTH
    _, params = s.request_finished(concurrent, [5, 6, 8])
    assert prompt_handoff.KEY not in params and params["remote_block_ids"] == [[5, 6, 8]]
    # the lease's tokens, packed once: a claim's digest of any prefix is the reader's
    sent = s.build_connector_meta(None).reqs_to_send["r3"]
    assert sent.tokens.digest(len(concurrent.prompt_token_ids)) == \
        token_digest(concurrent.prompt_token_ids)
    assert sent.tokens.digest(B) == token_digest(concurrent.prompt_token_ids[:B])


def test_producer_hands_the_proxys_early_release_to_the_worker(env):
    """``POST /v1/kv_transfer/release`` reaches the scheduler side through the engine core:
    the worker gets the request id with the block ids it names (it checks them)."""
    s = make("kv_producer")
    s.release_early("r1", [7, 3])
    assert s.has_pending_metadata()
    assert s.build_connector_meta(None).early_releases == {"r1": [7, 3]}
    assert not s.build_connector_meta(None).early_releases


@pytest.mark.parametrize("status", [RequestStatus.FINISHED_ABORTED, RequestStatus.FINISHED_ERROR])
def test_producer_does_not_keep_blocks_of_aborted_requests(env, status):
    s = make("kv_producer")
    req = request("r1", 5, {"do_remote_decode": True})
    req.status = status
    assert s.request_finished(req, [1, 2]) == (False, None)


def test_plain_requests_are_untouched(env):
    s = make("kv_consumer")
    req = request("r1", 9, None)
    assert s.get_num_new_matched_tokens(req, 0) == (0, False)
    req.status = RequestStatus.FINISHED_STOPPED
    assert s.request_finished(req, [1, 2, 3]) == (False, None)
    assert s.build_connector_meta(None).is_empty()


@pytest.mark.parametrize(
    "prompt_len, local, expect_tokens, expect_blocks",
    [
        (2, 0, 1, [0]),             # shorter than a block: still transferred
        (B - 1, 0, B - 2, [0]),
        (B, 0, B - 1, [0]),
        (B + 1, 0, B, [0]),
        (2 * B + 1, 0, 2 * B, [0, 1]),
        (4 * B + 2, 2 * B, 2 * B + 1, [2, 3, 4]),  # D's prefix cache has 2 blocks
    ],
)
def test_consumer_loads_all_but_the_last_prompt_token(env, prompt_len, local, expect_tokens,
                                                      expect_blocks):
    s = make("kv_consumer")
    n_remote = -(-prompt_len // B)
    req = request("d1", prompt_len, p_params(n_remote, unknown_future_field="x"))
    assert s.get_num_new_matched_tokens(req, local) == (expect_tokens, True)
    table = list(range(20, 20 + n_remote))
    s.update_state_after_alloc(req, table, expect_tokens)
    assert s.get_num_new_matched_tokens(req, local) == (0, False)  # never loaded twice
    meta = s.build_connector_meta(None)
    spec = meta.reqs_to_recv["d1"]
    assert spec.error is None
    assert spec.local_block_ids == [table[i] for i in expect_blocks]
    assert spec.remote_read_block_ids == [50 + i for i in expect_blocks]
    assert spec.remote.block_ids == list(range(50, 50 + n_remote))  # the full table, for the claim
    assert s.has_pending_work()
    s.update_connector_output(KVConnectorOutput(finished_recving={"d1"}))
    req.status = RequestStatus.FINISHED_STOPPED
    assert s.request_finished(req, table) == (False, None)
    assert not s.build_connector_meta(None).notices


def test_one_token_prompt_loads_nothing_and_releases_p(env):
    s = make("kv_consumer")
    req = request("d1", 1, p_params(1))
    assert s.get_num_new_matched_tokens(req, 0) == (0, False)
    meta = s.build_connector_meta(None)
    assert [(n.kind, n.remote.request_id) for n in meta.notices] == [("abort", "p-1")]


@pytest.mark.parametrize(
    "params, match",
    [
        (p_params(3, remote_port="x"), "remote_port"),
        ({k: v for k, v in p_params(3).items() if k != "remote_engine_id"}, "remote_engine_id"),
        (p_params(3, remote_block_ids=[1, -2, 3]), "remote_block_ids"),
        (p_params(1), "has 1 blocks but the prompt needs 3"),
    ],
)
def test_bad_params_become_a_failed_load_not_a_silent_recompute(env, params, match):
    s = make("kv_consumer")
    req = request("d1", 2 * B + 2, params)
    n, load_async = s.get_num_new_matched_tokens(req, 0)
    assert (n, load_async) == (2 * B + 1, True)
    s.update_state_after_alloc(req, [1, 2, 3], n)
    spec = s.build_connector_meta(None).reqs_to_recv["d1"]
    assert spec.error is not None and match in spec.error
    assert spec.local_block_ids == [1, 2, 3]


def test_abort_while_waiting_notifies_p_and_stops_heartbeats(env):
    s = make("kv_consumer")
    req = request("d1", 9, p_params(3))
    s.request_added(req)
    meta = s.build_connector_meta(None)
    assert "d1" in meta.heartbeat_start and meta.handshakes
    assert s.has_pending_work()
    req.status = RequestStatus.FINISHED_ABORTED
    assert s.request_finished(req, []) == (False, None)
    meta = s.build_connector_meta(None)
    assert meta.heartbeat_stop == {"d1"}
    assert [(n.kind, n.remote.request_id) for n in meta.notices] == [("abort", "p-1")]
    assert not s.has_pending_work()


def test_abort_of_a_request_never_seen_still_notifies_p(env):
    s = make("kv_consumer")
    req = request("d1", 9, p_params(3))
    req.status = RequestStatus.FINISHED_ABORTED
    assert s.request_finished(req, []) == (False, None)
    assert [n.kind for n in s.build_connector_meta(None).notices] == ["abort"]


def test_abort_during_load_is_handed_to_the_worker(env):
    s = make("kv_consumer")
    req = request("d1", 9, p_params(3))
    n, _ = s.get_num_new_matched_tokens(req, 0)
    s.update_state_after_alloc(req, [4, 5, 6], n)
    s.build_connector_meta(None)
    req.status = RequestStatus.FINISHED_ABORTED
    assert s.request_finished(req, [4, 5, 6]) == (False, None)
    meta = s.build_connector_meta(None)
    assert meta.aborted_recvs == {"d1"}
    assert s.has_pending_work()
    s.update_connector_output(KVConnectorOutput(finished_recving={"d1"}))
    assert not s.has_pending_work()


def test_factory_roles(env):
    cfg = KVTransferConfig(kv_role="kv_consumer")
    with pytest.raises(ValueError, match="unknown connector role"):
        create_connector(cfg, "runner")


def test_factory_reads_the_engine_config_it_is_given(env):
    """The scheduler side takes block size, TP size and data-parallel rank from the
    EngineConfig (typed access: an object that is not one is an error, not silent defaults)."""
    cfg = KVTransferConfig(kv_role="kv_consumer")
    s = create_connector(cfg, "scheduler", EngineConfig(block_size=8, tensor_parallel_size=2,
                                                        data_parallel_rank=3))
    assert (s.block_size, s.tp_size, s.side_channel_port) == (8, 2, 6103)
    d = create_connector(cfg, "scheduler")  # no config: EngineConfig's defaults
    assert (d.block_size, d.tp_size, d.side_channel_port) == (16, 1, 6100)

    class NotAnEngineConfig:
        block_size = 8

    with pytest.raises(AttributeError):
        create_connector(cfg, "scheduler", NotAnEngineConfig())
