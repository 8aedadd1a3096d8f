"""Front-end client of the engine-core process, used by the HTTP server.

:class:`AsyncEngine` spawns :func:`pdserve.engine.core.run_engine_core` in its own process
(multiprocessing ``spawn``), so tokenisation, HTTP handling and detokenisation on the server's
event loop never stall the decoding loop. The two talk over ZMQ ``ipc://`` sockets in a private
temporary directory with the messages of :mod:`pdserve.engine.messages`.

Per request the front end detokenises incrementally and applies stop strings (the stop string
is cut from the text, the request is aborted in the core, ``finish_reason`` is ``"stop"``); as in
vLLM, no stop string may end in the text of the first ``min_tokens`` tokens.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import multiprocessing
import shutil
import tempfile
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable

import zmq
import zmq.asyncio

from pdserve.config import EngineConfig
from pdserve.engine.detokenizer import IncrementalDetokenizer, StopStringMatcher
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
from pdserve.engine.outputs import EngineCoreOutput, TokenLogprobs
from pdserve.engine.sampling_params import SamplingParams
from pdserve.kv_transfer.factory import validate_kv_transfer_params
from pdserve.model_info import ModelInfo

logger = logging.getLogger(__name__)

# Seconds between liveness checks of the core process while no message arrives.
_LIVENESS_INTERVAL_S = 0.5
# Seconds shutdown() waits for the core to exit before terminating (then killing) it.
_SHUTDOWN_GRACE_S = 10.0


class EngineDeadError(RuntimeError):
    """The engine-core process died or was shut down; in-flight and new requests fail."""


class EngineStartupError(RuntimeError):
    """The engine-core process could not start (the message carries the core's reason)."""


@dataclass
class RequestOutput:
    """One delta of a request's output, as yielded by :meth:`AsyncEngine.generate`.

    Attributes:
        request_id: the request.
        new_token_ids: tokens generated since the previous delta.
        new_text: text since the previous delta (stop strings removed; may be empty while a
            multi-byte character or a possible stop-string prefix is held back).
        new_logprobs: logprobs of ``new_token_ids`` when requested.
        finished: True on the last delta.
        finish_reason: ``stop``, ``length``, ``abort`` or ``error`` on the last delta.
        stop_reason: the stop string or stop token id that ended the request, if any.
        num_prompt_tokens: prompt length (tokens).
        num_output_tokens: tokens generated so far (cumulative).
        num_cached_tokens: prompt tokens served from the local prefix cache.
        num_transferred_tokens: prompt tokens whose KV came from another instance.
        kv_transfer_params: the connector's params for the client (last delta only).
        error: the reason when ``finish_reason == "error"``.
    """

    request_id: str
    new_token_ids: list[int] = field(default_factory=list)
    new_text: str = ""
    new_logprobs: list[TokenLogprobs] = field(default_factory=list)
    finished: bool = False
    finish_reason: str | None = None
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    num_cached_tokens: int = 0
    kv_transfer_params: dict[str, Any] | None = None
    error: str | None = None
    stop_reason: int | str | None = None
    num_transferred_tokens: int = 0


@dataclass
class EngineStats:
    """Engine snapshot for ``/metrics``: queue sizes, KV cache use, cumulative token counters.

    ``kv_cache_usage`` is the fraction of blocks held by requests (0..1); all ``*_total`` fields
    are cumulative since the engine started (tokens, or events for preemptions).
    """

    num_running: int = 0
    num_waiting: int = 0
    num_waiting_for_remote_kvs: int = 0
    kv_cache_usage: float = 0.0
    num_blocks: int = 0
    num_free_blocks: int = 0
    prompt_tokens_total: int = 0
    prompt_tokens_computed_total: int = 0
    prompt_tokens_cached_total: int = 0
    prompt_tokens_transferred_total: int = 0
    generation_tokens_total: int = 0
    num_preemptions_total: int = 0
    num_kv_load_failures_total: int = 0
    num_held_for_transfer: int = 0

    @classmethod
    def from_snapshot(cls, snapshot: dict[str, Any]) -> "EngineStats":
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in snapshot.items() if k in names})


