"""What the NIXL connector hands its worker side before the next step (TP 1): a finished
request's hold (its lease starts in the step that finished it) and a pull's early lease claim
(sent when the request arrives, taken by its load when it covers it, else the load claims as
before)."""

from __future__ import annotations

import time

import pytest

from pdserve.kv_transfer.nixl.claims import STALE_S, Claims
from pdserve.kv_transfer.nixl.metadata import PullClaim, RecvSpec
from pdserve.kv_transfer.nixl.reads import Load
from pdserve.kv_transfer.nixl.scheduler import NixlConnectorScheduler
from pdserve.types.kv_params import KVTransferParams
from pdserve.types.kv_transfer_config import KVTransferConfig
from pdserve.types.remote_ref import RemoteEndpoint, RemoteKVRef, token_digest
from pdserve.types.request import Request, RequestStatus
from pdserve.types.sampling_params import SamplingParams
from tests.kv_transfer.test_bidirectional_unit import B, d_params

pytestmark = pytest.mark.timeout(30)

EP = RemoteEndpoint("d-engine", "127.0.0.1", 5601)


class FakeClient:
    """The side-channel client: records what is sent and cancelled."""

    def __init__(self):
        self.sent: list[dict] = []
        self.cancelled: list[int] = []

    def send(self, host, port, message, timeout_s):
        self.sent.append(message)
        return len(self.sent)

    def cancel(self, ticket):
        self.cancelled.append(ticket)


def _config(role: str) -> KVTransferConfig:
    return KVTransferConfig.from_dict({
        "kv_connector": "NixlConnector", "kv_role": role,
        "kv_connector_extra_config": {"bidirectional_kv_xfer": True}})


def _request(rid, prompt, params, max_tokens=8):
    return Request(request_id=rid, prompt_token_ids=prompt,
                   sampling_params=SamplingParams(max_tokens=max_tokens),
                   kv_transfer_params=KVTransferParams.parse(params))


def test_an_arriving_pull_claims_the_decoders_turn_at_once_at_tp_1_only():
    history = list(range(4000, 4200))
    prompt = history + list(range(10, 30))
    params = d_params(history, expiry=time.time() + 480)
    sched = NixlConnectorScheduler(_config("kv_producer"), B)
    sched.request_added(_request("p1", prompt, params))
    early = sched.take_early_metadata()
    claim = early.pull_claims["p1"]
    # the hash-verified prefix: D's 12 full blocks (its partial 13th has no hash)
    assert claim.num_tokens == 192 and claim.token_digest == token_digest(prompt[:192])
    assert claim.remote.request_id == "d-req" and claim.remote.block_ids == params["remote_block_ids"]
    assert sched.take_early_metadata() is None  # taken once
    assert not sched.build_connector_meta(None).pull_claims  # not in the next step's
    # the claim never names more tokens than the prompt has before its last one
    sched.request_added(_request("p2", history[:100], params))
    assert sched.take_early_metadata().pull_claims["p2"].num_tokens == 96
    # a prompt whose tail differs from D's tokens (the answer tokenized otherwise in the next
    # turn's chat) claims the blocks that match, which D grants, not the turn's end
    retold = history[:190] + list(range(9000, 9030))
    sched.request_added(_request("p4", retold, params))
    claim = sched.take_early_metadata().pull_claims["p4"]
    assert claim.num_tokens == 176 and claim.token_digest == token_digest(retold[:176])
    # the prefix computed for the claim is the one the pull plans with
    assert sched.get_num_new_matched_tokens(_request("p4", retold, params), 0) == (176, True)
    # no block of D's turn matches: nothing is claimed
    sched.request_added(_request("p5", list(range(7000, 7300)), params))
    assert sched.take_early_metadata() is None
    tp2 = NixlConnectorScheduler(_config("kv_producer"), B, tp_size=2)
    tp2.request_added(_request("p3", prompt, params))
    assert tp2.take_early_metadata() is None  # every rank claims for itself with its load


