"""Bookkeeping of the KV cache tiers behind the prefix cache: which block hash is in which tier,
LRU per tier, and the copy jobs of each step (pure bookkeeping: no torch).

:class:`TierManager` is told by the block manager when a cached block leaves the device
(:meth:`TierManager.on_evict`) and asked by admission which blocks past a device prefix hit a
tier holds (:meth:`TierManager.match`) and to bring them back (:meth:`TierManager.start_load`).
It never touches a tensor: it appends :class:`~pdserve.types.kv_tiers.TierJob` entries that the
model runner executes before the step's forward pass (:meth:`TierManager.take_jobs`), and learns
the end of LOAD jobs from the runner's :class:`~pdserve.types.kv_tiers.KVTierReport`
(:meth:`TierManager.loads_reported`).

Keys: the prefix cache's chained block hash. Everything else that makes a block's bytes mean
something (model, dtype, layout, TP rank) is fixed for one engine: the host pool lives and dies
with it, and the disk tier's files carry a header with that namespace and the hash, which the
runner checks on every read (:mod:`pdserve.runner.kv_tier_store`).

Pins: a host slot that a LOAD reads, or a file a LOAD reads, is pinned until the load is
reported; pinned entries are never evicted.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Sequence

from pdserve.engine.kv_events import KVEventBuffer
from pdserve.types.kv_events import BlockRemoved, BlockStored, KVEvent
from pdserve.types.kv_tiers import (
    COPY_TIME_BUCKETS_S, KVTierJobs, KVTierMedium, KVTierReport, TierJob, TierJobKind,
)

logger = logging.getLogger(__name__)


@dataclass
class _TierCounters:
    """Cumulative counters of one tier (blocks, bytes)."""

    hits: int = 0  # blocks found there by a prefix lookup and loaded from it
    stored: int = 0  # blocks written into the tier
    evictions: int = 0  # blocks that left the tier for lack of room
    bytes_in: int = 0  # bytes copied into the tier's medium


@dataclass
class _PendingLoad:
    """One request's blocks coming back from the tiers (by LOAD job id)."""

    job_index: dict[int, int]  # job id -> index of the block among the loaded ones
    total: int  # blocks loaded
    first_failed: int | None = None  # lowest index whose load failed


@dataclass
class TierLoadDone:
    """A request's tier load is over.

    Attributes:
        request_id: the request.
        num_blocks: blocks that were to be loaded.
        num_good: leading blocks whose KV is in the device cache now (``< num_blocks`` after a
            failed read).
    """

    request_id: str
    num_blocks: int
    num_good: int


@dataclass
class _CopyHistogram:
    counts: list[int] = field(default_factory=lambda: [0] * (len(COPY_TIME_BUCKETS_S) + 1))
    total_s: float = 0.0

    def observe(self, seconds: float) -> None:
        i = 0
        while i < len(COPY_TIME_BUCKETS_S) and seconds > COPY_TIME_BUCKETS_S[i]:
            i += 1
        self.counts[i] += 1
        self.total_s += seconds


