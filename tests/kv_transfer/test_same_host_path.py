"""The same-GPU read path on CPU: path selection, the block gather/scatter, the handshake
fields, the path monitor, and the worker's hooks end to end (the CUDA IPC peer stood in for by
the owner's CPU tensor; the GPU form runs in test_nixl_worker_processes.py on a GPU)."""

from __future__ import annotations

import logging
import os
import socket
import time

import pytest
import torch

from tests.support.ports import free_port
from pdserve.kv_transfer.nixl import same_host
from pdserve.kv_transfer.nixl.cuda_ipc import IpcExport
from pdserve.kv_transfer.nixl.direct_read import MAX_RUN_COPIES, DirectPeer, copy_blocks
from pdserve.kv_transfer.nixl.same_host import handshake_fields, remote_facts
from pdserve.kv_transfer.nixl.transfer_path import (
    PROBE_MIN_BYTES,
    PeerFacts,
    ReadPath,
    SameHostTransport,
    TransferPaths,
    choose_read_path,
)

pytestmark = pytest.mark.timeout(120)

GPU = PeerFacts("host|boot", 100, "GPU-a", True)


@pytest.mark.parametrize("setting, remote, path", [
    (SameHostTransport.AUTO, PeerFacts("host|boot", 200, "GPU-a", True), ReadPath.CUDA_IPC),
    (SameHostTransport.CUDA_IPC, PeerFacts("host|boot", 200, "GPU-a", True), ReadPath.CUDA_IPC),
    (SameHostTransport.NIXL, PeerFacts("host|boot", 200, "GPU-a", True), ReadPath.NIXL),
    (SameHostTransport.AUTO, PeerFacts("other|boot", 200, "GPU-a", True), ReadPath.NIXL),
    (SameHostTransport.AUTO, PeerFacts("host|boot2", 200, "GPU-a", True), ReadPath.NIXL),
    (SameHostTransport.AUTO, PeerFacts("host|boot", 200, "GPU-b", True), ReadPath.NIXL),
    (SameHostTransport.AUTO, PeerFacts("host|boot", 200, None, False), ReadPath.NIXL),
    (SameHostTransport.AUTO, PeerFacts("host|boot", 100, "GPU-a", True), ReadPath.NIXL),
    (SameHostTransport.AUTO, PeerFacts("host|boot", 200, "GPU-a", False), ReadPath.NIXL),
])
def test_choose_read_path(setting, remote, path):
    got, reason = choose_read_path(setting, GPU, remote)
    assert got is path and reason


MIRROR = PeerFacts("host|boot", 100, "GPU-a", True, has_host_mirror=True)


@pytest.mark.parametrize("setting, remote, path", [
    (SameHostTransport.AUTO, PeerFacts("host|boot", 200, "GPU-b", False, True),
     ReadPath.SHARED_HOST),
    (SameHostTransport.CUDA_IPC, PeerFacts("host|boot", 200, None, False, True),
     ReadPath.SHARED_HOST),
    (SameHostTransport.NIXL, PeerFacts("host|boot", 200, "GPU-a", False, True), ReadPath.NIXL),
    (SameHostTransport.AUTO, PeerFacts("other|boot", 200, "GPU-a", False, True), ReadPath.NIXL),
    (SameHostTransport.AUTO, PeerFacts("host|boot", 200, "GPU-a", True, False), ReadPath.NIXL),
])
def test_choose_read_path_in_host_buffer_mode(setting, remote, path):
    """A reader with a host mirror reads a same-host peer's shared mirror (any GPU, never by
    CUDA IPC), and NIXL otherwise."""
    got, reason = choose_read_path(setting, MIRROR, remote)
    assert got is path and reason


def test_cpu_reader_never_uses_cuda_ipc():
    cpu = PeerFacts("host|boot", 100, None, False)
    assert choose_read_path(SameHostTransport.CUDA_IPC, cpu, GPU)[0] is ReadPath.NIXL


