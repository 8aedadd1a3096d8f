"""Weight loading hooks of the layers: the default loader, the attributes every parameter
carries (``weight_loader``, ``num_shards``), and checkpoint tensors read lazily, so that a
tensor-parallel rank reads only its shard (:class:`LazyWeight`, :func:`narrow_weight`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Union

import torch
from torch import nn


class LazyWeight:
    """A checkpoint tensor not read yet: its shape, and reads of all of it or of a slice.

    A safetensors tensor wraps ``safe_open(...).get_slice(name)`` (:meth:`from_safetensors`),
    so a rank that narrows it reads only its rows or columns from the file, and the full tensor
    is never materialised on a rank that needs a shard.

    Args:
        shape: the tensor's full shape.
        read: ``read(dim, start, length)`` returns that slice as a CPU tensor (``dim`` None:
            the whole tensor).
    """

    def __init__(self, shape: tuple[int, ...],
                 read: Callable[[int | None, int, int], torch.Tensor]):
        self.shape = torch.Size(shape)
        self._read = read

    @classmethod
    def from_safetensors(cls, sl: Any) -> "LazyWeight":
        """Wrap a safetensors ``PySafeSlice`` (``safe_open(...).get_slice(name)``)."""

        def read(dim: int | None, start: int, length: int) -> torch.Tensor:
            if dim is None:
                return sl[:]
            index = [slice(None)] * dim + [slice(start, start + length)]
            return sl[tuple(index)]

        return cls(tuple(sl.get_shape()), read)

    def load(self) -> torch.Tensor:
        """The whole tensor."""
        return self._read(None, 0, 0)

    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor:
        """``length`` entries of dimension ``dim`` from ``start``, read from the source."""
        return self._read(dim, start, length)


#: What a weight loader receives: a tensor in memory, or one still in its checkpoint file.
LoadedWeight = Union[torch.Tensor, LazyWeight]
WeightLoader = Callable[[nn.Parameter, LoadedWeight, "int | None"], None]


def materialize(loaded: LoadedWeight) -> torch.Tensor:
    """``loaded`` as a tensor (reads a :class:`LazyWeight` whole)."""
    return loaded.load() if isinstance(loaded, LazyWeight) else loaded


def narrow_weight(loaded: LoadedWeight, dim: int, full: int, start: int, length: int
                  ) -> torch.Tensor:
    """The slice ``[start, start + length)`` of ``loaded`` along ``dim``, reading only that
    slice from the file when ``loaded`` is a :class:`LazyWeight`.

    Args:
        full: the size dimension ``dim`` must have in the checkpoint (the unsharded size).

    Raises:
        ValueError: ``loaded`` does not have ``full`` entries along ``dim``.
    """
    shape = tuple(loaded.shape)
    if dim >= len(shape) or shape[dim] != full:
        raise ValueError(f"shape {shape}, expected {full} entries along dim {dim}")
    return loaded.narrow(dim, start, length)


def copy_checked(target: torch.Tensor, loaded: LoadedWeight) -> None:
    """Copy ``loaded`` into ``target`` (cast to its dtype and device).

    Raises:
        ValueError: ``shape (..), expected (..)`` when the shapes differ.
    """
    if tuple(loaded.shape) != tuple(target.shape):
        raise ValueError(f"shape {tuple(loaded.shape)}, expected {tuple(target.shape)}")
    target.copy_(materialize(loaded))


def default_weight_loader(param: nn.Parameter, loaded: LoadedWeight,
                          shard_id: int | None = None) -> None:
    """Copy a whole, unsharded tensor into ``param`` (``shard_id`` must be None).

    Raises:
        ValueError: a shape mismatch or a shard id for an unsharded parameter.
    """
    if shard_id is not None:
        raise ValueError(f"shard {shard_id} given for an unsharded parameter")
    copy_checked(param.data, loaded)


def new_parameter(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device,
                  weight_loader: WeightLoader = default_weight_loader,
                  num_shards: int = 1) -> nn.Parameter:
    """An uninitialised, frozen parameter with its loading attributes.

    Args:
        shape: the full (fused) shape.
        dtype, device: where it lives.
        weight_loader: ``loader(param, tensor, shard_id)`` that copies one checkpoint tensor in.
        num_shards: how many checkpoint tensors fill it (3 for q|k|v, 2 for gate|up, else 1).
    """
    param = nn.Parameter(torch.empty(shape, dtype=dtype, device=device), requires_grad=False)
    param.weight_loader = weight_loader
    param.num_shards = num_shards
    return param
