"""The concurrent hand-off's parts without processes: the pending params' parsing, the scheduler
sides' bookkeeping of a pending load and of a lease with a transfer id, and the lease table's
pending claims (docs/proxy.md, "Concurrent hand-off")."""

from __future__ import annotations

import pytest

from pdserve.kv_transfer.nixl.held import HeldBlocks
from pdserve.kv_transfer.nixl.leases import ClaimStatus, LeaseTable
from pdserve.kv_transfer.nixl.metadata import SendSpec
from pdserve.kv_transfer.nixl.stats import StatsRecorder
from pdserve.types.kv_params import KVRole, KVTransferParams, parse_request_params
from pdserve.types.kv_transfer_config import KVTransferConfig
from pdserve.types.remote_ref import KVTransferParamsError, token_digest
from pdserve.types.request import Request, RequestStatus
from pdserve.types.sampling_params import SamplingParams
from pdserve.types.engine_config import EngineConfig
from pdserve.kv_transfer.factory import create_connector
from pdserve.types.remote_ref import PackedTokens

B = 4
TOKENS = list(range(100, 100 + 2 * B + 1))


def pending(**kw) -> dict:
    params = {"do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": "eng-P",
              "remote_host": "127.0.0.1", "remote_port": 6200, "remote_transfer_id": "t1",
              "tp_size": 1}
    params.update(kw)
    return params


@pytest.fixture
def env(monkeypatch):
    monkeypatch.setenv("PDSERVE_NIXL_SIDE_CHANNEL_HOST", "10.1.2.3")
    monkeypatch.setenv("PDSERVE_NIXL_SIDE_CHANNEL_PORT", "6100")


def make(role: str):
    cfg = KVTransferConfig.from_dict({"kv_role": role, "engine_id": f"eng-{role}"})
    return create_connector(cfg, "scheduler", EngineConfig(block_size=B))


# ------------------------------------------------------------------------------- params
def test_a_decode_leg_without_blocks_but_with_a_transfer_id_is_pending():
    params = KVTransferParams.parse(pending())
    assert params.role is KVRole.DECODE and params.error is None
    assert params.remote.pending and params.remote.transfer_id == "t1"
    done = params.remote.resolved("p-7", [3, 4])
    assert not done.pending and done.request_id == "p-7" and done.block_ids == [3, 4]
    # with blocks and a request id the reference is a sequential one, the id only carried
    full = KVTransferParams.parse(pending(remote_block_ids=[[1]], remote_request_id="p-1"))
    assert not full.remote.pending


@pytest.mark.parametrize("bad", ["", "a b", "x" * 129, 7, "é"])
def test_a_malformed_transfer_id_is_refused_on_both_legs(bad):
    cfg = KVTransferConfig.from_dict({"kv_role": "kv_both", "engine_id": "me"})
    with pytest.raises(KVTransferParamsError, match="remote_transfer_id"):
        parse_request_params(pending(remote_transfer_id=bad), cfg, 1000)
    with pytest.raises(KVTransferParamsError, match="transfer_id"):
        parse_request_params({"do_remote_decode": True, "transfer_id": bad}, cfg, 1000)
    ok = parse_request_params({"do_remote_decode": True, "transfer_id": "T-1_a"}, cfg, 1000)
    assert ok.transfer_id == "T-1_a"


# ------------------------------------------------------------------------ scheduler sides
def test_a_pending_load_reads_the_whole_prompt_without_heartbeats(env):
    s = make("kv_consumer")
    req = Request("d1", list(TOKENS), SamplingParams(),
                  kv_transfer_params=KVTransferParams.parse(pending()))
    s.request_added(req)
    assert s.get_num_new_matched_tokens(req, 0) == (len(TOKENS), True)  # P's token comes too
    s.update_state_after_alloc(req, [20, 21, 22], len(TOKENS))
    meta = s.build_connector_meta(None)
    # P's lease, once it starts, is kept alive by transfer id while the request waits
    assert meta.heartbeat_start["d1"].pending
    spec = meta.reqs_to_recv["d1"]
    assert spec.error is None and spec.remote.pending
    assert spec.local_block_ids == [20, 21, 22] and spec.remote_read_block_ids == []
    assert spec.starts_with_first_token and spec.first_token is None
    assert spec.digest_tokens == len(TOKENS) and spec.token_digest == token_digest(TOKENS)


def test_a_pending_load_after_a_local_prefix_hit_starts_at_that_block(env):
    s = make("kv_consumer")
    req = Request("d2", list(TOKENS), SamplingParams(),
                  kv_transfer_params=KVTransferParams.parse(pending()))
    assert s.get_num_new_matched_tokens(req, B) == (len(TOKENS) - B, True)
    s.update_state_after_alloc(req, [30, 31, 32], len(TOKENS) - B)
    spec = s.build_connector_meta(None).reqs_to_recv["d2"]
    assert spec.remote_first_block == 1 and spec.local_block_ids == [31, 32]


def test_a_pending_request_aborted_before_its_load_tells_p_by_reference(env):
    s = make("kv_consumer")
    req = Request("d3", list(TOKENS), SamplingParams(),
                  kv_transfer_params=KVTransferParams.parse(pending()))
    s.request_added(req)
    s.build_connector_meta(None)
    req.status = RequestStatus.FINISHED_ABORTED
    s.request_finished(req, [])
    (notice,) = s.build_connector_meta(None).notices
    assert notice.kind == "abort" and notice.remote.pending  # sent by transfer id


