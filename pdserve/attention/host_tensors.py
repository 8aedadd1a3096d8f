"""Host-side integer tensors of a step's inputs, built through numpy.

``torch.tensor`` on a Python list inspects every element's type, which costs several times what a
conversion through numpy does (docs/benchmarks.md, "Measurements moved out of code comments"). The
model runner builds its per-step inputs (token ids, positions, slots, block tables) and its
attention metadata with these functions.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
import torch

_NUMPY_DTYPES = {torch.int64: np.int64, torch.int32: np.int32}


def int_tensor(values: Iterable[int], dtype: torch.dtype = torch.int64,
               count: int = -1) -> torch.Tensor:
    """A 1-D CPU tensor of ``values``.

    Args:
        values: ints (a list, or any iterable; ``count`` items of it when given).
        dtype: ``torch.int64`` or ``torch.int32``.
        count: number of items, or -1 for all of them.

    Raises:
        KeyError: another dtype.
        ValueError: fewer than ``count`` items, or a value that does not fit ``dtype``.
        OverflowError: a value that does not fit ``dtype``.
    """
    return torch.from_numpy(np.fromiter(values, _NUMPY_DTYPES[dtype], count))


def padded_rows(rows: list[list[int]], width: int, dtype: torch.dtype = torch.int32) -> torch.Tensor:
    """``[len(rows), width]`` CPU tensor: row ``i`` starts with ``rows[i]`` (cut to ``width``)
    and is padded with 0.

    Raises:
        KeyError: ``dtype`` is not int64 or int32.
    """
    out = np.zeros((len(rows), width), dtype=_NUMPY_DTYPES[dtype])
    for i, row in enumerate(rows):
        out[i, :min(len(row), width)] = row[:width]
    return torch.from_numpy(out)
