"""The supervisor of ``pdserve up``: starts the planned children, waits for their health, watches
them and stops them (with everything they spawned) on a signal or a child's death.

* Ctrl-C / SIGTERM / SIGHUP is forwarded to every child (a second one sends SIGKILL); children that
  have not exited after ``shutdown_timeout`` seconds are killed.
* If an engine instance dies after startup while another instance of its role serves, it is
  restarted on its own ports after a back-off (:mod:`~pdserve.launcher.restarts`); if the proxy
  or a role's last instance dies, or an instance keeps failing, the others are stopped and the
  launcher exits non-zero, printing that child's last log lines. A death during startup stops
  everything too.
* Every child runs in its own session (process group), and the whole group is signalled, so the
  engine-core processes that ``pdserve serve`` spawns are stopped too. Children also get
  ``PR_SET_PDEATHSIG`` (Linux), so they are terminated even when the launcher itself is killed with
  SIGKILL.

Child logs go to the log directory, one file per part, and a machine-readable
``pdserve-up.json`` there lists the parts with their PIDs, ports and URLs.
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Callable, Sequence, TextIO

from pdserve.launcher.children import Child, tail_lines
from pdserve.launcher.errors import LaunchError
from pdserve.launcher.plan import ChildSpec
from pdserve.launcher.restarts import InstanceState, RestartPolicy, Restarter, describe_exit

DEFAULT_STARTUP_TIMEOUT_S = 900.0
DEFAULT_SHUTDOWN_TIMEOUT_S = 30.0
STATUS_FILE_NAME = "pdserve-up.json"
# Seconds the processes still in a stopped child's process group get to exit by themselves;
# those still running then were left behind, and get SIGTERM, then SIGKILL after
# LEFTOVER_GRACE_S seconds.
LEFTOVER_EXIT_S = 2.0
LEFTOVER_GRACE_S = 5.0
# Seconds between "still waiting" lines while starting, when stderr is not a terminal.
PROGRESS_LINE_INTERVAL_S = 15.0

# What a starting engine is busy with, recognised in its log: (text in a log line, words for
# the progress line); the last matching line of the log tail wins, and an empty phase (the model
# is loaded) ends the one before. The texts are the log lines of pdserve's model cache and loader.
STARTUP_PHASES: tuple[tuple[str, str | None], ...] = (
    ("to safetensors in", "converting the built-in model to safetensors (one time: later starts "
                          "skip this; about a minute on a small CPU)"),
    ("load_format=", None),
)
PHASE_LOG_LINES = 200
PHASE_CHECK_INTERVAL_S = 1.0


def _check_health(url: str, timeout: float = 2.0) -> bool:
    import httpx

    try:
        return httpx.get(url, timeout=timeout).status_code == 200
    except httpx.HTTPError:
        return False


class Launcher:
    """Starts the children of a plan, waits for readiness, supervises and stops them.

    Args:
        specs: the children, started in this order.
        log_dir: directory for ``<name>.log`` and :data:`STATUS_FILE_NAME`.
        startup_timeout: seconds to wait for all parts to become healthy.
        shutdown_timeout: seconds to wait for children after the stop signal before SIGKILL.
        health_check: ``url -> bool``; replaceable in tests.
        out: where the banner and messages go.
        restart_policy: when a dead instance is restarted (default :class:`RestartPolicy`;
            ``RestartPolicy(max_restarts=0)``: never, any death stops everything).
    """

    def __init__(self, specs: Sequence[ChildSpec], log_dir: Path, *,
                 startup_timeout: float = DEFAULT_STARTUP_TIMEOUT_S,
                 shutdown_timeout: float = DEFAULT_SHUTDOWN_TIMEOUT_S,
                 health_check: Callable[[str], bool] = _check_health,
                 poll_interval: float = 0.25, out: TextIO | None = None,
                 restart_policy: RestartPolicy | None = None):
        self.log_dir = Path(log_dir)
        self.children = [Child(s, self.log_dir / f"{s.name}.log") for s in specs]
        self.startup_timeout = startup_timeout
        self.shutdown_timeout = shutdown_timeout
        self.health_check = health_check
        self.poll_interval = poll_interval
        self.out = out or sys.stdout
        self.stop_signal: int | None = None
        self._signal_count = 0
        self._old_handlers: dict[int, object] = {}
        self.started_at = time.monotonic()
        self._phase: str | None = None
        self._phases_noted: set[tuple[str, str]] = set()
        self._next_phase_check = 0.0
        self.restarter = Restarter(
            self.children, restart_policy or RestartPolicy(startup_timeout_s=startup_timeout),
            health_check=health_check, say=self.say,
            on_change=lambda: self.write_status("ready", ready_after_s=self.ready_after_s))
        self.ready_after_s: float | None = None

    # ---- messages -----------------------------------------------------------------------
    def say(self, msg: str = "") -> None:
        print(msg, file=self.out, flush=True)

    def status_path(self) -> Path:
        return self.log_dir / STATUS_FILE_NAME

    def write_status(self, state: str, **extra) -> None:
        """Writes ``pdserve-up.json``: launcher PID, state and every child's PID/ports/log (a
        child that has exited once the deployment stops or failed is ``stopped``)."""
        ending = state in ("stopping", "stopped", "failed")
        data = {
            "launcher_pid": os.getpid(),
            "state": state,
            "children": [
                {**asdict(c.spec), "pid": c.proc.pid if c.proc else None,
                 "url": c.spec.url, "log": str(c.log_path), "ready": c.ready,
                 "state": (InstanceState.STOPPED if ending and c.poll() is not None
                           else self.restarter.state(c)).value,
                 "restarts": max(c.starts - 1, 0)}
                for c in self.children],
            **extra,
        }
        tmp = self.status_path().with_suffix(".tmp")
        tmp.write_text(json.dumps(data, indent=2))
        tmp.replace(self.status_path())

    # ---- signals ------------------------------------------------------------------------
    def _on_signal(self, signum: int, _frame) -> None:
        self._signal_count += 1
        if self.stop_signal is None:
            self.stop_signal = signum
        if self._signal_count > 1:  # impatient user: kill right away
            for child in self.children:
                child.signal_group(signal.SIGKILL)

    def install_signal_handlers(self) -> None:
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            self._old_handlers[sig] = signal.signal(sig, self._on_signal)

    def restore_signal_handlers(self) -> None:
        for sig, handler in self._old_handlers.items():
            signal.signal(sig, handler)
        self._old_handlers.clear()

    # ---- lifecycle ----------------------------------------------------------------------
    def start_all(self) -> None:
        """Starts every child (logs to ``<log_dir>/<name>.log``) and writes the status file.

        Raises:
            LaunchError: a child's command cannot be executed.
        """
        self.log_dir.mkdir(parents=True, exist_ok=True)
        for child in self.children:
            try:
                child.start()
            except OSError as exc:
                raise LaunchError(f"cannot start {child.spec.name} "
                                  f"({shlex.join(child.spec.argv)}): {exc}") from None
        self.write_status("starting")

    def dead_child(self) -> Child | None:
        for child in self.children:
            if child.poll() is not None:
                return child
        return None

    def wait_until_ready(self) -> bool:
        """Polls every child's health URL until all answer 200, showing progress.

        On a terminal a progress bar shows how many parts are ready, the elapsed time and the
        parts still starting; otherwise (CI logs) one line is printed per ready part and a
        "still waiting" line every :data:`PROGRESS_LINE_INTERVAL_S` seconds.

        Returns False (after reporting why) if a child exits, a stop signal arrives, or the
        startup timeout passes.
        """
        from tqdm import tqdm

        deadline = time.monotonic() + self.startup_timeout
        interactive = sys.stderr.isatty()
        bar = tqdm(total=len(self.children), file=sys.stderr, disable=not interactive,
                   dynamic_ncols=True, leave=False, bar_format="{bar:20} {n}/{total} parts ready "
                   "[{elapsed}] {desc}")
        next_line = time.monotonic() + PROGRESS_LINE_INTERVAL_S

        def note(msg: str) -> None:
            if interactive:
                bar.write(msg, file=sys.stderr)
            else:
                self.say(msg)

        try:
            while True:
                for child in self.children:
                    if not child.ready and child.poll() is None and self.health_check(
                            child.spec.url + child.spec.health_path):
                        child.ready = True
                        bar.update(1)
                        note(f"  {child.spec.name} ready at {child.spec.url} after "
                             f"{time.monotonic() - self.started_at:.1f} s")
                waiting = [c.spec.name for c in self.children if not c.ready]
                phase = self._startup_phase(note)
                bar.set_description_str(("waiting for " + ", ".join(waiting) if waiting else "")
                                        + (f": {phase}" if phase and waiting else ""))
                if not waiting:
                    return True
                if self.stop_signal is not None:
                    note(f"received {signal.Signals(self.stop_signal).name} during startup")
                    return False
                dead = self.dead_child()
                if dead is not None:
                    bar.close()
                    self.report_death(dead)
                    return False
                now = time.monotonic()
                if now > deadline:
                    bar.close()
                    self.say(f"pdserve up: not ready after {self.startup_timeout:.0f} s: "
                             + ", ".join(waiting))
                    for child in self.children:
                        if not child.ready:
                            self.print_log_tail(child)
                    return False
                if not interactive and now >= next_line:
                    self.say(f"  waiting for {', '.join(waiting)} "
                             f"({now - self.started_at:.0f} s)" + (f": {phase}" if phase else ""))
                    next_line = now + PROGRESS_LINE_INTERVAL_S
                time.sleep(self.poll_interval)
        finally:
            bar.close()

    def _startup_phase(self, note: Callable[[str], None]) -> str | None:
        """What the starting children are busy with, as far as their logs tell (see
        :data:`STARTUP_PHASES`), or None. A phase seen for the first time is also printed once
        as a line of its own."""
        now = time.monotonic()
        if now < self._next_phase_check:
            return self._phase
        self._next_phase_check = now + PHASE_CHECK_INTERVAL_S
        self._phase = None
        for child in self.children:
            if child.ready:
                continue
            phase = None
            for line in tail_lines(child.log_path, PHASE_LOG_LINES):
                for marker, words in STARTUP_PHASES:
                    if marker in line:
                        phase = words
            if phase is not None:
                self._phase = phase
                if (child.spec.name, phase) not in self._phases_noted:
                    self._phases_noted.add((child.spec.name, phase))
                    note(f"  {child.spec.name}: {phase}")
        return self._phase

    def supervise(self) -> int:
        """After startup: sleeps until a stop signal (returns 0), restarting dead instances
        (:class:`~pdserve.launcher.restarts.Restarter`) until one ends the deployment
        (returns 1)."""
        while True:
            if self.stop_signal is not None:
                self.say(f"\nreceived {signal.Signals(self.stop_signal).name}, stopping ...")
                return 0
            stop = self.restarter.poll()
            if stop is not None:
                child, why = stop
                self.say(f"pdserve up: {why}; stopping the others.")
                self.print_log_tail(child)
                return 1
            time.sleep(self.poll_interval)

    def report_death(self, child: Child) -> None:
        self.say(f"pdserve up: {child.spec.name} (pid {child.pid}) {describe_exit(child.poll())}; "
                 f"stopping the others.")
        self.print_log_tail(child)

    def print_log_tail(self, child: Child) -> None:
        lines = tail_lines(child.log_path)
        self.say(f"---- last {len(lines)} lines of {child.log_path} ----")
        for line in lines:
            self.say(f"  {line}")
        self.say("----")

    def stop_all(self, sig: int = signal.SIGTERM) -> list[str]:
        """Stops every child and everything it started.

        ``sig`` goes to each child itself first, so that a server can shut down its own
        processes in order. Children still running after ``shutdown_timeout`` get SIGKILL, with
        their whole process group. Processes still running in a child's group
        :data:`LEFTOVER_EXIT_S` after it exited were left behind: they get SIGTERM, then SIGKILL
        after :data:`LEFTOVER_GRACE_S`, and are reported.

        Returns:
            The names of the children that had to be killed.
        """
        # A child whose command could not be started has no process to wait for.
        started = [c for c in self.children if c.proc is not None]
        for child in started:
            if child.poll() is None:
                child.signal(sig)
        deadline = time.monotonic() + self.shutdown_timeout
        while time.monotonic() < deadline and any(c.poll() is None for c in started):
            time.sleep(0.05)
        killed = [c.spec.name for c in started if c.poll() is None]
        for child in started:
            if child.poll() is None:
                child.signal_group(signal.SIGKILL)
        for child in started:
            child.proc.wait()
        # Helpers a child started may need a moment to notice that it is gone and exit by
        # themselves (multiprocessing's resource tracker ignores SIGTERM and waits for its
        # pipe to close): only what is still running after that was left behind.
        deadline = time.monotonic() + LEFTOVER_EXIT_S
        while time.monotonic() < deadline and any(c.group_alive() for c in self.children):
            time.sleep(0.05)
        leftovers = [c for c in self.children if c.group_alive()]
        for child in leftovers:
            child.signal_group(signal.SIGTERM)
        deadline = time.monotonic() + LEFTOVER_GRACE_S
        while time.monotonic() < deadline and any(c.group_alive() for c in leftovers):
            time.sleep(0.05)
        for child in leftovers:
            if child.group_alive():
                child.signal_group(signal.SIGKILL)
        if killed:
            self.say(f"pdserve up: killed (no exit after {self.shutdown_timeout:.0f} s): "
                     + ", ".join(killed))
        if leftovers:
            self.say("pdserve up: stopped processes left behind by "
                     + ", ".join(c.spec.name for c in leftovers))
        return killed

    def run(self, on_ready: Callable[["Launcher"], None] | None = None) -> int:
        """Starts, waits for readiness, supervises, and always stops every child.

        Returns:
            0 after a requested stop, 1 if a child died or startup failed.
        """
        self.install_signal_handlers()
        try:
            self.start_all()
            for child in self.children:
                base, dp = child.spec.side_channel_port, child.spec.data_parallel_size
                extra = ("" if not base else f", side channel {base}" if dp == 1 else
                         f", {dp} data-parallel ranks, side channels {base}-{base + dp - 1}")
                gpu = f", GPU {child.spec.gpu}" if child.spec.gpu is not None else ""
                if child.spec.gpu_memory_share is not None:
                    gpu += (f" (shared: --gpu-memory-utilization "
                            f"{child.spec.gpu_memory_share:.3f} of its total memory)")
                self.say(f"  started {child.spec.name:<10} pid {child.pid}, port "
                         f"{child.spec.port}{extra}{gpu}, log {child.log_path}")
            if not self.wait_until_ready():
                rc = 0 if self.stop_signal is not None and self.dead_child() is None else 1
                self.write_status("failed" if rc else "stopping")
                return rc
            ready_after_s = self.ready_after_s = round(time.monotonic() - self.started_at, 2)
            if on_ready is not None:
                on_ready(self)
            # Written after the banner, so a reader that sees "ready" also finds the endpoint
            # lines in the output.
            self.write_status("ready", ready_after_s=ready_after_s)
            rc = self.supervise()
            self.write_status("stopping")
            return rc
        except LaunchError as exc:
            self.say(f"pdserve up: error: {exc}")
            return 1
        finally:
            self.stop_all(self.stop_signal or signal.SIGTERM)
            if self.log_dir.exists():
                self.write_status("stopped")
            self.restore_signal_handlers()

