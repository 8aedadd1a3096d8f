"""Host-buffer mode (``kv_buffer_device: "cpu"`` with a CUDA KV cache) on CPU: the mirror's
copies, its shared memory file, and two workers moving KV through their mirrors, by NIXL
READs and by the same-host copy from the owner's shared mirror (the mode forced on CPU
caches)."""

from __future__ import annotations

import os
import time

import pytest
import torch

from tests.support.ports import free_port
from pdserve.kv_transfer.nixl import host_buffer, shared_host
from pdserve.kv_transfer.nixl.host_buffer import HostMirror, block_spans

pytestmark = pytest.mark.timeout(120)


def test_wanted_only_for_cpu_buffer_with_cuda_cache():
    assert host_buffer.wanted("cpu", "cuda")
    assert not host_buffer.wanted("cpu", "cpu")
    assert not host_buffer.wanted("auto", "cuda")
    assert not host_buffer.wanted("cuda", "cuda")


def test_block_spans():
    assert block_spans([]) == []
    assert block_spans([3, 4, 5, 9, 1, 2]) == [(3, 3), (9, 1), (1, 2)]


def test_mirror_stages_and_unstages_blocks():
    cache = torch.arange(8 * 6, dtype=torch.float32).view(8, 2, 3)
    mirror = HostMirror(cache)
    mirror.stage("r1", [1, 2, 6], "args")
    assert mirror.pending()
    assert mirror.take_staged() == [("r1", ("args",))] and not mirror.pending()
    for b in (1, 2, 6):
        assert torch.equal(mirror.host[b], cache[b])
    mirror.host[4].fill_(-1.0)
    assert HostMirror.done(mirror.to_device([4]))
    assert float(cache[4].sum()) == -6.0
    mirror.stage("r2", [0], "x")
    assert mirror.cancel("r2") and not mirror.cancel("r2") and mirror.take_staged() == []


def _worker(role, kv, monkeypatch, transport="auto"):
    from pdserve.kv_transfer.base import KVCacheSpec
    from pdserve.types.kv_transfer_config import KVTransferConfig
    from pdserve.kv_transfer.factory import create_connector

    monkeypatch.setenv("PDSERVE_NIXL_SIDE_CHANNEL_HOST", "127.0.0.1")
    monkeypatch.setenv("PDSERVE_NIXL_SIDE_CHANNEL_PORT", str(free_port()))
    cfg = KVTransferConfig.from_dict({
        "kv_role": role, "kv_buffer_device": "cpu",
        "kv_connector_extra_config": {"kv_handshake_timeout": 5.0,
                                      "same_host_transport": transport,
                                      "kv_metrics_log_interval": 1e6}})
    worker = create_connector(cfg, "worker")
    n, layers, _, heads, bs, dim = kv.shape
    worker.register_kv_cache(kv, KVCacheSpec(
        num_blocks=n, block_size=bs, num_layers=layers, num_kv_heads=heads, head_dim=dim,
        dtype="float32", element_size=4, model_name="tiny"))
    return worker, cfg.engine_id


