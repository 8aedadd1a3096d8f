"""Fixtures for the model-side tests: torch runs single-threaded
(tests/support/torch_threads.py)."""

from tests.support.torch_threads import _one_torch_thread  # noqa: F401  (autouse session fixture)
