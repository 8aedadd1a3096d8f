"""The API server's connection to one engine core (one data-parallel rank): its two ZMQ
sockets, its process or heartbeats, its outstanding requests and latest stats.

A local core is a child process (multiprocessing ``spawn``) on ``ipc://`` sockets in a private
temporary directory; its liveness is the process's. A remote core (a rank of a headless host,
:mod:`pdserve.engine.data_parallel`) connects to ``tcp://`` sockets bound here; its liveness is
its heartbeats (:data:`pdserve.types.core_messages.HEARTBEAT_TIMEOUT_S`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from typing import Any, Callable, Iterator

import zmq
import zmq.asyncio

from pdserve.types.engine_config import EngineConfig
from pdserve.types.core_messages import (
    HEARTBEAT_INTERVAL_S,
    HEARTBEAT_TIMEOUT_S,
    CoreAddresses,
    CoreFailed,
    Ping,
    Ready,
    StartupFailed,
    StepOutputs,
    make_encoder,
    make_output_decoder,
)
from pdserve.engine.output_processor import EngineStats
from pdserve.utils.host_devices import detect_gpus

logger = logging.getLogger(__name__)

# Seconds between liveness checks of the core while no message arrives.
LIVENESS_INTERVAL_S = 0.5
# Seconds close() waits for a local core to exit before terminating (then killing) it.
SHUTDOWN_GRACE_S = 10.0


class CoreStartupError(RuntimeError):
    """The engine core could not start (the message carries the core's reason)."""


def rank_devices(local_rank: int, tensor_parallel_size: int = 1) -> list[int]:
    """CUDA device indices of a local data-parallel rank: TP rank ``r`` of local DP rank ``d``
    uses device ``d * tp + r`` (indices into the devices this host's process sees)."""
    return [local_rank * tensor_parallel_size + r for r in range(tensor_parallel_size)]


@contextlib.contextmanager
def cuda_devices_env(devices: list[int] | None) -> Iterator[None]:
    """Sets ``CUDA_VISIBLE_DEVICES`` to ``devices`` while a child process is spawned, then
    restores it (a spawned child copies the environment at start). ``devices`` index the GPUs
    this process may use (an existing ``CUDA_VISIBLE_DEVICES``, else the GPUs ``nvidia-smi``
    lists), taken modulo their number when there are fewer: ranks then share GPUs, with a
    warning. None, or no GPU at all: unchanged."""
    old = os.environ.get("CUDA_VISIBLE_DEVICES")
    visible = detect_gpus() if devices is not None else []
    if not visible:
        yield
        return
    if max(devices) >= len(visible):
        logger.warning("data-parallel ranks need GPUs %s but only %d are visible (%s); ranks "
                       "share them round robin", devices, len(visible), ",".join(visible))
    os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(
        dict.fromkeys(visible[d % len(visible)] for d in devices))
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("CUDA_VISIBLE_DEVICES", None)
        else:
            os.environ["CUDA_VISIBLE_DEVICES"] = old


def tensor_parallel_size(config: EngineConfig) -> int:
    """The config's tensor-parallel size (1 when the config has no such setting)."""
    return int(vars(config).get("tensor_parallel_size", 1) or 1)


class CoreClient:
    """One engine core as the front end sees it (create with :meth:`local` or :meth:`remote`).

    Attributes:
        rank: the core's data-parallel rank.
        outstanding: requests sent to it and not finished (the load balance's measure).
        stats: the latest stats snapshot the core sent.
        dead: why the core counts as dead, or None while it lives.
    """

    def __init__(self, rank: int, sync_ctx: zmq.Context, async_ctx: zmq.asyncio.Context,
                 input_address: str, output_address: str, remote: bool):
        self.rank = rank
        self.remote = remote
        self.outstanding = 0
        self.stats = EngineStats()
        self.dead: str | None = None
        self.proc: Any = None
        self._encoder = make_encoder()
        self._decoder = make_output_decoder()
        self._in = sync_ctx.socket(zmq.PUSH)
        self._in.setsockopt(zmq.SNDHWM, 0)
        self._in.setsockopt(zmq.LINGER, 0)
        self._out = async_ctx.socket(zmq.PULL)
        self._out.setsockopt(zmq.RCVHWM, 0)
        self._out.setsockopt(zmq.LINGER, 0)
        try:
            self._in.bind(input_address)
            self._out.bind(output_address)
        except zmq.ZMQError:
            self.close_sockets()
            raise
        self.addresses = CoreAddresses(
            input_address=self._in.getsockopt_string(zmq.LAST_ENDPOINT),
            output_address=self._out.getsockopt_string(zmq.LAST_ENDPOINT), remote=remote)
        self._last_seen = time.monotonic()

    @classmethod
    def local(cls, rank: int, config: EngineConfig, sync_ctx: zmq.Context,
              async_ctx: zmq.asyncio.Context, tmpdir: str,
              devices: list[int] | None = None) -> "CoreClient":
        """Bind ``ipc://`` sockets in ``tmpdir`` and spawn the core process for ``config``.

        Args:
            devices: CUDA devices the core sees (``CUDA_VISIBLE_DEVICES``), or None for the
                server's own environment.
        """
        self = cls(rank, sync_ctx, async_ctx, f"ipc://{tmpdir}/input-{rank}",
                   f"ipc://{tmpdir}/output-{rank}", remote=False)
        self.proc = spawn_core(config, self.addresses, rank, devices)
        return self

    @classmethod
    def remote(cls, rank: int, bind_host: str, sync_ctx: zmq.Context,
               async_ctx: zmq.asyncio.Context) -> "CoreClient":
        """Bind ``tcp://`` sockets on ``bind_host`` (free ports) for a rank of another host.

        Raises:
            CoreStartupError: the address cannot be bound (the message names the option).
        """
        try:
            return cls(rank, sync_ctx, async_ctx, f"tcp://{bind_host}:*", f"tcp://{bind_host}:*",
                       remote=True)
        except zmq.ZMQError as e:
            raise CoreStartupError(
                f"cannot listen on {bind_host} for data-parallel rank {rank} ({e}): set "
                "--data-parallel-address to an address of this host") from None

    # ------------------------------------------------------------------ liveness
    @property
    def silent_s(self) -> float:
        """Seconds since the core's last message (a core with requests sends one at least every
        :data:`~pdserve.types.core_messages.HEARTBEAT_INTERVAL_S`, pdserve/engine/core_loop.py)."""
        return time.monotonic() - self._last_seen

    def check_alive(self) -> str | None:
        """Why the core is dead (and records it), or None while it lives."""
        if self.dead is None:
            if self.proc is not None and not self.proc.is_alive():
                self.dead = f"engine core of data-parallel rank {self.rank} died " \
                            f"(exit code {self.proc.exitcode})"
            elif self.remote and time.monotonic() - self._last_seen > HEARTBEAT_TIMEOUT_S:
                self.dead = f"data-parallel rank {self.rank} sent nothing for " \
                            f"{HEARTBEAT_TIMEOUT_S:g} s (its host is gone or unreachable)"
        return self.dead

    async def keepalive(self) -> None:
        """Send a remote rank a :class:`Ping` every :data:`HEARTBEAT_INTERVAL_S` until cancelled
        (from the start on: the rank watches for them also while other ranks still load)."""
        while True:
            try:
                self.send(Ping(), block=False)
            except zmq.Again:  # not connected yet (still joining): nothing to keep alive
                pass
            await asyncio.sleep(HEARTBEAT_INTERVAL_S)

    # ------------------------------------------------------------------ messages
    def send(self, msg: Any, block: bool = True) -> None:
        """Send one input message.

        Raises:
            zmq.ZMQError: the socket refused it (non-blocking only).
        """
        self._in.send(self._encoder.encode(msg), 0 if block else zmq.NOBLOCK)

    async def wait_ready(self) -> Ready:
        """The core's :class:`Ready` message.

        Raises:
            CoreStartupError: it failed to start or died.
        """
        while True:
            if await self._out.poll(timeout=int(LIVENESS_INTERVAL_S * 1000)):
                msg = self._decoder.decode(await self._out.recv())
                self._last_seen = time.monotonic()
                if isinstance(msg, Ready):
                    return msg
                if isinstance(msg, (StartupFailed, CoreFailed)):
                    if msg.traceback:
                        logger.debug("engine core traceback:\n%s", msg.traceback)
                    raise CoreStartupError(f"engine failed to start: {msg.message}")
                continue
            if self.proc is not None and not self.proc.is_alive():
                raise CoreStartupError(
                    f"engine core process exited during startup (exit code {self.proc.exitcode});"
                    " see its log above")
            if self.remote:
                self._last_seen = time.monotonic()  # a joining rank loads its model first

    async def output_loop(self, on_outputs: Callable[["CoreClient", StepOutputs], None],
                          on_dead: Callable[["CoreClient", str], None]) -> None:
        """Receive the core's messages until it dies: ``on_outputs(self, msg)`` per
        :class:`StepOutputs` (the callback records ``msg.stats``), then ``on_dead(self,
        reason)`` once."""
        try:
            while True:
                if not await self._out.poll(timeout=int(LIVENESS_INTERVAL_S * 1000)):
                    reason = self.check_alive()
                    if reason is not None:
                        on_dead(self, reason)
                        return
                    continue
                msg = self._decoder.decode(await self._out.recv())
                self._last_seen = time.monotonic()
                if isinstance(msg, StepOutputs):
                    on_outputs(self, msg)
                elif isinstance(msg, CoreFailed):
                    if msg.traceback:
                        logger.error("engine core traceback:\n%s", msg.traceback)
                    self.dead = f"engine core of data-parallel rank {self.rank} failed: {msg.message}"
                    on_dead(self, self.dead)
                    return
        except asyncio.CancelledError:
            raise
        except Exception as e:  # a front-end bug must not leave requests hanging
            logger.exception("engine output loop failed")
            on_dead(self, f"engine output handling failed: {e}")

    # ------------------------------------------------------------------ shutdown
    async def stop_process(self, kill: bool) -> None:
        """Wait for a local core to exit (``kill``: at once), terminating then killing it."""
        proc = self.proc
        if proc is None or proc.pid is None:
            return
        if not kill:
            await asyncio.to_thread(proc.join, SHUTDOWN_GRACE_S)
        if proc.is_alive():
            proc.terminate()
            await asyncio.to_thread(proc.join, 5.0)
        if proc.is_alive():
            proc.kill()
            await asyncio.to_thread(proc.join, 5.0)

    def close_sockets(self) -> None:
        """Close both sockets; a remote rank's input gets up to a second to deliver what was
        sent last (the Shutdown)."""
        self._in.close(1000 if self.remote else 0)
        self._out.close(0)


def spawn_core(config: EngineConfig, addresses: CoreAddresses, rank: int,
               devices: list[int] | None) -> Any:
    """Start the engine-core process of one rank (``spawn``, daemon: it dies with us) and return
    it (a ``multiprocessing.Process``)."""
    import multiprocessing

    from pdserve.engine.core_loop import run_engine_core

    mp = multiprocessing.get_context("spawn")
    proc = mp.Process(target=run_engine_core, args=(config, addresses),
                      name=f"pdserve-engine-core-{rank}", daemon=True)
    with cuda_devices_env(devices):
        proc.start()
    return proc
