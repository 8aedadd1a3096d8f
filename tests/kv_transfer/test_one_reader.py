"""One reader per lease (pdserve/kv_transfer/nixl/readers.py): the owner binds a lease to the
reader id of its first granted claim; another reader's claim (by request id and blocks, or a
pending one by transfer id) is refused and its "done" or "abort" leaves the lease alone; the TP
ranks of one reader, and claims or notices without the field (an older pdserve), act as before.
The reader side names its id in every claim (the early one of a pull too) and notice.

The same rule between real processes, over NIXL READs: test_one_reader_processes.py."""

from __future__ import annotations

import pytest

from pdserve.kv_transfer.nixl.claims import Claims
from pdserve.kv_transfer.nixl.held import HeldBlocks
from pdserve.kv_transfer.nixl.leases import ClaimStatus, LeaseTable
from pdserve.kv_transfer.nixl.metadata import PullClaim, RecvSpec, RemoteNotice, SendSpec
from pdserve.kv_transfer.nixl.notice_inbox import NoticeInbox
from pdserve.kv_transfer.nixl.notice_sender import NoticeSender
from pdserve.kv_transfer.nixl.notifications import Notice, decode_notif, encode_notif
from pdserve.kv_transfer.nixl.readers import LEASED_TO_ANOTHER, reader_id
from pdserve.kv_transfer.nixl.reads import Load
from pdserve.kv_transfer.nixl.side_channel import SideChannelServer, side_channel_request
from pdserve.kv_transfer.nixl.stats import StatsRecorder
from pdserve.types.kv_transfer_config import KVTransferConfig
from pdserve.types.remote_ref import RemoteEndpoint, RemoteKVRef, token_digest
from pdserve.types.remote_ref import PackedTokens
from tests.kv_transfer.test_nixl_worker_parts import FakeAgent, FakeRemotes, ImmediatePool
from tests.support.ports import free_port

pytestmark = pytest.mark.timeout(30)

TOKENS = list(range(100, 108))
DIGEST = token_digest(TOKENS)
BLOCKS = [5, 6]
A = reader_id("inst-d1", "req-1")  # the first reader
B = reader_id("inst-d2", "req-1")  # another decoder, given the same params (same request id)
C = reader_id("inst-d1", "req-2")  # another request on the first decoder
EP = RemoteEndpoint("p", "127.0.0.1", 5600)


def held_lease(transfer_id: str | None = None) -> LeaseTable:
    table = LeaseTable()
    table.add("p1", BLOCKS, 30.0, now=0.0, tokens=PackedTokens.of(TOKENS), first_token=77,
              transfer_id=transfer_id)
    return table


def claim(table: LeaseTable, reader=None, **kw) -> tuple[ClaimStatus, str, float]:
    return table.claim("p1", BLOCKS, len(TOKENS), DIGEST, now=1.0, reader=reader, **kw)


def test_reader_ids_tell_readers_apart_and_are_the_same_for_one_reader():
    assert len({A, B, C}) == 3
    assert reader_id("inst-d1", "req-1") == A  # what every TP rank of that request computes


# ----------------------------------------------------------------------------- lease table
def test_a_second_reader_is_refused_and_the_first_keeps_its_lease():
    table = held_lease()
    assert claim(table, A)[0] is ClaimStatus.OK
    for other in (B, C):
        status, reason, left = claim(table, other)
        assert (status, left) == (ClaimStatus.REJECT, 0.0) and LEASED_TO_ANOTHER in reason
        answer = table.claim_answer("p1", BLOCKS, len(TOKENS), DIGEST, other)
        assert answer.status is ClaimStatus.REJECT and answer.first_token is None
    # the first reader again (a retry after a timeout, another rank): granted as before
    assert claim(table, A)[0] is ClaimStatus.OK
    assert table.claim_answer("p1", BLOCKS, len(TOKENS), DIGEST, A).first_token == 77


