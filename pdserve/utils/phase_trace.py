"""Opt-in phase timestamps of requests in every pdserve process, for latency profiling.

With the environment variable ``PDSERVE_PHASE_TRACE`` naming a directory, every process that
imports this module (proxy, API servers, engine cores; children inherit the variable) appends one
line per :func:`mark` to ``<dir>/<pid>.trace``::

    # role P.api
    1733112345.123456 api.in
    1733112345.125710 api.prompt

``role`` names the process (:func:`set_role`: ``proxy``, ``P.api``/``P.core`` for a prefiller,
``D.api``/``D.core`` for a decoder, ``S.api``/``S.core`` without a KV role), the second field is
the wall-clock time in seconds (``time.time()``: one clock for all processes of a host), the third
the phase. Marks carry no request id: the traces of concurrent requests interleave, so a timeline
is read from one client sending one request at a time (``benchmarks/pd_phases.py`` does that and
prints the median offset of each phase from the client's send). Without the variable
:func:`mark` returns at once and nothing is written. The phases are listed in
docs/architecture.md ("Phase trace").
"""

from __future__ import annotations

import os
import threading
import time
from typing import TextIO

#: Environment variable naming the trace directory (unset or empty: tracing off).
ENV = "PDSERVE_PHASE_TRACE"

_dir = os.environ.get(ENV) or None
_role = "?"
_file: TextIO | None = None
_pid = 0
_lock = threading.Lock()  # engine thread and side-channel thread share the file


def enabled() -> bool:
    """True when this process writes marks."""
    return _dir is not None


def set_role(role: str) -> None:
    """Name this process in its trace file (``proxy``, ``P.api``, ``D.core``, ...); call it
    before the first :func:`mark`."""
    global _role
    _role = role


def kv_role_prefix(kv_role: str | None) -> str:
    """``P`` for ``kv_producer``, ``D`` for ``kv_consumer``, ``PD`` for ``kv_both``, ``S``
    (single instance) without a KV role."""
    return {"kv_producer": "P", "kv_consumer": "D", "kv_both": "PD"}.get(kv_role or "", "S")


def mark(phase: str) -> None:
    """Append ``<time.time()> <phase>`` to this process's trace file (nothing when tracing is
    off). ``phase`` must not contain a newline."""
    if _dir is None:
        return
    global _file, _pid
    now = time.time()
    with _lock:
        if _file is None or _pid != os.getpid():  # first mark, or a forked child
            _pid = os.getpid()
            _file = open(os.path.join(_dir, f"{_pid}.trace"), "a", buffering=1)
            _file.write(f"# role {_role}\n")
        _file.write(f"{now:.6f} {phase}\n")


def configure(directory: str | None) -> None:
    """Turn tracing on (into ``directory``) or off (None) in this process; for tests and
    drivers that set the variable after import."""
    global _dir, _file
    with _lock:
        if _file is not None:
            _file.close()
        _dir, _file = directory, None
