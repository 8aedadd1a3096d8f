"""KVTierStore on CPU: a step's tier jobs copy exactly the blocks they name (device -> host ->
file -> host -> device, in job order), a LOAD is reported once, and a block file that is
corrupt, truncated or another engine's is a failed LOAD with a warning, never wrong KV."""

from __future__ import annotations

import logging
import os
import time

import pytest
import torch

from pdserve.runner.kv_tier_store import KVTierStore, block_namespace
from pdserve.types.kv_tiers import KVTierJobs, TierJob, TierJobKind

STORE, LOAD = TierJobKind.STORE, TierJobKind.LOAD
WRITE, DELETE = TierJobKind.DISK_WRITE, TierJobKind.DISK_DELETE


def cache(seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn((8, 2, 2, 1, 4, 8), generator=g)  # [blocks, L, 2, H_kv, bs, D]


def wait_report(store: KVTierStore, timeout_s: float = 10.0):
    """Poll until a report names a LOAD (file reads finish on the I/O thread)."""
    deadline = time.monotonic() + timeout_s
    while True:
        report = store.report()
        if report.finished_loads or report.failed_loads or time.monotonic() > deadline:
            return report
        time.sleep(0.005)


def written_file(directory, timeout_s: float = 10.0) -> str:
    """The one block file under ``directory`` once the I/O thread has written it."""
    deadline = time.monotonic() + timeout_s
    while True:
        files = [f.path for d in os.scandir(directory) if d.is_dir()
                 for f in os.scandir(d.path) if f.name.endswith(".kvblock")]
        if files:
            [path] = files
            return path
        assert time.monotonic() < deadline, "no block file written"
        time.sleep(0.01)


def test_blocks_travel_device_host_disk_and_back(tmp_path):
    kv = cache()
    original = kv.clone()
    ns = block_namespace("m", "float32", (2, 2, 1, 4, 8), 0, 1)
    store = KVTierStore(kv, host_blocks=2, namespace=ns, disk_dir=str(tmp_path))
    store.run(KVTierJobs([TierJob(STORE, 0, 11, block_id=3, slot=0),
                          TierJob(STORE, 1, 12, block_id=5, slot=1),
                          TierJob(WRITE, 2, 11, slot=0),  # slot 0 goes to disk, then is reused
                          TierJob(STORE, 3, 13, block_id=6, slot=0)]))
    assert store.report().finished_loads == set()
    kv.zero_()
    store.run(KVTierJobs([TierJob(LOAD, 4, 12, block_id=0, slot=1),
                          TierJob(LOAD, 5, 13, block_id=1, slot=0)]))
    assert store.report().finished_loads == {4, 5}  # CPU: copied in the step
    assert torch.equal(kv[0], original[5]) and torch.equal(kv[1], original[6])
    store.run(KVTierJobs([TierJob(LOAD, 6, 11, block_id=2, slot=1, from_disk=True)]))
    assert wait_report(store).finished_loads == {6}
    assert torch.equal(kv[2], original[3])
    store.run(KVTierJobs([TierJob(DELETE, 7, 11)]))
    store.shutdown()
    assert not any(os.scandir(tmp_path))  # the engine's directory is removed


@pytest.mark.parametrize("damage", ["flip", "truncate", "foreign"])
def test_a_bad_file_is_a_failed_load_and_leaves_the_block_alone(tmp_path, caplog, damage):
    kv = cache()
    ns = block_namespace("m", "float32", (2, 2, 1, 4, 8), 0, 1)
    store = KVTierStore(kv, host_blocks=1, namespace=ns, disk_dir=str(tmp_path))
    store.run(KVTierJobs([TierJob(STORE, 0, 42, block_id=4, slot=0),
                          TierJob(WRITE, 1, 42, slot=0)]))
    path = written_file(tmp_path)
    if damage == "flip":
        with open(path, "r+b") as f:
            f.seek(-3, os.SEEK_END)
            f.write(b"\x01\x02\x03")
    elif damage == "truncate":
        os.truncate(path, os.path.getsize(path) - 10)
    else:  # written by an engine of another namespace (another TP rank, say)
        other = KVTierStore(cache(1), host_blocks=1,
                            namespace=block_namespace("m", "float32", (2, 2, 1, 4, 8), 1, 2),
                            disk_dir=str(tmp_path / "other"))
        other.run(KVTierJobs([TierJob(STORE, 0, 42, block_id=4, slot=0),
                              TierJob(WRITE, 1, 42, slot=0)]))
        os.replace(written_file(tmp_path / "other"), path)
        other.shutdown()
    before = kv[0].clone()
    with caplog.at_level(logging.WARNING, logger="pdserve.model"):
        store.run(KVTierJobs([TierJob(LOAD, 2, 42, block_id=0, slot=0, from_disk=True)]))
        report = wait_report(store)
    assert report.failed_loads == {2} and not report.finished_loads
    assert torch.equal(kv[0], before)
    assert any("KV disk tier" in r.getMessage() for r in caplog.records)
    store.shutdown()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_a_load_overlaps_the_running_step_and_the_next_step_sees_it():
    """On CUDA a step's host LOADs and STOREs do not wait for the step still running on the
    engine's stream (none of their blocks is that step's), while the engine's next work waits
    for them: the copies finish while a long kernel still runs, a read queued on the engine's
    stream after ``run`` sees the loaded block, and
    :meth:`KVTierStore.wait_before_connector_writes` of the next step (an instance whose KV
    connector writes outside the engine's stream) returns only once the LOAD is done."""
    dev = torch.device("cuda")
    g = torch.Generator().manual_seed(0)
    # 16 MiB blocks: a LOAD of one takes a fraction of a millisecond, far longer than the host
    # needs from ``run`` to ``report``, so a wait that does not happen shows
    kv = torch.randn((8, 32, 2, 8, 64, 128), generator=g).to(dev)
    original = kv.clone()
    store = KVTierStore(kv, host_blocks=2, namespace=block_namespace("m", "f32", (), 0, 1))
    store.run(KVTierJobs([TierJob(STORE, 0, 11, block_id=3, slot=0)]))
    torch.cuda.synchronize()
    running_step = torch.cuda.Event()
    torch.cuda._sleep(2_000_000_000)  # the running step: about a second of a busy kernel
    running_step.record()
    store.run(KVTierJobs([TierJob(STORE, 1, 12, block_id=5, slot=1),
                          TierJob(LOAD, 2, 11, block_id=0, slot=0)]))
    seen = kv[0].clone()  # the next step's read, queued on the engine's stream
    store.run(None)  # the next step, without tier jobs
    store.wait_before_connector_writes()
    assert store.report().finished_loads == {2}
    assert not running_step.query(), "the LOAD waited for the running step"
    torch.cuda.synchronize()
    assert torch.equal(seen, original[3]) and torch.equal(store.host[1], original[5].cpu())
