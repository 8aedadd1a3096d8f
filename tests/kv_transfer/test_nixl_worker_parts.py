"""The NIXL worker's parts in one process, without NIXL: held blocks and their leases,
heartbeats, outgoing notices (NIXL, or side channel when NIXL fails) and incoming notices
(rank 0 forwards side-channel notices to its TP ranks). These behaviours are otherwise
exercised only through real worker processes (test_nixl_worker_processes.py,
test_nixl_tp_processes.py, test_nixl_peer_restart.py)."""

from __future__ import annotations

import concurrent.futures as cf
import time
from dataclasses import dataclass, field
from types import SimpleNamespace

import pytest

from pdserve.kv_transfer.nixl.heartbeats import Heartbeats
from pdserve.kv_transfer.nixl.held import (
    HELD_NOTIF_POLL_INTERVAL_S, NOTIF_POLL_INTERVAL_S, READ_FAST_POLL_INTERVAL_S,
    READ_FAST_POLL_WINDOW_S, READ_POLL_WINDOW_S, HeldBlocks,
)
from pdserve.kv_transfer.nixl.leases import ClaimStatus, LeaseTable
from pdserve.kv_transfer.nixl.metadata import RemoteNotice, SendSpec
from pdserve.kv_transfer.nixl.notice_inbox import NoticeInbox
from pdserve.kv_transfer.nixl.notice_sender import NoticeSender
from pdserve.kv_transfer.nixl.notifications import Notice, decode_notif, encode_notif
from pdserve.kv_transfer.nixl.stats import StatsRecorder
from pdserve.types.remote_ref import RemoteEndpoint, RemoteKVRef

pytestmark = pytest.mark.timeout(30)

EP = RemoteEndpoint("p", "127.0.0.1", 5600)


def ref(request_id="r1", blocks=(3, 4)):
    return RemoteKVRef(EP, request_id, list(blocks))


# ----------------------------------------------------------------------------------- fakes
@dataclass
class FakeAgent:
    """Records the NIXL notifications sent; ``fail_send`` makes them raise."""

    sent: list[tuple[str, bytes]] = field(default_factory=list)
    inbox: dict[str, list[bytes]] = field(default_factory=dict)
    loaded: list[bytes] = field(default_factory=list)
    fail_send: bool = False

    def send_notif(self, name, payload):
        if self.fail_send:
            raise RuntimeError("NIXL_ERR_REMOTE_DISCONNECT")
        self.sent.append((name, payload))

    def get_notifs(self):
        out, self.inbox = self.inbox, {}
        return out

    def load_agent(self, metadata):
        self.loaded.append(metadata)
        return f"agent-of-{metadata.decode()}"


class FakeRemotes:
    """A remote registry with one remote that is ready (or not yet)."""

    def __init__(self, ready=True, lease_s=30.0, targets=(0,), expected=None):
        route = SimpleNamespace(targets=tuple(targets),
                                expected=expected or {r: 1 for r in targets})
        self.remote = SimpleNamespace(
            ready=ready, route=route,
            agents={r: SimpleNamespace(name=f"p-tp{r}") for r in targets})
        self.lease_s = lease_s
        self.ensured: list[RemoteEndpoint] = []

    def get(self, endpoint):
        return self.remote if endpoint == EP else None

    def ensure(self, endpoint):
        self.ensured.append(endpoint)
        return self.remote

    def lease_duration(self, remote):
        return self.lease_s


class ImmediatePool:
    """Runs a submitted call at once (the thread pool of side-channel notices)."""

    def __init__(self, raises=None):
        self.calls = []
        self.raises = raises

    def submit(self, fn, *args):
        self.calls.append(args)
        fut = cf.Future()
        if self.raises is not None:
            fut.set_exception(self.raises)
        else:
            fut.set_result({"ok": True})
        return fut


def stats():
    return StatsRecorder(log_interval_s=0.0)


# ------------------------------------------------------------------------------ held blocks
def test_held_blocks_end_on_the_readers_done_and_are_reported_once():
    held = HeldBlocks(LeaseTable(), st := stats())
    held.send("r1", SendSpec("r1", [3, 4], lease_duration=30.0), now=0.0)
    assert "r1" in held.leases and len(held) == 1
    held.apply(Notice("done", "r1", 1, [3, 4]))
    assert held.take_finished() == {"r1"}
    assert held.take_finished() == set()
    assert len(held) == 0 and st.current.num_kv_expired_reqs == 0