def test_the_prefiller_holds_its_blocks_under_the_transfer_id(env):
    s = make("kv_producer")
    req = Request("p1", list(TOKENS), SamplingParams(max_tokens=1),
                  kv_transfer_params=KVTransferParams.parse(
                      {"do_remote_decode": True, "transfer_id": "t9"}))
    req.output_token_ids.append(77)
    req.status = RequestStatus.FINISHED_LENGTH
    hold, params = s.request_finished(req, [5, 6, 7])
    assert hold and params["remote_request_id"] == "p1"
    send = s.build_connector_meta(None).reqs_to_send["p1"]
    assert send.transfer_id == "t9" and send.first_token == 77


# ------------------------------------------------------------------------- lease table
def test_a_pending_claim_waits_then_learns_the_lease_and_a_closed_one_is_refused():
    table = LeaseTable()
    digest = token_digest(TOKENS)
    assert table.claim_transfer("t1", len(TOKENS), digest).status is ClaimStatus.WAIT
    table.add("p1", [5, 6, 7], 30.0, tokens=PackedTokens.of(TOKENS), first_token=77, transfer_id="t1")
    answer = table.claim_transfer("t1", len(TOKENS), digest)
    assert (answer.status, answer.request_id, answer.block_ids, answer.first_token) == \
        (ClaimStatus.OK, "p1", [5, 6, 7], 77)
    other = table.claim_transfer("t1", len(TOKENS), token_digest(TOKENS[:-1] + [1]))
    assert other.status is ClaimStatus.REJECT and not other.block_ids  # another prompt learns nothing
    assert table.done("p1", block_ids=[5, 6, 7])
    late = table.claim_transfer("t1", len(TOKENS), digest)
    assert late.status is ClaimStatus.REJECT and "read done" in late.reason


def test_an_abort_by_transfer_id_before_the_lease_closes_it_when_it_starts():
    table = LeaseTable()
    assert table.abort_transfer("t2") is None
    assert table.add("p2", [1, 2], 30.0, transfer_id="t2") == "abort"
    # after the lease started the abort names it, for the caller to apply as a notice
    table.add("p3", [3], 30.0, transfer_id="t3")
    assert table.abort_transfer("t3") == ("p3", [3])


def test_a_heartbeat_by_transfer_id_renews_the_lease_once_it_started():
    """The owner's side of a waiting reader's heartbeats by transfer id
    (``NixlConnectorWorker._transfer_notice``): applied as a heartbeat naming the lease's
    blocks, which extends it; before the lease starts there is nothing to renew."""
    from types import SimpleNamespace

    from pdserve.kv_transfer.nixl.notifications import Notice
    from pdserve.kv_transfer.nixl.worker import NixlConnectorWorker

    table, applied = LeaseTable(), []
    held = HeldBlocks(table, StatsRecorder(10.0), lambda: None)
    inbox = SimpleNamespace(on_side_channel_notice=lambda kind, rid, blocks, reader=None:
                            applied.append(held.apply(Notice(kind, rid, 1, blocks, reader))))
    worker = SimpleNamespace(leases=table, inbox=inbox)
    NixlConnectorWorker._transfer_notice(worker, "heartbeat", "t5")  # P still computing
    assert applied == []
    held.send("p5", SendSpec("p5", [4, 5], 30.0, transfer_id="t5"), now=0.0)
    assert table.next_expiry() == 30.0
    NixlConnectorWorker._transfer_notice(worker, "heartbeat", "t5")  # at time.monotonic()
    assert len(applied) == 1 and table.next_expiry() > 30.0
    assert table.expire(now=31.0) == []  # renewed: not expired at its first deadline
    NixlConnectorWorker._transfer_notice(worker, "abort", "t5", reader=None)
    assert held.take_finished() == {"p5"}


def test_a_read_prompt_lease_records_its_hand_off_time():
    from pdserve.kv_transfer.nixl.notifications import Notice

    started = []
    stats = StatsRecorder(10.0)
    held = HeldBlocks(LeaseTable(), stats, lambda: started.append(1))
    held.send("p4", SendSpec("p4", [1, 2], 30.0, transfer_id="t4"), now=0.0)
    assert started == [1]  # the side channel is woken for the pending claim
    held.apply(Notice("done", "p4", 1, [1, 2]))
    assert held.take_finished() == {"p4"}
    (handoff,) = stats.take_delta()["handoff_s"]
    assert 0.0 <= handoff < 5.0


def test_packed_tokens_digest_every_prefix_as_older_instances_do():
    """A lease's packed tokens answer a claim of any prefix with the digest a reader computes,
    the same bytes as the wire form older pdserve instances hash (struct-packed int64)."""
    import hashlib
    import struct

    ids = [0, 1, 2**40, 151_000] + list(range(100))
    packed = PackedTokens.of(ids)
    assert len(packed) == len(ids)
    for n in (0, 1, 4, len(ids)):
        assert packed.digest(n) == token_digest(ids[:n])
    assert token_digest(ids) == hashlib.sha256(struct.pack(f"<{len(ids)}q", *ids)).hexdigest()
