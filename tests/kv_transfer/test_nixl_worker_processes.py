"""Two-process tests of the NIXL worker sides moving real KV blocks over UCX (tcp/sm on CPU).

The owner (P) and the reader (D) are separate processes (see ``nixl_peer.py``); the test plays
the scheduler sides by handing each worker its per-step metadata.
"""

from __future__ import annotations

import concurrent.futures as cf

import pytest
import torch

from tests.support.nixl_peer import GEOMETRY, PeerProcess, block_pattern, peer_config
from tests.support.ports import free_port
from pdserve.kv_transfer.nixl.metadata import NixlConnectorMetadata, RecvSpec, RemoteNotice, SendSpec
from pdserve.types.remote_ref import RemoteEndpoint, RemoteKVRef

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]

LEASE_S = 1.5  # P's configured lease (sets D's heartbeat period to LEASE_S / 3)


@pytest.fixture(scope="module")
def pair():
    p = PeerProcess(peer_config("kv_producer", kv_lease_duration=LEASE_S), free_port(), GEOMETRY)
    d = None
    try:
        assert p.hello.get("ok"), p.hello
        d = PeerProcess(peer_config("kv_consumer"), free_port(), GEOMETRY, zeros=True)
        assert d.hello.get("ok"), d.hello
        yield p, d
    finally:
        if d is not None:
            d.shutdown()
        p.shutdown()


def ref_to(p: PeerProcess, request_id: str, block_ids: list[int]) -> RemoteKVRef:
    return RemoteKVRef(RemoteEndpoint(p.engine_id, "127.0.0.1", p.port), request_id, block_ids)


def lease(p: PeerProcess, request_id: str, block_ids: list[int], duration: float = 30.0) -> None:
    p.bind(NixlConnectorMetadata(reqs_to_send={request_id: SendSpec(request_id, block_ids, duration)}))
    out = p.step()
    assert request_id not in out["finished_sending"]


def recv_meta(d_req: str, ref: RemoteKVRef, local: list[int], remote: list[int]):
    return NixlConnectorMetadata(reqs_to_recv={
        d_req: RecvSpec(d_req, ref, local, remote, num_tokens=len(local) * 4)
    })


def test_read_moves_blocks_merges_descriptors_and_notifies_owner(pair):
    p, d = pair
    remote_ids = [3, 4, 5, 9]
    local_ids = [10, 11, 12, 20]  # runs: 3-5 -> 10-12 (one descriptor), 9 -> 20
    lease(p, "p-read", remote_ids)
    d.bind(recv_meta("d-read", ref_to(p, "p-read", remote_ids), local_ids, remote_ids))
    acc = d.step_until(lambda a: "d-read" in a["finished_recving"])
    assert not acc["invalid_block_ids"]
    got = d.blocks(local_ids)
    numel = got[0].numel()
    for rid, block in zip(remote_ids, got):
        assert torch.equal(block, block_pattern(rid, numel))
    # untouched neighbours stay zero
    assert all(float(b.abs().sum()) == 0.0 for b in d.blocks([13, 21]))
    stats = [s for s in acc["stats"] if s["xfer_time_s"]]
    assert stats and stats[-1]["num_descriptors"] == [2]
    block_bytes = numel * 4
    assert stats[-1]["bytes"] == [4 * block_bytes]
    # the READ's notification frees P's lease at once (well before the 30 s lease)
    p_acc = p.step_until(lambda a: "p-read" in a["finished_sending"], timeout_s=10)
    assert p_acc["last"]["num_leases"] == 0
    assert not any(s["num_kv_expired_reqs"] for s in p_acc["stats"])