def test_a_finished_prefills_hold_is_taken_out_of_the_next_steps_metadata():
    sched = NixlConnectorScheduler(KVTransferConfig.from_dict(
        {"kv_connector": "NixlConnector", "kv_role": "kv_producer"}), B)
    req = _request("p1", list(range(40)), {"do_remote_decode": True}, max_tokens=1)
    sched.request_added(req)
    req.output_token_ids = [5]
    req.status = RequestStatus.FINISHED_LENGTH
    held, params = sched.request_finished(req, [7, 8, 9])
    assert held and params["remote_block_ids"] == [[7, 8, 9]]  # one KV-cache group
    early = sched.take_early_metadata()
    assert list(early.reqs_to_send) == ["p1"] and early.reqs_to_send["p1"].first_token == 5
    assert not sched.build_connector_meta(None).reqs_to_send
    assert sched.has_pending_work()  # the blocks are held until the worker reports them


def _spec(ref: RemoteKVRef, end: int) -> RecvSpec:
    return RecvSpec("p1", ref, [1, 2], ref.block_ids[:2], end, digest_tokens=end,
                    token_digest="d")


def test_a_load_takes_the_early_claim_that_covers_it_and_claims_itself_otherwise():
    client = FakeClient()
    claims = Claims(_config("kv_producer"), client)
    ref = RemoteKVRef(EP, "d-req", [100, 101, 102], num_tokens=40)
    claims.send_early("p1", PullClaim(ref, 40, "digest40"))
    assert client.sent[-1] == {"type": "claim", "request_id": "d-req",
                               "block_ids": [100, 101, 102], "num_tokens": 40,
                               "token_digest": "digest40"}
    load = Load(_spec(ref, 32))
    claims.claim("p1", load)
    assert (load.claim, load.early, len(client.sent), len(claims)) == (1, True, 1, 0)
    # refused or failed: the load's own claim, with its own tokens, once
    assert claims.again(load) and not load.early and load.claim == 2
    assert client.sent[-1]["num_tokens"] == 32 and client.sent[-1]["token_digest"] == "d"
    assert not claims.again(load)

    # other blocks, or more tokens than claimed: the early claim is not used
    for other, end in ((RemoteKVRef(EP, "d-req", [100, 101, 103], num_tokens=40), 32),
                       (ref, 41)):
        claims.send_early("p1", PullClaim(other, 40, "x"))
        ticket = len(client.sent)
        load = Load(_spec(ref, end))
        claims.claim("p1", load)
        assert not load.early and ticket in client.cancelled and load.claim == ticket + 1


def test_early_claims_no_load_takes_are_dropped():
    client = FakeClient()
    claims = Claims(_config("kv_producer"), client)
    ref = RemoteKVRef(EP, "d-req", [100], num_tokens=10)
    claims.send_early("p1", PullClaim(ref, 10, "x"))
    claims.send_early("p2", PullClaim(ref, 10, "x"))
    claims.drop("p1")  # declined, or the request ended
    assert client.cancelled == [1] and len(claims) == 1
    claims.drop_stale(time.monotonic())
    assert len(claims) == 1
    claims.drop_stale(time.monotonic() + STALE_S + 1)
    assert client.cancelled == [1, 2] and len(claims) == 0


# ------------------------------------------------------------- a pull's load with an early claim
class AnsweringClient(FakeClient):
    """Answers each claim with the next of ``replies`` (None: not yet)."""

    def __init__(self, replies):
        super().__init__()
        self.replies = list(replies)
        self.answers: dict[int, dict] = {}

    def send(self, host, port, message, timeout_s):
        ticket = super().send(host, port, message, timeout_s)
        self.answers[ticket] = self.replies.pop(0)
        return ticket

    def poll(self, now=None):
        pass

    def result(self, ticket):
        return self.answers.pop(ticket, None)


class DirectPeer:
    """A same-host direct reader whose copies finish at once."""

    def __init__(self):
        self.copies = []

    def post_read(self, local, remote):
        self.copies.append((list(local), list(remote)))
        return "h", "DONE"

    def telemetry(self, handle):
        return None

    def release(self, handle):
        pass


