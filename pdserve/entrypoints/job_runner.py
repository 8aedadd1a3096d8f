"""Running a request's engine jobs: their outputs merged as they arrive, the unfinished ones
aborted when the consumer goes away, TTFT / TPOT / end-to-end latency recorded, and the result
collected into choices or streamed as SSE events.

A stream that has had nothing to send for :data:`KEEPALIVE_INTERVAL_S` (its request queued,
preempted, or its text held back) sends an SSE comment (``: keep-alive``, which clients ignore)
so that a reader with an idle timeout, the proxy's ``--stall-timeout`` above all, does not take
a busy but live server for a dead one.

The engine returns each job's ``kv_transfer_params`` complete (the connector builds them, P's
prompt ids included); they are relayed as they are.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable, Sequence

from pdserve.utils import phase_trace
from pdserve.types.sampling_params import SamplingParams
from pdserve.types.kv_params import KVTransferParams
from pdserve.entrypoints.errors import OpenAIError, engine_exception_to_error
from pdserve.entrypoints.choices import (
    ChoiceState,
    failed_request_error,
    first_kv_transfer_params,
    usage_of,
)
from pdserve.entrypoints.sse import DONE, KEEPALIVE, sse_event
from pdserve.entrypoints.metrics import ServerMetrics

logger = logging.getLogger(__name__)

# Finish reasons that end a request normally; anything else is reported as an error.
OK_FINISH_REASONS = ("stop", "length")
#: Seconds a streamed response may send nothing before it sends a keep-alive comment
#: (:data:`pdserve.entrypoints.sse.KEEPALIVE`). Well below the proxy's ``--stall-timeout``
#: (default 30 s: :data:`pdserve.router.migration.DEFAULT_STALL_TIMEOUT_S`), after which a silent
#: decode leg counts as failed: a stall timeout should be two intervals or more. A keep-alive
#: is sent only while the engine cores have been heard from within the interval (a core with
#: requests says it lives every second: ``AsyncEngine.core_silence_s``), so a core stuck in a
#: step with its process alive still leaves its streams silent, and the proxy's stall timeout
#: takes it for failed; a dead core fails its requests
#: (:meth:`pdserve.engine.core_client.CoreClient.check_alive`), which ends their streams with an
#: error event.
KEEPALIVE_INTERVAL_S = 10.0


@dataclass
class EngineJob:
    """One engine request: one choice of one prompt.

    Attributes:
        index: the choice index in the response (prompt index * n + i).
        request_id: the engine request id.
        prompt_token_ids: the prompt.
        sampling_params: sampling for this choice (``n`` = 1; seed already offset by i).
        kv_transfer_params: the request's parsed ``kv_transfer_params`` (with a prefill leg's
            rendered-prompt digest: ``KVTransferParams.with_prompt_digest``) or None.
        resumed_output_ids: a resumed request's output so far (``pdserve_resume``), which the
            engine computes after the prompt and continues; empty otherwise.
        data_parallel_rank: the rank that serves the job (the request's
            ``X-data-parallel-rank``); None: the engine picks the least-loaded one.
        after: the index of the job whose second output token (or end) this one waits for
            before it goes to the engine, or None. The choices after the first of a request that
            reads a remote KV wait for the first: its read puts the prompt's KV in the prefix
            cache, done once it computed a token after the prefiller's first one (which may be
            emitted while the read is still under way).
    """

    index: int
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    kv_transfer_params: KVTransferParams | None = None
    resumed_output_ids: list[int] = field(default_factory=list)
    data_parallel_rank: int | None = None
    after: int | None = None


class JobRunner:
    """Runs engine jobs through ``engine.generate`` and turns their outputs into choices.

    Args:
        engine: an ``AsyncEngine`` (``generate``, ``abort``).
        metrics: where latencies and finish reasons are recorded.
        model_name: the served model name (the ``model`` of streamed chunks).
    """

    def __init__(self, engine: Any, metrics: ServerMetrics, model_name: str):
        self.engine = engine
        self.metrics = metrics
        self.model_name = model_name

    async def run(self, jobs: list[EngineJob], arrival: float, idle_s: float | None = None
                  ) -> AsyncIterator[tuple[int, Any] | None]:
        """Yields ``(choice index, RequestOutput)`` as outputs arrive from all jobs; with
        ``idle_s``, also None each time ``idle_s`` seconds pass without one (the jobs go on).

        Leaving early (consumer closed, cancelled, or an exception) aborts every job that has not
        finished. Exceptions from ``engine.generate`` are raised as :class:`OpenAIError`. A
        job with ``after`` goes to the engine once that job has two output tokens or has ended.

        Args:
            jobs: the engine requests.
            arrival: ``time.monotonic()`` when the HTTP request arrived (for TTFT / e2e).
            idle_s: seconds without an output after which None is yielded (again every
                ``idle_s`` while none comes); None: never.
        """
        unfinished = {job.index: job.request_id for job in jobs}
        # a resumed job's output count includes the tokens another instance generated
        resumed = {job.index: len(job.resumed_output_ids) for job in jobs}
        first_token_at: dict[int, float] = {}
        queue: asyncio.Queue[tuple[int, Any]] = asyncio.Queue()
        done_marker = object()
        idle_marker = object()
        # set at a job's second output token or its end; the jobs that wait for it (``after``)
        # start then
        started = {job.index: asyncio.Event() for job in jobs}
        loop = asyncio.get_running_loop()
        last_item = time.monotonic()  # when the last item (or None) was taken from the queue
        idle_timer: asyncio.TimerHandle | None = None

        def idle_check() -> None:
            """Queues an idle marker once ``idle_s`` passed since the last item; re-arms. One
            timer per request, not one per output: an output only sets ``last_item``."""
            nonlocal idle_timer
            wait = last_item + idle_s - time.monotonic()
            if wait <= 0:
                queue.put_nowait((-1, idle_marker))
                wait = idle_s
            idle_timer = loop.call_later(wait, idle_check)

        async def pump(job: EngineJob) -> None:
            try:
                if job.after is not None:
                    await started[job.after].wait()
                args = (job.request_id, job.prompt_token_ids, job.sampling_params,
                        job.kv_transfer_params)
                # only the options a job uses are passed (engine doubles take the basic call)
                options: dict[str, Any] = {}
                if job.resumed_output_ids:
                    options["resumed_output_ids"] = job.resumed_output_ids
                if job.data_parallel_rank is not None:
                    options["data_parallel_rank"] = job.data_parallel_rank
                gen = self.engine.generate(*args, **options)
                num_tokens = 0
                async with contextlib.aclosing(gen):
                    async for out in gen:
                        queue.put_nowait((job.index, out))
                        num_tokens += len(out.new_token_ids)
                        if num_tokens >= 2:
                            started[job.index].set()
            except asyncio.CancelledError:
                raise
            except Exception as e:  # noqa: BLE001 - forwarded to the consumer
                queue.put_nowait((job.index, e))
            finally:
                started[job.index].set()
                queue.put_nowait((job.index, done_marker))

        tasks = [asyncio.create_task(pump(job)) for job in jobs]
        if idle_s is not None:
            idle_timer = loop.call_later(idle_s, idle_check)
        try:
            remaining = len(tasks)
            while remaining:
                index, item = await queue.get()
                last_item = time.monotonic()
                if item is idle_marker:
                    yield None
                    continue
                if item is done_marker:
                    remaining -= 1
                    continue
                if isinstance(item, BaseException):
                    raise engine_exception_to_error(item) from item
                phase_trace.mark("api.item")
                now = last_item
                if item.new_token_ids and index not in first_token_at:
                    first_token_at[index] = now
                    self.metrics.observe_first_token(now - arrival)
                if item.finished:
                    unfinished.pop(index, None)
                    self.metrics.count_finished(item.finish_reason)
                    if item.finish_reason in OK_FINISH_REASONS:
                        self.metrics.observe_finished(now - arrival, (
                            first_token_at[index] - arrival if index in first_token_at else None
                        ), item.num_output_tokens - resumed[index])
                yield index, item
        finally:
            if idle_timer is not None:
                idle_timer.cancel()
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            for request_id in unfinished.values():
                self.metrics.count_finished("abort")
                try:
                    await self.engine.abort(request_id)
                except Exception:  # noqa: BLE001 - best effort; the engine may be gone
                    logger.debug("abort of %s failed", request_id, exc_info=True)

    async def collect(self, jobs: list[EngineJob], arrival: float,
                      prompt_indices: list[int]) -> list[ChoiceState]:
        """Runs the jobs to completion and returns one state per choice, in index order.

        Raises:
            OpenAIError: an engine exception, or a choice that finished with ``error``/``abort``.
        """
        states = {j.index: ChoiceState(j.index, prompt_indices[k]) for k, j in enumerate(jobs)}
        gen = self.run(jobs, arrival)
        async with contextlib.aclosing(gen):
            async for index, out in gen:
                st = states[index]
                st.update(out)
                if out.finished and st.finish_reason not in OK_FINISH_REASONS:
                    raise failed_request_error(st)
        return [states[i] for i in sorted(states)]

    async def stream(self, jobs: list[EngineJob], arrival: float, *, response_id: str,
                     object_name: str, prompt_indices: list[int], include_usage: bool,
                     choice_of: Callable[[int, Any, str | None], dict[str, Any]],
                     opening_choices: Sequence[dict[str, Any]] = (),
                     token_ids: bool = False,
                     first_chunk_extra: dict[str, Any] | None = None) -> AsyncIterator[str]:
        """The SSE events of a streamed completions / chat response, ending with ``[DONE]``.

        Each chunk is ``{"id", "object": object_name, "created", "model", "choices"}``, plus
        ``"usage": null`` when ``include_usage``. First one chunk per ``opening_choices`` entry,
        then one chunk per engine output that carries text, logprobs or the finish, whose single
        choice is ``choice_of(index, output, finish_reason or None)``. The chunk that finishes the
        last choice carries ``kv_transfer_params`` unless ``include_usage``, in which case a final
        chunk with no choices carries ``usage`` and ``kv_transfer_params``.

        ``token_ids`` (the request's ``return_token_ids``): an output that carries only tokens
        (its text held back) still gets a chunk, so that the choices' ``token_ids`` add up to
        every generated token. ``first_chunk_extra``: top-level fields of the first chunk.

        A choice that finishes with ``error``/``abort``, an :class:`OpenAIError`, or any other
        exception is reported in-band as an OpenAI error event followed by ``[DONE]`` (the HTTP
        status has already been sent).
        """
        created = int(time.time())
        states = {j.index: ChoiceState(j.index, prompt_indices[k]) for k, j in enumerate(jobs)}
        remaining = len(jobs)

        def chunk(choices: list[dict[str, Any]], **extra: Any) -> str:
            body: dict[str, Any] = {"id": response_id, "object": object_name,
                                    "created": created, "model": self.model_name,
                                    "choices": choices}
            if include_usage:
                body["usage"] = None
            if pending_extra:
                body.update(pending_extra)
                pending_extra.clear()
            body.update(extra)
            return sse_event(body)

        pending_extra = dict(first_chunk_extra or {})
        try:
            for choice in opening_choices:
                yield chunk([choice])
            sent_at = time.monotonic()  # when the last event (or keep-alive) was yielded
            runner = self.run(jobs, arrival, KEEPALIVE_INTERVAL_S)
            async with contextlib.aclosing(runner):
                async for item in runner:
                    if item is not None:
                        index, out = item
                        st = states[index]
                        st.update(out)
                        if out.finished and st.finish_reason not in OK_FINISH_REASONS:
                            yield sse_event(failed_request_error(st).body())
                            yield DONE
                            return
                    if item is None or not (out.new_text or out.new_logprobs or out.finished
                                            or (token_ids and out.new_token_ids)):
                        # nothing to send: idle for an interval (None), or outputs whose text
                        # is held back, which get a keep-alive once an interval passed
                        if (item is None or time.monotonic() - sent_at >= KEEPALIVE_INTERVAL_S) \
                                and self.engine.core_silence_s() < KEEPALIVE_INTERVAL_S:
                            sent_at = time.monotonic()
                            yield KEEPALIVE
                        continue
                    extra: dict[str, Any] = {}
                    if out.finished:
                        remaining -= 1
                        if remaining == 0 and not include_usage:
                            extra["kv_transfer_params"] = first_kv_transfer_params(
                                list(states.values()))
                    phase_trace.mark("api.chunk")
                    sent_at = time.monotonic()
                    yield chunk([choice_of(index, out,
                                           st.finish_reason if out.finished else None)], **extra)
            if include_usage:
                all_states = [states[i] for i in sorted(states)]
                yield chunk([], usage=usage_of(all_states).model_dump(),
                            kv_transfer_params=first_kv_transfer_params(all_states))
            yield DONE
        except OpenAIError as e:
            yield sse_event(e.body())
            yield DONE
        except Exception as e:  # noqa: BLE001 - the stream has started; report in-band
            logger.exception("error while streaming %s", response_id)
            yield sse_event(OpenAIError(f"Internal server error: {e}", 500).body())
            yield DONE