def test_the_tp_ranks_of_one_reader_share_the_lease_and_only_their_notices_end_it():
    """A reader of TP 2: both ranks claim with the request's one reader id and each sends a
    "done" (the owner's rank 0 expects 2); another reader's "done" or "abort", by notification
    or side channel, leaves the bound lease alone."""
    held = HeldBlocks(LeaseTable(), StatsRecorder(0.0))
    held.send("p1", SendSpec("p1", BLOCKS, 30.0, tokens=PackedTokens.of(TOKENS), first_token=77), now=0.0)
    for _rank in range(2):
        assert claim(held.leases, A)[0] is ClaimStatus.OK
    held.apply(Notice("done", "p1", 2, BLOCKS, B))
    held.apply(Notice("done", "p1", 2, BLOCKS, B))
    held.apply(Notice("abort", "p1", 1, BLOCKS, C))
    assert "p1" in held.leases and held.take_finished() == set()
    held.apply(Notice("done", "p1", 2, BLOCKS, A))
    assert "p1" in held.leases  # one of the reader's two
    held.apply(Notice("done", "p1", 2, BLOCKS, A))
    assert "p1" not in held.leases and held.take_finished() == {"p1"}


def test_the_bound_readers_abort_ends_the_lease():
    table = held_lease()
    assert claim(table, A)[0] is ClaimStatus.OK
    assert not table.abort("p1", BLOCKS, reader=B)
    assert table.abort("p1", BLOCKS, reader=A) and "p1" not in table


def test_a_claim_or_notice_without_a_reader_acts_as_before():
    """An older pdserve names no reader: its claim is granted as before (and binds nothing),
    its notices act whoever the lease is bound to."""
    table = held_lease()
    assert claim(table)[0] is ClaimStatus.OK
    assert claim(table, A)[0] is ClaimStatus.OK  # not bound by the unnamed claim
    assert claim(table, B)[0] is ClaimStatus.REJECT
    assert claim(table)[0] is ClaimStatus.OK  # still granted, bound or not
    assert table.done("p1", block_ids=BLOCKS) and "p1" not in table
    assert claim(held_lease(), 7)[0] is ClaimStatus.REJECT  # a reader id must be a string


def test_an_unbound_lease_takes_any_readers_notice():
    """Before any claim was granted (the reader still queued) an abort ends the lease as before,
    whoever sends it: no READ can be under way, and a later claim is refused."""
    table = held_lease()
    assert table.abort("p1", BLOCKS, reader=B) and "p1" not in table
    assert claim(table, A)[0] is ClaimStatus.REJECT


def test_a_second_readers_pending_claim_is_refused_and_learns_no_blocks():
    table = LeaseTable()
    assert table.claim_transfer("t1", len(TOKENS), DIGEST, reader=A).status is \
        ClaimStatus.WAIT
    table.add("p1", BLOCKS, 30.0, tokens=PackedTokens.of(TOKENS), first_token=77, transfer_id="t1")
    first = table.claim_transfer("t1", len(TOKENS), DIGEST, reader=A)
    assert (first.status, first.request_id, first.block_ids) == (ClaimStatus.OK, "p1", BLOCKS)
    second = table.claim_transfer("t1", len(TOKENS), DIGEST, reader=B)
    assert second.status is ClaimStatus.REJECT and LEASED_TO_ANOTHER in second.reason
    assert (second.request_id, second.block_ids, second.first_token) == ("", None, None)
    # the first reader's other TP rank; and a second reader by request id: the same rule
    assert table.claim_transfer("t1", len(TOKENS), DIGEST, reader=A).status is ClaimStatus.OK
    assert claim(table, C)[0] is ClaimStatus.REJECT


def test_a_pending_claim_binds_the_lease_against_a_later_claim_by_request_id():
    table = held_lease(transfer_id="t2")
    assert claim(table, B)[0] is ClaimStatus.OK
    answer = table.claim_transfer("t2", len(TOKENS), DIGEST, reader=A)
    assert answer.status is ClaimStatus.REJECT and answer.block_ids is None


