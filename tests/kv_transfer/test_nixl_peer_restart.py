"""A KV owner that restarts (killed or terminated, same or new engine id, same side-channel
port) must not break the instances that read from it: the reader notices the new instance
(its claim answer names another agent instance, or the transport fails) and handshakes afresh.

Both directions use the same worker code: a prefiller restarted under its decoders, and a
decoder restarted under a prefiller that pulls a previous turn's KV from it (bidirectional).
"""

from __future__ import annotations

import signal
import uuid

import pytest
import torch

from tests.support.nixl_peer import GEOMETRY, PeerProcess, block_pattern, peer_config
from tests.support.ports import free_port
from tests.kv_transfer.test_nixl_worker_processes import lease, recv_meta, ref_to

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

ROLES = {  # restarted owner's role -> (owner config role, reader config role)
    "prefiller": ("kv_producer", "kv_consumer"),
    "decoder": ("kv_consumer", "kv_producer"),
}


def _owner(role: str, port: int, engine_id: str | None) -> PeerProcess:
    cfg = peer_config(ROLES[role][0], bidirectional_kv_xfer=True)
    if engine_id:
        cfg["engine_id"] = engine_id
    peer = PeerProcess(cfg, port, GEOMETRY)
    assert peer.hello.get("ok"), peer.hello
    return peer


def _read(owner: PeerProcess, reader: PeerProcess, tag: str) -> dict:
    remote_ids, local_ids = [3, 4], [10 + len(tag) % 5, 20]
    lease(owner, f"o-{tag}", remote_ids)
    reader.bind(recv_meta(f"r-{tag}", ref_to(owner, f"o-{tag}", remote_ids), local_ids,
                          remote_ids))
    acc = reader.step_until(lambda a: f"r-{tag}" in a["finished_recving"], timeout_s=30)
    if not acc["invalid_block_ids"]:
        got = reader.blocks(local_ids)
        for rid, block in zip(remote_ids, got):
            assert torch.equal(block, block_pattern(rid, block.numel()))
    return acc


@pytest.mark.parametrize("role", ["prefiller", "decoder"])
@pytest.mark.parametrize("fixed_engine_id", [True, False], ids=["fixed-id", "new-id"])
def test_reads_succeed_after_the_owner_restarts(role, fixed_engine_id):
    """The owner is killed (SIGKILL), restarted, terminated (SIGTERM), restarted: every read
    after each restart succeeds and moves the right blocks."""
    engine_id = f"owner-{uuid.uuid4().hex[:8]}" if fixed_engine_id else None
    port = free_port()
    reader = PeerProcess(peer_config(ROLES[role][1], bidirectional_kv_xfer=True), free_port(),
                         GEOMETRY, zeros=True)
    owner = None
    try:
        assert reader.hello.get("ok"), reader.hello
        owner = _owner(role, port, engine_id)
        first = _read(owner, reader, "before")
        assert not first["invalid_block_ids"]
        for sig in (signal.SIGKILL, signal.SIGTERM):
            owner.kill(sig)
            owner = _owner(role, port, engine_id)
            if fixed_engine_id:
                assert owner.engine_id == engine_id
            for n in range(2):  # no request after the restart may fail
                acc = _read(owner, reader, f"{sig.name}-{n}")
                assert not acc["invalid_block_ids"], acc
                assert any(s["xfer_time_s"] for s in acc["stats"])
            # the reads' notifications reached the new owner: its leases end at once
            owner.step_until(lambda a: a["last"]["num_leases"] == 0, timeout_s=10)
    finally:
        if owner is not None:
            owner.shutdown()
        reader.shutdown()