def _tracker(client):
    from types import SimpleNamespace

    from pdserve.kv_transfer.nixl.loads import LoadTracker
    from pdserve.kv_transfer.nixl.stats import StatsRecorder
    from pdserve.types.outputs import KVConnectorOutput

    remote = SimpleNamespace(agent=SimpleNamespace(num_blocks=1000, block_bytes=64),
                             instance_id=None, direct=DirectPeer(), endpoint=EP,
                             route=SimpleNamespace(targets=(0,)))
    remotes = SimpleNamespace(ensure=lambda ep: remote, get=lambda ep: remote)
    out = KVConnectorOutput()
    notices = []
    tracker = LoadTracker(_config("kv_producer"), SimpleNamespace(block_bytes=64), remotes,
                          client, StatsRecorder(0.0), lambda: out, notices.append)
    return tracker, out, remote, notices


def test_a_pulls_load_reads_with_its_granted_early_claim_and_claims_again_when_refused():
    ref = RemoteKVRef(EP, "d-req", [100, 101, 102], num_tokens=40)
    ok = {"ok": True, "lease_expiry_in": 400.0}
    client = AnsweringClient([ok])
    tracker, out, remote, _ = _tracker(client)
    tracker.claims.send_early("p1", PullClaim(ref, 40, "early"))
    tracker.add("p1", RecvSpec("p1", ref, [7, 8], [100, 101], 32, digest_tokens=32,
                               token_digest="d"))
    tracker.progress(time.monotonic())
    assert len(client.sent) == 1  # no second claim
    assert remote.direct.copies == [([7, 8], [100, 101])] and out.finished_recving == {"p1"}

    # refused (another turn's tokens, a lease that ended): the load's own claim decides
    client = AnsweringClient([{"ok": False, "reason": "tokens differ"}, ok])
    tracker, out, remote, _ = _tracker(client)
    tracker.claims.send_early("p1", PullClaim(ref, 40, "early"))
    tracker.add("p1", RecvSpec("p1", ref, [7, 8], [100, 101], 32, digest_tokens=32,
                               token_digest="d"))
    tracker.progress(time.monotonic())
    tracker.progress(time.monotonic())
    assert [m["token_digest"] for m in client.sent] == ["early", "d"]
    assert remote.direct.copies and out.finished_recving == {"p1"} and not out.load_errors

    # both refused: the load fails as before
    client = AnsweringClient([{"ok": False, "reason": "x"}, {"ok": False, "reason": "gone"}])
    tracker, out, remote, notices = _tracker(client)
    tracker.claims.send_early("p1", PullClaim(ref, 40, "early"))
    tracker.add("p1", RecvSpec("p1", ref, [7, 8], [100, 101], 32, digest_tokens=32,
                               token_digest="d"))
    tracker.progress(time.monotonic())
    tracker.progress(time.monotonic())
    assert not remote.direct.copies and "p1" in out.load_errors and not notices


def test_a_decoders_load_reports_the_owners_first_token_before_posting_its_read():
    """The claim's answer brings P's first token: it is reported at once, and the READ is posted
    only once the report carrying it was taken (the token goes out first)."""
    ref = RemoteKVRef(EP, "p-req", [100, 101], num_tokens=32)
    client = AnsweringClient([{"ok": True, "lease_expiry_in": 30.0, "first_token_id": 77}])
    tracker, out, remote, _ = _tracker(client)
    tracker.add("d1", RecvSpec("d1", ref, [7, 8], [100, 101], 32, digest_tokens=32,
                               token_digest="d", starts_with_first_token=True))
    tracker.progress(time.monotonic())
    assert out.first_tokens == {"d1": 77} and not remote.direct.copies
    assert tracker.next_poll_in() == 0.0  # the next step posts it
    tracker.progress(time.monotonic())
    assert not remote.direct.copies  # the report was not taken yet
    tracker.report_taken()
    tracker.progress(time.monotonic())
    assert remote.direct.copies == [([7, 8], [100, 101])] and out.finished_recving == {"d1"}

    # aborted while it waits: nothing is read, the owner is told
    client = AnsweringClient([{"ok": True, "lease_expiry_in": 30.0, "first_token_id": 77}])
    tracker, out, remote, notices = _tracker(client)
    tracker.add("d1", RecvSpec("d1", ref, [7, 8], [100, 101], 32, digest_tokens=32,
                               token_digest="d", starts_with_first_token=True))
    tracker.progress(time.monotonic())
    tracker.abort("d1")
    tracker.report_taken()
    tracker.progress(time.monotonic())
    assert not remote.direct.copies and out.finished_recving == {"d1"}
    assert [n.kind for n in notices] == ["abort"]
