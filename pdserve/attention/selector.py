"""Picks the attention backend for a device (``PDSERVE_ATTENTION_BACKEND``): per-head models'
and multi-head latent (MLA) models'."""

from __future__ import annotations

import os

import torch

from pdserve.attention.base import AttentionBackend
from pdserve.attention.mla import MLAAttentionBackend, MLAGeometry
from pdserve.attention.torch_backend import TorchAttentionBackend
from pdserve.attention.triton_backend import TritonAttentionBackend

BACKEND_CHOICES = ("auto", "torch", "triton")


def select_attention_backend(device: torch.device, num_heads: int, num_kv_heads: int,
                             head_dim: int, block_size: int, scale: float) -> AttentionBackend:
    """The attention backend for ``device``: Triton on CUDA when ``triton`` is importable, torch
    SDPA otherwise. ``PDSERVE_ATTENTION_BACKEND=torch`` forces the SDPA backend (and with it the
    layers' torch ops); ``triton`` makes a missing Triton an error on CUDA.

    Args:
        device: the model device.
        num_heads, num_kv_heads, head_dim, block_size, scale: see
            :class:`pdserve.attention.base.AttentionBackend`.

    Raises:
        ImportError: ``PDSERVE_ATTENTION_BACKEND=triton`` on CUDA without Triton.
        ValueError: ``PDSERVE_ATTENTION_BACKEND`` is not one of :data:`BACKEND_CHOICES`, or a
            bad head geometry (see :class:`AttentionBackend`).
    """
    args = (num_heads, num_kv_heads, head_dim, block_size, scale)
    choice = _choice()
    if device.type == "cuda" and choice in ("auto", "triton"):
        try:
            return TritonAttentionBackend(*args)
        except ImportError:
            if choice == "triton":
                raise
    return TorchAttentionBackend(*args)


def _choice() -> str:
    """``PDSERVE_ATTENTION_BACKEND`` (default ``auto``).

    Raises:
        ValueError: not one of :data:`BACKEND_CHOICES`.
    """
    choice = os.environ.get("PDSERVE_ATTENTION_BACKEND", "auto").lower()
    if choice not in BACKEND_CHOICES:
        raise ValueError(f"PDSERVE_ATTENTION_BACKEND={choice!r} is not one of "
                         f"{', '.join(BACKEND_CHOICES)}")
    return choice


def select_mla_backend(device: torch.device, geometry: MLAGeometry, block_size: int,
                       scale: float) -> MLAAttentionBackend:
    """The multi-head latent attention backend for ``device``, by the rule of
    :func:`select_attention_backend`: :class:`~pdserve.attention.mla_triton.
    TritonMLAAttentionBackend` on CUDA when Triton is importable (CUDA graphs, the layers' Triton
    ops), the torch :class:`~pdserve.attention.mla.MLAAttentionBackend` otherwise or with
    ``PDSERVE_ATTENTION_BACKEND=torch``.

    Raises:
        ImportError: ``PDSERVE_ATTENTION_BACKEND=triton`` on CUDA without Triton.
        ValueError: a bad ``PDSERVE_ATTENTION_BACKEND`` or an odd latent entry width.
    """
    choice = _choice()
    if device.type == "cuda" and choice in ("auto", "triton"):
        try:
            from pdserve.attention.mla_triton import TritonMLAAttentionBackend

            return TritonMLAAttentionBackend(geometry, block_size, scale)
        except ImportError:
            if choice == "triton":
                raise
    return MLAAttentionBackend(geometry, block_size, scale)
