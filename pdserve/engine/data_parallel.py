"""Data parallelism: the per-rank engine configuration, the checks of the DP options, the head's
rendezvous socket and the headless host that runs ranks for a head on another host.

Layout (vLLM's option names): ``--data-parallel-size N`` ranks in all; a host starts
``--data-parallel-size-local`` of them from ``--data-parallel-start-rank``. The head (start
rank 0) serves the API and runs ranks ``0 .. local-1`` as child processes; every other rank
belongs to a ``--headless`` host, whose ranks join the head at
``--data-parallel-address:--data-parallel-rpc-port`` (a ZMQ REQ -> ROUTER exchange,
:class:`pdserve.types.core_messages.JoinRequest`) and are then driven over ``tcp://`` sockets the
head bound for them (:class:`pdserve.engine.core_client.CoreClient`), with heartbeats both ways.
No cluster manager: the hosts are started by whatever runs them (docs/deployment.md).

Each rank is a full engine with its own device(s) (:func:`core_client.rank_devices`), KV cache,
KV connector, NIXL agent, engine id ``<engine_id>_dp<rank>`` and side-channel port
``base + rank`` (``kv_transfer/config.py``).
"""

from __future__ import annotations

import dataclasses
import ipaddress
import logging
import signal
import socket
import time
from typing import Any

import zmq
import zmq.asyncio

from pdserve.types.engine_config import EngineConfig
from pdserve.engine.core_client import (
    CoreClient,
    CoreStartupError,
    rank_devices,
    spawn_core,
    tensor_parallel_size,
)
from pdserve.types.core_messages import CoreAddresses, JoinReply, JoinRequest, make_encoder

logger = logging.getLogger(__name__)

class DataParallelConfigError(ValueError):
    """Data-parallel options that cannot work together; the message names the setting."""


def rank_config(config: EngineConfig, rank: int) -> EngineConfig:
    """The configuration of one rank's engine core: ``data_parallel_rank`` set and, with more
    than one rank, the KV connector's engine id suffixed ``_dp<rank>`` (vLLM's scheme), so
    each rank is a distinct engine to its peers."""
    kv = config.kv_transfer_config
    if kv is not None and config.data_parallel_size > 1:
        kv = dataclasses.replace(kv, engine_id=kv.engine_id_for(rank, config.data_parallel_size))
    return dataclasses.replace(config, data_parallel_rank=rank, kv_transfer_config=kv)


def is_loopback(host: str) -> bool:
    """Whether ``host`` names this machine's loopback interface (``localhost``, 127.x, ::1)."""
    try:
        return ipaddress.ip_address(socket.gethostbyname(host)).is_loopback
    except (OSError, ValueError):
        return host == "localhost"


def _loopback_side_channel_message(where: str) -> str:
    return (f"{where}: PDSERVE_NIXL_SIDE_CHANNEL_HOST is a loopback address, which decoders on "
            "other hosts cannot reach; set PDSERVE_NIXL_SIDE_CHANNEL_HOST to this host's "
            "address that the other hosts can reach")


def validate(config: EngineConfig) -> None:
    """Check the data-parallel options once, at startup.

    Raises:
        DataParallelConfigError: the message names the option to change.
    """
    size, local, start = (config.data_parallel_size, config.local_data_parallel_size,
                          config.data_parallel_start_rank)
    if size < 1:
        raise DataParallelConfigError(f"--data-parallel-size must be >= 1, got {size}")
    if not 1 <= local <= size:
        raise DataParallelConfigError(
            f"--data-parallel-size-local must be between 1 and --data-parallel-size ({size}), "
            f"got {local}")
    if start < 0 or start + local > size:
        raise DataParallelConfigError(
            f"--data-parallel-start-rank {start} with --data-parallel-size-local {local} goes "
            f"past --data-parallel-size {size}")
    if not config.headless and start != 0:
        raise DataParallelConfigError(
            "--data-parallel-start-rank is for --headless hosts; the head runs ranks from 0")
    multi_host = config.headless or local < size
    if multi_host and not config.data_parallel_address:
        raise DataParallelConfigError(
            "ranks on several hosts need --data-parallel-address (the head's address that every "
            "rank host can reach)")
    if size > 1 and config.kv_events_endpoint:
        raise DataParallelConfigError(
            "--kv-events-endpoint is not supported with --data-parallel-size > 1")
    kv = config.kv_transfer_config
    if kv is not None:
        last_port = kv.side_channel_port_for(start + local - 1)
        if last_port > 65535:
            raise DataParallelConfigError(
                f"the side-channel port of rank {start + local - 1} would be {last_port}; lower "
                "PDSERVE_NIXL_SIDE_CHANNEL_PORT")
        if multi_host and is_loopback(kv.side_channel_host):
            raise DataParallelConfigError(_loopback_side_channel_message(
                "ranks on several hosts hand their side channel to remote peers"))