def test_params_with_a_forged_first_token_never_take_the_lease():
    """The claim carries the first token the reader's params relayed: another than the lease's
    is refused before the lease is bound (the reason does not tell the lease's), so the honest
    reader still gets it."""
    table = held_lease()
    status, reason, _ = claim(table, B, first_token=78)
    assert status is ClaimStatus.REJECT and "first token (78)" in reason and "77" not in reason
    assert claim(table, A, first_token=77)[0] is ClaimStatus.OK
    assert claim(table, A)[0] is ClaimStatus.OK  # no relayed token: not checked


# ---------------------------------------------------------------------------- side channel
@pytest.fixture
def channel():
    table = held_lease(transfer_id="t3")
    notices = []
    server = SideChannelServer(
        "127.0.0.1", free_port(), get_info=lambda: {"x": 1}, claim=table.claim_answer,
        notify=lambda *args, **kw: notices.append((args, kw)), claim_wait_s=1.0,
        claim_transfer=table.claim_transfer,
        transfer_notice=lambda *args, **kw: notices.append((args, kw)))
    try:
        yield server, table, notices
    finally:
        server.close()


def ask(server: SideChannelServer, message: dict) -> dict:
    return side_channel_request("127.0.0.1", server.port, message, 10.0)


def test_the_side_channel_binds_by_the_claims_reader_field(channel):
    server, table, notices = channel
    by_id = {"type": "claim", "request_id": "p1", "block_ids": BLOCKS,
             "num_tokens": len(TOKENS), "token_digest": DIGEST}
    pending = {"type": "claim", "transfer_id": "t3", "num_tokens": len(TOKENS),
               "token_digest": DIGEST, "wait_s": 1.0}
    forged = ask(server, dict(by_id, reader=C, first_token_id=78))
    assert not forged["ok"] and "first token" in forged["reason"]
    assert ask(server, dict(by_id, reader=A, first_token_id=77))["ok"]
    refused = ask(server, dict(by_id, reader=B))
    assert not refused["ok"] and LEASED_TO_ANOTHER in refused["reason"]
    refused = ask(server, dict(pending, reader=B))
    assert not refused["ok"] and "block_ids" not in refused
    assert ask(server, dict(pending, reader=A))["block_ids"] == BLOCKS
    assert ask(server, by_id)["ok"]  # an older pdserve's claim
    for bad in ({"reader": ""}, {"reader": 3}, {"first_token_id": -1}):
        assert ask(server, dict(by_id, **bad))["reason"] == "malformed claim"
    # notices pass the reader on (and none when the notice names none)
    ask(server, {"type": "notify", "kind": "done", "request_id": "p1", "block_ids": BLOCKS,
                 "tp_rank": 0, "expected": 2, "reader": A})
    ask(server, {"type": "notify", "kind": "abort", "transfer_id": "t3", "reader": B})
    ask(server, {"type": "notify", "kind": "heartbeat", "transfer_id": "t3"})
    ask(server, {"type": "notify", "kind": "abort", "request_id": "p1", "block_ids": BLOCKS})
    assert notices == [(("done", "p1", BLOCKS, 0, 2), {"reader": A}),
                       (("abort", "t3"), {"reader": B}), (("heartbeat", "t3"), {}),
                       (("abort", "p1", BLOCKS), {})]
    refused = ask(server, {"type": "notify", "kind": "done", "transfer_id": "t3"})
    assert not refused["ok"] and "abort or a heartbeat" in refused["reason"]
    assert "p1" in table


# ---------------------------------------------------------------------------- reader side
class FakeClient:
    def __init__(self):
        self.sent: list[dict] = []

    def send(self, host, port, message, timeout_s):
        self.sent.append(message)
        return len(self.sent)

    def cancel(self, ticket):
        pass