class TierManager:
    """Which block hashes the host and disk tiers hold, their LRU order and the copy jobs.

    Args:
        host_blocks: slots of the host-memory tier (>= 1).
        disk_blocks: blocks of the disk tier (0: no disk tier).
        block_bytes: bytes of one block (this rank's shard at TP > 1), for the byte counters.

    Raises:
        ValueError: ``host_blocks < 1`` or ``disk_blocks < 0``.
    """

    def __init__(self, host_blocks: int, disk_blocks: int = 0, block_bytes: int = 0):
        if host_blocks < 1 or disk_blocks < 0:
            raise ValueError(f"host_blocks must be >= 1 and disk_blocks >= 0, got {host_blocks}, "
                             f"{disk_blocks}")
        self.host_blocks = host_blocks
        self.disk_blocks = disk_blocks
        self.block_bytes = block_bytes
        self._host: OrderedDict[int, int] = OrderedDict()  # hash -> slot; front = least recent
        self._free_slots: list[int] = list(range(host_blocks - 1, -1, -1))
        self._slot_pins: dict[int, int] = {}  # slot -> pending LOADs reading it
        self._disk: OrderedDict[int, None] = OrderedDict()  # hashes with a file; front = LRU
        self._disk_pins: dict[int, int] = {}
        self._jobs: list[TierJob] = []
        self._next_job = 0
        self._loads: dict[str, _PendingLoad] = {}
        # job -> (request, or None for a detached load; hash, slot, from disk)
        self._job_owner: dict[int, tuple[str | None, int, int, bool]] = {}
        self._filling: set[int] = set()  # slots a file read fills (not readable before)
        self._events = KVEventBuffer()
        self.counters = {KVTierMedium.CPU: _TierCounters(), KVTierMedium.DISK: _TierCounters()}
        self.bytes_to_device = 0
        self.dropped = 0  # evicted device blocks no tier could take (every slot pinned)
        self._copy_times = _CopyHistogram()

    # ---------------------------------------------------------------- KV events
    def enable_events(self) -> None:
        """Record tier changes as KV events with their ``medium`` (see :meth:`take_events`)."""
        self._events.enable()

    def take_events(self) -> list[KVEvent]:
        """Events since the last call (empty when events are off)."""
        return self._events.take()

    def _event(self, cls: type[BlockStored] | type[BlockRemoved], h: int,
               medium: KVTierMedium) -> None:
        self._events.add_hash(cls, h, medium.value)

    def snapshot(self) -> dict[str, list[int]]:
        """Every hash per tier now (``{"CPU": [...], "DISK": [...]}``), for KV event snapshots."""
        return {KVTierMedium.CPU.value: list(self._host), KVTierMedium.DISK.value: list(self._disk)}

    # ---------------------------------------------------------------- device evictions
    def on_evict(self, block_id: int, block_hash: int) -> None:
        """A cached device block is being reused for other tokens in the step being scheduled:
        keep its KV in the host tier (a STORE job, executed before the step overwrites it).
        A hash the host tier has already is only made most recent."""
        if block_hash in self._host:
            self._host.move_to_end(block_hash)
            return
        slot = self._take_slot()
        if slot is None:
            self.dropped += 1
            return
        self._host[block_hash] = slot
        self._add_job(TierJobKind.STORE, block_hash, block_id=block_id, slot=slot)
        c = self.counters[KVTierMedium.CPU]
        c.stored += 1
        c.bytes_in += self.block_bytes
        self._event(BlockStored, block_hash, KVTierMedium.CPU)

    def _take_slot(self) -> int | None:
        """A free host slot, evicting the least recent unpinned one (to disk when there is a
        disk tier) if none is free; None when every slot is pinned."""
        if self._free_slots:
            return self._free_slots.pop()
        for h, slot in self._host.items():
            if not self._slot_pins.get(slot):
                break
        else:
            return None
        del self._host[h]
        self.counters[KVTierMedium.CPU].evictions += 1
        self._event(BlockRemoved, h, KVTierMedium.CPU)
        if self.disk_blocks and h not in self._disk:
            self._disk_put(h, slot)
        elif h in self._disk:
            self._disk.move_to_end(h)
        return slot

    def _disk_put(self, h: int, slot: int) -> None:
        if len(self._disk) >= self.disk_blocks:
            for old in self._disk:
                if not self._disk_pins.get(old):
                    break
            else:
                return  # every file is being read: the block is dropped
            del self._disk[old]
            self.counters[KVTierMedium.DISK].evictions += 1
            self._event(BlockRemoved, old, KVTierMedium.DISK)
            self._add_job(TierJobKind.DISK_DELETE, old)
        self._disk[h] = None
        self._add_job(TierJobKind.DISK_WRITE, h, slot=slot)
        c = self.counters[KVTierMedium.DISK]
        c.stored += 1
        c.bytes_in += self.block_bytes
        self._event(BlockStored, h, KVTierMedium.DISK)

    def _add_job(self, kind: TierJobKind, h: int, block_id: int = -1, slot: int = -1,
                 from_disk: bool = False) -> int:
        job_id = self._next_job
        self._next_job += 1
        self._jobs.append(TierJob(kind, job_id, h, block_id, slot, from_disk))
        return job_id

    # ---------------------------------------------------------------- lookups and loads
    def match(self, block_hashes: Sequence[int]) -> list[KVTierMedium]:
        """The tiers of the leading ``block_hashes`` that a tier holds (stops at the first
        hash no tier has). Touches nothing."""
        found: list[KVTierMedium] = []
        for h in block_hashes:
            slot = self._host.get(h)
            if slot is not None:
                if slot in self._filling:
                    break  # its file read is in flight: not usable yet
                found.append(KVTierMedium.CPU)
            elif h in self._disk:
                found.append(KVTierMedium.DISK)
            else:
                break
        return found

    def start_load(self, request_id: str, block_hashes: Sequence[int],
                   block_ids: Sequence[int], detached: bool = False) -> int:
        """Schedule LOAD jobs of ``block_hashes`` (a :meth:`match` of this step) into the
        device blocks ``block_ids`` (same length) for ``request_id``.

        ``detached``: host-tier blocks that the step's forward waits for (the request is
        computed in this step): the load is not the request's (:meth:`is_loading` stays
        False, :meth:`loads_reported` returns nothing for it); its reports only unpin the
        host slots.

        Returns:
            How many leading blocks will be loaded (fewer than asked when a disk block finds no
            host slot because every slot is pinned; 0 schedules nothing).

        Raises:
            ValueError: lengths differ, or the request already has a load in flight.
        """
        if len(block_hashes) != len(block_ids):
            raise ValueError("block_hashes and block_ids must have the same length")
        if not detached and request_id in self._loads:
            raise ValueError(f"request {request_id} already loads from the tiers")
        index: dict[int, int] = {}
        for i, (h, b) in enumerate(zip(block_hashes, block_ids)):
            slot = self._host.get(h)
            from_disk = False
            if slot is not None:
                self._host.move_to_end(h)
                medium = KVTierMedium.CPU
            elif h in self._disk:
                slot = self._take_slot()
                if slot is None:
                    break
                self._host[h] = slot
                self._event(BlockStored, h, KVTierMedium.CPU)
                self._disk.move_to_end(h)
                self._disk_pins[h] = self._disk_pins.get(h, 0) + 1
                from_disk = True
                self._filling.add(slot)
                medium = KVTierMedium.DISK
                self.counters[KVTierMedium.CPU].bytes_in += self.block_bytes
            else:
                break
            self._slot_pins[slot] = self._slot_pins.get(slot, 0) + 1
            job = self._add_job(TierJobKind.LOAD, h, block_id=b, slot=slot, from_disk=from_disk)
            index[job] = i
            self._job_owner[job] = (None if detached else request_id, h, slot, from_disk)
            self.counters[medium].hits += 1
            self.bytes_to_device += self.block_bytes
        if index and not detached:
            self._loads[request_id] = _PendingLoad(index, len(index))
        return len(index)

    def has_unreported_loads(self) -> bool:
        """True while any LOAD job (detached ones included) is not yet reported."""
        return bool(self._job_owner)

    def is_loading(self, request_id: str) -> bool:
        """True while ``request_id`` has LOAD jobs not yet reported."""
        return request_id in self._loads

    def take_jobs(self) -> KVTierJobs | None:
        """The jobs of the step being scheduled, in order (None when there are none)."""
        if not self._jobs:
            return None
        jobs, self._jobs = self._jobs, []
        return KVTierJobs(jobs)

    def loads_reported(self, report: KVTierReport) -> list[TierLoadDone]:
        """Apply the runner's report: unpin what finished loads read, forget blocks whose
        read failed (the file is corrupt or gone: it is never tried again), and return the
        requests whose every LOAD job is over."""
        for s in report.copy_times_s:
            self._copy_times.observe(s)
        done: list[TierLoadDone] = []
        for job, failed in [(j, False) for j in report.finished_loads] + \
                           [(j, True) for j in report.failed_loads]:
            owner = self._job_owner.pop(job, None)
            if owner is None:
                continue
            request_id, h, slot, from_disk = owner
            self._unpin(h, slot, from_disk)
            if request_id is None:  # a detached load: only its slots were pinned
                if failed:
                    self._forget(h, slot)
                continue
            load = self._loads[request_id]
            i = load.job_index.pop(job)
            if failed:
                self._forget(h, slot)
                load.first_failed = i if load.first_failed is None else min(load.first_failed, i)
            if not load.job_index:
                del self._loads[request_id]
                good = load.total if load.first_failed is None else load.first_failed
                done.append(TierLoadDone(request_id, load.total, good))
        return done

    def _unpin(self, h: int, slot: int, from_disk: bool) -> None:
        pins = self._slot_pins[slot] - 1
        if pins:
            self._slot_pins[slot] = pins
        else:
            del self._slot_pins[slot]
        if from_disk:
            self._filling.discard(slot)
            dp = self._disk_pins.get(h, 1) - 1
            if dp:
                self._disk_pins[h] = dp
            else:
                self._disk_pins.pop(h, None)

    def _forget(self, h: int, slot: int) -> None:
        """A read of ``h`` failed: its host copy (filled from the bad file) and its file go."""
        if self._host.get(h) == slot and not self._slot_pins.get(slot):
            del self._host[h]
            self._free_slots.append(slot)
            self._event(BlockRemoved, h, KVTierMedium.CPU)
        if h in self._disk and not self._disk_pins.get(h):
            del self._disk[h]
            self._event(BlockRemoved, h, KVTierMedium.DISK)
            self._add_job(TierJobKind.DISK_DELETE, h)

    def clear(self) -> bool:
        """Forget every block of both tiers (their files are deleted by DISK_DELETE jobs).
        Only possible while no load is in flight (detached ones included).

        Returns:
            True when the tiers were cleared.
        """
        if self._loads or self._job_owner:
            return False
        for h in list(self._host):
            self._event(BlockRemoved, h, KVTierMedium.CPU)
        for h in list(self._disk):
            self._event(BlockRemoved, h, KVTierMedium.DISK)
            self._add_job(TierJobKind.DISK_DELETE, h)
        self._host.clear()
        self._disk.clear()
        self._free_slots = list(range(self.host_blocks - 1, -1, -1))
        return True

    # ---------------------------------------------------------------- status
    def stats(self) -> dict:
        """Snapshot for ``/metrics``: per tier capacity, use and cumulative counters, the
        bytes copied back into the device cache and the copy-time histogram (cumulative
        bucket counts, upper bounds :data:`~pdserve.types.kv_tiers.COPY_TIME_BUCKETS_S`)."""
        media = {}
        for medium, capacity, used in ((KVTierMedium.CPU, self.host_blocks, len(self._host)),
                                       (KVTierMedium.DISK, self.disk_blocks, len(self._disk))):
            if capacity == 0:
                continue
            c = self.counters[medium]
            media[medium.value] = {
                "capacity_blocks": capacity, "used_blocks": used, "hits": c.hits,
                "stored": c.stored, "evictions": c.evictions, "bytes_in": c.bytes_in,
            }
        return {"media": media, "bytes_to_device": self.bytes_to_device, "dropped": self.dropped,
                "copy_time_counts": list(self._copy_times.counts),
                "copy_time_sum_s": self._copy_times.total_s}

    def check_consistency(self) -> None:
        """Assert the internal invariants (tests).

        Raises:
            AssertionError: slots used twice or lost, pins of unknown slots.
        """
        used = list(self._host.values())
        assert len(used) == len(set(used)), "a host slot holds two hashes"
        assert not set(used) & set(self._free_slots), "a used slot is also free"
        assert len(used) + len(self._free_slots) == self.host_blocks, "host slots lost"
        assert len(self._disk) <= self.disk_blocks, "disk tier over capacity"
        assert set(self._slot_pins) <= set(used), "a pinned slot holds no block"
