"""The GPUs of this host, found without torch, and the defaults chosen from them (NIXL's
progress thread) for ``pdserve serve`` and ``pdserve up`` alike."""

from __future__ import annotations

import os
import subprocess
from typing import Sequence

__all__ = ["detect_gpus", "nixl_progress_thread_default"]


def detect_gpus() -> list[str]:
    """GPUs this process may use, as ``CUDA_VISIBLE_DEVICES`` entries (indices or UUIDs).

    Honours an existing ``CUDA_VISIBLE_DEVICES`` (entries up to the first invalid one, as CUDA
    does); otherwise asks ``nvidia-smi -L``. Returns ``[]`` when there is no NVIDIA GPU. Does not
    import torch, so ``pdserve up`` starts fast.
    """
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        gpus = []
        for entry in visible.split(","):
            entry = entry.strip()
            if not entry or entry.startswith("-"):
                break
            gpus.append(entry)
        return gpus
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=20,
                             check=False)
    except (OSError, subprocess.TimeoutExpired):
        return []
    if out.returncode != 0:
        return []
    return [str(i) for i, line in enumerate(l for l in out.stdout.splitlines()
                                            if l.startswith("GPU "))]


def nixl_progress_thread_default(device: str | None, gpus: Sequence[str]) -> bool:
    """Whether an engine runs NIXL's progress thread when ``nixl_progress_thread`` is not given.

    The thread polls UCX without pause and keeps one CPU core busy: worth it next to a GPU,
    a loss for an engine on the CPU, whose host's cores compute the model (docs/configuration.md,
    "NIXL's progress thread"). So: on when the engine has a GPU (``device`` is not ``"cpu"``
    and ``gpus`` is not empty), off otherwise.

    Args:
        device: the engine's ``--device`` (``auto``, ``cpu``, ``cuda``; None: auto).
        gpus: the GPUs the engine may use (:func:`detect_gpus`, or those ``pdserve up`` gave it).
    """
    return device != "cpu" and bool(gpus)
