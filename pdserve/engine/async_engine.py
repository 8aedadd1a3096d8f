"""Front-end client of the engine core(s), used by the HTTP server.

:class:`AsyncEngine` spawns :func:`pdserve.engine.core_loop.run_engine_core` in its own process
(multiprocessing ``spawn``), so tokenisation, HTTP handling and detokenisation on the server's
event loop never stall the decoding loop. The two talk over ZMQ sockets with the messages of
:mod:`pdserve.types.core_messages` (one :class:`pdserve.engine.core_client.CoreClient` per core).

With data parallelism (``data_parallel_size > 1``, :mod:`pdserve.engine.data_parallel`) there is
one core per rank, local or on other hosts; each request goes to the rank with the fewest
outstanding requests (ties: the next rank after the last one chosen), whether or not it loads
remote KV, unless the request names its rank (``X-data-parallel-rank``: a router's concurrent
hand-off). A prefill's returned ``kv_transfer_params`` name the rank that computed it (its own
side-channel port and engine id), so a decoder reads from that rank. One rank dying makes the
whole engine dead.

Per request the front end detokenises incrementally and applies stop strings (cut from the
text, the request aborted in the core, ``finish_reason`` ``"stop"``; :mod:`.output_processor`);
as in vLLM, none may end in the text of the first ``min_tokens`` tokens, and an ending EOS or stop
token has no text (its id is kept). A request's ``kv_transfer_params`` arrive parsed
(:class:`pdserve.types.kv_params.KVTransferParams`) and are passed on to the core as they are.

The module is one class and stays whole (past 450 lines): its start-up, request, liveness and
output paths all work on the same request table and cores, and a helper given parts of them
would reach into its owner.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import shutil
from typing import Any, AsyncIterator, Callable, Sequence

import zmq
import zmq.asyncio

from pdserve.utils import phase_trace
from pdserve.types.engine_config import EngineConfig
from pdserve.engine import ipc_dir
from pdserve.engine.core_client import (
    CoreClient,
    CoreStartupError,
    rank_devices,
    tensor_parallel_size,
)
from pdserve.types.core_messages import (
    AbortRequests,
    AddRequest,
    Ready,
    ReleaseEarly,
    Shutdown,
    StepOutputs,
)
from pdserve.engine.output_processor import (
    EngineStats,
    RequestOutput,
    RequestState,
    process_output,
)
from pdserve.types.sampling_params import SamplingParams
from pdserve.types.kv_params import KVTransferParams
from pdserve.types.model_info import ModelInfo

__all__ = ["AsyncEngine", "EngineDeadError", "EngineStartupError", "EngineStats", "RequestOutput"]

logger = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    """The engine-core process died or was shut down; in-flight and new requests fail."""


class EngineStartupError(RuntimeError):
    """The engine-core process could not start (the message carries the core's reason)."""


class AsyncEngine:
    """Asynchronous client of the engine-core process(es) (create with :meth:`start`).

    Attributes:
        config: the engine configuration (``max_model_len`` resolved).
        tokenizer: the model's tokenizer.
        model_info: the core's ``ModelInfo``.
        max_model_len: longest prompt + output (tokens).
        num_blocks / block_size: KV cache geometry (``num_blocks`` of one rank).
    """

    def __init__(self) -> None:  # use start()
        self.config: EngineConfig
        self.tokenizer: Any = None
        self.model_info: Any = None
        self.max_model_len = 0
        self.num_blocks = 0
        self.block_size = 0
        self._cores: list[CoreClient] = []
        self._tmpdir = ""
        self._sync_ctx: zmq.Context | None = None
        self._async_ctx: zmq.asyncio.Context | None = None
        self._rendezvous: Any = None
        self._requests: dict[str, tuple[RequestState, CoreClient]] = {}
        self._stats_listeners: list[Callable[[dict[str, Any]], None]] = []
        self._output_tasks: list[asyncio.Task] = []
        self._keepalive_tasks: list[asyncio.Task] = []  # heartbeats to remote ranks
        self._next_rank = 0
        self._dead: str | None = None
        self._closed = False

    # ================================================================ lifecycle
    @classmethod
    async def start(cls, config: EngineConfig) -> "AsyncEngine":
        """Spawn the engine core(s) and wait until every rank is ready (model loaded, KV cache
        allocated; remote ranks joined).

        Raises:
            EngineStartupError: a core failed to start (bad model, bad config, ...) or died.
        """
        self = cls()
        self.config = config
        self._tmpdir = ipc_dir.create()
        self._sync_ctx = zmq.Context()
        self._async_ctx = zmq.asyncio.Context()
        try:
            try:
                self._start_cores(config)
            except CoreStartupError as e:
                raise EngineStartupError(str(e)) from None
            self._keepalive_tasks = [asyncio.create_task(c.keepalive(), name=f"pdserve-ping-{c.rank}")
                                     for c in self._cores if c.remote]
            # Load the tokenizer in a thread while the cores load the model.
            tokenizer_task = asyncio.ensure_future(asyncio.to_thread(self._load_tokenizer, config))
            try:
                readies = await self._wait_ready()
            finally:
                await asyncio.wait([tokenizer_task])
                tokenizer_error = tokenizer_task.exception()
            if tokenizer_error is not None:
                raise EngineStartupError(f"could not load the tokenizer: {tokenizer_error}") from tokenizer_error
            self.tokenizer = tokenizer_task.result()
        except BaseException:
            await self._close(kill=True)
            raise
        ready = readies[0]
        self.model_info = ModelInfo.from_dict(ready.model_info)
        self.max_model_len = min(r.max_model_len for r in readies)
        self.num_blocks = ready.num_blocks
        self.block_size = ready.block_size
        self.config = dataclasses.replace(config, max_model_len=self.max_model_len)
        for core, r in zip(self._cores, readies):
            core.stats = EngineStats(num_blocks=r.num_blocks, num_free_blocks=r.num_blocks)
        self._output_tasks = [
            asyncio.create_task(core.output_loop(self._handle_step_outputs, self._core_died),
                                name=f"pdserve-engine-output-{core.rank}")
            for core in self._cores]
        logger.info(
            "engine ready: %s, %d KV blocks of %d tokens, max_model_len %d%s",
            getattr(self.model_info, "name", config.model), self.num_blocks, self.block_size,
            self.max_model_len,
            f", {len(self._cores)} data-parallel ranks" if len(self._cores) > 1 else "",
        )
        return self

    def _start_cores(self, config: EngineConfig) -> None:
        """Spawn the local ranks' cores and bind the remote ranks' sockets and the rendezvous.

        Raises:
            CoreStartupError: a socket cannot be bound or a process cannot be started.
        """
        from pdserve.engine.data_parallel import RendezvousServer, rank_config

        tp = tensor_parallel_size(config)
        num_local = config.local_data_parallel_size
        for rank in range(config.data_parallel_size):
            if rank < num_local:
                devices = (rank_devices(rank, tp) if config.data_parallel_size > 1
                           and config.device != "cpu" else None)
                core = CoreClient.local(rank, rank_config(config, rank), self._sync_ctx,
                                        self._async_ctx, self._tmpdir, devices)
            else:
                core = CoreClient.remote(rank, str(config.data_parallel_address),
                                         self._sync_ctx, self._async_ctx)
            self._cores.append(core)
        remote = [c for c in self._cores if c.remote]
        if remote:
            self._rendezvous = RendezvousServer(config, self._async_ctx, remote)

    @staticmethod
    def _load_tokenizer(config: EngineConfig) -> Any:
        from pdserve.model_files.tokenizer import load_tokenizer

        return load_tokenizer(config)

    async def _wait_ready(self) -> list[Ready]:
        """Every core's Ready, in rank order; the first failure cancels the other waits."""
        tasks = [asyncio.ensure_future(core.wait_ready()) for core in self._cores]
        if self._rendezvous is not None:
            tasks.append(asyncio.ensure_future(self._rendezvous.serve()))
        try:
            pending = set(tasks[: len(self._cores)])
            while pending:
                done, _ = await asyncio.wait(pending | set(tasks[len(self._cores):]),
                                             return_when=asyncio.FIRST_COMPLETED)
                for t in done:
                    t.result()  # raises the failure
                pending -= done
            return [t.result() for t in tasks[: len(self._cores)]]
        except CoreStartupError as e:
            raise EngineStartupError(str(e)) from None
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def shutdown(self) -> None:
        """Stop the core processes (gracefully, then by force) and release the sockets.
        In-flight requests fail with :class:`EngineDeadError`. Idempotent."""
        if self._closed:
            return
        for core in self._cores:
            if core.check_alive() is None:
                try:
                    core.send(Shutdown(), block=False)
                except zmq.ZMQError:
                    pass
        await self._close(kill=False)

    async def _close(self, kill: bool) -> None:
        self._closed = True
        self._mark_dead("the engine was shut down")
        tasks = self._output_tasks + self._keepalive_tasks
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await asyncio.gather(*(core.stop_process(kill) for core in self._cores))
        for core in self._cores:
            core.close_sockets()
        if self._rendezvous is not None:
            self._rendezvous.close()
        for ctx in (self._sync_ctx, self._async_ctx):
            if ctx is not None:
                ctx.term()
        self._sync_ctx = self._async_ctx = None
        if self._tmpdir:
            shutil.rmtree(self._tmpdir, ignore_errors=True)

    # ================================================================ health and stats
    @property
    def data_parallel_size(self) -> int:
        """Engine cores behind this client."""
        return len(self._cores)

    async def check_health(self) -> None:
        """Raises:
        EngineDeadError: a core process died (any rank) or the engine was shut down."""
        if self._dead is None:
            for core in self._cores:
                reason = core.check_alive()
                if reason is not None:
                    self._mark_dead(reason)
                    break
        if self._dead is not None:
            raise EngineDeadError(self._dead)

    def core_silence_s(self) -> float:
        """Seconds since the most silent engine core's last message. A core with requests sends
        one at least every :data:`~pdserve.types.core_messages.HEARTBEAT_INTERVAL_S` while its
        loop runs, so a long silence means a core stuck in a step (or gone)."""
        return max(core.silent_s for core in self._cores)

    def stats(self) -> EngineStats:
        """The latest snapshots the cores sent (updated after every step with output), summed
        over the ranks; with several ranks ``per_rank`` holds each rank's own."""
        ranks = [core.stats for core in self._cores]
        if len(ranks) == 1:
            return ranks[0]
        return EngineStats.combine(ranks)

    def add_stats_listener(self, fn: Callable[[dict[str, Any]], None]) -> None:
        """Call ``fn(delta)`` with every connector stats delta (``KVConnectorOutput.stats``) as
        the core reports it, on the event loop thread."""
        self._stats_listeners.append(fn)

    def end_requests(self, reason: str) -> None:
        """End every request in flight with :class:`EngineDeadError` (``reason``; the front end
        answers 503, or an error event in a stream); the engine keeps running. Each request's
        :meth:`generate` raises it and, as it is left, aborts the request in its core, which
        frees its blocks. A server shutting down does this before its grace period ends, so
        that its requests end with an answer instead of being cancelled (a dead core's
        requests end the same way)."""
        for st, _ in self._requests.values():
            if not st.finished:
                st.finished = True
                st.queue.put_nowait(EngineDeadError(reason))

    def _core_died(self, core: CoreClient, reason: str) -> None:
        self._mark_dead(reason)

    def _mark_dead(self, reason: str) -> None:
        if self._dead is not None:
            return
        self._dead = reason
        if not self._closed:
            logger.error("engine is dead: %s", reason)
        self.end_requests(reason)

    def _pick_core(self, rank: int | None = None) -> CoreClient:
        """The core of ``rank`` (ValueError when there is none); without one, the rank with the
        fewest outstanding requests, ties to the first one at or after the rank following the
        last choice (round robin among equals)."""
        n = len(self._cores)
        if rank is not None:
            if not 0 <= rank < n:
                raise ValueError(f"data-parallel rank {rank} does not exist (ranks 0..{n - 1})")
            return self._cores[rank]
        order = [self._cores[(self._next_rank + i) % n] for i in range(n)]
        core = min(order, key=lambda c: c.outstanding)
        self._next_rank = (core.rank + 1) % n
        return core

    # ================================================================ requests
    def _validate(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> None:
        if request_id in self._requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        params.validate()
        n = len(prompt_token_ids)
        if n == 0:
            raise ValueError("the prompt must contain at least one token")
        if n > self.max_model_len:
            raise ValueError(f"the prompt has {n} tokens, more than max_model_len ({self.max_model_len})")
        if n + params.max_tokens > self.max_model_len:
            raise ValueError(
                f"the prompt ({n} tokens) plus max_tokens ({params.max_tokens}) exceeds "
                f"max_model_len ({self.max_model_len})"
            )
        vocab = getattr(self.model_info, "vocab_size", None)
        if vocab is not None:
            bad = [t for t in prompt_token_ids if not (isinstance(t, int) and 0 <= t < vocab)]
            if bad:
                raise ValueError(f"prompt token ids must be integers in [0, {vocab}); got {bad[:5]}")

    async def generate(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        kv_transfer_params: KVTransferParams | None = None,
        resumed_output_ids: Sequence[int] = (),
        data_parallel_rank: int | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Run one sequence; yield its output deltas until (and including) the finished one.

        ``sampling_params.n`` is not fanned out here (the server sends ``n`` requests).
        Leaving the iterator early (``break``, client disconnect, cancellation) aborts the
        request and frees its blocks.

        Args:
            kv_transfer_params: the request's ``kv_transfer_params`` as the front end parsed
                and checked them (:func:`pdserve.types.kv_params.parse_request_params`).
            resumed_output_ids: a resumed request's output so far: the core's prompt is
                ``prompt_token_ids + resumed_output_ids`` (``sampling_params`` already counts
                only the tokens left); the outputs continue its text and count it
                (:class:`~pdserve.engine.output_processor.RequestState`).
            data_parallel_rank: the rank whose core runs the request (a router's
                ``X-data-parallel-rank``, concurrent hand-off); None: the least-loaded rank.

        Raises:
            ValueError: invalid input (duplicate id, empty or too long prompt, bad parameters,
                a rank outside ``0 .. data_parallel_size - 1``).
            EngineDeadError: the core died before or while the request ran.
        """
        await self.check_health()
        st = RequestState(self.tokenizer, prompt_token_ids, sampling_params, resumed_output_ids)
        prompt_token_ids = list(prompt_token_ids) + list(resumed_output_ids)
        self._validate(request_id, prompt_token_ids, sampling_params)
        core = self._pick_core(data_parallel_rank)
        self._requests[request_id] = (st, core)
        core.outstanding += 1
        delivered = False  # the caller got the finished output
        try:
            core.send(
                AddRequest(
                    request_id=request_id,
                    prompt_token_ids=prompt_token_ids,
                    sampling_params=sampling_params,
                    kv_transfer_params=kv_transfer_params,
                )
            )
            phase_trace.mark("ae.sent")
            while True:
                item = await st.queue.get()
                if isinstance(item, BaseException):
                    raise item
                if item.finished:
                    delivered = True
                yield item
                if item.finished:
                    return
        finally:
            core.outstanding -= 1
            self._requests.pop(request_id, None)
            if not st.finished or not delivered:
                # Unfinished: abort it. Finished but its output never reached the caller (the
                # client left meanwhile): the core ends a lease it holds for a remote reader.
                st.finished = True
                self._send_abort(core, [request_id])

    async def abort(self, request_id: str) -> None:
        """Abort a request; its ``generate`` iterator ends with ``finish_reason="abort"``.
        Unknown or finished ids are ignored."""
        entry = self._requests.get(request_id)
        if entry is None or entry[0].finished:
            return
        st, core = entry
        st.finished = True
        self._send_abort(core, [request_id])
        st.queue.put_nowait(
            RequestOutput(
                request_id=request_id,
                finished=True,
                finish_reason="abort",
                num_prompt_tokens=st.num_prompt_tokens,
                num_output_tokens=st.num_output_tokens,
            )
        )

    async def release_early(self, rank: int, request_id: str, block_ids: list[int]) -> bool:
        """Hand the proxy's early release of a finished prefill's held blocks to the core of
        data-parallel rank ``rank`` (:class:`~pdserve.types.core_messages.ReleaseEarly`; its
        connector ends the hold only when it is of exactly ``block_ids`` for ``request_id``).

        Returns:
            True once the core has the release.

        Raises:
            EngineDeadError: the core died or the engine was shut down.
        """
        await self.check_health()
        self._cores[rank].send(ReleaseEarly(request_id=request_id, block_ids=list(block_ids)))
        return True

    def _send_abort(self, core: CoreClient, request_ids: list[str]) -> None:
        if self._dead is not None or self._closed:
            return
        try:
            core.send(AbortRequests(request_ids), block=False)
        except zmq.ZMQError as e:
            logger.warning("could not send abort for %s: %s", request_ids, e)

    # ================================================================ output handling
    def _handle_step_outputs(self, core: CoreClient, msg: StepOutputs) -> None:
        if msg.outputs:
            phase_trace.mark("ae.recv")
        if msg.stats is not None:
            core.stats = EngineStats.from_snapshot(msg.stats)
        for delta in msg.connector_stats:
            for fn in self._stats_listeners:
                try:
                    fn(delta)
                except Exception:
                    logger.exception("stats listener failed")
        for o in msg.outputs:
            entry = self._requests.get(o.request_id)
            if entry is not None and not entry[0].finished:
                st = entry[0]
                out = process_output(o, st)
                if out.finish_reason == "stop" and o.finish_reason is None:
                    self._send_abort(core, [o.request_id])  # a stop string ended it in the front end
                st.queue.put_nowait(out)