def test_first_token_comes_from_the_owners_claim_answer(pair):
    """P's lease keeps the first token its prefill sampled and a granted claim answers it: D
    reports P's token with the finished load, and a relayed token that differs fails the load
    (before any READ) without ending P's lease: the honest reader then reads it."""
    p, d = pair
    for p_req, loads in (("p-first", [("d-first", 42)]),
                         ("p-forged", [("d-forged", 43), ("d-honest-first", 42)])):
        p.bind(NixlConnectorMetadata(reqs_to_send={
            p_req: SendSpec(p_req, [7, 8], 30.0, first_token=42)}))
        p.step()
        for d_req, relayed in loads:
            d.bind(NixlConnectorMetadata(reqs_to_recv={d_req: RecvSpec(
                d_req, ref_to(p, p_req, [7, 8]), [14, 15], [7, 8], num_tokens=8,
                first_token=relayed)}))
            acc = d.step_until(lambda a: d_req in a["finished_recving"])
            if relayed == 42:
                assert not acc["invalid_block_ids"] and acc["first_tokens"] == {d_req: 42}
            else:
                assert acc["invalid_block_ids"] == {14, 15} and not acc["first_tokens"]
                assert p_req not in p.step()["finished_sending"]
        p.step_until(lambda a: p_req in a["finished_sending"], timeout_s=10)


def test_claim_answer_wakes_the_reader_and_side_channel_notice_wakes_the_owner(pair):
    """The engine loop sleeps until a wake-up handle is readable: the lease claim's answer
    must make the reader's readable, and a side-channel notice the owner's."""
    from pdserve.kv_transfer.nixl.side_channel import side_channel_request

    p, d = pair  # handshaken by the earlier tests of this module
    d.wait_wakeup(0.0)  # consume wake-ups left over from earlier tests
    # D claims blocks P does not hold yet: P holds the claim back until the lease appears
    d.bind(recv_meta("d-wake", ref_to(p, "p-wake", [2, 3]), [5, 6], [2, 3]))
    out = d.step()
    assert "d-wake" not in out["finished_recving"]
    assert out["next_poll_in"] is None or out["next_poll_in"] > 1.0  # nothing to poll for
    with cf.ThreadPoolExecutor(1) as pool:
        waiting = pool.submit(d.wait_wakeup, 30.0)
        lease(p, "p-wake", [2, 3])  # P answers the claim now
        assert waiting.result()["woke"]
    acc = d.step_until(lambda a: "d-wake" in a["finished_recving"])
    assert not acc["invalid_block_ids"]
    p.step_until(lambda a: "p-wake" in a["finished_sending"], timeout_s=10)
    # a notice over the side channel (readers that cannot use NIXL notifications) wakes P
    lease(p, "p-wake2", [4])
    reply = side_channel_request("127.0.0.1", p.port, {"type": "notify", "kind": "abort",
                                                      "request_id": "p-wake2",
                                                      "block_ids": [4]}, 10.0)
    assert reply.get("ok"), reply
    assert p.wait_wakeup(20.0)["woke"]
    assert "p-wake2" in p.step()["finished_sending"]


def test_lease_expiry_frees_blocks_and_is_counted_for_every_entry(pair):
    p, _ = pair
    # three leases; the middle one is the shortest, so a scan of only the head would miss it
    p.bind(NixlConnectorMetadata(reqs_to_send={
        "exp-a": SendSpec("exp-a", [1], 30.0),
        "exp-b": SendSpec("exp-b", [2], 0.3),
        "exp-c": SendSpec("exp-c", [6], 0.6),
    }))
    acc = p.step_until(lambda a: {"exp-b", "exp-c"} <= a["finished_sending"], timeout_s=10)
    assert "exp-a" not in acc["finished_sending"]
    assert sum(s["num_kv_expired_reqs"] for s in acc["stats"]) == 2
    # drop the long one explicitly
    p.bind(NixlConnectorMetadata(release_sends={"exp-a"}))
    assert "exp-a" in p.step()["finished_sending"]


def test_expired_multi_turn_blocks_are_counted_apart(pair):
    """A decoder's turn blocks (a lease heartbeats do not renew) that nobody pulls expire by
    design: counted as turns expired, besides the expired leases."""
    p, _ = pair
    p.bind(NixlConnectorMetadata(reqs_to_send={
        "turn-a": SendSpec("turn-a", [7], 0.2, renew_on_heartbeat=False),
        "lease-b": SendSpec("lease-b", [8], 0.2),
    }))
    acc = p.step_until(lambda a: {"turn-a", "lease-b"} <= a["finished_sending"], timeout_s=10)
    assert sum(s["num_kv_expired_reqs"] for s in acc["stats"]) == 2
    assert sum(s["num_kv_turns_expired"] for s in acc["stats"]) == 1


