"""Opt-in phase timestamps of requests in every pdserve process, for latency profiling.

With the environment variable ``PDSERVE_PHASE_TRACE`` naming a directory, every process that
imports this module (proxy, API servers, engine cores; children inherit the variable) appends one
line per :func:`mark` to ``<dir>/<pid>.trace`` (buffered, written every
:data:`FLUSH_INTERVAL_S` by a thread of its own, and at exit)::

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

import atexit
import os
import threading
import time
from typing import TextIO

#: Environment variable naming the trace directory (unset or empty: tracing off).
ENV = "PDSERVE_PHASE_TRACE"
#: Seconds between the background writes of the buffered marks.
FLUSH_INTERVAL_S = 0.05

_dir = os.environ.get(ENV) or None
_role = "?"
_file: TextIO | None = None
_pid = 0
_lines: list[str] = []  # marks not written yet
_lock = threading.Lock()  # every thread of a process marks into one buffer
_file_lock = threading.Lock()  # one writer at a time; marks wait only for the buffer's swap


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
    """Note ``<time.time()> <phase>`` for this process's trace file (nothing when tracing is
    off). ``phase`` must not contain a newline.

    The mark only goes into a buffer: a background thread writes the buffer every
    :data:`FLUSH_INTERVAL_S` (and :func:`flush` at exit). A write per mark would be a system
    call on the traced path, during which CPython hands the GIL to another thread of the
    process (an engine core's side-channel thread would wait behind its engine thread), so the
    trace would move the timings it records."""
    if _dir is None:
        return
    global _pid, _file
    now = time.time()
    with _lock:
        if _pid != os.getpid():  # first mark, or a forked child (no flusher thread there)
            _pid, _file = os.getpid(), None
            _lines.clear()
            threading.Thread(target=_flush_loop, name="pdserve-phase-trace",
                             daemon=True).start()
        _lines.append(f"{now:.6f} {phase}\n")


def flush() -> None:
    """Write the buffered marks to this process's trace file now (the first write opens it
    and names the role)."""
    global _file
    with _file_lock:
        with _lock:  # the marking threads wait for this swap only, not for the write
            if not _lines or _dir is None:
                return
            lines = _lines[:]
            _lines.clear()
            directory, pid = _dir, _pid
        if _file is None:
            _file = open(os.path.join(directory, f"{pid}.trace"), "a")
            _file.write(f"# role {_role}\n")
        _file.write("".join(lines))
        _file.flush()


def _flush_loop() -> None:
    pid = os.getpid()
    while _dir is not None and _pid == pid:
        time.sleep(FLUSH_INTERVAL_S)
        flush()


atexit.register(flush)


def configure(directory: str | None) -> None:
    """Turn tracing on (into ``directory``) or off (None) in this process, writing what was
    buffered first; for tests and drivers that set the variable after import."""
    global _dir, _file, _pid
    flush()
    with _file_lock, _lock:
        if _file is not None:
            _file.close()
        _dir, _file, _pid = directory, None, 0
