"""The engine thread's non-blocking side-channel client and the wake-up pipe."""

from __future__ import annotations

import select
import threading
import time

import pytest
import zmq

from tests.support.ports import free_port
from pdserve.kv_transfer.nixl.leases import ClaimAnswer, ClaimStatus
from pdserve.kv_transfer.nixl.side_channel import SideChannelError, SideChannelServer, SideChannelTimeout
from pdserve.kv_transfer.nixl.side_channel_client import SideChannelClient
from pdserve.kv_transfer.wakeup import Waker
from pdserve.utils import phase_trace

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def server():
    held = {"a": [1, 2]}
    lock = threading.Lock()

    def claim(request_id, block_ids, num_tokens=None, digest=None, reader=None, first_token=None):
        with lock:
            blocks = held.get(request_id)
        if blocks is None:
            return ClaimAnswer(ClaimStatus.WAIT, f"unknown {request_id}")
        return ClaimAnswer(ClaimStatus.OK, "", 9.0) if blocks == block_ids else \
            ClaimAnswer(ClaimStatus.REJECT, "wrong blocks")

    srv = SideChannelServer("127.0.0.1", free_port(), get_info=lambda: {"x": 1}, claim=claim,
                            notify=lambda kind, req: None, claim_wait_s=10.0)
    srv.held, srv.lock = held, lock
    try:
        yield srv
    finally:
        srv.close()


def wait_results(client: SideChannelClient, tickets: list[int], timeout_s: float = 20.0) -> dict:
    """Poll the client's sockets (as the engine loop does) until every ticket is answered."""
    poller = zmq.Poller()
    for s in client.sockets():
        poller.register(s, zmq.POLLIN)
    out: dict = {}
    deadline = time.monotonic() + timeout_s
    while len(out) < len(tickets):
        assert time.monotonic() < deadline, f"answers missing: {out}"
        poller.poll(1000)
        client.poll()
        for t in tickets:
            if t not in out:
                res = client.result(t)
                if res is not None:
                    out[t] = res
    return out


def send_claims(client: SideChannelClient, port: int, later_id: str) -> tuple[int, ...]:
    """Send a granted claim, a rejected one, one the server holds back (no lease of
    ``later_id`` yet) and a ``get_info``, in this order on one connection: ``(ok, bad, later,
    info)`` tickets. The server answers in order, so once ``info`` is answered the held-back
    claim has had its first (waiting) answer."""
    client.connect("127.0.0.1", port)
    ok = client.send("127.0.0.1", port, {"type": "claim", "request_id": "a", "block_ids": [1, 2]},
                     10.0)
    bad = client.send("127.0.0.1", port, {"type": "claim", "request_id": "a", "block_ids": [7]},
                      10.0)
    later = client.send("127.0.0.1", port,
                        {"type": "claim", "request_id": later_id, "block_ids": [3]}, 10.0)
    info = client.send("127.0.0.1", port, {"type": "get_info"}, 10.0)
    return ok, bad, later, info


def test_answers_on_one_connection_are_matched_to_their_requests(server):
    client = SideChannelClient()
    try:
        ok, bad, later, info = send_claims(client, server.port, "b")
        assert len(client.sockets()) == 1  # one persistent connection
        first = wait_results(client, [ok, bad, info])
        assert first[ok]["ok"] and first[ok]["lease_expiry_in"] == 9.0
        assert not first[bad]["ok"] and first[bad]["reason"] == "wrong blocks"
        assert first[info]["info"]["x"] == 1
        assert client.result(later) is None
        with server.lock:
            server.held["b"] = [3]
        assert wait_results(client, [later])[later]["ok"]
        assert client.next_deadline() is None
    finally:
        client.close()