def test_early_release_from_the_engine_core_frees_a_lease_only_for_its_blocks(pair):
    """The proxy's early release as the engine core delivers it (``early_releases``, from the
    scheduler side's ``release_early``): exactly the leased blocks, counted once."""
    p, _ = pair
    lease(p, "p-early", [24, 25])
    p.bind(NixlConnectorMetadata(early_releases={"p-early": [24]}))  # wrong blocks: kept
    out = p.step()
    assert "p-early" not in out["finished_sending"] and out["num_leases"] >= 1
    p.bind(NixlConnectorMetadata(early_releases={"p-early": [24, 25]}))
    acc = p.step_until(lambda a: "p-early" in a["finished_sending"], timeout_s=5)
    assert sum(s["num_kv_leases_released_early"] for s in acc["stats"]) == 1
    assert not any(s["num_kv_expired_reqs"] for s in acc["stats"])


def test_a_release_reaches_a_lease_only_through_the_engine_core(pair, monkeypatch):
    """The side channel takes readers' notices only: a "release" sent to it is refused and ends
    nothing. The proxy's release, checked by P's front end (``parse_release``) and handed on by
    the engine core (``early_releases``), ends the lease only when it names exactly its blocks:
    not with fewer blocks, nor with another lease's blocks under this request id."""
    from pdserve.types.kv_transfer_config import KVTransferConfig
    from pdserve.kv_transfer.nixl.release import parse_release
    from pdserve.kv_transfer.nixl.side_channel import side_channel_request

    p, _ = pair
    monkeypatch.setenv("PDSERVE_NIXL_SIDE_CHANNEL_PORT", str(p.port))  # P's front end's view
    lease(p, "p-rel", [22, 23])
    lease(p, "p-rel-other", [26])
    p.wait_wakeup(0.0)  # consume wake-ups left over from earlier tests
    reply = side_channel_request("127.0.0.1", p.port, {
        "type": "notify", "kind": "release", "request_id": "p-rel", "block_ids": [22, 23]}, 10.0)
    assert not reply.get("ok") and "unknown notice kind 'release'" in reply["reason"], reply
    assert not p.wait_wakeup(0.3)["woke"]  # nothing reached the engine thread
    out = p.step()
    assert "p-rel" not in out["finished_sending"]

    config = KVTransferConfig.from_dict(dict(peer_config("kv_producer"), engine_id=p.engine_id))
    params = {"remote_engine_id": p.engine_id, "remote_host": "127.0.0.1",
              "remote_port": p.port, "remote_request_id": "p-rel"}

    def release(block_ids: list[int]) -> dict:
        ref = parse_release(config, dict(params, remote_block_ids=block_ids))
        p.bind(NixlConnectorMetadata(early_releases={ref.request_id: list(ref.block_ids)}))
        return p.step()

    def released(out: dict) -> int:
        return (out["stats"] or {}).get("num_kv_leases_released_early", 0)

    for wrong in ([22], [26]):  # fewer blocks; the other lease's blocks
        out = release(wrong)
        assert not {"p-rel", "p-rel-other"} & set(out["finished_sending"]), wrong
        assert released(out) == 0
    out = release([22, 23])
    assert "p-rel" in out["finished_sending"] and "p-rel-other" not in out["finished_sending"]
    assert released(out) == 1 and not (out["stats"] or {}).get("num_kv_expired_reqs")
    with pytest.raises(ValueError, match="not this instance"):
        parse_release(config, dict(params, remote_engine_id="someone-else",
                                   remote_block_ids=[22, 23]))
    p.bind(NixlConnectorMetadata(release_sends={"p-rel-other"}))
    assert "p-rel-other" in p.step()["finished_sending"]


