"""The attention backend choice (pdserve/attention/selector.py)."""

from __future__ import annotations

import pytest
import torch

from pdserve.attention.selector import select_attention_backend
from pdserve.attention.torch_backend import TorchAttentionBackend


def test_cpu_gets_the_torch_backend(monkeypatch):
    monkeypatch.delenv("PDSERVE_ATTENTION_BACKEND", raising=False)
    backend = select_attention_backend(torch.device("cpu"), 4, 2, 16, 16, 0.25)
    assert type(backend) is TorchAttentionBackend


def test_an_unknown_backend_name_is_an_error(monkeypatch):
    monkeypatch.setenv("PDSERVE_ATTENTION_BACKEND", "bogus")
    with pytest.raises(ValueError, match="PDSERVE_ATTENTION_BACKEND='bogus'"):
        select_attention_backend(torch.device("cpu"), 4, 2, 16, 16, 0.25)
