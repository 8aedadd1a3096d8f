"""Capture and replay of decode steps as CUDA graphs, one graph per padded batch size.

A decode step of a small model launches hundreds of small kernels; replaying them as one CUDA
graph removes the per-launch CPU cost, which is what bounds batch-1 decode latency (TPOT). The
technique is the one vLLM and SGLang use: capture the forward pass once per batch size from a fixed
list, with every input in a static buffer; at run time copy the real inputs into the buffers, pad
the batch up to the next captured size, and replay.

The helper is generic: it knows nothing about the model. The model runner passes a callable
``forward(static_inputs) -> output`` whose launches depend only on the shapes of the tensors it is
given (no host synchronisation, no data-dependent shapes, no ``.item()``), and a description of the
inputs. ``--enforce-eager`` is the runner's business: it simply does not build a
:class:`CUDAGraphRunner`.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils import _pytree as pytree


@dataclass(frozen=True)
class StaticInputSpec:
    """One batched input of the captured forward pass.

    Attributes:
        shape: the shape of one row, without the leading batch dim (``()`` for a per-sequence
            scalar such as a position; ``(max_blocks,)`` for a block table).
        dtype: the buffer's dtype.
        pad_value: what padding rows (and the unused tail of narrower rows) are filled with. It
            must make the forward pass harmless for those rows, e.g. slot ``-1`` (the KV write skips
            it) and context length ``0`` (attention returns zeros).
    """

    shape: tuple[int, ...]
    dtype: torch.dtype
    pad_value: int | float


def default_capture_sizes(max_batch_size: int) -> list[int]:
    """Batch sizes to capture: 1, 2, 4, 8, then every multiple of 16, and ``max_batch_size``.

    Padding a batch to the next size wastes at most a third of a step for sizes above 8.

    Raises:
        ValueError: if ``max_batch_size < 1``.
    """
    if max_batch_size < 1:
        raise ValueError(f"max_batch_size must be at least 1, got {max_batch_size}")
    sizes = {s for s in (1, 2, 4, 8) if s <= max_batch_size}
    sizes.update(range(16, max_batch_size + 1, 16))
    sizes.add(max_batch_size)
    return sorted(sizes)


def padded_batch_size(num_seqs: int, capture_sizes: Sequence[int]) -> int | None:
    """The smallest captured size that holds ``num_seqs`` rows, or None if none does.

    ``capture_sizes`` must be sorted ascending.
    """
    i = bisect.bisect_left(capture_sizes, num_seqs)
    return capture_sizes[i] if i < len(capture_sizes) else None


def warm_up(fn: Callable[[], Any], times: int) -> torch.cuda.Stream:
    """Run ``fn`` ``times`` times eagerly on a side stream before its capture (Triton compiles,
    cuBLAS picks its kernels, the allocator caches its blocks), then wait for the device.

    Returns:
        The side stream (a capture may run on it: not the legacy default stream).
    """
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(times):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    return side


def capture_agreed(capture: Callable[[], Any],
                   agree: Callable[[str | None], bool] | None) -> tuple[bool, Any]:
    """Run one size's ``capture()``; with ``agree`` (tensor parallelism), hand its error (None:
    captured) to every rank and learn whether every rank captured that size.

    Returns:
        ``(ok, result)``: ``ok`` False when a rank failed (``result`` is then None).

    Raises:
        Exception: ``capture``'s own error when ``agree`` is None.
    """
    error, result = None, None
    try:
        result = capture()
    except Exception as e:  # with agree: reported to every rank below
        if agree is None:
            raise
        error = f"{type(e).__name__}: {e}"
    if agree is not None and not agree(error):
        return False, None
    return True, result


class CUDAGraphRunner:
    """Static input buffers plus one captured CUDA graph per batch size.

    Args:
        forward: ``forward(static_inputs) -> output``; ``static_inputs`` maps each name of
            ``input_specs`` to a ``[batch, *spec.shape]`` view of its static buffer. The output is a
            tensor (or a tuple/list/dict of tensors) whose dim 0 is the batch, e.g. logits
            ``[batch, vocab]``.
        input_specs: name -> :class:`StaticInputSpec`.
        capture_sizes: batch sizes to capture (see :func:`default_capture_sizes`).
        device: a CUDA device.
        num_warmup: eager runs before each capture (lets Triton compile and cuBLAS pick kernels
            outside the capture).

    Raises:
        ValueError: on a non-CUDA device or an empty/invalid size list.
    """

    def __init__(
        self,
        forward: Callable[[dict[str, torch.Tensor]], Any],
        input_specs: Mapping[str, StaticInputSpec],
        capture_sizes: Sequence[int],
        device: torch.device | str,
        num_warmup: int = 2,
    ) -> None:
        device = torch.device(device)
        if device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device, got {device}")
        sizes = sorted(set(int(s) for s in capture_sizes))
        if not sizes or sizes[0] < 1:
            raise ValueError(f"capture_sizes must be positive batch sizes, got {list(capture_sizes)}")
        self.forward = forward
        self.specs = dict(input_specs)
        self.capture_sizes = sizes
        self.max_batch_size = sizes[-1]
        self.device = device
        self.num_warmup = num_warmup
        self.buffers = {
            name: torch.full(
                (self.max_batch_size, *spec.shape), spec.pad_value, dtype=spec.dtype, device=device
            )
            for name, spec in self.specs.items()
        }
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._outputs: dict[int, Any] = {}
        self._pool = None

    @property
    def captured(self) -> bool:
        """True once :meth:`capture` has run."""
        return bool(self._graphs)

    def padded_size(self, num_seqs: int) -> int | None:
        """The captured batch size a batch of ``num_seqs`` runs at, or None if too large."""
        return padded_batch_size(num_seqs, self.capture_sizes)

    def _views(self, batch_size: int) -> dict[str, torch.Tensor]:
        return {name: buf[:batch_size] for name, buf in self.buffers.items()}

    @torch.inference_mode()
    def capture(self, agree: Callable[[str | None], bool] | None = None) -> bool:
        """Capture one graph per batch size, largest first, all in one memory pool.

        The buffers hold only padding values during capture, so the forward pass must be harmless
        on padding rows (see :class:`StaticInputSpec`).

        Args:
            agree: for a forward pass with collectives (tensor parallelism): called after each
                batch size on every rank with this rank's capture error (None: captured);
                returns whether every rank captured that size. All ranks then stop together at
                the first size one of them failed, so no rank is left in a warm-up collective
                the others never join. None: an error raises.

        Returns:
            True when every size was captured; False when ``agree`` said a rank failed (no
            graph is kept).
        """
        self._pool = torch.cuda.graph_pool_handle()
        with torch.cuda.device(self.device):
            for bs in reversed(self.capture_sizes):
                inputs = self._views(bs)
                warm_up(lambda: self.forward(inputs), self.num_warmup)
                graph = torch.cuda.CUDAGraph()

                def capture(graph=graph, inputs=inputs):
                    with torch.cuda.graph(graph, pool=self._pool):
                        return self.forward(inputs)

                ok, out = capture_agreed(capture, agree)
                if not ok:
                    self._graphs.clear()
                    self._outputs.clear()
                    return False
                self._graphs[bs] = graph
                self._outputs[bs] = out
            torch.cuda.synchronize()
        return True

    def _fill(self, name: str, value: torch.Tensor, n: int, bs: int) -> None:
        buf = self.buffers[name]
        spec = self.specs[name]
        if value.shape[0] != n:
            raise ValueError(f"input {name!r} has {value.shape[0]} rows, expected {n}")
        row_shape = tuple(value.shape[1:])
        if row_shape == spec.shape:
            buf[:n].copy_(value, non_blocking=True)
        else:
            if len(row_shape) != len(spec.shape) or any(a > b for a, b in zip(row_shape, spec.shape)):
                raise ValueError(f"input {name!r} rows {row_shape} do not fit the static rows {spec.shape}")
            buf[:n].fill_(spec.pad_value)
            buf[(slice(0, n), *(slice(0, d) for d in row_shape))].copy_(value, non_blocking=True)
        if bs > n:
            buf[n:bs].fill_(spec.pad_value)

    @torch.inference_mode()
    def run(self, inputs: Mapping[str, torch.Tensor]) -> Any:
        """Copy ``inputs`` into the static buffers, pad, replay, return the output's first rows.

        Args:
            inputs: name -> ``[num_seqs, ...]`` tensor for every input spec (host or device
                tensors); a row may be narrower than the spec (e.g. a shorter block table), the
                rest is filled with the pad value.

        Returns:
            The captured output sliced to ``num_seqs`` rows. It is a view of a static buffer that
            the next replay overwrites: consume or copy it first.

        Raises:
            RuntimeError: if :meth:`capture` has not run.
            ValueError: if an input is missing, has the wrong row count or shape, or the batch is
                larger than the largest captured size.
        """
        if not self._graphs:
            raise RuntimeError("CUDAGraphRunner.run() before capture()")
        missing = set(self.specs) - set(inputs)
        if missing:
            raise ValueError(f"missing graph inputs: {sorted(missing)}")
        n = next(iter(inputs.values())).shape[0]
        bs = self.padded_size(n)
        if bs is None or n < 1:
            raise ValueError(f"batch of {n} is outside the captured sizes 1..{self.max_batch_size}")
        for name in self.specs:
            self._fill(name, inputs[name], n, bs)
        return self.replay(n)

    @torch.inference_mode()
    def replay(self, num_seqs: int) -> Any:
        """Replay the graph of ``num_seqs``' padded size on the inputs already in
        :attr:`buffers` (after :meth:`run`, updated in place on the device, e.g. by a
        multi-step decode round); returns the output's first ``num_seqs`` rows, as :meth:`run`.

        Raises:
            ValueError: ``num_seqs`` is outside the captured sizes.
        """
        bs = self.padded_size(num_seqs)
        if bs is None or num_seqs < 1 or bs not in self._graphs:
            raise ValueError(f"batch of {num_seqs} is outside the captured sizes 1..{self.max_batch_size}")
        self._graphs[bs].replay()
        return pytree.tree_map(lambda t: t[:num_seqs] if isinstance(t, torch.Tensor) else t,
                               self._outputs[bs])