def test_an_owner_that_only_holds_blocks_sleeps_until_a_claim_wakes_it(pair):
    """Merely held blocks (a decoder's finished turn) ask for a step only at the slow
    notification poll (or their lease's expiry), not every few ms; the reader's claim wakes the
    owner, which then polls fast for the READ's "done"."""
    from pdserve.kv_transfer.nixl.held import HELD_NOTIF_POLL_INTERVAL_S, NOTIF_POLL_INTERVAL_S

    _, d = pair
    p = PeerProcess(peer_config("kv_producer", kv_lease_duration=LEASE_S), free_port(), GEOMETRY)
    try:
        assert p.hello.get("ok"), p.hello
        p.bind(NixlConnectorMetadata(reqs_to_send={
            "turn": SendSpec("turn", [5, 6], 480.0, renew_on_heartbeat=False)}))
        out = p.step()
        assert out["next_poll_in"] == pytest.approx(HELD_NOTIF_POLL_INTERVAL_S, abs=0.05)
        p.bind(NixlConnectorMetadata(reqs_to_send={"soon": SendSpec("soon", [9], 0.2)}))
        assert p.step()["next_poll_in"] <= 0.2  # a lease's expiry comes before the slow poll
        p.step_until(lambda a: "soon" in a["finished_sending"], timeout_s=5)
        assert p.step()["next_poll_in"] == pytest.approx(HELD_NOTIF_POLL_INTERVAL_S, abs=0.05)
        p.wait_wakeup(0.0)
        with cf.ThreadPoolExecutor(1) as pool:
            waiting = pool.submit(p.wait_wakeup, 15.0)
            d.bind(recv_meta("d-turn", ref_to(p, "turn", [5, 6]), [16, 17], [5, 6]))
            acc = d.step_until(lambda a: "d-turn" in a["finished_recving"])
            woke = waiting.result()
        assert not acc["invalid_block_ids"]
        assert woke["woke"], "the granted claim did not wake the owner's loop"
        assert woke["next_poll_in"] <= NOTIF_POLL_INTERVAL_S  # the READ's "done" comes next
        p_acc = p.step_until(lambda a: "turn" in a["finished_sending"], timeout_s=10)
        assert p_acc["last"]["num_leases"] == 0 and p_acc["last"]["next_poll_in"] is None
    finally:
        p.shutdown()


def test_abort_notification_frees_owner_lease(pair):
    p, d = pair
    lease(p, "p-abort", [7, 8])
    ref = ref_to(p, "p-abort", [7, 8])
    d.bind(NixlConnectorMetadata(notices=[RemoteNotice(ref, "abort")]))
    d.step()
    acc = p.step_until(lambda a: "p-abort" in a["finished_sending"], timeout_s=10)
    assert not any(s["num_kv_expired_reqs"] for s in acc["stats"])


def test_heartbeats_keep_a_waiting_lease_alive(pair):
    p, d = pair
    # a lease of P's configured length; D heartbeats every LEASE_S / 3
    lease(p, "p-hb", [14], duration=LEASE_S)
    d.bind(NixlConnectorMetadata(heartbeat_start={"d-hb": ref_to(p, "p-hb", [14])}))
    import time

    t_end = time.monotonic() + 2.5 * LEASE_S
    while time.monotonic() < t_end:
        d.step()
        out = p.step()
        assert "p-hb" not in out["finished_sending"], "lease expired despite heartbeats"
        time.sleep(0.05)
    d.bind(NixlConnectorMetadata(heartbeat_stop={"d-hb"}))
    d.step()
    acc = p.step_until(lambda a: "p-hb" in a["finished_sending"], timeout_s=3 * LEASE_S)
    assert sum(s["num_kv_expired_reqs"] for s in acc["stats"]) == 1


