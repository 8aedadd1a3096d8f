"""KV events: the block manager records prefix-cache changes, the publisher sends them with
sequence numbers and serves snapshots, and the proxy's index follows them (gaps -> resync)."""

from __future__ import annotations

import asyncio

import msgspec
import pytest

from pdserve.engine.block_manager import KVCacheManager
from pdserve.types.block_hash import block_hashes
from pdserve.engine.kv_events import KVEventPublisher
from pdserve.types.kv_events import (AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch,
                                     KVSnapshot, default_snapshot_endpoint)
from pdserve.router.kv_index import InstanceKVIndex, connectable

from pdserve.types.request import Request
from pdserve.types.sampling_params import SamplingParams

BS = 4


def req(request_id: str, tokens: list[int]) -> Request:
    return Request(request_id=request_id, prompt_token_ids=list(tokens), sampling_params=SamplingParams())


def compute_all(kvm: KVCacheManager, r: Request) -> list[int]:
    """Allocate the request's whole sequence (with its prefix hit) and register it as computed."""
    blocks, n = kvm.get_computed_blocks(r)
    table = kvm.allocate_slots(r, r.num_tokens - n, blocks)
    assert table is not None
    r.num_computed_tokens = r.num_tokens
    kvm.cache_blocks(r, r.num_tokens)
    return table


def replay(events) -> set[int]:
    """The hash set a subscriber holds after applying ``events`` from empty."""
    held: set[int] = set()
    for ev in events:
        if isinstance(ev, BlockStored):
            held.update(ev.block_hashes)
        elif isinstance(ev, BlockRemoved):
            held.difference_update(ev.block_hashes)
        elif isinstance(ev, AllBlocksCleared):
            held.clear()
    return held


def test_events_off_by_default_record_nothing():
    kvm = KVCacheManager(num_blocks=8, block_size=BS)
    compute_all(kvm, req("a", list(range(9))))
    assert kvm.take_events() == []


def test_stored_and_evicted_blocks_are_reported_with_prefix_cache_hashes():
    kvm = KVCacheManager(num_blocks=4, block_size=BS)
    kvm.enable_events()
    a = req("a", list(range(9)))  # 2 full blocks + 1 token
    compute_all(kvm, a)
    events = kvm.take_events()
    assert events == [BlockStored(block_hashes(list(range(9)), BS))]
    assert kvm.take_events() == []
    kvm.free(a)
    # a new, different request needs every block: the cached ones are evicted (removed events)
    b = req("b", [100 + t for t in range(13)])
    compute_all(kvm, b)
    events = kvm.take_events()
    assert replay([BlockStored(block_hashes(list(range(9)), BS))] + events) == set(
        block_hashes(b.all_token_ids, BS))
    assert any(isinstance(e, BlockRemoved) for e in events)
    assert set(kvm.cached_block_hashes()) == set(block_hashes(b.all_token_ids, BS))
    kvm.check_consistency()


def test_a_prefix_hit_stores_only_the_new_blocks_and_reset_clears():
    kvm = KVCacheManager(num_blocks=16, block_size=BS)
    kvm.enable_events()
    a = req("a", list(range(8)) + [50, 51, 52, 53, 54])
    compute_all(kvm, a)
    b = req("b", list(range(8)) + [60, 61, 62, 63, 64])
    compute_all(kvm, b)
    events = kvm.take_events()
    stored = [h for e in events for h in e.block_hashes]
    assert len(stored) == len(set(stored)) == 4  # 2 shared + 1 per request, each once
    kvm.free(a)
    kvm.free(b)
    assert kvm.reset_prefix_cache()
    assert kvm.take_events() == [AllBlocksCleared()]


def test_index_applies_batches_and_detects_gaps_and_restarts():
    ix = InstanceKVIndex("http://x", clock=lambda: 0.0)
    assert not ix.apply_batch(KVEventBatch(1, 1, 0.0, []))  # no snapshot yet
    ix.apply_snapshot(KVSnapshot(1, 5, 16, [1, 2]))
    assert ix.apply_batch(KVEventBatch(1, 4, 0.0, [BlockStored([9])]))  # covered: skipped
    assert ix.hashes == {1, 2}
    assert ix.apply_batch(KVEventBatch(1, 6, 0.0, [BlockStored([3]), BlockRemoved([1])]))
    assert ix.hashes == {2, 3} and ix.hit_blocks([2, 3, 4]) == 2 and ix.hit_blocks([3, 2]) == 2
    assert not ix.apply_batch(KVEventBatch(1, 8, 0.0, []))  # batch 7 lost
    assert not ix.synced and ix.hashes == {2, 3}
    ix.apply_snapshot(KVSnapshot(1, 8, 16, [7]))
    assert ix.resyncs == 1 and ix.live(5.0)
    assert not ix.apply_batch(KVEventBatch(2, 1, 0.0, []))  # the engine restarted


def test_index_goes_stale_without_batches():
    now = [0.0]
    ix = InstanceKVIndex("http://x", clock=lambda: now[0])
    ix.apply_snapshot(KVSnapshot(1, 0, 16, []))
    assert ix.live(5.0)
    now[0] = 5.5
    assert not ix.live(5.0)
    ix.apply_batch(KVEventBatch(1, 1, 0.0, []))  # a heartbeat
    assert ix.live(5.0)


def test_endpoints():
    assert default_snapshot_endpoint("tcp://*:5557") == "tcp://*:5558"
    with pytest.raises(ValueError):
        default_snapshot_endpoint("ipc:///tmp/x")
    assert connectable("tcp://*:5557", "http://10.0.0.7:8100") == "tcp://10.0.0.7:5557"
    assert connectable("tcp://0.0.0.0:1", "http://[::1]:8100") == "tcp://[::1]:1"
    assert connectable("tcp://10.1.1.1:1", "http://h:8100") == "tcp://10.1.1.1:1"


async def test_publisher_batches_and_snapshot_over_zmq():
    import zmq
    import zmq.asyncio

    from tests.support.ports import free_port

    pub_ep, snap_ep = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
    publisher = KVEventPublisher(pub_ep, snap_ep, block_size=16)
    ctx = zmq.asyncio.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(pub_ep)
    req_sock = ctx.socket(zmq.REQ)
    req_sock.connect(snap_ep)
    try:
        decode = msgspec.msgpack.Decoder(KVEventBatch).decode
        # PUB drops messages until the subscription arrives: publish until one is received
        for _ in range(200):
            publisher.publish([BlockStored([7])])
            if await sub.poll(20):
                break
        first = decode(await sub.recv())
        assert first.events == [BlockStored([7])] and first.epoch == publisher.epoch
        publisher.publish([])  # no heartbeat due yet: nothing sent
        publisher.publish([BlockRemoved([7])])
        nxt = decode(await sub.recv())
        while nxt.seq < publisher.seq:
            nxt = decode(await sub.recv())
        assert nxt.events == [BlockRemoved([7])]
        await req_sock.send(b"")
        for _ in range(200):
            await asyncio.sleep(0.01)
            publisher.serve_snapshot([1, 2, 3])
            if await req_sock.poll(0):
                break
        snap = msgspec.msgpack.decode(await req_sock.recv(), type=KVSnapshot)
        assert (snap.seq, snap.block_size, snap.block_hashes) == (publisher.seq, 16, [1, 2, 3])
    finally:
        sub.close(0)
        req_sock.close(0)
        ctx.term()
        publisher.close()
