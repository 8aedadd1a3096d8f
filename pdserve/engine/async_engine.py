"""Front-end client of the engine-core process, used by the HTTP server.

:class:`AsyncEngine` spawns :func:`pdserve.engine.core.run_engine_core` in its own process
(multiprocessing ``spawn``), so tokenisation, HTTP handling and detokenisation on the server's
event loop never stall the decoding loop. The two talk over ZMQ ``ipc://`` sockets in a private
temporary directory with the messages of :mod:`pdserve.engine.messages`.

Per request the front end detokenises incrementally and applies stop strings (the stop string
is cut from the text, the request is aborted in the core, ``finish_reason`` is ``"stop"``;
:mod:`pdserve.engine.output_processor`); as in vLLM, no stop string may end in the text of the
first ``min_tokens`` tokens. A request's ``kv_transfer_params`` arrive parsed
(:class:`pdserve.kv_transfer.params.KVTransferParams`) and are passed on to the core as they are.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import multiprocessing
import shutil
import tempfile
from typing import Any, AsyncIterator, Callable

import zmq
import zmq.asyncio

from pdserve.config import EngineConfig
from pdserve.engine.messages import (
    AbortRequests,
    AddRequest,
    CoreAddresses,
    CoreFailed,
    Ready,
    Shutdown,
    StartupFailed,
    StepOutputs,
    make_encoder,
    make_output_decoder,
)
from pdserve.engine.output_processor import (
    EngineStats,
    RequestOutput,
    RequestState,
    process_output,
)
from pdserve.engine.sampling_params import SamplingParams
from pdserve.kv_transfer.params import KVTransferParams
from pdserve.model_info import ModelInfo

__all__ = ["AsyncEngine", "EngineDeadError", "EngineStartupError", "EngineStats", "RequestOutput"]

logger = logging.getLogger(__name__)

# Seconds between liveness checks of the core process while no message arrives.
_LIVENESS_INTERVAL_S = 0.5
# Seconds shutdown() waits for the core to exit before terminating (then killing) it.
_SHUTDOWN_GRACE_S = 10.0


class EngineDeadError(RuntimeError):
    """The engine-core process died or was shut down; in-flight and new requests fail."""


class EngineStartupError(RuntimeError):
    """The engine-core process could not start (the message carries the core's reason)."""


class AsyncEngine:
    """Asynchronous client of one engine-core process (create with :meth:`start`).

    Attributes:
        config: the engine configuration (``max_model_len`` resolved).
        tokenizer: the model's tokenizer.
        model_info: the core's ``ModelInfo``.
        max_model_len: longest prompt + output (tokens).
        num_blocks / block_size: KV cache geometry.
    """

    def __init__(self) -> None:  # use start()
        self.config: EngineConfig
        self.tokenizer: Any = None
        self.model_info: Any = None
        self.max_model_len = 0
        self.num_blocks = 0
        self.block_size = 0
        self._proc: Any = None
        self._tmpdir = ""
        self._sync_ctx: zmq.Context | None = None
        self._async_ctx: zmq.asyncio.Context | None = None
        self._in_sock: Any = None
        self._out_sock: Any = None
        self._encoder = make_encoder()
        self._decoder = make_output_decoder()
        self._requests: dict[str, RequestState] = {}
        self._stats = EngineStats()
        self._stats_listeners: list[Callable[[dict[str, Any]], None]] = []
        self._output_task: asyncio.Task | None = None
        self._dead: str | None = None
        self._closed = False

    # ================================================================ lifecycle
    @classmethod
    async def start(cls, config: EngineConfig) -> "AsyncEngine":
        """Spawn the engine core and wait until it is ready (model loaded, KV cache allocated).

        Raises:
            EngineStartupError: the core failed to start (bad model, bad config, ...) or died.
        """
        self = cls()
        self.config = config
        self._tmpdir = tempfile.mkdtemp(prefix="pdserve-engine-")
        addresses = CoreAddresses(
            input_address=f"ipc://{self._tmpdir}/input", output_address=f"ipc://{self._tmpdir}/output"
        )
        self._sync_ctx = zmq.Context()
        self._async_ctx = zmq.asyncio.Context()
        self._in_sock = self._sync_ctx.socket(zmq.PUSH)
        self._in_sock.setsockopt(zmq.SNDHWM, 0)
        self._in_sock.setsockopt(zmq.LINGER, 0)
        self._in_sock.bind(addresses.input_address)
        self._out_sock = self._async_ctx.socket(zmq.PULL)
        self._out_sock.setsockopt(zmq.RCVHWM, 0)
        self._out_sock.setsockopt(zmq.LINGER, 0)
        self._out_sock.bind(addresses.output_address)

        from pdserve.engine.core import run_engine_core

        mp = multiprocessing.get_context("spawn")
        self._proc = mp.Process(
            target=run_engine_core, args=(config, addresses), name="pdserve-engine-core", daemon=True
        )
        try:
            self._proc.start()
            # Load the tokenizer in a thread while the core loads the model.
            tokenizer_task = asyncio.ensure_future(asyncio.to_thread(self._load_tokenizer, config))
            try:
                ready = await self._wait_ready()
            finally:
                await asyncio.wait([tokenizer_task])
                tokenizer_error = tokenizer_task.exception()
            if tokenizer_error is not None:
                raise EngineStartupError(f"could not load the tokenizer: {tokenizer_error}") from tokenizer_error
            self.tokenizer = tokenizer_task.result()
        except BaseException:
            await self._close(kill=True)
            raise
        self.model_info = ModelInfo.from_dict(ready.model_info)
        self.max_model_len = ready.max_model_len
        self.num_blocks = ready.num_blocks
        self.block_size = ready.block_size
        self.config = dataclasses.replace(config, max_model_len=ready.max_model_len)
        self._stats = EngineStats(num_blocks=ready.num_blocks, num_free_blocks=ready.num_blocks)
        self._output_task = asyncio.create_task(self._output_loop(), name="pdserve-engine-output")
        logger.info(
            "engine ready: %s, %d KV blocks of %d tokens, max_model_len %d",
            getattr(self.model_info, "name", config.model), self.num_blocks, self.block_size, self.max_model_len,
        )
        return self

    @staticmethod
    def _load_tokenizer(config: EngineConfig) -> Any:
        from pdserve.tokenizer import load_tokenizer

        return load_tokenizer(config)

    async def _wait_ready(self) -> Ready:
        while True:
            if await self._out_sock.poll(timeout=int(_LIVENESS_INTERVAL_S * 1000)):
                msg = self._decoder.decode(await self._out_sock.recv())
                if isinstance(msg, Ready):
                    return msg
                if isinstance(msg, (StartupFailed, CoreFailed)):
                    if msg.traceback:
                        logger.debug("engine core traceback:\n%s", msg.traceback)
                    raise EngineStartupError(f"engine failed to start: {msg.message}")
                continue
            if not self._proc.is_alive():
                raise EngineStartupError(
                    f"engine core process exited during startup (exit code {self._proc.exitcode});"
                    " see its log above"
                )

    async def shutdown(self) -> None:
        """Stop the core process (gracefully, then by force) and release the sockets. In-flight
        requests fail with :class:`EngineDeadError`. Idempotent."""
        if self._closed:
            return
        if self._dead is None and self._proc is not None and self._proc.is_alive():
            try:
                self._in_sock.send(self._encoder.encode(Shutdown()), zmq.NOBLOCK)
            except zmq.ZMQError:
                pass
        await self._close(kill=False)

    async def _close(self, kill: bool) -> None:
        self._closed = True
        self._mark_dead("the engine was shut down")
        if self._output_task is not None:
            self._output_task.cancel()
            try:
                await self._output_task
            except (asyncio.CancelledError, Exception):
                pass
        proc = self._proc
        if proc is not None and proc.pid is not None:
            if not kill:
                await asyncio.to_thread(proc.join, _SHUTDOWN_GRACE_S)
            if proc.is_alive():
                proc.terminate()
                await asyncio.to_thread(proc.join, 5.0)
            if proc.is_alive():
                proc.kill()
                await asyncio.to_thread(proc.join, 5.0)
        for sock in (self._in_sock, self._out_sock):
            if sock is not None:
                sock.close(0)
        for ctx in (self._sync_ctx, self._async_ctx):
            if ctx is not None:
                ctx.term()
        self._in_sock = self._out_sock = None
        self._sync_ctx = self._async_ctx = None
        if self._tmpdir:
            shutil.rmtree(self._tmpdir, ignore_errors=True)

    # ================================================================ health and stats
    @property
    def is_dead(self) -> bool:
        return self._dead is not None

    async def check_health(self) -> None:
        """Raises:
        EngineDeadError: the core process died or the engine was shut down."""
        if self._dead is None and (self._proc is None or not self._proc.is_alive()):
            code = self._proc.exitcode if self._proc is not None else None
            self._mark_dead(f"engine core process died (exit code {code})")
        if self._dead is not None:
            raise EngineDeadError(self._dead)

    def stats(self) -> EngineStats:
        """The latest snapshot the core sent (updated after every step with output)."""
        return self._stats

    def add_stats_listener(self, fn: Callable[[dict[str, Any]], None]) -> None:
        """Call ``fn(delta)`` with every connector stats delta (``KVConnectorOutput.stats``) as
        the core reports it, on the event loop thread."""
        self._stats_listeners.append(fn)

    def _mark_dead(self, reason: str) -> None:
        if self._dead is not None:
            return
        self._dead = reason
        if not self._closed:
            logger.error("engine is dead: %s", reason)
        for st in self._requests.values():
            if not st.finished:
                st.finished = True
                st.queue.put_nowait(EngineDeadError(reason))

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
    ) -> AsyncIterator[RequestOutput]:
        """Run one sequence; yield its output deltas until (and including) the finished one.

        ``sampling_params.n`` is not fanned out here (the server sends ``n`` requests).
        Leaving the iterator early (``break``, client disconnect, cancellation) aborts the
        request and frees its blocks.

        Args:
            kv_transfer_params: the request's ``kv_transfer_params`` as the front end parsed
                and checked them (:func:`pdserve.kv_transfer.params.parse_request_params`).

        Raises:
            ValueError: invalid input (duplicate id, empty or too long prompt, bad parameters).
            EngineDeadError: the core died before or while the request ran.
        """
        await self.check_health()
        prompt_token_ids = list(prompt_token_ids)
        self._validate(request_id, prompt_token_ids, sampling_params)
        st = RequestState(self.tokenizer, prompt_token_ids, sampling_params)
        self._requests[request_id] = st
        try:
            self._in_sock.send(
                self._encoder.encode(
                    AddRequest(
                        request_id=request_id,
                        prompt_token_ids=prompt_token_ids,
                        sampling_params=sampling_params,
                        kv_transfer_params=kv_transfer_params,
                    )
                )
            )
            while True:
                item = await st.queue.get()
                if isinstance(item, BaseException):
                    raise item
                yield item
                if item.finished:
                    return
        finally:
            self._requests.pop(request_id, None)
            if not st.finished:
                st.finished = True
                self._send_abort([request_id])

    async def abort(self, request_id: str) -> None:
        """Abort a request; its ``generate`` iterator ends with ``finish_reason="abort"``.
        Unknown or finished ids are ignored."""
        st = self._requests.get(request_id)
        if st is None or st.finished:
            return
        st.finished = True
        self._send_abort([request_id])
        st.queue.put_nowait(
            RequestOutput(
                request_id=request_id,
                finished=True,
                finish_reason="abort",
                num_prompt_tokens=st.num_prompt_tokens,
                num_output_tokens=st.num_output_tokens,
            )
        )

    def _send_abort(self, request_ids: list[str]) -> None:
        if self._dead is not None or self._in_sock is None:
            return
        try:
            self._in_sock.send(self._encoder.encode(AbortRequests(request_ids)), zmq.NOBLOCK)
        except zmq.ZMQError as e:
            logger.warning("could not send abort for %s: %s", request_ids, e)

    # ================================================================ output handling
    async def _output_loop(self) -> None:
        try:
            while True:
                if not await self._out_sock.poll(timeout=int(_LIVENESS_INTERVAL_S * 1000)):
                    if not self._proc.is_alive():
                        self._mark_dead(f"engine core process died (exit code {self._proc.exitcode})")
                        return
                    continue
                msg = self._decoder.decode(await self._out_sock.recv())
                if isinstance(msg, StepOutputs):
                    self._handle_step_outputs(msg)
                elif isinstance(msg, CoreFailed):
                    if msg.traceback:
                        logger.error("engine core traceback:\n%s", msg.traceback)
                    self._mark_dead(f"engine core failed: {msg.message}")
                    return
        except asyncio.CancelledError:
            raise
        except Exception as e:  # a front-end bug must not leave requests hanging
            logger.exception("engine output loop failed")
            self._mark_dead(f"engine output handling failed: {e}")

    def _handle_step_outputs(self, msg: StepOutputs) -> None:
        if msg.stats is not None:
            self._stats = EngineStats.from_snapshot(msg.stats)
        for delta in msg.connector_stats:
            for fn in self._stats_listeners:
                try:
                    fn(delta)
                except Exception:
                    logger.exception("stats listener failed")
        for o in msg.outputs:
            st = self._requests.get(o.request_id)
            if st is not None and not st.finished:
                out = process_output(o, st)
                if out.finish_reason == "stop" and o.finish_reason is None:
                    self._send_abort([o.request_id])  # a stop string ended it in the front end
                st.queue.put_nowait(out)