def test_a_notice_naming_other_blocks_ends_nothing():
    held = HeldBlocks(LeaseTable(), stats())
    held.send("r1", SendSpec("r1", [3, 4], lease_duration=30.0), now=0.0)
    for kind in ("done", "abort"):
        held.apply(Notice(kind, "r1", 1, [3, 5]))
    held.release_early("r1", [3, 5])
    assert held.take_finished() == set() and "r1" in held.leases


def test_a_release_notice_from_a_reader_ends_nothing():
    """The proxy's early release reaches the owner only through its engine core: a notice of
    that kind (by NIXL or side channel) naming the lease's own blocks is not applied."""
    held = HeldBlocks(LeaseTable(), st := stats())
    held.send("r1", SendSpec("r1", [3, 4], lease_duration=30.0), now=0.0)
    held.apply(Notice("release", "r1", 1, [3, 4]))
    assert held.take_finished() == set() and "r1" in held.leases
    assert st.current.num_kv_leases_released_early == 0


def test_tp_done_needs_every_expected_notice():
    held = HeldBlocks(LeaseTable(), stats())
    held.send("r1", SendSpec("r1", [3], lease_duration=30.0), now=0.0)
    held.apply(Notice("done", "r1", 2, [3]))
    assert held.take_finished() == set()
    held.apply(Notice("done", "r1", 2, [3]))
    assert held.take_finished() == {"r1"}


def test_a_done_before_the_lease_ends_it_at_once():
    held = HeldBlocks(LeaseTable(), stats())
    held.apply(Notice("done", "r1", 1, [3, 4]))  # the reader was faster than the owner's step
    held.send("r1", SendSpec("r1", [3, 4], lease_duration=30.0), now=0.0)
    assert held.take_finished() == {"r1"} and "r1" not in held.leases


def test_release_and_early_release_are_counted():
    held = HeldBlocks(LeaseTable(), st := stats())
    held.send("a", SendSpec("a", [1], lease_duration=30.0), now=0.0)
    held.send("b", SendSpec("b", [2], lease_duration=30.0), now=0.0)
    held.release("a")  # the scheduler: its client left before the params
    held.release_early("b", [2])  # the proxy: the decode leg will not read
    held.release("never-held")
    assert held.take_finished() == {"a", "b"}
    assert st.current.num_kv_leases_released_early == 2


def test_expiry_frees_the_blocks_and_counts_turns_apart(monkeypatch):
    held = HeldBlocks(LeaseTable(), st := stats())
    held.send("p", SendSpec("p", [1], lease_duration=0.0), now=0.0)
    held.send("turn", SendSpec("turn", [2], lease_duration=0.0, renew_on_heartbeat=False),
              now=0.0)
    held.expire()
    assert held.take_finished() == {"p", "turn"}
    assert st.current.num_kv_expired_reqs == 2 and st.current.num_kv_turns_expired == 1


def test_heartbeat_extends_a_renewable_lease_and_waits_follow_expiry():
    held = HeldBlocks(LeaseTable(), stats())
    start = time.monotonic() - 4.0
    held.send("r1", SendSpec("r1", [3], lease_duration=5.0), now=start)
    assert held.waits(start) == [HELD_NOTIF_POLL_INTERVAL_S, 5.0]
    held.apply(Notice("heartbeat", "r1", 1, [3]))  # extended to time.monotonic() + 5
    assert held.leases.next_expiry() >= start + 9.0
    assert HeldBlocks(LeaseTable(), stats()).waits(0.0) == []


