"""Two-process tests of the concurrent hand-off's pending claims (docs/proxy.md): a reader that
names the router's transfer id, not the owner's request and blocks, over real NIXL READs.

The owner (P) and the reader (D) are separate processes (``tests/support/nixl_peer.py``); the
test plays both scheduler sides by handing each worker its per-step metadata.
"""

from __future__ import annotations

import time

import pytest
import torch

from pdserve.kv_transfer.nixl.metadata import NixlConnectorMetadata, RecvSpec, SendSpec
from pdserve.types.remote_ref import RemoteEndpoint, RemoteKVRef, token_digest
from pdserve.types.remote_ref import PackedTokens
from tests.support.nixl_peer import GEOMETRY, PeerProcess, block_pattern, peer_config
from tests.support.ports import free_port

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]

WAIT_S = 2.0  # D's kv_prefill_wait_timeout
TOKENS = [11, 12, 13, 14, 15, 16, 17, 18]  # two blocks of 4


@pytest.fixture(scope="module")
def pair():
    p = PeerProcess(peer_config("kv_producer"), free_port(), GEOMETRY)
    d = None
    try:
        assert p.hello.get("ok"), p.hello
        d = PeerProcess(peer_config("kv_consumer", kv_prefill_wait_timeout=WAIT_S), free_port(),
                        GEOMETRY, zeros=True)
        assert d.hello.get("ok"), d.hello
        yield p, d
    finally:
        if d is not None:
            d.shutdown()
        p.shutdown()


def pending_ref(p: PeerProcess, transfer_id: str) -> RemoteKVRef:
    return RemoteKVRef(RemoteEndpoint(p.engine_id, "127.0.0.1", p.port), "", [],
                       transfer_id=transfer_id)


def pending_load(d_req: str, ref: RemoteKVRef, local: list[int], tokens: list[int],
                 first_block: int = 0) -> NixlConnectorMetadata:
    return NixlConnectorMetadata(reqs_to_recv={d_req: RecvSpec(
        d_req, ref, local, [], num_tokens=4 * len(local), digest_tokens=len(tokens),
        token_digest=token_digest(tokens), starts_with_first_token=True,
        remote_first_block=first_block)})


def hold(p: PeerProcess, request_id: str, block_ids: list[int], transfer_id: str,
         first_token: int = 42) -> None:
    p.bind(NixlConnectorMetadata(reqs_to_send={request_id: SendSpec(
        request_id, block_ids, 30.0, tokens=PackedTokens.of(list(TOKENS)), first_token=first_token,
        transfer_id=transfer_id)}))


def test_a_pending_claim_waits_for_the_lease_and_reads_the_blocks_it_names(pair):
    """D claims before P holds anything; once P's lease with that transfer id starts, D learns
    P's blocks and first token from the answer, READs exactly those blocks, and P's lease ends
    by D's "done"."""
    p, d = pair
    d.bind(pending_load("d-pend", pending_ref(p, "t-pend"), [10, 11], TOKENS))
    for _ in range(5):  # P prefills meanwhile: D waits
        assert "d-pend" not in d.step()["finished_recving"]
        time.sleep(0.05)
    hold(p, "p-pend", [3, 4], "t-pend")
    p.step()
    acc = d.step_until(lambda a: "d-pend" in a["finished_recving"])
    assert not acc["invalid_block_ids"] and acc["first_tokens"] == {"d-pend": 42}
    got = d.blocks([10, 11])
    for rid, block in zip([3, 4], got):
        assert torch.equal(block, block_pattern(rid, block.numel()))
    p.step_until(lambda a: "p-pend" in a["finished_sending"], timeout_s=10)


def test_a_local_prefix_hit_reads_only_the_blocks_after_it(pair):
    """D's prefix cache holds the first block: the pending load reads P's second block only."""
    p, d = pair
    hold(p, "p-tail", [6, 7], "t-tail")
    p.step()
    d.bind(pending_load("d-tail", pending_ref(p, "t-tail"), [20], TOKENS, first_block=1))
    acc = d.step_until(lambda a: "d-tail" in a["finished_recving"])
    assert not acc["invalid_block_ids"]
    (block,) = d.blocks([20])
    assert torch.equal(block, block_pattern(7, block.numel()))
    assert float(d.blocks([21])[0].abs().sum()) == 0.0
    p.step_until(lambda a: "p-tail" in a["finished_sending"], timeout_s=10)


def test_a_pending_claim_for_other_tokens_is_refused_and_leaves_the_lease(pair):
    """A reader whose tokens differ from P's learns nothing and cannot end the lease."""
    p, d = pair
    hold(p, "p-other", [8, 9], "t-other")
    p.step()
    d.bind(pending_load("d-other", pending_ref(p, "t-other"), [12, 13], TOKENS[:-1] + [99]))
    acc = d.step_until(lambda a: "d-other" in a["finished_recving"])
    assert acc["load_errors"] == {"d-other": "LEASE_REFUSED"}
    assert acc["invalid_block_ids"] == {12, 13}
    assert "p-other" not in p.step()["finished_sending"]
    p.bind(NixlConnectorMetadata(release_sends={"p-other"}))
    assert "p-other" in p.step()["finished_sending"]


def test_a_reader_that_gives_up_before_the_lease_ends_it_when_it_starts(pair):
    """D's request ends while P still prefills: D's abort by transfer id is remembered, and
    P's lease closes the moment it starts (no blocks held for the lease duration)."""
    p, d = pair
    d.bind(pending_load("d-gone", pending_ref(p, "t-gone"), [14, 15], TOKENS))
    d.step()
    d.bind(NixlConnectorMetadata(aborted_recvs={"d-gone"}))
    acc = d.step_until(lambda a: "d-gone" in a["finished_recving"])
    assert not acc["invalid_block_ids"]  # an aborted request's blocks are just freed
    for _ in range(20):  # the abort travels by side channel in the background
        d.step()
        time.sleep(0.05)
    hold(p, "p-gone", [16, 17], "t-gone")
    acc = p.step_until(lambda a: "p-gone" in a["finished_sending"], timeout_s=5)
    assert "p-gone" in acc["finished_sending"]


def test_a_pending_claim_gives_up_after_the_readers_wait(pair):
    """No lease for the transfer id within ``kv_prefill_wait_timeout``: the load fails."""
    _, d = pair
    d.bind(pending_load("d-late", pending_ref(pair[0], "t-never"), [18], TOKENS[:4]))
    t0 = time.monotonic()
    acc = d.step_until(lambda a: "d-late" in a["finished_recving"], timeout_s=WAIT_S + 15)
    assert acc["load_errors"] == {"d-late": "LEASE_REFUSED"}
    assert time.monotonic() - t0 >= WAIT_S - 0.5
