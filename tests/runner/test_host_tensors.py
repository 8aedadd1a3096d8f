"""Host tensors of a step's inputs built through numpy (pdserve/attention/host_tensors.py)."""

from __future__ import annotations

import pytest
import torch

from pdserve.attention.host_tensors import int_tensor, padded_rows


def test_int_tensor_values_and_dtypes():
    t = int_tensor([3, -1, 2**40])
    assert t.dtype == torch.int64 and t.tolist() == [3, -1, 2**40]
    t32 = int_tensor(iter(range(5)), torch.int32, count=3)
    assert t32.dtype == torch.int32 and t32.tolist() == [0, 1, 2]
    assert int_tensor([]).shape == (0,)
    with pytest.raises((OverflowError, ValueError)):
        int_tensor([2**40], torch.int32)
    with pytest.raises(KeyError):
        int_tensor([1], torch.float32)


def test_padded_rows_cut_and_pad():
    t = padded_rows([[1, 2, 3], [], [4, 5, 6, 7, 8]], 4)
    assert t.dtype == torch.int32
    assert t.tolist() == [[1, 2, 3, 0], [0, 0, 0, 0], [4, 5, 6, 7]]
    assert padded_rows([[9]], 1, torch.int64).tolist() == [[9]]
