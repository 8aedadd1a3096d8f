"""NIXL KV transfer between instances of different TP sizes, every rank its own process.

Each instance is a group of processes (``nixl_peer.TPGroup``): one gloo group per instance,
one NIXL worker side per rank with its shard of the KV heads, agents exchanged through
``TPRank.all_gather`` at registration, rank 0 hosting the side channel. The owners' caches hold
the global pattern ``nixl_peer.tp_pattern`` (each element encodes block, layer, K/V, global
head and token); the readers start from zeros. The test plays the one scheduler of each
instance, binding the same metadata on every rank. 2 KV heads, so TP 4 replicates them.
"""

from __future__ import annotations


import pytest
import torch

from tests.support.nixl_peer import TPGroup, tp_pattern
from tests.support.ports import free_port
from pdserve.kv_transfer.nixl.metadata import NixlConnectorMetadata, RecvSpec, SendSpec
from pdserve.types.remote_ref import RemoteEndpoint, RemoteKVRef
from pdserve.kv_transfer.nixl.tp_plan import descriptors_per_request, rank_heads

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

GEOMETRY = {"num_blocks": 24, "block_size": 4, "num_layers": 2, "total_num_kv_heads": 2,
            "head_dim": 8, "model": "tiny"}
SIZES = (1, 2, 4)
PAIRINGS = [(1, 1), (2, 1), (1, 2), (2, 2), (1, 4), (4, 1), (4, 2), (2, 4)]
REMOTE = [3, 4, 5, 9]  # owner blocks: a run of three and one alone
LOCAL = [10, 11, 12, 20]


def config(engine_id: str) -> dict:
    role = "kv_producer" if engine_id.startswith("p") else "kv_consumer"
    return {"kv_connector": "NixlConnector", "kv_role": role, "engine_id": engine_id,
            "kv_connector_extra_config": {"kv_handshake_timeout": 5.0,
                                          "nixl_progress_thread": False,
                                          "kv_metrics_log_interval": 60.0}}


@pytest.fixture(scope="module")
def groups():
    """Owners ("p<T>") and readers ("d<T>") of TP 1, 2 and 4, and an owner of another model
    shape ("p2-wide": 4 KV heads on TP 2)."""
    made: dict[str, TPGroup] = {}
    try:
        for t in SIZES:
            made[f"p{t}"] = TPGroup(config(f"p{t}"), free_port(), GEOMETRY, t)
            made[f"d{t}"] = TPGroup(config(f"d{t}"), free_port(), GEOMETRY, t, zeros=True)
        made["p2-wide"] = TPGroup(config("p2-wide"), free_port(),
                                  dict(GEOMETRY, total_num_kv_heads=4), 2)
        yield made
    finally:
        for group in made.values():
            group.shutdown()


def ref(owner: TPGroup, request_id: str) -> RemoteKVRef:
    return RemoteKVRef(RemoteEndpoint(owner.engine_id, "127.0.0.1", owner.port), request_id, REMOTE)


def reported_once(accs: list[dict], key: str, request_id: str) -> None:
    for rank, acc in enumerate(accs):
        assert acc["counts"].get((key, request_id)) == 1, (rank, key, acc["counts"])