def test_forged_block_ids_fail_the_load(pair):
    p, d = pair
    lease(p, "p-forged", [15, 16])
    # in range but not the leased blocks -> the owner refuses the claim
    d.bind(recv_meta("d-forged", ref_to(p, "p-forged", [17, 18]), [24, 25], [17, 18]))
    acc = d.step_until(lambda a: "d-forged" in a["finished_recving"])
    assert set(acc["invalid_block_ids"]) == {24, 25}
    assert sum(s["num_failed_transfers"] for s in acc["stats"]) == 1
    assert all(float(b.abs().sum()) == 0.0 for b in d.blocks([24, 25]))
    # out of the owner's range -> refused before any I/O
    d.bind(recv_meta("d-range", ref_to(p, "p-forged", [15, 10_000]), [26, 27], [15, 10_000]))
    acc = d.step_until(lambda a: "d-range" in a["finished_recving"])
    assert set(acc["invalid_block_ids"]) == {26, 27}
    # The failed reader's abort notices name the forged blocks: the owner keeps the real lease.
    # An abort for another lease, sent after them on the same path, shows they were all seen.
    lease(p, "p-marker", [29])
    d.bind(NixlConnectorMetadata(notices=[RemoteNotice(ref_to(p, "p-marker", [29]), "abort")]))
    d.step()
    acc = p.step_until(lambda a: "p-marker" in a["finished_sending"], timeout_s=10)
    assert "p-forged" not in acc["finished_sending"]
    # the honest reader still reads the real lease, and its "done" ends it
    d.bind(recv_meta("d-honest", ref_to(p, "p-forged", [15, 16]), [24, 25], [15, 16]))
    acc = d.step_until(lambda a: "d-honest" in a["finished_recving"])
    assert not acc["invalid_block_ids"]
    numel = d.blocks([24])[0].numel()
    assert [torch.equal(b, block_pattern(r, numel)) for r, b in zip([15, 16], d.blocks([24, 25]))] \
        == [True, True]
    p.step_until(lambda a: "p-forged" in a["finished_sending"], timeout_s=10)


def test_unknown_request_id_is_refused_after_the_claim_wait(pair):
    p, d = pair
    d.bind(recv_meta("d-unknown", ref_to(p, "never-leased", [1]), [28], [1]))
    acc = d.step_until(lambda a: "d-unknown" in a["finished_recving"], timeout_s=15)
    assert acc["invalid_block_ids"] == {28}


def test_failed_loads_report_why(pair):
    """Each failed load names its reason (KVLoadFailure), for the client's error message."""
    p, d = pair
    lease(p, "p-why", [13, 14])
    dead = RemoteKVRef(RemoteEndpoint("nobody", "127.0.0.1", free_port()), "x", [0])
    wrong = RemoteKVRef(RemoteEndpoint("not-" + p.engine_id, "127.0.0.1", p.port), "p-why", [13])
    d.bind(NixlConnectorMetadata(reqs_to_recv={
        "why-refused": RecvSpec("why-refused", ref_to(p, "p-why", [17]), [2], [17],
                                num_tokens=4),
        "why-range": RecvSpec("why-range", ref_to(p, "p-why", [10_000]), [3], [10_000],
                              num_tokens=4),
        "why-engine": RecvSpec("why-engine", wrong, [4], [13], num_tokens=4),
        "why-timeout": RecvSpec("why-timeout", dead, [6], [0], num_tokens=4),
    }))
    acc = d.step_until(lambda a: len(a.get("load_errors", {})) == 4, timeout_s=20)
    assert acc["load_errors"] == {
        "why-refused": "LEASE_REFUSED", "why-range": "INVALID_REFERENCE",
        "why-engine": "INVALID_REFERENCE", "why-timeout": "TIMEOUT",
    }
    p.bind(NixlConnectorMetadata(release_sends={"p-why"}))
    p.step()


def test_abort_while_waiting_for_claim_reports_finished_recving_and_frees_owner(pair):
    p, d = pair
    lease(p, "p-ab2", [19])
    d.bind(recv_meta("d-ab2", ref_to(p, "p-ab2", [19]), [29], [19]))
    d.bind(NixlConnectorMetadata(aborted_recvs={"d-ab2"}))
    acc = d.step_until(lambda a: "d-ab2" in a["finished_recving"])
    assert not acc["invalid_block_ids"]  # an aborted request's blocks are just freed
    p.step_until(lambda a: "p-ab2" in a["finished_sending"], timeout_s=10)