def test_merely_held_blocks_are_polled_slowly_and_a_claimed_lease_fast():
    """An instance that only holds blocks (a decoder's finished turn, 480 s) sleeps until its
    next lease expiry or the slow notification poll; a granted claim (the reader's READ comes
    next) brings the fast poll back until the lease ends or the read window passes."""
    held = HeldBlocks(LeaseTable(), stats())
    held.send("turn", SendSpec("turn", [3, 4], lease_duration=480.0, renew_on_heartbeat=False),
              now=100.0)
    held.send("short", SendSpec("short", [7], lease_duration=0.2), now=100.0)
    assert min(held.waits(100.0)) == pytest.approx(0.2)  # the short lease's expiry is due first
    assert held.waits(100.0)[0] == HELD_NOTIF_POLL_INTERVAL_S >= 0.5
    assert held.leases.expire(now=100.2) == ["short"]
    assert min(held.waits(101.0)) == HELD_NOTIF_POLL_INTERVAL_S  # not 1-10 ms
    status, _, _ = held.leases.claim("turn", [3, 4], now=102.0)
    assert status is ClaimStatus.OK
    assert min(held.waits(102.0)) == READ_FAST_POLL_INTERVAL_S  # the READ is served now
    assert min(held.waits(102.0 + READ_FAST_POLL_WINDOW_S)) == NOTIF_POLL_INTERVAL_S
    assert min(held.waits(102.0 + READ_POLL_WINDOW_S)) == HELD_NOTIF_POLL_INTERVAL_S
    held.leases.add("other", [9], 480.0, now=102.0)
    held.apply(Notice("done", "turn", 1, [3, 4]))  # the read ended its lease
    assert held.take_finished() == {"turn"}
    assert min(held.waits(102.5)) == HELD_NOTIF_POLL_INTERVAL_S
    assert held.leases.claim("other", [8], now=103.0)[0] is ClaimStatus.REJECT  # a refused claim: slow
    assert min(held.waits(103.0)) == HELD_NOTIF_POLL_INTERVAL_S


class FakeMirror:
    def __init__(self):
        self.staged, self.done = {}, []

    def stage(self, request_id, block_ids, *extra):
        self.staged[request_id] = extra

    def cancel(self, request_id):
        return self.staged.pop(request_id, None) is not None

    def take_staged(self):
        out, self.done = self.done, []
        return out

    def pending(self):
        return bool(self.staged)


def test_host_buffer_mode_starts_the_lease_once_staged():
    held = HeldBlocks(LeaseTable(), stats())
    mirror = FakeMirror()
    held.use_mirror(mirror)
    held.send("r1", SendSpec("r1", [3], lease_duration=30.0), now=0.0)
    held.send("r2", SendSpec("r2", [4], lease_duration=30.0), now=0.0)
    assert len(held) == 0 and held.staging()
    held.release("r2")  # released while staging: ends at once
    assert held.take_finished() == {"r2"}
    mirror.done = [("r1", mirror.staged.pop("r1"))]
    held.start_staged(now=1.0)
    assert "r1" in held.leases and not held.staging()


# ------------------------------------------------------------------------------ heartbeats
def test_heartbeats_every_third_of_the_lease_once_the_remote_is_ready():
    remotes = FakeRemotes(ready=False, lease_s=3.0)
    sent = []
    beats = Heartbeats(remotes, lambda r, kind: sent.append((r.request_id, kind)))
    beats.start("d1", ref("r1"))
    assert remotes.ensured == [EP]
    beats.send_due(now=10.0)
    assert sent == [] and remotes.ensured == [EP, EP]  # not ready: the handshake is asked for
    assert beats.waits(10.0) == []
    remotes.remote.ready = True
    beats.send_due(now=10.0)
    beats.send_due(now=10.5)
    assert sent == [("r1", "heartbeat")]
    assert beats.waits(10.5) == [pytest.approx(0.5)]
    beats.send_due(now=11.0)
    assert sent == [("r1", "heartbeat")] * 2


def test_heartbeats_stop_per_request_and_per_failed_remote():
    beats = Heartbeats(FakeRemotes(), lambda r, kind: None)
    beats.start("a", ref("ra"))
    beats.start("b", ref("rb"))
    beats.stop("a")
    beats.stop("never")
    assert len(beats) == 1
    beats.drop_remote(EP.key)
    assert len(beats) == 0


# ---------------------------------------------------------------------------- notice sender
def test_notice_goes_by_nixl_to_every_target_rank_with_its_count():
    agent, pool = FakeAgent(), ImmediatePool()
    sender = NoticeSender(agent, FakeRemotes(targets=(0, 1), expected={0: 2, 1: 1}), pool,
                          stats(), lambda e, why: None, 1.0)
    sender.queue(RemoteNotice(ref(), "done"))
    assert sender.has_queued()
    sender.flush()
    assert not sender.has_queued() and pool.calls == []
    assert [(n, decode_notif(p)) for n, p in agent.sent] == [
        ("p-tp0", Notice("done", "r1", 2, [3, 4])), ("p-tp1", Notice("done", "r1", 1, [3, 4]))]


