"""Imports a pdserve Triton kernel module for the tests: compiled kernels with CUDA; on a machine
without CUDA the same kernels under Triton's interpreter (``TRITON_INTERPRET=1``, set before
``triton`` is first imported), on small shapes."""

from __future__ import annotations

import importlib
import os

import pytest
import torch


def import_kernels(module: str, kernel: str):
    """``(module, has_cuda)``; skips the calling test module when Triton is not installed, or
    when only CPU is available and Triton's interpreter is older than 3.7 (before 3.7 it turns
    scalars into 1-element arrays that numpy >= 2.4 refuses to convert to int, so loops with
    run-time bounds fail). ``kernel`` names one ``triton.jit`` function of the module: when the
    module was imported earlier in this process without the interpreter, it is reloaded, after
    :mod:`pdserve.kernels.pdl` (whose ``triton.jit`` step every kernel calls)."""
    has_cuda = torch.cuda.is_available()
    if not has_cuda:
        os.environ.setdefault("TRITON_INTERPRET", "1")
    triton = pytest.importorskip("triton")
    if not has_cuda and tuple(int(x) for x in triton.__version__.split(".")[:2]) < (3, 7):
        pytest.skip("the CPU tests need Triton >= 3.7's interpreter", allow_module_level=True)
    mod = importlib.import_module(module)
    if not has_cuda and type(getattr(mod, kernel)).__name__ != "InterpretedFunction":
        pdl = importlib.import_module("pdserve.kernels.pdl")
        if type(pdl.enter).__name__ != "InterpretedFunction":
            importlib.reload(pdl)
        mod = importlib.reload(mod)
    return mod, has_cuda