def test_unreachable_side_channel_fails_the_load(pair):
    _, d = pair
    dead = RemoteKVRef(RemoteEndpoint("nobody", "127.0.0.1", free_port()), "x", [0])
    d.bind(recv_meta("d-dead", dead, [30], [0]))
    acc = d.step_until(lambda a: "d-dead" in a["finished_recving"], timeout_s=15)
    assert acc["invalid_block_ids"] == {30}


def test_wrong_engine_id_fails_the_handshake(pair):
    p, d = pair
    lease(p, "p-wrong", [21])
    wrong = RemoteKVRef(RemoteEndpoint("not-" + p.engine_id, "127.0.0.1", p.port), "p-wrong", [21])
    d.bind(recv_meta("d-wrong", wrong, [31], [21]))
    acc = d.step_until(lambda a: "d-wrong" in a["finished_recving"])
    assert acc["invalid_block_ids"] == {31}
    p.bind(NixlConnectorMetadata(release_sends={"p-wrong"}))
    p.step()


def test_incompatible_geometry_fails_the_handshake_and_frees_owner_blocks(pair):
    _, d = pair
    other = PeerProcess(peer_config("kv_producer"), free_port(), dict(GEOMETRY, head_dim=16))
    try:
        assert other.hello.get("ok"), other.hello
        lease(other, "o-1", [2])
        d.bind(recv_meta("d-mismatch", ref_to(other, "o-1", [2]), [5], [2]))
        acc = d.step_until(lambda a: "d-mismatch" in a["finished_recving"])
        assert acc["invalid_block_ids"] == {5}
        # the abort reaches the owner over the side channel (its agent was never loaded)
        other.step_until(lambda a: "o-1" in a["finished_sending"], timeout_s=10)
    finally:
        other.shutdown()


def test_port_in_use_is_a_clear_startup_error(pair):
    p, _ = pair
    clash = PeerProcess(peer_config("kv_consumer"), p.port, GEOMETRY)
    try:
        assert "error" in clash.hello
        assert "already in use" in clash.hello["error"]
        assert str(p.port) in clash.hello["error"]
    finally:
        clash.kill()


def test_missing_backend_is_a_clear_startup_error():
    bad = PeerProcess(peer_config("kv_consumer", backends=["UCX", "NO_SUCH_BACKEND"]),
                      free_port(), GEOMETRY)
    try:
        assert "error" in bad.hello
        assert "NO_SUCH_BACKEND" in bad.hello["error"]
    finally:
        bad.kill()


@pytest.mark.gpu
def test_vram_read_between_processes_on_gpus():
    """KV caches registered as VRAM (P on GPU 0, D on GPU 1 when there are two)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    d_dev = "cuda:1" if torch.cuda.device_count() > 1 else "cuda:0"
    p = PeerProcess(peer_config("kv_producer"), free_port(), GEOMETRY, device="cuda:0")
    d = None
    try:
        assert p.hello.get("ok"), p.hello
        d = PeerProcess(peer_config("kv_consumer"), free_port(), GEOMETRY, zeros=True,
                        device=d_dev)
        assert d.hello.get("ok"), d.hello
        remote_ids, local_ids = [2, 3, 4, 5, 30], [7, 8, 9, 10, 1]
        lease(p, "gpu-1", remote_ids)
        d.bind(recv_meta("d-gpu-1", ref_to(p, "gpu-1", remote_ids), local_ids, remote_ids))
        acc = d.step_until(lambda a: "d-gpu-1" in a["finished_recving"])
        assert not acc["invalid_block_ids"]
        got = d.blocks(local_ids)
        for rid, block in zip(remote_ids, got):
            assert torch.equal(block, block_pattern(rid, block.numel()))
        assert [s for s in acc["stats"] if s["xfer_time_s"]][-1]["num_descriptors"] == [2]
        p.step_until(lambda a: "gpu-1" in a["finished_sending"], timeout_s=10)
    finally:
        if d is not None:
            d.shutdown()
        p.shutdown()
