"""One reader per lease over real NIXL READs (pdserve/kv_transfer/nixl/readers.py): an owner (P)
and two reader instances (D1, D2) in their own processes (``tests/support/nixl_peer.py``); the
test plays the scheduler sides by handing each worker its per-step metadata.

P applies a reader's "done" only when its engine loop steps, so a test that does not step P
holds the moment between the first reader's READ and P freeing the blocks: the moment a second
reader of the same params (``kv_transfer_params`` replayed to another decoder) used to be
granted its claim and READ blocks P was about to give to another request.
"""

from __future__ import annotations

import time

import pytest
import torch

from pdserve.kv_transfer.nixl.metadata import (
    NixlConnectorMetadata, RecvSpec, RemoteNotice, SendSpec,
)
from pdserve.kv_transfer.nixl.side_channel import side_channel_request
from pdserve.types.remote_ref import RemoteEndpoint, RemoteKVRef, token_digest
from pdserve.types.remote_ref import PackedTokens
from tests.support.nixl_peer import GEOMETRY, PeerProcess, block_pattern, peer_config
from tests.support.ports import free_port

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]

TOKENS = [11, 12, 13, 14, 15, 16, 17, 18]  # two blocks of 4


@pytest.fixture(scope="module")
def peers():
    started: list[PeerProcess] = []
    try:
        p = PeerProcess(peer_config("kv_producer"), free_port(), GEOMETRY)
        started.append(p)
        assert p.hello.get("ok"), p.hello
        for _ in range(2):
            d = PeerProcess(peer_config("kv_consumer", kv_prefill_wait_timeout=5.0),
                            free_port(), GEOMETRY, zeros=True)
            started.append(d)
            assert d.hello.get("ok"), d.hello
        yield tuple(started)
    finally:
        for peer in reversed(started):
            peer.shutdown()


def ref_to(p: PeerProcess, request_id: str = "", block_ids: list[int] | None = None,
           transfer_id: str | None = None) -> RemoteKVRef:
    return RemoteKVRef(RemoteEndpoint(p.engine_id, "127.0.0.1", p.port), request_id,
                       list(block_ids or []), transfer_id=transfer_id)


def hold(p: PeerProcess, request_id: str, block_ids: list[int],
         transfer_id: str | None = None) -> None:
    p.bind(NixlConnectorMetadata(reqs_to_send={request_id: SendSpec(
        request_id, block_ids, 30.0, tokens=PackedTokens.of(list(TOKENS)), first_token=42,
        transfer_id=transfer_id)}))
    assert request_id not in p.step()["finished_sending"]


def load(d_req: str, ref: RemoteKVRef, local: list[int]) -> NixlConnectorMetadata:
    remote = [] if ref.pending else list(ref.block_ids)
    return NixlConnectorMetadata(reqs_to_recv={d_req: RecvSpec(
        d_req, ref, local, remote, num_tokens=4 * len(local), digest_tokens=len(TOKENS),
        token_digest=token_digest(TOKENS), starts_with_first_token=True)})


def assert_read(d: PeerProcess, local: list[int], remote: list[int]) -> None:
    for rid, block in zip(remote, d.blocks(local)):
        assert torch.equal(block, block_pattern(rid, block.numel()))


def test_a_second_decoder_given_the_same_params_is_refused_before_p_frees_the_blocks(peers):
    """D1 reads P's blocks; before P applied D1's "done" (P does not step), D2 gets the same
    params: its claim is refused (LEASE_REFUSED: it recomputes or fails) and it reads nothing.
    P's lease then ends by D1's "done" alone."""
    p, d1, d2 = peers
    hold(p, "p-twice", [3, 4])
    d1.bind(load("d1-read", ref_to(p, "p-twice", [3, 4]), [10, 11]))
    acc = d1.step_until(lambda a: "d1-read" in a["finished_recving"])
    assert not acc["load_errors"] and acc["first_tokens"] == {"d1-read": 42}
    assert_read(d1, [10, 11], [3, 4])
    before = d2.blocks([12, 13])
    d2.bind(load("d2-read", ref_to(p, "p-twice", [3, 4]), [12, 13]))
    acc = d2.step_until(lambda a: "d2-read" in a["finished_recving"])
    assert acc["load_errors"] == {"d2-read": "LEASE_REFUSED"}
    assert "leased to another reader" in acc["last"]["load_error_details"]["d2-read"]
    assert acc["invalid_block_ids"] == {12, 13} and not acc["first_tokens"]
    assert all(torch.equal(a, b) for a, b in zip(before, d2.blocks([12, 13])))
    p.step_until(lambda a: "p-twice" in a["finished_sending"], timeout_s=10)


def test_two_decoders_waiting_on_one_transfer_id_get_one_lease(peers):
    """The concurrent hand-off's pending params replayed: D1's and D2's pending claims wait on
    one transfer id; the lease is bound to the one granted first, the other learns no blocks."""
    p, d1, d2 = peers
    for d, d_req, local in ((d1, "d1-pend", [14, 15]), (d2, "d2-pend", [14, 15])):
        d.bind(load(d_req, ref_to(p, transfer_id="t-twice"), local))
        d.step()
    hold(p, "p-pend", [5, 6], transfer_id="t-twice")
    acc1 = d1.step_until(lambda a: "d1-pend" in a["finished_recving"])
    acc2 = d2.step_until(lambda a: "d2-pend" in a["finished_recving"])
    outcomes = sorted([acc1["load_errors"].get("d1-pend"), acc2["load_errors"].get("d2-pend")],
                      key=str)
    assert outcomes == ["LEASE_REFUSED", None], (acc1, acc2)
    winner = d1 if not acc1["load_errors"] else d2
    assert_read(winner, [14, 15], [5, 6])
    p.step_until(lambda a: "p-pend" in a["finished_sending"], timeout_s=10)


def test_another_readers_abort_leaves_a_claimed_lease(peers):
    """A reader claimed P's lease (its READ may be under way); another reader's request with
    the same params ends before its claim and sends "abort": P keeps the blocks. The claiming
    reader's own "done" ends the lease."""
    p, _, d2 = peers
    hold(p, "p-abort", [7, 8])
    first = "other-instance/req-9"
    answer = side_channel_request("127.0.0.1", p.port, {
        "type": "claim", "request_id": "p-abort", "block_ids": [7, 8],
        "num_tokens": len(TOKENS), "token_digest": token_digest(TOKENS), "reader": first}, 10.0)
    assert answer["ok"], answer
    d2.bind(NixlConnectorMetadata(notices=[RemoteNotice(ref_to(p, "p-abort", [7, 8]), "abort",
                                                         reader_request="d2-gone")]))
    for _ in range(20):  # the abort travels by NIXL notification or side channel
        d2.step()
        assert "p-abort" not in p.step()["finished_sending"]
        time.sleep(0.05)
    assert side_channel_request("127.0.0.1", p.port, {
        "type": "notify", "kind": "done", "request_id": "p-abort", "block_ids": [7, 8],
        "reader": first}, 10.0)["ok"]
    p.step_until(lambda a: "p-abort" in a["finished_sending"], timeout_s=10)
