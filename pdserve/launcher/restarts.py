"""The restarts of ``pdserve up``: a dead engine instance is restarted on its own ports after a
back-off while the other instances of its role serve, until its role has no live instance left
or it keeps failing.

* An instance *dies* when its process exits (any code, any signal) after the deployment was
  ready, or while it was being restarted.
* It is restarted only while another instance of its role runs; the proxy (one per deployment)
  and a role's last instance are never restarted: their death stops ``pdserve up`` as before.
* Back-off: ``initial_backoff_s * 2 ** (n - 1)`` seconds before the ``n``-th restart within the
  window, at most ``max_backoff_s``.
* Giving up: an instance that died more than ``max_restarts`` times within ``window_s`` seconds,
  or that does not answer ``/health`` within ``startup_timeout_s`` of a restart, stops the whole
  deployment.
* Before a restart the processes left in the dead instance's process group (its engine cores)
  are killed, and its HTTP and NIXL side-channel ports must be free again (each poll checks;
  ``port_wait_s`` without them is a failure).
"""

from __future__ import annotations

import enum
import signal
import socket
import time
from collections import deque
from dataclasses import dataclass
from typing import Callable, Sequence

from pdserve.launcher.children import Child

DEFAULT_MAX_RESTARTS = 3
DEFAULT_RESTART_WINDOW_S = 300.0
DEFAULT_INITIAL_BACKOFF_S = 1.0
DEFAULT_MAX_BACKOFF_S = 30.0
DEFAULT_PORT_WAIT_S = 60.0


@dataclass(frozen=True)
class RestartPolicy:
    """When and how often a dead instance is restarted.

    Attributes:
        max_restarts: restarts allowed per instance within ``window_s`` (K); 0 turns restarts
            off (any death stops the deployment).
        window_s: seconds over which deaths are counted.
        initial_backoff_s: delay before the first restart in the window, seconds.
        max_backoff_s: the cap of the doubling delay, seconds.
        startup_timeout_s: seconds a restarted instance has to answer ``/health``.
        port_wait_s: seconds to wait for the dead instance's ports to be free.
    """

    max_restarts: int = DEFAULT_MAX_RESTARTS
    window_s: float = DEFAULT_RESTART_WINDOW_S
    initial_backoff_s: float = DEFAULT_INITIAL_BACKOFF_S
    max_backoff_s: float = DEFAULT_MAX_BACKOFF_S
    startup_timeout_s: float = 900.0
    port_wait_s: float = DEFAULT_PORT_WAIT_S

    def backoff(self, attempt: int) -> float:
        """Seconds to wait before restart number ``attempt`` (1-based) of the window."""
        return min(self.initial_backoff_s * 2 ** (attempt - 1), self.max_backoff_s)


class InstanceState(enum.Enum):
    """Where a supervised instance stands after the deployment became ready."""

    SERVING = "serving"          # running and (was) healthy
    BACKING_OFF = "backing_off"  # dead, waiting for its back-off and its ports
    RESTARTING = "restarting"    # started again, not healthy yet
    STOPPED = "stopped"          # exited while the deployment stopped


def ports_free(host: str, ports: Sequence[int]) -> bool:
    """True when every port in ``ports`` can be bound on ``host`` right now."""
    for port in ports:
        with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET,
                           socket.SOCK_STREAM) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                sock.bind((host, port))
            except OSError:
                return False
    return True


def child_ports(child: Child) -> list[int]:
    """The HTTP port and every NIXL side-channel port of ``child``."""
    spec = child.spec
    ports = [spec.port]
    if spec.side_channel_port:
        ports += range(spec.side_channel_port, spec.side_channel_port + spec.data_parallel_size)
    return ports


def describe_exit(code: int | None) -> str:
    """``"was killed by SIGKILL"`` / ``"exited with code 3"`` for a return code."""
    if code is not None and code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


@dataclass
class _Track:
    state: InstanceState = InstanceState.SERVING
    deaths: deque | None = None  # monotonic times of the deaths within the window
    restart_at: float = 0.0      # BACKING_OFF: when the back-off ends
    ports_since: float = 0.0     # BACKING_OFF: when the ports were first found busy
    started_at: float = 0.0      # RESTARTING: when the process was started again
    died_at: float = 0.0


