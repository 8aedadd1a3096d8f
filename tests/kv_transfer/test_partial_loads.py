"""A pull whose claim answer names fewer blocks than planned (a decoder's turn restored with only
its leading blocks): the reader's :class:`~pdserve.kv_transfer.nixl.loads.LoadTracker` reads the
blocks the owner holds and reports a partial load, not a failure (the NIXL READ, the direct
same-host copy and host-buffer mode); a load none of whose blocks came back, or a pending
reference answered with fewer blocks, still fails. Fakes stand for the agent, the remote and the
side channel."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest

from pdserve.kv_transfer.nixl.loads import LoadTracker
from pdserve.kv_transfer.nixl.metadata import RecvSpec
from pdserve.kv_transfer.nixl.stats import StatsRecorder
from pdserve.types.kv_transfer_config import KVTransferConfig
from pdserve.types.outputs import KVConnectorOutput, KVLoadFailure
from pdserve.types.remote_ref import RemoteEndpoint, RemoteKVRef

EP = RemoteEndpoint("d-engine", "127.0.0.1", 5601)
ADVERTISED = [100, 101, 102, 103, 104]  # the turn's blocks as D's params named them
TURN = RemoteKVRef(EP, "d-req", ADVERTISED, num_tokens=80)


class Client:
    """The side-channel client: every claim is answered with ``reply`` at once."""

    def __init__(self, reply: dict):
        self.reply = reply
        self.sent: list[dict] = []

    def send(self, host, port, message, timeout_s):
        self.sent.append(message)
        return len(self.sent)

    def result(self, ticket):
        return self.reply

    def cancel(self, ticket):
        pass


class Direct:
    """A same-host direct peer: every read ends in ``state`` when posted, and is recorded as
    ``(local, remote)`` block lists."""

    num_blocks = 1000
    block_bytes = 64

    def __init__(self, state: str = "DONE"):
        self.reads: list[tuple[list[int], list[int]]] = []
        self.state = state

    def post_read(self, local, remote):
        self.reads.append((list(local), list(remote)))
        return len(self.reads), self.state

    def check(self, handle):
        return self.state

    def telemetry(self, handle):
        return None

    def release(self, handle):
        pass


class Agent(Direct):
    """The local NIXL agent (and the owner's agent: its block count): READs as a direct peer's
    copies."""

    def post_read(self, owner, local, remote, notif):
        return super().post_read(local, remote)


class Mirror:
    """Host-buffer mode's host mirror: copies to the GPU finish at once."""

    def __init__(self):
        self.to_gpu: list[list[int]] = []

    def to_device(self, block_ids):
        self.to_gpu.append(list(block_ids))
        return SimpleNamespace(event=None)


def tracker(reply: dict, path: str = "nixl", state: str = "DONE"):
    """A LoadTracker over ``path`` (``nixl``, ``direct`` or ``host_buffer``) whose claims are
    answered with ``reply``; returns it with its output, agent, direct peer, mirror and
    stats."""
    agent, direct = Agent(state), Direct(state)
    mirror = Mirror() if path == "host_buffer" else None
    route = SimpleNamespace(reads=[SimpleNamespace(src_rank=0)], expected={0: 1}, targets=(0,),
                            whole=lambda read: True)
    remote = SimpleNamespace(agent=agent, agents={0: agent}, instance_id=None, route=route,
                             direct=direct if path == "direct" else None, endpoint=EP)
    remotes = SimpleNamespace(ensure=lambda ep: remote, get=lambda ep: remote,
                              forget=lambda ep, why: None)
    config = KVTransferConfig.from_dict({"kv_connector": "NixlConnector",
                                         "kv_role": "kv_producer",
                                         "kv_connector_extra_config": {
                                             "bidirectional_kv_xfer": True}})
    out, stats = KVConnectorOutput(), StatsRecorder(0.0)
    loads = LoadTracker(config, agent, remotes, Client(reply), stats, lambda: out,
                        lambda notice: None, mirror=lambda: mirror)
    return loads, out, agent, direct, mirror, stats


def pull(ref: RemoteKVRef = TURN, first: int = 1) -> RecvSpec:
    """P's pull of D's turn: P's own hit is ``first`` blocks; it loads blocks first..3 of the
    turn (tokens 4*first .. 63 of a prompt whose first 64 tokens match) into 30, 31, ..."""
    local = [30 + i for i in range(4 - first)]
    return RecvSpec("p1", ref, local, list(ref.block_ids[first:4]) if ref.block_ids else [],
                    num_tokens=16 * len(local), min_lease_left_s=5.0, digest_tokens=64,
                    token_digest="digest", remote_first_block=first)


def restored(block_ids: list[int]) -> dict:
    """D's answer to the claim of a demoted turn restored into ``block_ids``."""
    return {"ok": True, "lease_expiry_in": 60.0, "block_ids": block_ids}


@pytest.mark.parametrize("path", ["nixl", "direct", "host_buffer"])
def test_a_restore_with_fewer_blocks_reads_the_leading_ones_as_a_partial_load(path):
    # D kept the turn's first three blocks (now 7, 8, 9); P planned turn blocks 1..3
    loads, out, agent, direct, mirror, stats = tracker(restored([7, 8, 9]), path)
    loads.add("p1", pull())
    loads.progress(time.monotonic())
    loads.poll(time.monotonic())
    mover = direct if path == "direct" else agent
    assert mover.reads == [([30, 31], [8, 9])]  # the two blocks D holds, into the first two
    if path == "host_buffer":
        assert mirror.to_gpu == [[30, 31]]
    assert out.finished_recving == {"p1"} and out.partial_loads == {"p1": 2}
    assert not out.invalid_block_ids and not out.load_errors
    delta = stats.take_delta()
    assert delta["num_failed_transfers"] == 0 and delta["num_partial_transfers"] == 1
    assert delta["bytes"] == [2 * 64]


def test_a_restore_with_all_the_planned_blocks_is_a_whole_load():
    loads, out, agent, _, _, stats = tracker(restored([7, 8, 9, 10, 11]))
    loads.add("p1", pull())
    loads.progress(time.monotonic())
    assert agent.reads == [([30, 31, 32], [8, 9, 10])]
    assert out.finished_recving == {"p1"} and not out.partial_loads and not out.invalid_block_ids
    assert stats.take_delta()["num_partial_transfers"] == 0


def test_a_restore_with_none_of_the_planned_blocks_fails_the_load():
    # only the turn's first block came back: P's own hit already covers it
    loads, out, agent, _, _, stats = tracker(restored([7]))
    loads.add("p1", pull())
    loads.progress(time.monotonic())
    assert agent.reads == [] and not out.partial_loads
    assert out.invalid_block_ids == {30, 31, 32}
    # the owner gave the turn up: its lease is refused, the reference was valid
    assert out.load_errors["p1"].reason is KVLoadFailure.LEASE_REFUSED
    assert ("holds 1 of the turn's blocks now, none past the 1 this instance has; the prompt "
            "needs 4") in out.load_errors["p1"].detail
    assert stats.take_delta()["num_failed_transfers"] == 1


def test_a_pending_reference_answered_with_fewer_blocks_still_fails():
    """A prefiller's prompt lease holds the whole prompt: fewer blocks are no partial load."""
    pending = RemoteKVRef(EP, "", [], num_tokens=80, transfer_id="t1")
    reply = dict(restored([7, 8]), request_id="p-req")
    loads, out, agent, _, _, _ = tracker(reply)
    loads.add("p1", pull(pending, first=0))
    loads.progress(time.monotonic())
    assert agent.reads == [] and not out.partial_loads
    assert out.invalid_block_ids == {30, 31, 32, 33}
    assert out.load_errors["p1"].reason is KVLoadFailure.INVALID_REFERENCE


def test_a_partial_load_whose_read_fails_reports_every_planned_block_invalid():
    loads, out, agent, _, _, stats = tracker(restored([7, 8]), state="ERR")
    loads.add("p1", pull())
    loads.progress(time.monotonic())
    assert agent.reads == [([30], [8])]
    assert not out.partial_loads and out.invalid_block_ids == {30, 31, 32}
    assert out.load_errors["p1"].reason is KVLoadFailure.TRANSPORT
    delta = stats.take_delta()
    assert delta["num_failed_transfers"] == 1 and delta["num_partial_transfers"] == 0
