"""The KV cache tiers' memory and copies on the runner side: a host-memory pool of blocks (pinned
on CUDA), a directory of block files, and the copies between them and the KV cache that the
scheduler's :class:`~pdserve.types.kv_tiers.TierJob` list asks for.

Copies (docs/architecture.md, "KV cache tiers"):

* device <-> host on CUDA run on a copy stream of their own, at once: they do not wait for the
  step still running on the engine's stream (async scheduling), since no block a job copies is
  used by that step (a block is free, and so evictable or reusable, only once no launched step
  uses it: ``KVCacheManager.set_in_flight``). A step's host LOADs thus overlap the step before
  it. The engine's stream waits for the step's STOREs before its forward pass overwrites those
  blocks, and for its host LOADs (the scheduler computes a request whose history is in the
  host tier in the step that loads it). The host waits only on an instance whose KV connector
  writes into blocks outside the engine's stream, and only for the step's STOREs and the LOADs
  of earlier steps (:meth:`KVTierStore.wait_before_connector_writes`). A LOAD is reported
  finished, and its host slot unpinned, once its CUDA event has completed. A disk LOAD's
  host-to-device copy is issued when its file read ends; its request is only scheduled once
  that copy is reported. On a CPU engine the same copies are plain synchronous tensor copies.
* host <-> disk run on one I/O thread, in job order. A file is a header (magic, block hash,
  the engine's namespace: model, dtype, block shape, fp8 scales, TP rank, its payload length and
  CRC32) and the block's bytes. A read whose header or checksum does not match is a failed
  LOAD, logged as a warning: the scheduler recomputes that block, never serves wrong KV.
"""

from __future__ import annotations

import hashlib
import logging
import os
import queue
import shutil
import struct
import threading
import time
import zlib
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Callable

import torch

from pdserve.types.kv_tiers import KVTierJobs, KVTierReport, TierJob, TierJobKind

logger = logging.getLogger("pdserve.model")

_MAGIC = b"PDSKV001"
_HEADER = struct.Struct("<8sQ16sQI")  # magic, block hash, namespace, payload bytes, crc32


def block_namespace(*parts: object) -> bytes:
    """16 bytes that identify what a block's bytes mean (model, dtype, block shape, fp8
    scales, TP rank and size): a file written under another namespace is never read."""
    return hashlib.sha256("|".join(map(str, parts)).encode()).digest()[:16]


class _DiskIO:
    """One thread that writes, reads and deletes block files in submission order."""

    def __init__(self, directory: str, namespace: bytes):
        self.directory = directory
        self.namespace = namespace
        self._queue: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="pdserve-kv-disk", daemon=True)
        self._thread.start()

    def path(self, block_hash: int) -> str:
        return os.path.join(self.directory, f"{block_hash:016x}.kvblock")

    def submit(self, fn: Callable[[], object]) -> Future:
        fut: Future = Future()
        self._queue.put((fn, fut))
        return fut

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            fn, fut = item
            try:
                fut.set_result(fn())
            except BaseException as e:  # reported to the step that polls it
                fut.set_exception(e)

    def write(self, block_hash: int, payload: bytes) -> None:
        header = _HEADER.pack(_MAGIC, block_hash, self.namespace, len(payload),
                              zlib.crc32(payload))
        tmp = self.path(block_hash) + ".tmp"
        with open(tmp, "wb") as f:
            f.write(header)
            f.write(payload)
        os.replace(tmp, self.path(block_hash))

    def read(self, block_hash: int, expected_len: int) -> bytes | str:
        """The block's payload, or a sentence saying why the file cannot be used."""
        path = self.path(block_hash)
        try:
            with open(path, "rb") as f:
                data = f.read()
        except OSError as e:
            return f"cannot read {path}: {e}"
        if len(data) < _HEADER.size:
            return f"{path} is truncated ({len(data)} bytes)"
        magic, h, ns, n, crc = _HEADER.unpack_from(data)
        payload = data[_HEADER.size:]
        if magic != _MAGIC or h != block_hash or ns != self.namespace:
            return f"{path} has a foreign header (another block, engine or format)"
        if n != expected_len or len(payload) != n:
            return f"{path} is truncated or of another size ({len(payload)} of {expected_len} bytes)"
        if zlib.crc32(payload) != crc:
            return f"{path} fails its checksum"
        return payload

    def delete(self, block_hash: int) -> None:
        try:
            os.unlink(self.path(block_hash))
        except FileNotFoundError:
            pass

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join(timeout=10)
        shutil.rmtree(self.directory, ignore_errors=True)


