"""Fixtures for the model-side tests: torch runs single-threaded (tests/torch_threads.py)."""

from torch_threads import _one_torch_thread  # noqa: F401  (autouse session fixture)