def test_a_failed_nixl_notice_forgets_the_remote_and_goes_by_side_channel():
    agent, pool, forgotten = FakeAgent(fail_send=True), ImmediatePool(), []
    sender = NoticeSender(agent, FakeRemotes(targets=(0, 1), expected={0: 1, 1: 3}), pool,
                          stats(), lambda e, why: forgotten.append((e, why)), 2.5)
    sender.send(ref(), "abort", tp_rank=1)
    assert forgotten and forgotten[0][0] == EP and "abort notification failed" in forgotten[0][1]
    host, port, message, timeout = pool.calls[0]
    assert (host, port, timeout) == (EP.host, EP.port, 2.5)
    assert message == {"type": "notify", "kind": "abort", "request_id": "r1",
                       "block_ids": [3, 4], "tp_rank": 1, "expected": 3}


def test_without_nixls_progress_thread_every_notice_goes_by_side_channel_per_rank():
    """A notification posted outside a transfer leaves only while the sender polls its agent:
    without the progress thread every notice goes by the side channel, which answers it."""
    agent, pool = FakeAgent(), ImmediatePool()
    sender = NoticeSender(agent, FakeRemotes(targets=(0, 1), expected={0: 2, 1: 1}), pool,
                          stats(), lambda e, why: None, 1.0, nixl_delivers=False)
    sender.queue(RemoteNotice(ref(), "abort"))
    sender.flush()
    assert agent.sent == []
    assert [call[2] for call in pool.calls] == [
        {"type": "notify", "kind": "abort", "request_id": "r1", "block_ids": [3, 4],
         "tp_rank": 0, "expected": 2},
        {"type": "notify", "kind": "abort", "request_id": "r1", "block_ids": [3, 4],
         "tp_rank": 1, "expected": 1}]


def test_a_notice_to_a_remote_not_handshaken_goes_by_side_channel_and_failures_count():
    pool = ImmediatePool(raises=RuntimeError("no answer"))
    sender = NoticeSender(FakeAgent(), FakeRemotes(ready=False), pool, st := stats(),
                          lambda e, why: None, 1.0)
    sender.send(ref(), "heartbeat")
    assert pool.calls[0][2] == {"type": "notify", "kind": "heartbeat", "request_id": "r1",
                                "block_ids": [3, 4]}
    assert sender.has_background()
    sender.flush()
    assert not sender.has_background() and st.current.num_failed_notifications == 1


# ----------------------------------------------------------------------------- notice inbox
def test_inbox_applies_nixl_notifications_and_ignores_unknown_ones():
    agent, applied = FakeAgent(), []
    inbox = NoticeInbox(agent, 0, applied.append, lambda: None, stats())
    agent.inbox = {"d": [encode_notif("done", "r1", 1, [3]), b"garbage"]}
    inbox.process()
    assert applied == [Notice("done", "r1", 1, [3])]


def test_rank0_applies_and_forwards_side_channel_notices_to_its_ranks():
    agent, applied, woken = FakeAgent(), [], []
    inbox = NoticeInbox(agent, 0, applied.append, lambda: woken.append(1), st := stats())
    inbox.set_siblings({1: b"m1", 2: b"m2"})
    inbox.on_side_channel_notice("abort", "r1", [3])  # every rank
    inbox.on_side_channel_notice("done", "r2", [4], tp_rank=2, expected=2)  # rank 2 only
    assert woken == [1, 1] and inbox.has_side_notices()
    inbox.process()
    assert not inbox.has_side_notices()
    assert applied == [Notice("abort", "r1", 1, [3])]
    assert [(n, decode_notif(p)) for n, p in agent.sent] == [
        ("agent-of-m1", Notice("abort", "r1", 1, [3])),
        ("agent-of-m2", Notice("abort", "r1", 1, [3])),
        ("agent-of-m2", Notice("done", "r2", 2, [4])),
    ]
    assert agent.loaded == [b"m1", b"m2"]  # each sibling's agent loaded once
    agent.fail_send = True
    inbox.on_side_channel_notice("heartbeat", "r1", [3], tp_rank=1)
    inbox.process()
    assert st.current.num_failed_notifications == 1


def test_a_rank_other_than_0_applies_only_its_own_side_channel_notices():
    agent, applied = FakeAgent(), []
    inbox = NoticeInbox(agent, 1, applied.append, lambda: None, stats())
    inbox.on_side_channel_notice("done", "r1", [3], tp_rank=1)
    inbox.process()
    assert applied == [Notice("done", "r1", 1, [3])] and agent.sent == []