@pytest.mark.parametrize("tp_p,tp_d", PAIRINGS)
def test_every_reader_rank_gets_its_head_slice_and_every_owner_rank_learns_it(groups, tp_p,
                                                                             tp_d):
    p, d = groups[f"p{tp_p}"], groups[f"d{tp_d}"]
    p_req, d_req = f"p-{tp_p}-{tp_d}", f"d-{tp_p}-{tp_d}"
    p.reset()
    d.reset()
    p.bind(NixlConnectorMetadata(reqs_to_send={p_req: SendSpec(p_req, REMOTE, 30.0)}))
    d.bind(NixlConnectorMetadata(reqs_to_recv={d_req: RecvSpec(
        d_req, ref(p, p_req), LOCAL, REMOTE, num_tokens=len(LOCAL) * 4)}))
    d_accs = d.step_until(lambda a: d_req in a["finished_recving"], others=(p,))
    reported_once(d_accs, "finished_recving", d_req)
    full = tp_pattern(GEOMETRY)
    for j, (rank, acc) in enumerate(zip(d.ranks, d_accs)):
        assert not acc["invalid_block_ids"] and not acc.get("load_errors"), acc
        heads = rank_heads(2, tp_d, j)
        got = rank.blocks(LOCAL)
        for rid, block in zip(REMOTE, got):
            want = full[rid][:, :, heads.start:heads.start + heads.count].reshape(-1)
            assert torch.equal(block, want), (j, rid)
        assert all(float(b.abs().sum()) == 0.0 for b in rank.blocks([13, 21]))
    # descriptors: merged runs for whole blocks, one per block x layer x K/V for a slice
    ndesc = sum(sum(s["num_descriptors"]) for acc in d_accs for s in acc["stats"])
    assert ndesc == descriptors_per_request(2, tp_p, tp_d, GEOMETRY["num_layers"], 3) + \
        descriptors_per_request(2, tp_p, tp_d, GEOMETRY["num_layers"], 1)
    # every owner rank frees its blocks exactly once, on the readers' notices (not by expiry)
    p_accs = p.step_until(lambda a: p_req in a["finished_sending"])
    for _ in range(3):
        p.step()  # nothing more comes
    for acc in p_accs:
        assert acc["last"]["num_leases"] == 0
        assert not any(s.get("num_kv_expired_reqs") for s in acc["stats"])
    reported_once(p_accs, "finished_sending", p_req)


def test_owner_of_another_head_count_is_refused_at_the_handshake(groups):
    """4 KV heads on TP 2 cannot be read by a TP-1 instance of 2 KV heads: the load fails
    with a message naming both sides, nothing is written, and every owner rank drops its lease
    (the reader's abort goes by the side channel, rank 0 forwards it)."""
    p, d = groups["p2-wide"], groups["d1"]
    p.reset()
    d.reset()
    p.bind(NixlConnectorMetadata(reqs_to_send={"p-wide": SendSpec("p-wide", REMOTE, 30.0)}))
    d.bind(NixlConnectorMetadata(reqs_to_recv={"d-wide": RecvSpec(
        "d-wide", ref(p, "p-wide"), [1, 2, 6, 7], REMOTE, num_tokens=16)}))
    (acc,) = d.step_until(lambda a: "d-wide" in a["finished_recving"], others=(p,))
    assert acc["invalid_block_ids"] == {1, 2, 6, 7}
    message = acc["load_errors"]["d-wide"]
    assert "engine p2-wide has TP 2 with 4 KV heads (2 per rank)" in message, message
    assert "engine d1 has TP 1 with 2 KV heads (2 per rank)" in message, message
    assert all(float(b.abs().sum()) == 0.0 for b in d.ranks[0].blocks([1, 2, 6, 7]))
    accs = p.step_until(lambda a: "p-wide" in a["finished_sending"])
    reported_once(accs, "finished_sending", "p-wide")


def test_owner_rank_0_keeps_the_lease_until_every_reader_rank_is_done(groups):
    """Owner rank 0 answers every reader rank's lease claim, so it frees its blocks only after
    the "done" of each reader rank (each notice says how many it waits for)."""
    p, d = groups["p1"], groups["d2"]
    p.reset()
    d.reset()
    p.bind(NixlConnectorMetadata(reqs_to_send={"p-slow": SendSpec("p-slow", REMOTE, 30.0)}))
    d.bind(NixlConnectorMetadata(reqs_to_recv={"d-slow": RecvSpec(
        "d-slow", ref(p, "p-slow"), LOCAL, REMOTE, num_tokens=16)}))
    first, second = d.ranks
    while "d-slow" not in first.step()["finished_recving"]:  # reader rank 1 is not stepped
        p.step()
    for _ in range(20):
        p.step()
    assert "p-slow" not in p.accs[0]["finished_sending"]
    assert p.accs[0]["last"]["num_leases"] == 1
    while "d-slow" not in second.step()["finished_recving"]:
        p.step()
    (acc,) = p.step_until(lambda a: "p-slow" in a["finished_sending"])
    reported_once([acc], "finished_sending", "p-slow")