def test_claim_replies_carry_ok_bools_and_the_trace_marks_keep_their_names(server, tmp_path):
    """A :class:`ClaimStatus` stays on the owner: a claim's reply says ``"ok": bool`` (its keys
    as ever), and the side channel's phase-trace marks are named by the status values."""
    phase_trace.configure(str(tmp_path))
    client = SideChannelClient()
    try:
        ok, bad, later, info = send_claims(client, server.port, "c")
        replies = wait_results(client, [ok, bad, info])  # ``later`` waits at the server now
        del replies[info]
        with server.lock:
            server.held["c"] = [3]
        replies.update(wait_results(client, [later]))
    finally:
        client.close()
        phase_trace.configure(None)
    for ticket, granted in ((ok, True), (bad, False), (later, True)):
        reply = dict(replies[ticket])
        reply.pop("seq", None)
        assert set(reply) == {"ok", "reason", "lease_expiry_in", "instance_id"}, reply
        assert reply["ok"] is granted
    marks = [line.split()[1] for f in tmp_path.glob("*.trace")
             for line in f.read_text().splitlines() if not line.startswith("#")]
    assert {"sc.claim_ok", "sc.claim_reject", "sc.claim_wait"} <= set(marks), marks


def test_unanswered_request_times_out_and_drops_the_connection():
    client = SideChannelClient()
    try:
        port = free_port()  # nothing listens here
        t = client.send("127.0.0.1", port, {"type": "claim", "request_id": "x", "block_ids": []}, 5.0)
        client.poll()
        assert client.result(t) is None
        assert client.next_deadline() is not None
        client.poll(now=time.monotonic() + 6.0)
        with pytest.raises(SideChannelTimeout):
            client.result(t)
        assert client.sockets() == []
        assert client.next_deadline() is None
    finally:
        client.close()


def test_waker_is_readable_from_wake_until_drain():
    waker = Waker()
    try:
        assert not select.select([waker.fileno()], [], [], 0)[0]
        assert not waker.drain()
        thread = threading.Thread(target=lambda: [waker.wake() for _ in range(3)])
        thread.start()
        thread.join(20)
        assert select.select([waker.fileno()], [], [], 0)[0]
        assert waker.drain()
        assert not select.select([waker.fileno()], [], [], 0)[0]
    finally:
        waker.close()
    waker.wake()  # after close: ignored


def test_fp8_scale_mismatch_says_how_many_layers_differ_not_every_scale():
    """Two fp8 caches with other per-layer scales: the compatibility message counts the layers
    that differ and shows the first two, not the 2 x num_layers scales of each side."""
    from pdserve.kv_transfer.nixl.compat import compat_mismatch

    layers = 30
    local = {"dtype": "float8_e4m3fn", "num_layers": layers,
             "kv_scales": [0.01] * layers + [0.02] * layers}
    remote_scales = list(local["kv_scales"])
    for layer in (3, 7, 20):
        remote_scales[layer] = 0.5  # key scale
    remote_scales[layers + 9] = 0.25  # value scale of layer 9
    message = compat_mismatch(local, dict(local, kv_scales=remote_scales))
    assert message.startswith("kv_scales differ in 4 of 30 layers (layer 3: local k=0.01 "
                              "v=0.02, remote k=0.5 v=0.02; layer 7: "), message
    assert "(2 more)" in message and "layer 9" not in message and len(message) < 200, message
    auto = compat_mismatch(local, dict(local, dtype="float32", kv_scales=[]))
    assert "dtype: local='float8_e4m3fn' remote='float32'" in auto
    assert "kv_scales: local has 60, remote none" in auto and "0.01" not in auto


def test_an_address_zmq_refuses_fails_the_request_not_the_engine_thread():
    """The engine thread's client never raises for a bad address: the request's result is the
    error (its load fails), the connection is not kept."""
    client = SideChannelClient()
    try:
        client.connect("not a host!!", 5600)  # ahead of the first claim: nothing to report yet
        ticket = client.send("not a host!!", 5600, {"type": "claim"}, 1.0)
        with pytest.raises(SideChannelError, match="not a host"):
            client.result(ticket)
        assert client.sockets() == []
    finally:
        client.close()
