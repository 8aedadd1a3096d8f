"""KV cache tiers behind the prefix cache: their configuration, the copy jobs the scheduler hands
the model runner each step, and the runner's report of them (torch-free).

A block evicted from the device KV cache while it is registered in the prefix cache is copied to
a host-memory pool (the *CPU* tier; a second host pool on a CPU engine) and, when that pool
evicts it in turn, written to a file of the optional *DISK* tier. A prefix lookup that misses on
the device and hits a tier copies the blocks back (docs/architecture.md, "KV cache tiers").
The names of the media are those of vLLM's KV events (``medium``): ``GPU`` (the engine's own KV
cache, whatever its device), ``CPU``, ``DISK``.

Jobs are ordered: the runner executes a step's :attr:`KVTierJobs.jobs` before the step's
forward pass, the STORE / DISK_WRITE / DISK_DELETE jobs in list order and then the LOAD jobs in
list order (no LOAD is ever listed before a job that it must follow: a loaded block is not
cached, a slot a LOAD reads is pinned), so a host slot written to disk and then reused, or a
device block stored and then overwritten by the step, always sees its old content first.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field

GiB = 1 << 30


class KVTierMedium(enum.Enum):
    """Where a block's KV is; the values are vLLM's KV-event ``medium`` strings."""

    GPU = "GPU"  # the engine's KV cache (device memory, or host memory on a CPU engine)
    CPU = "CPU"  # the host-memory tier
    DISK = "DISK"  # the disk tier


class KVOffloadingBackend(enum.Enum):
    """``--kv-offloading-backend``: only vLLM's ``native`` backend exists here."""

    NATIVE = "native"

    @classmethod
    def parse(cls, text: str) -> "KVOffloadingBackend":
        """The backend named ``text`` (case and surrounding blanks ignored).

        Raises:
            ValueError: an unknown backend (the message names the flag).
        """
        try:
            return cls(text.strip().lower())
        except ValueError:
            raise ValueError(f"--kv-offloading-backend must be 'native', got {text!r}") from None


@dataclass(frozen=True)
class KVOffloadingConfig:
    """The KV tiers of one engine (``--kv-offloading-size``, ``--kv-offloading-backend``,
    ``--kv-offloading-disk-dir``, ``--kv-offloading-disk-size``).

    Attributes:
        host_bytes: bytes of the host-memory tier over all TP ranks (each rank holds its shard
            of every block, ``host_bytes / tp_size``).
        backend: the offloading backend.
        disk_dir: directory of the disk tier's files, or None (no disk tier).
        disk_bytes: bytes of the disk tier over all TP ranks (0 without a disk tier).
    """

    host_bytes: int
    backend: KVOffloadingBackend = KVOffloadingBackend.NATIVE
    disk_dir: str | None = None
    disk_bytes: int = 0

    @classmethod
    def from_flags(cls, size_gib: float | None, backend: str | None, disk_dir: str | None,
                   disk_size_gib: float | None) -> "KVOffloadingConfig | None":
        """Validate the command-line values (GiB as floats) into a config; None when no tier
        is asked for.

        Raises:
            ValueError: a non-positive or non-finite size, an unknown backend, a disk tier
                without a host tier (the disk tier sits below it), a disk directory without a
                size or a size without a directory (the message names the flag).
        """
        parsed_backend = (KVOffloadingBackend.parse(backend) if backend is not None
                          else KVOffloadingBackend.NATIVE)
        if size_gib is None:
            if backend is not None or disk_dir is not None or disk_size_gib is not None:
                raise ValueError("--kv-offloading-backend / --kv-offloading-disk-dir / "
                                 "--kv-offloading-disk-size need --kv-offloading-size GiB "
                                 "(the host-memory tier the disk tier sits below)")
            return None
        if not 0 < size_gib < math.inf:
            raise ValueError(f"--kv-offloading-size must be a finite number > 0 GiB, "
                             f"got {size_gib}")
        if (disk_dir is None) != (disk_size_gib is None):
            raise ValueError("--kv-offloading-disk-dir and --kv-offloading-disk-size go together")
        if disk_size_gib is not None and not 0 < disk_size_gib < math.inf:
            raise ValueError(f"--kv-offloading-disk-size must be a finite number > 0 GiB, "
                             f"got {disk_size_gib}")
        return cls(host_bytes=int(size_gib * GiB), backend=parsed_backend, disk_dir=disk_dir,
                   disk_bytes=int((disk_size_gib or 0) * GiB))

    def capacity(self, block_bytes: int, tp_size: int = 1) -> tuple[int, int]:
        """``(host_blocks, disk_blocks)``: blocks of one TP rank's shard (``block_bytes``
        bytes each) that fit in each tier.

        Raises:
            ValueError: the host tier holds no block (the message gives the block's size).
        """
        if block_bytes <= 0 or tp_size <= 0:
            raise ValueError("block_bytes and tp_size must be positive")
        host = self.host_bytes // tp_size // block_bytes
        disk = self.disk_bytes // tp_size // block_bytes
        if host < 1:
            raise ValueError(f"--kv-offloading-size {self.host_bytes / GiB:.4g} GiB holds no KV "
                             f"block of {block_bytes * tp_size} bytes")
        if self.disk_dir is not None and disk < 1:
            raise ValueError(f"--kv-offloading-disk-size {self.disk_bytes / GiB:.4g} GiB holds "
                             f"no KV block of {block_bytes * tp_size} bytes")
        return int(host), int(disk)


class TierJobKind(enum.Enum):
    """What one :class:`TierJob` copies."""

    STORE = "store"  # device block -> host slot (a cached block evicted from the device)
    LOAD = "load"  # host slot -> device block (``from_disk``: file -> host slot first)
    DISK_WRITE = "disk_write"  # host slot -> file of ``block_hash``
    DISK_DELETE = "disk_delete"  # remove the file of ``block_hash``


@dataclass(frozen=True)
class TierJob:
    """One copy of one block.

    Attributes:
        kind: see :class:`TierJobKind`.
        job_id: unique per engine (LOAD jobs are reported back by id).
        block_hash: the prefix cache's chained hash of the block's tokens (the key of every tier).
        block_id: device block (STORE, LOAD), else -1.
        slot: host slot (STORE, LOAD, DISK_WRITE), else -1.
        from_disk: LOAD only: read the block's file into ``slot`` first.
    """

    kind: TierJobKind
    job_id: int
    block_hash: int
    block_id: int = -1
    slot: int = -1
    from_disk: bool = False


@dataclass
class KVTierJobs:
    """A step's tier jobs, executed by the runner in list order before the forward pass."""

    jobs: list[TierJob] = field(default_factory=list)


@dataclass
class KVTierReport:
    """The runner's report of tier jobs after a step.

    Attributes:
        finished_loads: LOAD job ids whose block is in the device cache now.
        failed_loads: LOAD job ids whose block could not be read (a corrupt or truncated
            file): the block's KV is NOT in the device cache.
        copy_times_s: seconds of each finished copy batch (device<->host, or a file read).
    """

    finished_loads: set[int] = field(default_factory=set)
    failed_loads: set[int] = field(default_factory=set)
    copy_times_s: list[float] = field(default_factory=list)


#: Upper bounds (s) of the tier copy-time histogram's buckets.
COPY_TIME_BUCKETS_S = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1,
                       0.25, 0.5, 1.0, 2.5)