class Restarter:
    """Watches the children of a ready deployment and restarts dead engine instances.

    Args:
        children: every child of the deployment (engines and proxy).
        policy: the restart policy.
        health_check: ``url -> bool``.
        say: prints one line of the launcher's output.
        on_change: called after an instance's PID or state changed (rewrites the status file).
        clock: monotonic seconds; replaceable in tests.
    """

    def __init__(self, children: Sequence[Child], policy: RestartPolicy, *,
                 health_check: Callable[[str], bool], say: Callable[[str], None],
                 on_change: Callable[[], None], clock: Callable[[], float] = time.monotonic):
        self.children = list(children)
        self.policy = policy
        self.health_check = health_check
        self.say = say
        self.on_change = on_change
        self.clock = clock
        self._tracks = {c.spec.name: _Track(deaths=deque()) for c in self.children}
        self.restarts = 0  # instances started again, all together

    def state(self, child: Child) -> InstanceState:
        """The state of ``child``."""
        return self._tracks[child.spec.name].state

    def _live_peers(self, child: Child) -> list[Child]:
        return [c for c in self.children if c is not child and c.spec.role == child.spec.role
                and self._tracks[c.spec.name].state is InstanceState.SERVING
                and c.poll() is None]

    def _note(self, child: Child, msg: str) -> None:
        """Says ``msg`` in the launcher's output and appends it to the child's log."""
        self.say(f"pdserve up: {msg}")
        try:
            with open(child.log_path, "a") as log:
                log.write(f"[pdserve up] {msg}\n")
        except OSError:
            pass

    def poll(self) -> tuple[Child, str] | None:
        """One supervision step.

        Returns:
            None while the deployment serves, or (the child, why) when ``pdserve up`` must stop
            everything: a proxy or a role's last instance died, or an instance keeps failing.
        """
        now = self.clock()
        for child in self.children:
            track = self._tracks[child.spec.name]
            if track.state is InstanceState.BACKING_OFF:
                stop = self._try_restart(child, track, now)
            elif child.poll() is not None:
                stop = self._on_death(child, track, now)
            elif track.state is InstanceState.RESTARTING:
                stop = self._check_back(child, track, now)
            else:
                stop = None
            if stop is not None:
                return child, stop
        return None

    def _on_death(self, child: Child, track: _Track, now: float) -> str | None:
        how = describe_exit(child.poll())
        name, pid = child.spec.name, child.pid
        if child.spec.role == "proxy":
            return f"{name} (pid {pid}) {how}"
        peers = self._live_peers(child)
        if self.policy.max_restarts <= 0 or not peers:
            why = "" if peers else f" and no other {child.spec.role} instance is serving"
            return f"{name} (pid {pid}) {how}{why}"
        while track.deaths and now - track.deaths[0] > self.policy.window_s:
            track.deaths.popleft()
        track.deaths.append(now)
        attempt = len(track.deaths)
        if attempt > self.policy.max_restarts:
            return (f"{name} (pid {pid}) {how}; it died {attempt} times within "
                    f"{self.policy.window_s:.0f} s (restart limit {self.policy.max_restarts})")
        delay = self.policy.backoff(attempt)
        # Its engine cores may outlive the API server (SIGKILL reaches only the server).
        child.signal_group(signal.SIGKILL)
        track.state, track.restart_at, track.ports_since, track.died_at = (
            InstanceState.BACKING_OFF, now + delay, 0.0, now)
        child.ready = False
        self._note(child, f"{name} (pid {pid}) {how}; restarting it in {delay:g} s "
                          f"(restart {attempt} of {self.policy.max_restarts} within "
                          f"{self.policy.window_s:.0f} s); "
                          f"{', '.join(c.spec.name for c in peers)} "
                          f"{'keeps' if len(peers) == 1 else 'keep'} serving")
        self.on_change()
        return None

    def _try_restart(self, child: Child, track: _Track, now: float) -> str | None:
        if now < track.restart_at:
            return None
        if not self._live_peers(child):
            return (f"{child.spec.name} is down and no other {child.spec.role} instance is "
                    f"serving")
        ports = child_ports(child)
        if not ports_free(child.spec.host, ports):
            if not track.ports_since:
                track.ports_since = now
                self._note(child, f"{child.spec.name}: waiting for its ports "
                                  f"{', '.join(map(str, ports))} to be free")
            if now - track.ports_since > self.policy.port_wait_s:
                return (f"{child.spec.name}: its ports {', '.join(map(str, ports))} are still "
                        f"busy after {self.policy.port_wait_s:.0f} s")
            return None
        try:
            child.start()
        except OSError as exc:
            return f"cannot restart {child.spec.name}: {exc}"
        self.restarts += 1
        track.state, track.started_at = InstanceState.RESTARTING, now
        self._note(child, f"restarted {child.spec.name}: pid {child.pid}, port {child.spec.port}")
        self.on_change()
        return None

    def _check_back(self, child: Child, track: _Track, now: float) -> str | None:
        if self.health_check(child.spec.url + child.spec.health_path):
            child.ready = True
            track.state = InstanceState.SERVING
            self._note(child, f"{child.spec.name} is serving again (pid {child.pid}), "
                              f"{now - track.died_at:.1f} s after it died")
            self.on_change()
            return None
        if now - track.started_at > self.policy.startup_timeout_s:
            return (f"{child.spec.name} (pid {child.pid}) is not healthy "
                    f"{self.policy.startup_timeout_s:.0f} s after its restart")
        return None
