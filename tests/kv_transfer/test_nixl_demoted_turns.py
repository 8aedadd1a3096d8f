"""Two-process tests of a decoder's demoted turn lease (pdserve/engine/turn_demotion.py): the
owner's worker gives up the lease's blocks, a reader's claim waits until the owner names the
blocks that hold the KV again, and the reader READs those (real NIXL READs).

The owner and the reader are separate processes (``tests/support/nixl_peer.py``); the test plays
both scheduler sides by handing each worker its per-step metadata.
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

TOKENS = [21, 22, 23, 24, 25, 26, 27, 28, 29]  # two full blocks of 4 and one token
BIDIRECTIONAL = {"kv_handshake_timeout": 5.0, "bidirectional_kv_xfer": True}


@pytest.fixture(scope="module")
def pair():
    owner = PeerProcess(peer_config("kv_consumer", **BIDIRECTIONAL), free_port(), GEOMETRY)
    reader = None
    try:
        assert owner.hello.get("ok"), owner.hello
        reader = PeerProcess(peer_config("kv_producer", **BIDIRECTIONAL), free_port(), GEOMETRY,
                             zeros=True)
        assert reader.hello.get("ok"), reader.hello
        yield owner, reader
    finally:
        if reader is not None:
            reader.shutdown()
        owner.shutdown()


def demoted_turn(owner: PeerProcess, request_id: str, block_ids: list[int]) -> None:
    """Hold a turn's blocks under a TTL lease, then demote it (as D under pressure)."""
    owner.bind(NixlConnectorMetadata(reqs_to_send={request_id: SendSpec(
        request_id, block_ids, 30.0, renew_on_heartbeat=False,
        tokens=PackedTokens.of(list(TOKENS)))}))
    owner.bind(NixlConnectorMetadata(demote_turns={request_id}))
    assert owner.step()["demoted_turns"] == [request_id]


def pull(reader: PeerProcess, owner: PeerProcess, read_id: str, request_id: str,
         advertised: list[int], local: list[int], claim_wait_s: float = 0.0) -> None:
    ref = RemoteKVRef(RemoteEndpoint(owner.engine_id, "127.0.0.1", owner.port), request_id,
                      list(advertised), len(TOKENS) - 1)
    reader.bind(NixlConnectorMetadata(reqs_to_recv={read_id: RecvSpec(
        read_id, ref, local, list(advertised[:len(local)]), num_tokens=4 * len(local),
        digest_tokens=4 * len(local), token_digest=token_digest(TOKENS[:4 * len(local)]),
        claim_wait_s=claim_wait_s)}))


def wait_restore_wanted(owner: PeerProcess, reader: PeerProcess, request_id: str) -> None:
    deadline = time.monotonic() + 10
    while request_id not in owner.step()["turns_to_restore"]:
        assert request_id not in reader.step()["finished_recving"]  # the claim waits
        assert time.monotonic() < deadline
        time.sleep(0.01)


def test_a_claim_of_a_demoted_turn_waits_and_reads_the_blocks_it_was_restored_into(pair):
    owner, reader = pair
    demoted_turn(owner, "turn", [3, 4, 5])
    pull(reader, owner, "pull", "turn", [3, 4, 5], [10, 11])
    wait_restore_wanted(owner, reader, "turn")
    owner.bind(NixlConnectorMetadata(restored_turns={"turn": [8, 9]}))
    acc = reader.step_until(lambda a: "pull" in a["finished_recving"])
    assert not acc["invalid_block_ids"], acc
    for owner_block, block in zip([8, 9], reader.blocks([10, 11])):
        assert torch.equal(block, block_pattern(owner_block, block.numel()))
    # the reader's "done" names the blocks it read: the lease ends
    owner.step_until(lambda a: "turn" in a["finished_sending"], timeout_s=10)
    assert owner.step()["num_leases"] == 0


def test_a_demoted_turn_whose_blocks_are_lost_is_refused_and_the_lease_ends(pair):
    owner, reader = pair
    demoted_turn(owner, "gone", [6, 7, 12])
    pull(reader, owner, "pull-gone", "gone", [6, 7, 12], [14, 15])
    wait_restore_wanted(owner, reader, "gone")
    owner.bind(NixlConnectorMetadata(lost_turns={"gone"}))
    acc = reader.step_until(lambda a: "pull-gone" in a["finished_recving"])
    assert set(acc["invalid_block_ids"]) == {14, 15}
    assert acc["load_errors"]["pull-gone"] == "LEASE_REFUSED"
    assert float(sum(b.abs().sum() for b in reader.blocks([14, 15]))) == 0.0  # nothing read
    owner.step_until(lambda a: "gone" in a["finished_sending"], timeout_s=10)


def test_a_turn_restored_into_fewer_blocks_is_read_as_a_partial_load(pair):
    """Only the turn's first block came back: the pull READs it into its first block, leaves
    its second unread and reports a partial load of one block, not a failure."""
    owner, reader = pair
    demoted_turn(owner, "half", [16, 17, 18])
    pull(reader, owner, "pull-half", "half", [16, 17, 18], [20, 21])
    wait_restore_wanted(owner, reader, "half")
    owner.bind(NixlConnectorMetadata(restored_turns={"half": [9]}))
    acc = reader.step_until(lambda a: "pull-half" in a["finished_recving"])
    assert acc["partial_loads"] == {"pull-half": 1}
    assert not acc["invalid_block_ids"] and not acc["load_errors"], acc
    assert sum(s["num_failed_transfers"] for s in acc["stats"]) == 0
    assert sum(s["num_partial_transfers"] for s in acc["stats"]) == 1
    first, second = reader.blocks([20, 21])
    assert torch.equal(first, block_pattern(9, first.numel()))
    assert float(second.abs().sum()) == 0.0  # not read: the reader computes it
    # the "done" names the blocks the owner holds: the lease ends
    owner.step_until(lambda a: "half" in a["finished_sending"], timeout_s=10)


def test_a_pull_whose_claim_outwaits_its_bound_reads_nothing_and_ends_the_turn(pair):
    """The owner does not restore the turn within the pull's ``claim_wait_s``: the reader gives
    the pull up (a load of no block, no failure, nothing read) and its abort ends the lease."""
    owner, reader = pair
    demoted_turn(owner, "slow", [22, 23, 24])
    pull(reader, owner, "pull-slow", "slow", [22, 23, 24], [25, 26], claim_wait_s=0.3)
    t0 = time.monotonic()
    wait_restore_wanted(owner, reader, "slow")  # the claim waits for a restore that never comes
    acc = reader.step_until(lambda a: "pull-slow" in a["finished_recving"])
    assert time.monotonic() - t0 >= 0.3
    assert acc["partial_loads"] == {"pull-slow": 0}
    assert not acc["invalid_block_ids"] and not acc["load_errors"], acc
    assert sum(s["num_pulls_given_up"] for s in acc["stats"]) == 1
    assert sum(s["num_failed_transfers"] for s in acc["stats"]) == 0
    assert float(sum(b.abs().sum() for b in reader.blocks([25, 26]))) == 0.0  # nothing read
    owner.step_until(lambda a: "slow" in a["finished_sending"], timeout_s=10)
