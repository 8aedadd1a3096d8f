"""The small-batch linear kernel (pdserve/kernels/gemv.py) against ``F.linear``, and the linear
layers' choice of it.

Without CUDA the kernel runs under Triton's interpreter (``TRITON_INTERPRET=1``, set by
``import_kernels`` before ``triton`` is imported) on small shapes.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.support.triton_kernels import import_kernels

gemv, HAS_CUDA = import_kernels("pdserve.kernels.gemv", "_gemv_kernel")

from pdserve.layers.linear import Linear, MergedLinear, RowParallelLinear  # noqa: E402

DEVICE = torch.device("cuda" if HAS_CUDA else "cpu")


@pytest.mark.parametrize("rows", [1, 2])
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matches_f_linear(rows, with_bias, dtype):
    # N not a multiple of the 4 features per program, K not a multiple of the 512-wide step
    gen = torch.Generator().manual_seed(rows)
    n, k = 22, 600
    w = torch.randn(n, k, generator=gen).to(DEVICE, dtype)
    x = torch.randn(rows, k, generator=gen).to(DEVICE, dtype)
    b = torch.randn(n, generator=gen).to(DEVICE, dtype) if with_bias else None
    got = gemv.small_batch_linear(x, w, b)
    ref = F.linear(x.double(), w.double(), None if b is None else b.double())
    assert got.shape == (rows, n) and got.dtype == dtype
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    assert ((got.double() - ref).norm() / ref.norm()).item() < tol


def test_rejects_what_it_cannot_compute():
    w = torch.zeros(8, 16, device=DEVICE)
    with pytest.raises(ValueError, match="rows"):
        gemv.small_batch_linear(torch.zeros(gemv.MAX_ROWS + 1, 16, device=DEVICE), w)
    with pytest.raises(ValueError, match="expected"):
        gemv.small_batch_linear(torch.zeros(1, 15, device=DEVICE), w)
    with pytest.raises(ValueError, match="contiguous"):
        gemv.small_batch_linear(torch.zeros(1, 32, device=DEVICE)[:, ::2], w)
    with pytest.raises(ValueError, match="mismatch"):
        gemv.small_batch_linear(torch.zeros(1, 16, device=DEVICE), w, torch.zeros(7, device=DEVICE))


@pytest.mark.parametrize("cls", [Linear, MergedLinear, RowParallelLinear])
def test_layers_take_the_kernel_for_few_rows_only(cls, monkeypatch):
    calls = []
    real = gemv.small_batch_linear
    monkeypatch.setattr(gemv, "small_batch_linear", lambda *a: calls.append(a[0].shape[0]) or real(*a))
    args = (32, [12, 8]) if cls is MergedLinear else (32, 20)  # out_features <= in_features
    layer = cls(*args, True, torch.float32, DEVICE)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(layer.weight.shape, generator=gen))
        layer.bias.copy_(torch.randn(layer.bias.shape, generator=gen))
    for rows in (1, 2, 3):
        x = torch.randn(rows, 32, generator=gen).to(DEVICE)
        layer.use_triton = False
        ref = layer(x)
        layer.use_triton = True
        assert torch.allclose(layer(x), ref, rtol=1e-5, atol=1e-5)
    assert calls == [1, 2]  # only with the Triton ops on, only up to MAX_ROWS rows


def test_preferred_follows_the_measured_shapes():
    assert gemv.preferred(1, 6144, 1024)  # one row: always
    assert gemv.preferred(2, 1024, 3072) and not gemv.preferred(2, 4096, 1024)
    assert not gemv.preferred(3, 16, 1024)