@pytest.mark.parametrize("transport, path", [("nixl", "nixl"), ("auto", "shared_host")])
def test_workers_move_kv_through_their_host_mirrors(monkeypatch, transport, path):
    """The owner leases a request's blocks once they are in its mirror; with ``nixl`` NIXL
    reads mirror to mirror and the reader's load finishes after the copy into its cache, with
    ``auto`` the reader copies the owner's shared mirror straight into its cache (its own
    mirror untouched); the owner's lease ends by the read's notification; a lease released
    while staging ends at once."""
    from pdserve.kv_transfer.nixl.metadata import NixlConnectorMetadata, RecvSpec, SendSpec
    from pdserve.types.remote_ref import RemoteEndpoint, RemoteKVRef

    monkeypatch.setattr(host_buffer, "wanted", lambda buffer_device, cache_device: True)
    shape = (16, 2, 2, 2, 4, 8)
    owner_kv = torch.arange(torch.tensor(shape).prod().item(), dtype=torch.float32).view(shape)
    reader_kv = torch.zeros(shape)
    owner, owner_id = _worker("kv_producer", owner_kv, monkeypatch, transport)
    reader, _ = _worker("kv_consumer", reader_kv, monkeypatch, transport)
    try:
        assert owner.agent.base_addr == owner._mirror.host.data_ptr()  # NIXL moves the mirror
        assert reader.agent.base_addr == reader._mirror.host.data_ptr()
        remote_ids, local_ids = [3, 4, 5, 9], [10, 11, 12, 1]
        owner.bind_connector_metadata(NixlConnectorMetadata(
            reqs_to_send={"p-1": SendSpec("p-1", remote_ids, 30.0),
                          "p-2": SendSpec("p-2", [7], 30.0)},
            release_sends=["p-2"]))
        assert "p-1" not in owner.leases  # not before the copy to the mirror is seen done
        first = owner.get_finished(set())
        assert "p-1" in owner.leases and "p-2" not in owner.leases
        assert first.finished_sending == {"p-2"}
        ref = RemoteKVRef(RemoteEndpoint(owner_id, "127.0.0.1", owner.side_channel_port),
                          "p-1", remote_ids)
        reader.bind_connector_metadata(NixlConnectorMetadata(reqs_to_recv={
            "d-1": RecvSpec("d-1", ref, local_ids, remote_ids, num_tokens=16)}))
        recv, sent, paths = set(), set(), {}
        deadline = time.monotonic() + 20
        while not ("d-1" in recv and "p-1" in sent):
            assert time.monotonic() < deadline, (recv, sent)
            reader.start_load_kv()
            out = reader.get_finished(set())
            recv |= out.finished_recving
            assert not out.invalid_block_ids
            paths.update((out.stats or {}).get("transfer_paths") or {})
            sent |= owner.get_finished(set()).finished_sending
            time.sleep(0.002)
        assert paths[owner_id]["transport"] == path
        for lid, rid in zip(local_ids, remote_ids):
            assert torch.equal(reader_kv[lid], owner_kv[rid])
            # the NIXL READ lands in the reader's mirror; the shared path bypasses it
            assert torch.equal(reader._mirror.host[lid], owner_kv[rid]) == (path == "nixl")
        assert float(reader_kv[[0, 2, 13]].abs().sum()) == 0.0
        assert len(owner.leases) == 0
    finally:
        reader.shutdown()
        owner.shutdown()


@pytest.mark.slow
@pytest.mark.gpu
@pytest.mark.parametrize("transport, path", [
    ("auto", {"transport": "shared_host", "mem": "DRAM->VRAM"}),
    ("nixl", {"transport": "nixl", "mem": "DRAM->DRAM"})])
