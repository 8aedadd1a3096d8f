"""A session fixture that runs torch single-threaded, shared by the model-side test directories
(runner, models, attention, kernels) through their conftest.py."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(scope="session", autouse=True)
def _one_torch_thread():
    """Run torch single-threaded: the CI machine has 2 cores shared by parallel jobs, and OpenMP
    spin-waiting under oversubscription makes multi-threaded CPU kernels many times slower."""
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)
