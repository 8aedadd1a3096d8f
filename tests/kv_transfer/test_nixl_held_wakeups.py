"""The engine-loop schedule of an owner that holds blocks, on a real NIXL worker in this process
(its agent and side channel, no KV cache registered): merely held blocks ask for a step only at
the slow notification poll or their lease's expiry; a granted claim wakes the loop and brings
the fast poll back; the side channel refuses a "release" notice (the proxy's early release
comes through the engine core's metadata)."""

from __future__ import annotations

import select

import pytest

from tests.support.ports import free_port
from pdserve.kv_transfer.nixl.held import HELD_NOTIF_POLL_INTERVAL_S, READ_FAST_POLL_INTERVAL_S
from pdserve.kv_transfer.nixl.metadata import NixlConnectorMetadata, SendSpec
from pdserve.kv_transfer.nixl.side_channel import side_channel_request
from pdserve.types.kv_transfer_config import KVTransferConfig

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def worker(monkeypatch):
    from pdserve.kv_transfer.nixl.worker import NixlConnectorWorker

    monkeypatch.setenv("PDSERVE_NIXL_SIDE_CHANNEL_HOST", "127.0.0.1")
    monkeypatch.setenv("PDSERVE_NIXL_SIDE_CHANNEL_PORT", str(free_port()))
    w = NixlConnectorWorker(KVTransferConfig.from_dict({
        "kv_connector": "NixlConnector", "kv_role": "kv_consumer",
        "kv_connector_extra_config": {"kv_handshake_timeout": 2.0}}))
    try:
        yield w
    finally:
        w.shutdown()


def woke(w, timeout_s: float) -> bool:
    """Whether the worker's wake-up descriptor becomes readable within ``timeout_s``."""
    readable, _, _ = select.select([w.wakeup_handles()[0]], [], [], timeout_s)
    if readable:
        w.handle_wakeup()
    return bool(readable)


def ask(w, message: dict) -> dict:
    return side_channel_request("127.0.0.1", w.side_channel_port, message, 5.0)


def test_merely_held_turn_blocks_sleep_until_a_claim_wakes_the_loop(worker):
    worker.bind_connector_metadata(NixlConnectorMetadata(reqs_to_send={
        "turn": SendSpec("turn", [1, 2], 480.0, renew_on_heartbeat=False)}))
    assert worker.has_pending_work()
    assert worker.next_poll_in() == HELD_NOTIF_POLL_INTERVAL_S  # not 1-10 ms
    worker.bind_connector_metadata(NixlConnectorMetadata(reqs_to_send={
        "soon": SendSpec("soon", [3], 0.2)}))
    assert worker.next_poll_in() <= 0.2  # the expiry is due before the slow poll
    worker.bind_connector_metadata(NixlConnectorMetadata(release_sends={"soon"}))
    worker.get_finished(set())
    assert worker.next_poll_in() == HELD_NOTIF_POLL_INTERVAL_S
    assert not woke(worker, 0.0)

    refused = ask(worker, {"type": "claim", "request_id": "turn", "block_ids": [1, 9]})
    assert not refused["ok"] and not woke(worker, 0.3)  # a refused claim reads nothing
    assert worker.next_poll_in() == HELD_NOTIF_POLL_INTERVAL_S
    granted = ask(worker, {"type": "claim", "request_id": "turn", "block_ids": [1, 2]})
    assert granted["ok"], granted
    assert woke(worker, 5.0), "a granted claim must wake the engine loop"
    # the READ comes next: polled each millisecond, which serves it without NIXL's progress
    # thread, and sees its "done" at once
    assert worker.next_poll_in() == READ_FAST_POLL_INTERVAL_S


def test_the_side_channel_refuses_a_release_and_only_metadata_releases_early(worker):
    worker.bind_connector_metadata(NixlConnectorMetadata(reqs_to_send={
        "p": SendSpec("p", [4, 5], 30.0), "q": SendSpec("q", [6], 30.0)}))
    reply = ask(worker, {"type": "notify", "kind": "release", "request_id": "p",
                         "block_ids": [4, 5]})
    assert reply == {"ok": False, "reason": "unknown notice kind 'release' (one of done, abort, "
                                            "heartbeat)"}
    reply = ask(worker, {"type": "notify", "kind": "release", "request_id": "p",
                         "block_ids": [4, 5], "tp_rank": 0, "expected": 1})
    assert not reply["ok"] and not woke(worker, 0.3)
    assert not worker.get_finished(set()).finished_sending and "p" in worker.leases
    worker.bind_connector_metadata(NixlConnectorMetadata(early_releases={"p": [6]}))
    assert not worker.get_finished(set()).finished_sending  # another lease's blocks
    worker.bind_connector_metadata(NixlConnectorMetadata(early_releases={"p": [4, 5]}))
    out = worker.get_finished(set())
    assert out.finished_sending == {"p"} and "q" in worker.leases
    assert out.stats["num_kv_leases_released_early"] == 1