def test_host_buffer_mode_between_two_processes_on_one_gpu(transport, path):
    """P and D as two processes on cuda:0 with ``kv_buffer_device: "cpu"``: D copies P's shared
    host mirror into its GPU cache (``auto``) or NIXL reads host memory mirror to mirror
    (``nixl``); the blocks land in D's GPU cache, P's lease ends."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from tests.support.nixl_peer import PeerProcess, block_pattern

    from pdserve.kv_transfer.nixl.metadata import NixlConnectorMetadata, RecvSpec, SendSpec
    from pdserve.types.remote_ref import RemoteEndpoint, RemoteKVRef

    geometry = {"num_blocks": 128, "block_size": 4, "num_layers": 2, "num_kv_heads": 2,
                "head_dim": 8, "model": "tiny"}

    def config(role):
        return {"kv_connector": "NixlConnector", "kv_role": role, "kv_buffer_device": "cpu",
                "kv_connector_extra_config": {"kv_handshake_timeout": 5.0,
                                              "same_host_transport": transport}}

    p = PeerProcess(config("kv_producer"), free_port(), geometry, device="cuda:0")
    d = None
    try:
        assert p.hello.get("ok"), p.hello
        d = PeerProcess(config("kv_consumer"), free_port(), geometry, zeros=True,
                        device="cuda:0")
        assert d.hello.get("ok"), d.hello
        g = torch.Generator().manual_seed(2)
        remote_ids = torch.randperm(128, generator=g)[:40].tolist()
        local_ids = torch.randperm(128, generator=g)[:40].tolist()
        p.bind(NixlConnectorMetadata(reqs_to_send={"h1": SendSpec("h1", remote_ids, 30.0)}))
        ref = RemoteKVRef(RemoteEndpoint(p.engine_id, "127.0.0.1", p.port), "h1", remote_ids)
        d.bind(NixlConnectorMetadata(reqs_to_recv={"dh1": RecvSpec(
            "dh1", ref, local_ids, remote_ids, num_tokens=4 * len(local_ids))}))
        deadline = time.monotonic() + 30
        acc = None
        while True:  # P steps too: its lease starts once the blocks are in its mirror
            p.step()
            acc = d.step_until(lambda a: True, acc=acc)
            if "dh1" in acc["finished_recving"]:
                break
            assert time.monotonic() < deadline, acc
        stats = acc["stats"]
        assert not acc["invalid_block_ids"]
        for rid, block in zip(remote_ids, d.blocks(local_ids)):
            assert torch.equal(block, block_pattern(rid, block.numel()))
        paths = [s["transfer_paths"] for s in stats if "transfer_paths" in s]
        assert paths and {k: paths[0][p.engine_id][k] for k in path} == path
        p.step_until(lambda a: "h1" in a["finished_sending"], timeout_s=10)
    finally:
        if d is not None:
            d.shutdown()
        p.shutdown()


@pytest.mark.skipif(not shared_host.supported(), reason="needs memfd_create and /proc")
def test_shared_mirror_is_mapped_through_proc():
    """The owner's mirror lives in a memory file that a reader maps through
    ``/proc/<pid>/fd/<fd>`` (a second mapping of the same pages, as another process gets):
    bytes written by the owner are read by the reader's copy, the export survives its wire
    form, a wrong size or geometry is refused, and closing the owner's file ends it."""
    cache = torch.zeros(6, 2, 3)
    mirror = HostMirror(cache)
    export = mirror.export()
    assert export is not None and export.pid == os.getpid()
    assert shared_host.MirrorExport.from_wire(export.to_wire()) == export
    src = torch.arange(36, dtype=torch.float32).view(6, 2, 3)
    mirror.host.copy_(src)
    local = torch.full((4, 2, 3), -1.0)
    peer = shared_host.open_mirror(export, local)
    assert peer.remote.data_ptr() != mirror.host.data_ptr()  # its own mapping
    handle, state = peer.post_read([0, 1, 3], [5, 4, 0])
    assert state == "DONE"
    assert torch.equal(local[0], src[5]) and torch.equal(local[1], src[4])
    assert torch.equal(local[3], src[0]) and float(local[2].sum()) == -6.0
    mirror.host[2].fill_(7.0)  # shared pages: the reader's mapping sees later writes
    peer.post_read([2], [2])
    assert float(local[2].sum()) == 42.0
    peer.close()
    with pytest.raises(ValueError, match="does not match"):
        shared_host.open_mirror(export, torch.zeros(4, 3, 2))
    with pytest.raises(OSError, match="bytes"):
        shared_host.open_mirror(
            shared_host.MirrorExport(export.pid, export.fd, export.nbytes + 4, export.shape,
                                     export.dtype), cache)
    for bad in ({**export.to_wire(), "fd": -1}, {**export.to_wire(), "dtype": "os"},
                {**export.to_wire(), "shape": "x"}, None):
        with pytest.raises(ValueError):
            shared_host.MirrorExport.from_wire(bad)
    mirror.close()
    with pytest.raises(OSError):  # the owner closed its file: nothing left to map
        shared_host.open_mirror(export, cache)