# ------------------------------------------------------------------------------------- head
class RendezvousServer:
    """The head's ROUTER socket where the ranks of headless hosts join.

    Args:
        config: the head's configuration (address, port, size, model name).
        ctx: the asyncio ZMQ context.
        remote: the clients of the ranks that live on other hosts (sockets already bound).

    Raises:
        CoreStartupError: the address cannot be bound (the message names the options).
    """

    def __init__(self, config: EngineConfig, ctx: zmq.asyncio.Context, remote: list[CoreClient]):
        import msgspec

        self._config = config
        self._remote = {c.rank: c for c in remote}
        self._joined: set[int] = set()
        self._encoder = make_encoder()
        self._decoder = msgspec.msgpack.Decoder(JoinRequest)
        self._sock = ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self.address = f"tcp://{config.data_parallel_address}:{config.data_parallel_rpc_port}"
        try:
            self._sock.bind(self.address)
        except zmq.ZMQError as e:
            self._sock.close(0)
            raise CoreStartupError(
                f"cannot listen for data-parallel ranks on {self.address} ({e}): set "
                "--data-parallel-address to an address of this host and --data-parallel-rpc-port "
                "to a free port") from None
        logger.info("waiting for data-parallel ranks %s to join at %s",
                    sorted(self._remote), self.address)

    async def serve(self) -> None:
        """Answer join requests until cancelled."""
        import msgspec

        while True:
            identity, empty, raw = await self._sock.recv_multipart()
            try:
                reply = self._answer(self._decoder.decode(raw))
            except msgspec.DecodeError as e:
                reply = JoinReply(ok=False, reason=f"malformed join request: {e}")
            if not reply.ok:
                logger.warning("refused a data-parallel rank: %s", reply.reason)
            await self._sock.send_multipart([identity, empty, self._encoder.encode(reply)])

    def _answer(self, req: JoinRequest) -> JoinReply:
        cfg = self._config
        if req.data_parallel_size != cfg.data_parallel_size:
            return JoinReply(ok=False, reason=(
                f"the head runs --data-parallel-size {cfg.data_parallel_size}, this host "
                f"{req.data_parallel_size}"))
        if req.model != cfg.name:
            return JoinReply(ok=False, reason=f"the head serves {cfg.name!r}, this host {req.model!r}")
        core = self._remote.get(req.rank)
        if core is None:
            return JoinReply(ok=False, reason=(
                f"rank {req.rank} is not a remote rank of the head (remote ranks: "
                f"{sorted(self._remote)}); check --data-parallel-start-rank"))
        if req.rank in self._joined:
            return JoinReply(ok=False, reason=f"rank {req.rank} has already joined")
        if req.side_channel_host and is_loopback(req.side_channel_host):
            return JoinReply(ok=False, reason=_loopback_side_channel_message(
                f"rank {req.rank} advertises its side channel as {req.side_channel_host}"))
        self._joined.add(req.rank)
        logger.info("data-parallel rank %d joined", req.rank)
        return JoinReply(ok=True, input_address=core.addresses.input_address,
                         output_address=core.addresses.output_address)

    def close(self) -> None:
        self._sock.close(0)