class _RequestState:
    __slots__ = ("queue", "detokenizer", "stop_matcher", "min_tokens", "num_prompt_tokens",
                 "num_output_tokens", "finished")

    def __init__(self, tokenizer: Any, prompt_token_ids: list[int], params: SamplingParams):
        self.queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self.detokenizer = IncrementalDetokenizer(tokenizer, prompt_token_ids)
        self.stop_matcher = StopStringMatcher(params.stop)
        self.min_tokens = params.min_tokens  # no stop string ends in the first min_tokens tokens
        self.num_prompt_tokens = len(prompt_token_ids)
        self.num_output_tokens = 0
        self.finished = False


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
        self._requests: dict[str, _RequestState] = {}
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

    def check_kv_transfer_params(self, kv_transfer_params: dict[str, Any] | None) -> None:
        """Reject ``kv_transfer_params`` of a KV transfer this instance would perform that lack
        or mistype a field, so a client mistake is a 400 instead of a failed KV load. Without a
        connector the params are ignored; unknown extra fields are accepted. ``generate`` calls
        it; the server may call it earlier (before a streamed response's status is sent).

        Raises:
            ValueError: the message names the missing or mistyped field.
        """
        if self.config.kv_transfer_config is not None:
            validate_kv_transfer_params(self.config.kv_transfer_config, kv_transfer_params)
            first = (kv_transfer_params or {}).get("first_token_id")
            vocab = getattr(self.model_info, "vocab_size", None)
            if isinstance(first, int) and vocab is not None and first >= vocab:
                raise ValueError(f"kv_transfer_params.first_token_id {first} is outside the "
                                 f"vocabulary [0, {vocab})")

    async def generate(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        kv_transfer_params: dict[str, Any] | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Run one sequence; yield its output deltas until (and including) the finished one.

        ``sampling_params.n`` is not fanned out here (the server sends ``n`` requests).
        Leaving the iterator early (``break``, client disconnect, cancellation) aborts the
        request and frees its blocks.

        Raises:
            ValueError: invalid input (duplicate id, empty or too long prompt, bad parameters,
                ``kv_transfer_params`` of a KV transfer that lack or mistype a field).
            EngineDeadError: the core died before or while the request ran.
        """
        await self.check_health()
        prompt_token_ids = list(prompt_token_ids)
        self._validate(request_id, prompt_token_ids, sampling_params)
        self.check_kv_transfer_params(kv_transfer_params)
        st = _RequestState(self.tokenizer, prompt_token_ids, sampling_params)
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
                self._handle_output(o, st)

    def _handle_output(self, o: EngineCoreOutput, st: _RequestState) -> None:
        finished = o.finish_reason is not None
        finish_reason = o.finish_reason
        stop_reason: int | str | None = o.stop_reason
        tokens = o.new_token_ids
        if len(tokens) > 1 and st.stop_matcher.stop:
            # Several tokens at once (a multi-step round): match stop strings token by token,
            # so that tokens after a stop are neither emitted nor counted, as with single steps.
            emit, stop = "", None
            for i, tok in enumerate(tokens):
                part, stop = st.stop_matcher.feed(st.detokenizer.add_tokens([tok]),
                                                  st.num_output_tokens + i + 1 > st.min_tokens)
                emit += part
                if stop is not None:
                    tokens = tokens[: i + 1]
                    break
            if stop is None and finished:
                part, stop = st.stop_matcher.feed(st.detokenizer.flush(),
                                                  st.num_output_tokens + len(tokens) > st.min_tokens)
                emit += part
        else:
            text = st.detokenizer.add_tokens(tokens) if tokens else ""
            if finished:
                text += st.detokenizer.flush()
            emit, stop = st.stop_matcher.feed(text, st.num_output_tokens + len(tokens) > st.min_tokens)
        if stop is not None:
            if not finished:
                self._send_abort([o.request_id])
            finished = True
            finish_reason = "stop"
            stop_reason = stop
        elif finished:
            emit += st.stop_matcher.flush()
        st.num_output_tokens += len(tokens)
        if finished:
            st.finished = True
        st.queue.put_nowait(
            RequestOutput(
                request_id=o.request_id,
                new_token_ids=list(tokens),
                new_text=emit,
                new_logprobs=list(o.new_logprobs[: len(tokens)]),
                finished=finished,
                finish_reason=finish_reason,
                stop_reason=stop_reason,
                num_prompt_tokens=st.num_prompt_tokens,
                num_output_tokens=st.num_output_tokens,
                num_cached_tokens=o.num_cached_tokens,
                num_transferred_tokens=o.num_transferred_tokens,
                kv_transfer_params=o.kv_transfer_params,
                error=o.error,
            )
        )