@dataclass
class _Pending:
    """LOAD jobs whose host-to-device copy was issued; done when ``event`` completes."""

    job_ids: list[int]
    event: "torch.cuda.Event | None"
    start: "torch.cuda.Event | None" = None


class KVTierStore:
    """Host pool, block files and the copies of one rank's KV cache shard.

    Args:
        kv_cache: the paged KV cache ``[num_blocks, L, 2, H_kv, block_size, D]`` (or an MLA
            cache's shape: anything whose dim 0 is the block; a block is ``kv_cache[b]``,
            contiguous).
        host_blocks: slots of the host pool (>= 1).
        namespace: :func:`block_namespace` of this engine and rank.
        disk_dir: directory under which this engine's block files go (a subdirectory of its
            own, removed at shutdown), or None.

    Attributes:
        host: the host pool ``[host_blocks, *kv_cache.shape[1:]]`` in the cache's dtype (pinned
            on CUDA); slot ``s`` is ``host[s]``.
        block_nbytes: bytes of one block (a file's payload).

    Raises:
        ValueError: ``host_blocks < 1``.
        OSError: the disk directory cannot be created.
    """

    def __init__(self, kv_cache: torch.Tensor, host_blocks: int, namespace: bytes,
                 disk_dir: str | None = None):
        if host_blocks < 1:
            raise ValueError(f"host_blocks must be >= 1, got {host_blocks}")
        self.kv_cache = kv_cache
        self.cuda = kv_cache.device.type == "cuda"
        self.host = torch.zeros((host_blocks, *kv_cache.shape[1:]), dtype=kv_cache.dtype,
                                device="cpu", pin_memory=self.cuda)
        self.block_nbytes = self.host[0].numel() * self.host.element_size()
        self._stream = torch.cuda.Stream(kv_cache.device) if self.cuda else None
        self._store_events: dict[int, torch.cuda.Event] = {}  # slot -> its last STORE's event
        self._pending: list[_Pending] = []
        self._disk_reads: list[tuple[TierJob, Future, float]] = []
        self._report = KVTierReport()
        self._disk: _DiskIO | None = None
        if disk_dir is not None:
            directory = os.path.join(disk_dir, f"pdserve-{namespace.hex()}-{os.getpid()}")
            os.makedirs(directory, exist_ok=True)
            self._disk = _DiskIO(directory, namespace)
        self._stores_this_step: "torch.cuda.Event | None" = None
        self._earlier_loads: "torch.cuda.Event | None" = None  # the latest LOADs of earlier runs
        self._last_loads: "torch.cuda.Event | None" = None  # the LOADs of the latest run with some

    def run(self, jobs: KVTierJobs | None) -> None:
        """Issue a step's jobs (before its forward pass; see the module docstring): first the
        STORE, DISK_WRITE and DISK_DELETE jobs in list order, then the LOAD jobs in list order.
        Moving the loads behind the stores keeps every order that matters (a STORE into a
        slot or out of a block that a LOAD of the same step uses is listed before that LOAD:
        a loaded block is neither cached nor evictable, a slot a LOAD reads is pinned) and
        lets the engine's stream wait for the stores alone before what overwrites them.
        The engine's stream also waits for the step's host LOADs: a request whose history
        comes back from the host tier is computed in the step that loads it. The copies do
        not wait for the engine's stream: the step it still runs uses none of these blocks
        (the module docstring).

        Raises:
            RuntimeError: a DISK job without a disk tier (a bookkeeping bug).
        """
        self._stores_this_step = None
        self._earlier_loads = self._last_loads
        if jobs is None:
            return
        stream = self._stream
        begin = compute = None
        if stream is not None:
            compute = torch.cuda.current_stream(self.kv_cache.device)  # the engine's stream
            begin = torch.cuda.Event(enable_timing=True)
            begin.record(stream)
        loads: list[int] = []
        stored: set[int] = set()  # slots stored by this run, not yet ordered by an event
        t0 = time.perf_counter()
        load_jobs: list[TierJob] = []
        with torch.cuda.stream(stream) if stream is not None else _nullcontext():
            for job in jobs.jobs:
                kind = job.kind
                if kind is TierJobKind.STORE:
                    self.host[job.slot].copy_(self.kv_cache[job.block_id], non_blocking=self.cuda)
                    stored.add(job.slot)
                elif kind is TierJobKind.LOAD:
                    load_jobs.append(job)
                elif kind is TierJobKind.DISK_WRITE:
                    if job.slot in stored and stream is not None:
                        stream.synchronize()  # stored and evicted in one step (a tiny pool)
                    self._write_file(job)
                elif kind is TierJobKind.DISK_DELETE:
                    io = self._io()
                    io.submit(lambda h=job.block_hash: io.delete(h))
            if stored and stream is not None:
                stores_done = torch.cuda.Event()
                stores_done.record(stream)
                for slot in stored:
                    self._store_events[slot] = stores_done
                compute.wait_event(stores_done)
                self._stores_this_step = stores_done
            for job in load_jobs:
                if job.from_disk:
                    self._read_file(job)
                else:
                    self.kv_cache[job.block_id].copy_(self.host[job.slot], non_blocking=self.cuda)
                    loads.append(job.job_id)
        if not (stored or loads):
            return
        if stream is None:
            self._report.copy_times_s.append(time.perf_counter() - t0)
            self._report.finished_loads.update(loads)
            return
        end = torch.cuda.Event(enable_timing=True)
        end.record(stream)
        if loads:
            compute.wait_event(end)  # the step's forward may read the loaded blocks
            self._last_loads = end
        self._pending.append(_Pending(loads, end, begin))

    def wait_before_connector_writes(self) -> None:
        """Block the host until this step's STOREs and the host LOADs of earlier steps are
        done: a KV connector READ, which does not follow the engine's stream, may from now on
        write into a block a STORE copies out of, or into a block an earlier LOAD wrote (its
        request may have finished since, its blocks reused: a request that waits for remote
        KV after its host-tier hit is in no launched step). This step's LOADs need no wait:
        their blocks were allocated in this step's scheduling, so no READ of it targets
        them, and the blocks become reusable at the next scheduling at the earliest."""
        for event in (self._stores_this_step, self._earlier_loads):
            if event is not None and not event.query():
                event.synchronize()

    def _loads_issued(self, job_ids: list[int]) -> None:
        if not self.cuda:
            self._report.finished_loads.update(job_ids)
            return
        ev = torch.cuda.Event()
        ev.record(self._stream)
        self._pending.append(_Pending(job_ids, ev))

    def _io(self) -> _DiskIO:
        if self._disk is None:
            raise RuntimeError("a disk tier job without a disk tier")
        return self._disk

    def _write_file(self, job: TierJob) -> None:
        ev = self._store_events.pop(job.slot, None)
        if ev is not None and not ev.query():
            ev.synchronize()  # the slot's STORE must have landed before its bytes are read
        payload = self.host[job.slot].reshape(-1).view(torch.uint8).numpy().tobytes()
        io = self._io()
        io.submit(lambda: io.write(job.block_hash, payload))

    def _read_file(self, job: TierJob) -> None:
        io = self._io()
        n = self.block_nbytes
        fut = io.submit(lambda: io.read(job.block_hash, n))
        self._disk_reads.append((job, fut, time.perf_counter()))

    def report(self) -> KVTierReport:
        """Poll copies and file reads; the jobs finished or failed since the last report."""
        if self._disk_reads:
            self._poll_disk_reads()
        if self._pending:
            still = []
            for p in self._pending:
                if p.event.query():
                    self._report.finished_loads.update(p.job_ids)
                    if p.start is not None:
                        self._report.copy_times_s.append(p.start.elapsed_time(p.event) / 1e3)
                else:
                    still.append(p)
            self._pending = still
        report, self._report = self._report, KVTierReport()
        return report

    def _poll_disk_reads(self) -> None:
        still = []
        ready: list[TierJob] = []
        for job, fut, t0 in self._disk_reads:
            if not fut.done():
                still.append((job, fut, t0))
                continue
            try:
                payload = fut.result()
            except Exception as e:  # an I/O error: the block is a miss
                payload = f"read failed: {e}"
            if isinstance(payload, str):
                logger.warning("KV disk tier: %s; recomputing that block", payload)
                self._report.failed_loads.add(job.job_id)
                continue
            self._report.copy_times_s.append(time.perf_counter() - t0)
            ev = self._store_events.pop(job.slot, None)
            if ev is not None and not ev.query():
                ev.synchronize()  # an older STORE into this slot must land before we overwrite
            flat = self.host[job.slot].reshape(-1).view(torch.uint8)
            flat.copy_(torch.frombuffer(bytearray(payload), dtype=torch.uint8))
            ready.append(job)
        self._disk_reads = still
        if not ready:
            return
        stream = self._stream
        with torch.cuda.stream(stream) if stream is not None else _nullcontext():
            for job in ready:
                self.kv_cache[job.block_id].copy_(self.host[job.slot], non_blocking=self.cuda)
        self._loads_issued([j.job_id for j in ready])

    def shutdown(self) -> None:
        """Stop the I/O thread and remove this engine's block files."""
        if self._disk is not None:
            self._disk.close()
            self._disk = None


class _nullcontext:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None
