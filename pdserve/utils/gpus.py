"""Which GPUs this process may use, without importing torch (the API process and ``pdserve up``
both ask, before any engine starts)."""

from __future__ import annotations

import os
import subprocess


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
