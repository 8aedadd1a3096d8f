"""Host-buffer mode (``kv_buffer_device: "cpu"`` with the KV cache on CUDA): NIXL moves KV
between pinned host mirrors of the instances' KV caches, and the engine copies blocks between its
GPU cache and its mirror.

Block ``i`` of the mirror stages block ``i`` of the GPU cache (one to one, so block ids need no
translation). An owner copies a finished request's blocks to the mirror first and registers the
lease only when that copy is done, so a claim (which waits for an unknown lease, see
``side_channel.py``) is answered once the host bytes are ready; a reader's NIXL READ lands in its
mirror, and the load finishes after the mirror's blocks are copied to the GPU cache. Both copies
run on a side CUDA stream, polled by CUDA events. UCX moves host memory between two processes on
one machine without TCP (shared memory, CMA), which is the point of the mode where UCX does not
move GPU memory well.

The mirror costs as much pinned host memory as the KV cache. It lives in an anonymous memory file
(:mod:`.shared_host`) where the platform has them, so that a reader on the same host copies the
owner's mirror blocks straight into its GPU cache instead of a NIXL READ (the path is chosen per
peer, :mod:`.transfer_path`; ``same_host_transport: "nixl"`` keeps NIXL). The copies work on CPU
tensors as well (synchronously), which is how the CPU tests drive the mode.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import torch

from pdserve.kv_transfer.nixl import shared_host

logger = logging.getLogger(__name__)


def wanted(kv_buffer_device: str, cache_device_type: str) -> bool:
    """Whether ``kv_buffer_device`` asks for the host mirror (``"cpu"`` with a CUDA cache)."""
    return kv_buffer_device == "cpu" and cache_device_type == "cuda"


def block_spans(block_ids: list[int]) -> list[tuple[int, int]]:
    """``[(start, count), ...]``: runs of consecutive ids, in order."""
    spans: list[tuple[int, int]] = []
    for b in block_ids:
        if spans and b == spans[-1][0] + spans[-1][1]:
            spans[-1] = (spans[-1][0], spans[-1][1] + 1)
        else:
            spans.append((b, 1))
    return spans


@dataclass
class _Copy:
    event: Any = None  # torch.cuda.Event; None: done (CPU)


@dataclass
class _Staging:
    copy: _Copy
    args: tuple = field(default_factory=tuple)


class HostMirror:
    """A pinned host mirror ``[num_blocks, ...]`` of a KV cache and the copies between them.

    Args:
        kv_cache: the engine's KV cache ``[num_blocks, L, 2, H_kv, block_size, D]`` (CUDA; a CPU
            tensor in tests).

    Attributes:
        host: the mirror (register this one with NIXL).
    """

    def __init__(self, kv_cache: torch.Tensor):
        self.cache = kv_cache
        cuda = kv_cache.is_cuda
        self._shared: shared_host.SharedHostBuffer | None = None
        if shared_host.supported():
            try:
                self._shared = shared_host.SharedHostBuffer(tuple(kv_cache.shape),
                                                            kv_cache.dtype, pin=cuda)
            except OSError as e:
                logger.warning("the KV host buffer cannot be shared with readers on this host "
                               "(%s); they will use NIXL READs", e)
        if self._shared is not None and (self._shared.pinned or not cuda):
            self.host = self._shared.tensor
        else:
            if self._shared is not None:
                self._shared.close()
                self._shared = None
            self.host = torch.empty(kv_cache.shape, dtype=kv_cache.dtype, pin_memory=cuda)
        self._stream = torch.cuda.Stream(kv_cache.device) if cuda else None
        self._staging: dict[str, _Staging] = {}
        logger.info("KV host buffer: %.2f GiB of %s%s host memory mirrors the KV cache",
                    self.host.numel() * self.host.element_size() / 2**30,
                    "pinned" if cuda else "plain", " shared" if self._shared else "")

    def export(self) -> shared_host.MirrorExport | None:
        """How a reader on this host maps the mirror, or None when it is not shared."""
        return self._shared.export() if self._shared is not None else None

    def close(self) -> None:
        """Wait for staging copies and release a shared mirror (call after NIXL deregistered
        it)."""
        if self._stream is not None:
            self._stream.synchronize()
        self._staging.clear()
        if self._shared is not None:
            self.host = None  # type: ignore[assignment]
            self._shared.close()
            self._shared = None

    def _copy(self, block_ids: list[int], to_host: bool) -> _Copy:
        src, dst = (self.cache, self.host) if to_host else (self.host, self.cache)
        if self._stream is None:
            for s, n in block_spans(block_ids):
                dst[s:s + n].copy_(src[s:s + n])
            return _Copy()
        # after the work already queued on the engine's stream (it wrote these blocks, or last
        # used the destination blocks)
        self._stream.wait_stream(torch.cuda.current_stream(self.cache.device))
        with torch.inference_mode(), torch.cuda.stream(self._stream):
            for s, n in block_spans(block_ids):
                dst[s:s + n].copy_(src[s:s + n], non_blocking=True)
            event = torch.cuda.Event()
            event.record()
        return _Copy(event)

    @staticmethod
    def done(copy: _Copy) -> bool:
        """Whether a copy finished (never blocks)."""
        return copy.event is None or copy.event.query()

    # ------------------------------------------------------------------ owner: lease after copy
    def stage(self, request_id: str, block_ids: list[int], *args: Any) -> None:
        """Start copying a leased request's blocks to the mirror; ``args`` come back from
        :meth:`take_staged` when the copy is done."""
        self._staging[request_id] = _Staging(self._copy(block_ids, to_host=True), args)

    def take_staged(self) -> list[tuple[str, tuple]]:
        """``[(request_id, args), ...]`` whose copy to the mirror finished (and forgets them)."""
        ready = [(r, st.args) for r, st in self._staging.items() if self.done(st.copy)]
        for request_id, _ in ready:
            del self._staging[request_id]
        return ready

    def cancel(self, request_id: str) -> bool:
        """Forget a request still being staged (its lease was released); True when it was."""
        return self._staging.pop(request_id, None) is not None

    def pending(self) -> bool:
        """True while copies to the mirror are in flight."""
        return bool(self._staging)

    # -------------------------------------------------------------------- reader: mirror -> GPU
    def to_device(self, block_ids: list[int]) -> _Copy:
        """Start copying the mirror's blocks (a finished READ's destination) to the GPU cache."""
        return self._copy(block_ids, to_host=False)