# --------------------------------------------------------------------------------- headless
def join_head(config: EngineConfig, rank: int, timeout_s: float) -> CoreAddresses:
    """Ask the head for rank ``rank``'s sockets, retrying until ``timeout_s`` passes.

    Raises:
        DataParallelConfigError: the head cannot be reached in time, or refused the rank.
    """
    import msgspec

    host, port = str(config.data_parallel_address), config.data_parallel_rpc_port
    settings = (f"set --data-parallel-address to the head's address that this host can reach "
                f"(now {host}) and --data-parallel-rpc-port to the head's port (now {port})")
    deadline = time.monotonic() + timeout_s
    last_error = "no answer"
    while True:  # plain TCP first: an unreachable head is reported with the system's reason
        try:
            with socket.create_connection((host, port), timeout=max(0.1, deadline - time.monotonic())):
                break
        except OSError as e:
            last_error = e.strerror or str(e)
        if time.monotonic() >= deadline:
            raise DataParallelConfigError(
                f"cannot reach the data-parallel head at {host}:{port} within {timeout_s:g} s "
                f"({last_error}): {settings}")
        time.sleep(0.2)
    kv = config.kv_transfer_config
    request = JoinRequest(rank=rank, data_parallel_size=config.data_parallel_size,
                          model=config.name, side_channel_host=kv.side_channel_host if kv else "")
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.REQ)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(f"tcp://{host}:{port}")
        sock.send(make_encoder().encode(request))
        if not sock.poll(int(max(0.0, deadline - time.monotonic()) * 1000 + 1000), zmq.POLLIN):
            raise DataParallelConfigError(
                f"the data-parallel head at {host}:{port} did not answer rank {rank}'s join "
                f"request: {settings}")
        reply = msgspec.msgpack.Decoder(JoinReply).decode(sock.recv())
    finally:
        sock.close(0)
    if not reply.ok:
        raise DataParallelConfigError(f"the data-parallel head refused rank {rank}: {reply.reason}")
    return CoreAddresses(reply.input_address, reply.output_address, remote=True)


def run_headless(config: EngineConfig) -> int:
    """``pdserve serve --headless``: join the head with this host's ranks, run their engine
    cores, and exit when they do.

    Returns:
        0 when every rank stopped because the head shut it down (or on SIGTERM / SIGINT), 1 when
        joining failed or a rank exited with an error (the others are stopped first).
    """
    stop = {"signal": None}

    def on_signal(signum: int, _frame: Any) -> None:
        stop["signal"] = signum

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    ranks: list[tuple[int, Any]] = []  # (rank, its engine-core process)
    start, local = config.data_parallel_start_rank, config.local_data_parallel_size
    tp = tensor_parallel_size(config)
    try:
        for i, rank in enumerate(range(start, start + local)):
            addresses = join_head(config, rank, config.data_parallel_join_timeout)
            logger.info("rank %d joined the head; starting its engine core", rank)
            ranks.append((rank, spawn_core(rank_config(config, rank), addresses, rank,
                                           None if config.device == "cpu" else rank_devices(i, tp))))
    except (DataParallelConfigError, CoreStartupError) as e:
        print(f"pdserve serve --headless: {e}", flush=True)
        _stop_all(ranks)
        return 1
    exit_code = 0
    while stop["signal"] is None:
        done = [(rank, proc) for rank, proc in ranks if not proc.is_alive()]
        failed = [(rank, proc) for rank, proc in done if proc.exitcode]
        if failed or len(done) == len(ranks):
            for rank, proc in failed:
                logger.error("engine core of rank %d exited with code %s", rank, proc.exitcode)
            exit_code = 1 if failed else 0
            break
        time.sleep(0.2)
    _stop_all(ranks)
    return exit_code


def _stop_all(ranks: list[tuple[int, Any]]) -> None:
    """Terminate the ranks' processes (then kill those still running after 10 s)."""
    for _, proc in ranks:
        if proc.is_alive():
            proc.terminate()
    for _, proc in ranks:
        proc.join(10.0)
        if proc.is_alive():
            proc.kill()
            proc.join(5.0)