def test_the_early_claim_and_the_loads_own_name_the_same_reader():
    """A pull's early claim names the reader id its load will name, so the owner's lease bound
    by the early grant is the load's own (and its own claim after a refused early one too)."""
    client = FakeClient()
    config = KVTransferConfig.from_dict({"kv_connector": "NixlConnector",
                                         "kv_role": "kv_both"})
    claims = Claims(config, client, lambda request_id: reader_id("me", request_id))
    ref = RemoteKVRef(EP, "d-req", [100, 101], num_tokens=8)
    claims.send_early("p1", PullClaim(ref, 8, "early"))
    load = Load(RecvSpec("p1", ref, [1, 2], [100, 101], 8, digest_tokens=8, token_digest="d"),
                reader=claims.reader("p1"))
    claims.claim("p1", load)
    assert load.early and claims.again(load)
    assert [m["reader"] for m in client.sent] == ["me/p1", "me/p1"]
    # a load with a relayed first token says it in its claim; a pending one names its reader
    pending = RemoteKVRef(EP, "", [], transfer_id="t9")
    for spec in (RecvSpec("p2", ref, [1, 2], [100, 101], 8, first_token=42),
                 RecvSpec("p3", pending, [1], [], 4)):
        claims.claim(spec.request_id, Load(spec, reader=claims.reader(spec.request_id)))
    assert client.sent[-2]["first_token_id"] == 42 and client.sent[-2]["reader"] == "me/p2"
    assert client.sent[-1]["transfer_id"] == "t9" and client.sent[-1]["reader"] == "me/p3"
    assert "first_token_id" not in client.sent[-1]


def test_notices_name_the_reader_of_their_request():
    agent, pool = FakeAgent(), ImmediatePool()
    sender = NoticeSender(agent, FakeRemotes(targets=(0,)), pool, StatsRecorder(0.0),
                          lambda e, why: None, 1.0, reader=lambda r: reader_id("me", r))
    sender.queue(RemoteNotice(RemoteKVRef(EP, "p1", BLOCKS), "done", reader_request="d1"))
    sender.queue(RemoteNotice(RemoteKVRef(EP, "", [], transfer_id="t1"), "abort",
                              reader_request="d2"))
    sender.queue(RemoteNotice(RemoteKVRef(EP, "p1", BLOCKS), "abort"))  # names no reader
    sender.send(RemoteKVRef(EP, "", [], transfer_id="t1"), "heartbeat")  # a waiting request's
    sender.send(RemoteKVRef(EP, "", [], transfer_id="t1"), "done")  # nothing to say it to
    sender.flush()
    assert [decode_notif(p) for _, p in agent.sent] == [
        Notice("done", "p1", 1, BLOCKS, "me/d1"), Notice("abort", "p1", 1, BLOCKS)]
    assert [call[2] for call in pool.calls] == [
        {"type": "notify", "kind": "heartbeat", "transfer_id": "t1"},
        {"type": "notify", "kind": "abort", "transfer_id": "t1", "reader": "me/d2"}]
    # side channel: the message names it too
    down = NoticeSender(FakeAgent(), FakeRemotes(ready=False), pool := ImmediatePool(),
                        StatsRecorder(0.0), lambda e, why: None, 1.0,
                        reader=lambda r: reader_id("me", r))
    down.queue(RemoteNotice(RemoteKVRef(EP, "p1", BLOCKS), "abort", reader_request="d1"))
    down.flush()
    assert pool.calls[0][2]["reader"] == "me/d1"


def test_the_notification_form_carries_the_reader_and_rank_0_forwards_it():
    assert decode_notif(encode_notif("done", "p1", 2, BLOCKS, A)) == \
        Notice("done", "p1", 2, BLOCKS, A)
    assert decode_notif(encode_notif("done", "p1", 2, BLOCKS)).reader is None
    assert decode_notif(encode_notif("done", "p1", 2, BLOCKS, "")) is None  # malformed
    agent, applied = FakeAgent(), []
    inbox = NoticeInbox(agent, 0, applied.append, lambda: None, StatsRecorder(0.0))
    inbox.set_siblings({1: b"m1"})
    inbox.on_side_channel_notice("abort", "p1", BLOCKS, reader=B)
    inbox.process()
    assert applied == [Notice("abort", "p1", 1, BLOCKS, B)]
    assert decode_notif(agent.sent[0][1]) == Notice("abort", "p1", 1, BLOCKS, B)
