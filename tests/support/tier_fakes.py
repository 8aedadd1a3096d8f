"""A fake model runner with KV cache tiers: the fake KV slots of
:class:`~tests.support.engine_fakes.FakeModelRunner` copied to a fake host pool and a fake disk
exactly as the scheduler's tier jobs say. Any bookkeeping mistake (a block loaded from the wrong
slot, a slot reused while still needed, a stale file) puts wrong ``(position, token)`` pairs in
the KV and changes the sampled tokens.
"""

from __future__ import annotations

from typing import Any

from pdserve.engine.core import EngineCore
from pdserve.types.kv_tiers import KVOffloadingConfig, KVTierReport, TierJobKind
from pdserve.types.outputs import ModelRunnerOutput, SchedulerOutput
from tests.support.engine_fakes import FakeModelRunner, FakePendingStep, make_config


class _Spec(int):
    """The fake cache's spec: the block size (what the fake connector worker needs) with a
    ``block_bytes`` of 1, so tier sizes in bytes are sizes in blocks."""

    @property
    def block_bytes(self) -> int:
        return 1


class TieredFakeRunner(FakeModelRunner):
    """:class:`FakeModelRunner` with a host pool and a disk of block copies.

    Attributes:
        load_delay_steps: executes between a LOAD's issue and its report (a copy stream's lag).
        corrupt: block hashes whose file reads fail (a corrupt file).
        jobs: every tier job run, in order.
    """

    def __init__(self, *args: Any, load_delay_steps: int = 0, **kw: Any):
        super().__init__(*args, **kw)
        self.load_delay_steps = load_delay_steps
        self.corrupt: set[int] = set()
        self.host: list[list | None] = []
        self.disk: dict[int, list] = {}
        self.jobs: list = []
        self._due: list[tuple[int, int, bool]] = []  # (execute number, job id, failed)

    @property
    def kv_cache_spec(self) -> _Spec:
        return _Spec(self.block_size)

    def allocate_kv_tiers(self, host_blocks: int, disk_dir: str | None) -> None:
        self.host = [None] * host_blocks

    def _block(self, block_id: int) -> list:
        bs = self.block_size
        return self.kv[block_id * bs:(block_id + 1) * bs]

    def _run_jobs(self, sched: SchedulerOutput) -> None:
        self._run_launched()  # a copy stream waits for the work queued before it
        if sched.kv_tier_jobs is None:
            return
        bs = self.block_size
        for job in sched.kv_tier_jobs.jobs:
            self.jobs.append(job)
            if job.kind is TierJobKind.STORE:
                self.host[job.slot] = self._block(job.block_id)
            elif job.kind is TierJobKind.DISK_WRITE:
                self.disk[job.block_hash] = list(self.host[job.slot])
            elif job.kind is TierJobKind.DISK_DELETE:
                self.disk.pop(job.block_hash)
            else:  # LOAD
                failed = False
                if job.from_disk:
                    failed = job.block_hash in self.corrupt or job.block_hash not in self.disk
                    if not failed:
                        self.host[job.slot] = list(self.disk[job.block_hash])
                if not failed:
                    self.kv[job.block_id * bs:(job.block_id + 1) * bs] = self.host[job.slot]
                self._due.append((self.num_executes + 1 + self.load_delay_steps, job.job_id,
                                  failed))

    def _report(self) -> KVTierReport:
        report = KVTierReport()
        due = [d for d in self._due if d[0] <= self.num_executes]
        self._due = [d for d in self._due if d[0] > self.num_executes]
        for _, job_id, failed in due:
            (report.failed_loads if failed else report.finished_loads).add(job_id)
        return report

    def execute(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        self._run_jobs(sched)
        out = super().execute(sched)
        out.kv_tier_report = self._report()
        return out

    def execute_async(self, sched: SchedulerOutput) -> FakePendingStep:
        self._run_jobs(sched)
        step = super().execute_async(sched)
        step.kv_tier_report = self._report()
        return step


def make_tiered_core(num_blocks: int = 16, block_size: int = 4, host_blocks: int = 64,
                     disk_blocks: int = 0, load_delay_steps: int = 0,
                     connectors: tuple[Any, Any] | None = None,
                     **cfg: Any) -> tuple[EngineCore, TieredFakeRunner]:
    """An EngineCore over a :class:`TieredFakeRunner` with ``host_blocks`` host slots and
    ``disk_blocks`` disk blocks (``host_blocks=0``: no KV cache tiers)."""
    runner = TieredFakeRunner(num_blocks, block_size, load_delay_steps=load_delay_steps)
    off = KVOffloadingConfig(host_bytes=host_blocks, disk_dir="/unused" if disk_blocks else None,
                             disk_bytes=disk_blocks) if host_blocks else None  # 0: no tiers
    config = make_config(block_size=block_size, kv_offloading=off, **cfg)
    return EngineCore(config, lambda _config: runner, connectors=connectors), runner