def _caches(n_src=40, n_dst=50, shape=(2, 2, 3, 4, 5)):
    src = torch.arange(n_src * int(torch.tensor(shape).prod()), dtype=torch.float32)
    src = src.view(n_src, *shape)
    return torch.zeros((n_dst, *shape)), src


def _check(dst, src, dst_ids, src_ids):
    for d, s in zip(dst_ids, src_ids):
        assert torch.equal(dst[d], src[s])
    untouched = sorted(set(range(dst.shape[0])) - set(dst_ids))
    assert float(dst[untouched].abs().sum()) == 0.0


def test_copy_blocks_by_runs():
    dst, src = _caches()
    dst_ids, src_ids = [10, 11, 12, 30, 5], [3, 4, 5, 9, 0]  # runs: 3, 1, 1
    assert copy_blocks(dst, src, dst_ids, src_ids) == 3
    _check(dst, src, dst_ids, src_ids)


def test_copy_blocks_by_chunked_gather_when_fragmented():
    dst, src = _caches(n_src=200, n_dst=220)
    g = torch.Generator().manual_seed(0)
    n = MAX_RUN_COPIES + 40
    src_ids = torch.randperm(200, generator=g)[:n].tolist()
    dst_ids = torch.randperm(220, generator=g)[:n].tolist()
    block_bytes = dst[0].numel() * 4
    ops = copy_blocks(dst, src, dst_ids, src_ids, gather_chunk_bytes=block_bytes * 25)
    assert ops == -(-n // 25)
    _check(dst, src, dst_ids, src_ids)


def test_copy_blocks_gathers_fp8_caches_by_their_bytes():
    """An fp8 KV cache (--kv-cache-dtype fp8) takes the chunked gather path too (index_copy_
    has no fp8 kernels, so the bytes are moved)."""
    dst, src = _caches(n_src=200, n_dst=220)
    dst, src = dst.to(torch.float8_e4m3fn), (src % 300).to(torch.float8_e4m3fn)
    g = torch.Generator().manual_seed(1)
    n = MAX_RUN_COPIES + 40
    src_ids = torch.randperm(200, generator=g)[:n].tolist()
    dst_ids = torch.randperm(220, generator=g)[:n].tolist()
    assert copy_blocks(dst, src, dst_ids, src_ids) >= 1
    _check(dst.view(torch.uint8), src.view(torch.uint8), dst_ids, src_ids)


@pytest.mark.parametrize("dst_ids, src_ids, match", [
    ([1, 2], [1], "differ in length"),
    ([50], [0], "destination block id out of range"),
    ([0], [40], "source block id out of range"),
    ([0], [-1], "source block id out of range"),
])
def test_copy_blocks_rejects_bad_ids(dst_ids, src_ids, match):
    dst, src = _caches()
    with pytest.raises(ValueError, match=match):
        copy_blocks(dst, src, dst_ids, src_ids)


def test_copy_blocks_rejects_other_geometry():
    with pytest.raises(ValueError, match="block shapes"):
        copy_blocks(torch.zeros(4, 2, 3), torch.zeros(4, 3, 2), [0], [0])


def test_peer_on_cpu_copies_and_reports_telemetry():
    dst, src = _caches()
    peer = DirectPeer(dst, src)
    handle, state = peer.post_read([7, 8], [1, 2])
    assert state == "DONE" and peer.check(handle) == "DONE"
    post_s, xfer_s, nbytes, ops = peer.telemetry(handle)
    assert nbytes == 2 * dst[0].numel() * 4 and ops == 1 and xfer_s >= 0 and post_s >= 0
    peer.release(handle)
    _check(dst, src, [7, 8], [1, 2])


def test_handshake_fields_on_cpu_and_parsing():
    fields = handshake_fields(torch.zeros(2, 3))
    assert fields["pid"] == os.getpid() and socket.gethostname() in fields["host_id"]
    assert fields["gpu_uuid"] is None and fields["cuda_ipc"] is None
    assert fields["host_mirror"] is None
    facts, export, mirror = remote_facts(fields)
    assert export is None and mirror is None
    assert facts == PeerFacts(fields["host_id"], os.getpid(), None, False)
    # an owner from before these fields: nothing same-host
    facts, export, mirror = remote_facts({"engine_id": "x"})
    assert export is None and mirror is None
    assert choose_read_path(SameHostTransport.AUTO, GPU, facts)[0] is ReadPath.NIXL


def test_ipc_export_wire_round_trip_and_validation():
    wire = {"shape": [4, 2], "stride": [2, 1], "dtype": "bfloat16", "tensor_offset": 0,
            "storage_handle": b"h" * 64, "storage_size_bytes": 16, "storage_offset_bytes": 0,
            "ref_counter_handle": b"/torch_1", "ref_counter_offset": 0, "event_handle": b"e",
            "event_sync_required": True}
    export = IpcExport.from_wire(wire)
    assert export.shape == (4, 2) and export.dtype == "bfloat16"
    assert IpcExport.from_wire(export.to_wire()) == export
    for key, bad in (("dtype", "os"), ("storage_handle", "text"), ("shape", [4]),
                     ("storage_size_bytes", True), ("event_sync_required", 1)):
        with pytest.raises(ValueError):
            IpcExport.from_wire({**wire, key: bad})
    facts, parsed, _ = remote_facts({"host_id": "h", "pid": 3, "gpu_uuid": "GPU-a",
                                     "cuda_ipc": {**wire, "dtype": "nope"}})
    assert parsed is None and not facts.has_ipc_handle


def test_connect_peer_on_cpu_records_nixl_and_warns_when_cuda_ipc_was_asked(caplog):
    paths = TransferPaths()
    info = {"mem_type": "DRAM", **handshake_fields(torch.zeros(2, 3))}
    with caplog.at_level(logging.WARNING):
        assert same_host.connect_peer(SameHostTransport.CUDA_IPC, torch.zeros(2, 3), None, info,
                                      "p", paths, "DRAM") is None
    assert "same_host_transport is 'cuda_ipc'" in caplog.text
    assert paths.path_of("p") is ReadPath.NIXL
    assert paths.take_delta() == {"p": {"transport": "nixl", "mem": "DRAM->DRAM",
                                        "read_gbps": None}}
    assert paths.take_delta() is None


def test_slow_gpu_read_over_nixl_is_warned_once(caplog):
    paths = TransferPaths()
    paths.set_path("p", ReadPath.NIXL, "test", "VRAM", "VRAM")
    paths.set_path("q", ReadPath.CUDA_IPC, "test", "VRAM", "VRAM")
    paths.take_delta()
    with caplog.at_level(logging.WARNING):
        paths.observe("p", 1 << 20, 1.0)  # too small to say anything
        assert paths.take_delta() is None
        paths.observe("p", PROBE_MIN_BYTES * 32, 1.0)  # 0.54 GB/s
        paths.observe("p", PROBE_MIN_BYTES * 32, 0.001)  # later reads do not change it
        paths.observe("q", PROBE_MIN_BYTES, 1.0)
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "TCP" in warnings[0].getMessage()
    delta = paths.take_delta()
    assert delta["p"]["read_gbps"] == pytest.approx(PROBE_MIN_BYTES * 32 / 1e9)
    assert delta["q"]["transport"] == "cuda_ipc"


# ----------------------------------------------------------------- the worker's hooks, on CPU
def _worker(role: str, kv: torch.Tensor, monkeypatch, **extra):
    from pdserve.kv_transfer.base import KVCacheSpec
    from pdserve.types.kv_transfer_config import KVTransferConfig
    from pdserve.kv_transfer.factory import create_connector

    monkeypatch.setenv("PDSERVE_NIXL_SIDE_CHANNEL_HOST", "127.0.0.1")
    monkeypatch.setenv("PDSERVE_NIXL_SIDE_CHANNEL_PORT", str(free_port()))
    cfg = KVTransferConfig.from_dict({"kv_role": role, "kv_connector_extra_config": {
        "kv_handshake_timeout": 5.0, "kv_metrics_log_interval": 1e6, **extra}})
    worker = create_connector(cfg, "worker")
    n, layers, _, heads, bs, dim = kv.shape
    worker.register_kv_cache(kv, KVCacheSpec(
        num_blocks=n, block_size=bs, num_layers=layers, num_kv_heads=heads, head_dim=dim,
        dtype="float32", element_size=4, model_name="tiny"))
    return worker, cfg.engine_id


def test_worker_reads_through_the_same_host_peer_and_notifies_the_owner(monkeypatch):
    """The worker's hooks: a peer whose reads go by the same-host path gets its blocks copied
    after the claim, the read is reported in finished_recving with its stats and path, and the
    owner's lease ends at once by the "done" notice (not by its 30 s expiry)."""
    from pdserve.kv_transfer.nixl.metadata import NixlConnectorMetadata, RecvSpec, SendSpec
    from pdserve.types.remote_ref import RemoteEndpoint, RemoteKVRef

    shape = (16, 2, 2, 2, 4, 8)
    owner_kv = torch.arange(torch.tensor(shape).prod().item(), dtype=torch.float32).view(shape)
    reader_kv = torch.zeros(shape)
    opened, posted = [], []

    class CountingPeer(DirectPeer):
        def post_read(self, local_ids, remote_ids):
            posted.append((list(local_ids), list(remote_ids)))
            return super().post_read(local_ids, remote_ids)

    def fake_connect(setting, local, mirror, info, peer, paths, local_mem):
        paths.set_path(peer, ReadPath.CUDA_IPC, "test stand-in", info["mem_type"], local_mem)
        opened.append(CountingPeer(local, owner_kv))
        return opened[-1]

    monkeypatch.setattr(same_host, "connect_peer", fake_connect)
    owner, owner_id = _worker("kv_producer", owner_kv, monkeypatch)
    reader, _ = _worker("kv_consumer", reader_kv, monkeypatch)
    try:
        remote_ids, local_ids = [3, 4, 5, 9], [10, 11, 12, 1]
        owner.bind_connector_metadata(NixlConnectorMetadata(
            reqs_to_send={"p-1": SendSpec("p-1", remote_ids, 30.0)}))
        owner.get_finished(set())
        ref = RemoteKVRef(RemoteEndpoint(owner_id, "127.0.0.1", owner.side_channel_port),
                          "p-1", remote_ids)
        reader.bind_connector_metadata(NixlConnectorMetadata(reqs_to_recv={
            "d-1": RecvSpec("d-1", ref, local_ids, remote_ids, num_tokens=16)}))
        recv, sent, stats = set(), set(), []
        deadline = time.monotonic() + 20
        while not ("d-1" in recv and "p-1" in sent):
            assert time.monotonic() < deadline, (recv, sent)
            reader.start_load_kv()
            out = reader.get_finished(set())
            recv |= out.finished_recving
            assert not out.invalid_block_ids
            if out.stats:
                stats.append(out.stats)
            sent |= owner.get_finished(set()).finished_sending
            time.sleep(0.002)
        assert len(opened) == 1 and posted == [(local_ids, remote_ids)]
        for lid, rid in zip(local_ids, remote_ids):
            assert torch.equal(reader_kv[lid], owner_kv[rid])
        assert float(reader_kv[[0, 2, 13]].abs().sum()) == 0.0
        xfers = [s for s in stats if s.get("xfer_time_s")]
        assert xfers and xfers[0]["num_descriptors"] == [2]
        paths = [s["transfer_paths"] for s in stats if "transfer_paths" in s]
        assert paths and paths[0][owner_id]["transport"] == "cuda_ipc"
        assert len(owner.leases) == 0
    finally:
        reader.shutdown()
        owner.shutdown()


# ------------------------------------------------------------------------- on one GPU (device)
@pytest.mark.slow
@pytest.mark.gpu
@pytest.mark.parametrize("setting, transport", [("auto", "cuda_ipc"), ("nixl", "nixl")])
def test_two_processes_on_one_gpu_read_by_the_chosen_path(setting, transport):
    """P and D as two processes on cuda:0: with ``auto`` reads are CUDA IPC copies, with
    ``nixl`` NIXL READs; both move the right blocks, contiguous runs and a fragmented gather
    (more than MAX_RUN_COPIES runs), and free the owner's lease."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from tests.support.nixl_peer import PeerProcess, block_pattern

    from pdserve.kv_transfer.nixl.metadata import NixlConnectorMetadata, RecvSpec, SendSpec
    from pdserve.types.remote_ref import RemoteEndpoint, RemoteKVRef

    geometry = {"num_blocks": 256, "block_size": 4, "num_layers": 2, "num_kv_heads": 2,
                "head_dim": 8, "model": "tiny"}

    def config(role):
        return {"kv_connector": "NixlConnector", "kv_role": role, "kv_connector_extra_config": {
            "kv_handshake_timeout": 5.0, "same_host_transport": setting}}

    p = PeerProcess(config("kv_producer"), free_port(), geometry, device="cuda:0")
    d = None
    try:
        assert p.hello.get("ok"), p.hello
        d = PeerProcess(config("kv_consumer"), free_port(), geometry, zeros=True,
                        device="cuda:0")
        assert d.hello.get("ok"), d.hello
        g = torch.Generator().manual_seed(1)
        cases = [([2, 3, 4, 5, 30], [7, 8, 9, 10, 1]),
                 (torch.randperm(256, generator=g)[:100].tolist(),
                  torch.randperm(256, generator=g)[:100].tolist())]
        paths = []
        for i, (remote_ids, local_ids) in enumerate(cases):
            p.bind(NixlConnectorMetadata(reqs_to_send={
                f"p{i}": SendSpec(f"p{i}", remote_ids, 30.0)}))
            p.step()
            ref = RemoteKVRef(RemoteEndpoint(p.engine_id, "127.0.0.1", p.port), f"p{i}",
                              remote_ids)
            d.bind(NixlConnectorMetadata(reqs_to_recv={f"d{i}": RecvSpec(
                f"d{i}", ref, local_ids, remote_ids, num_tokens=4 * len(local_ids))}))
            acc = d.step_until(lambda a: f"d{i}" in a["finished_recving"])
            assert not acc["invalid_block_ids"]
            for rid, block in zip(remote_ids, d.blocks(local_ids)):
                assert torch.equal(block, block_pattern(rid, block.numel())), (rid, transport)
            paths += [s["transfer_paths"] for s in acc["stats"] if "transfer_paths" in s]
            p.step_until(lambda a: f"p{i}" in a["finished_sending"], timeout_s=10)
        assert paths and paths[0][p.engine_id]["transport"] == transport
        assert paths[0][p.engine_id]["mem"] == "VRAM->VRAM"
    finally:
        if d is not None:
            d.shutdown()
        p.shutdown()


@pytest.mark.gpu
def test_fragmented_gather_copy_survives_allocator_churn_on_the_current_stream():
    """The gather path's block-id tensors are allocated on the current stream and read by the
    peer's side stream: while the current stream is busy and allocates and frees memory, every
    copy must still land in the right blocks (without ``record_stream`` the allocator reused the
    id tensors' memory and the copy read garbage ids: a device-side assert under 64 streams)."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    dev = torch.device("cuda")
    blocks, shape = 4096, (2, 4, 16, 64)
    src = torch.randn(blocks, *shape, device=dev)
    dst = torch.zeros_like(src)
    peer = DirectPeer(dst, src)
    g = torch.Generator().manual_seed(0)
    busy = torch.randn(4096, 4096, device=dev)
    for _ in range(20):
        ids = torch.randperm(blocks, generator=g)[:4 * MAX_RUN_COPIES].tolist()
        dst_ids = torch.randperm(blocks, generator=g)[:len(ids)].tolist()
        busy = busy @ busy / 64  # the current stream is busy while the copy is queued
        handle, _ = peer.post_read(dst_ids, ids)
        for _ in range(8):  # churn: fresh allocations on the current stream reuse freed memory
            torch.full((len(ids),), -1, dtype=torch.int64, device=dev)
        torch.cuda.synchronize()
        assert peer.check(handle) == "DONE"
        assert torch.equal(dst[dst_ids], src[ids])
    peer.close()
