"""Drive conversations against an endpoint with concurrent clients.

Scheduling (deterministic for a fixed input and seed, whatever the server's timing):

* Conversation ``i`` belongs to client ``i % num_clients``. Each client keeps up to its share of
  ``max_active_conversations`` open at once (the share is ``k // p``, plus one for the first
  ``k % p`` clients) and sends the next turn of its open conversations round-robin, one request at
  a time. A finished (or failed) conversation is replaced by the client's next one. Interleaving
  conversations like this makes the server hold (or evict) the KV cache of several chats at once.
* Each request carries the whole history: system messages, then every earlier user message and the
  answer the server actually gave to it.
* ``request_rate`` > 0: each client waits an exponentially distributed time with mean
  ``1 / request_rate`` seconds before each request (a Poisson process per client); 0 sends back to
  back. The waits come from a per-client ``numpy`` generator derived from the seed.
* ``max_num_requests`` stops all clients once that many requests were sent; ``max_turns`` caps the
  user turns used from each conversation.
* A failed request (HTTP error, error event, timeout, broken stream) is recorded with its error and
  ends its conversation: later turns would need the answer that never came.
* Warmup (optional): first the first turn of every conversation is sent (clients as above, no rate
  limit); those requests are recorded apart and the measured run continues from turn 2.
"""

from __future__ import annotations

import asyncio
import secrets
import time
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import httpx
import numpy as np
from tqdm import tqdm

from pdserve.bench.client import post_chat_completion
from pdserve.bench.conversations import Conversation
from pdserve.bench.stats import RequestRecord

SESSION_HEADER = "X-Session-ID"


@dataclass
class RunConfig:
    """Settings of one benchmark run (see ``pdserve bench multi-turn --help`` for each flag)."""

    url: str
    model: str
    headers: dict[str, str] = field(default_factory=dict)
    stream: bool = True
    num_clients: int = 1
    max_active_conversations: int | None = None
    max_num_requests: int | None = None
    max_turns: int | None = None
    request_rate: float = 0.0
    seed: int = 0
    limit_min_tokens: int | None = None
    limit_max_tokens: int | None = None
    request_timeout_s: float = 300.0
    send_conversation_id: bool = False
    warmup: bool = False
    show_progress: bool = True


@dataclass
class ConversationState:
    """Progress of one conversation during the run."""

    conversation: Conversation
    num_turns: int
    session_id: str
    next_turn: int = 0
    history: list[dict[str, str]] = field(default_factory=list)
    error: str | None = None

    @property
    def done(self) -> bool:
        return self.error is not None or self.next_turn >= self.num_turns

    @property
    def remaining_turns(self) -> int:
        return 0 if self.done else self.num_turns - self.next_turn


@dataclass
class RunResult:
    """Records and timings of a run; ``states`` hold the conversations with the answers received."""

    records: list[RequestRecord]
    warmup_records: list[RequestRecord]
    runtime_s: float
    warmup_runtime_s: float | None
    states: list[ConversationState]
    run_id: str


def resolve_output_lengths(
    target: int | None, limit_min: int | None, limit_max: int | None
) -> tuple[int | None, int | None]:
    """Return ``(max_tokens, min_tokens)`` to send for one turn.

    With a target length (from the input), the answer length is fixed: both values are the target
    clipped to ``[limit_min, limit_max]``. Without one, ``max_tokens = limit_max`` and
    ``min_tokens = limit_min`` (each None when not set, and then not sent).
    """
    if target is None:
        return limit_max, limit_min
    n = target
    if limit_max is not None:
        n = min(n, limit_max)
    if limit_min is not None:
        n = max(n, limit_min)
    return n, n


def count_prompt_tokens(tokenizer: Any, messages: list[dict[str, str]]) -> int:
    """Tokens of ``messages`` as the server would see them (chat template applied when the tokenizer
    has one, else the contents' tokens summed)."""
    if getattr(tokenizer, "chat_template", None):
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        if isinstance(ids, Mapping):
            ids = ids["input_ids"]
        return len(ids)
    return sum(len(tokenizer.encode(m["content"], add_special_tokens=False)) for m in messages)


def _usage_int(usage: dict[str, Any] | None, *keys: str) -> int | None:
    value: Any = usage
    for key in keys:
        if not isinstance(value, dict):
            return None
        value = value.get(key)
    return value if isinstance(value, int) and not isinstance(value, bool) else None


class _RequestBudget:
    def __init__(self, limit: int | None):
        self.remaining = limit

    def take(self) -> bool:
        if self.remaining is None:
            return True
        if self.remaining <= 0:
            return False
        self.remaining -= 1
        return True


class BenchmarkRunner:
    """Runs the conversations of one benchmark; use :meth:`run` (async) or :func:`run_benchmark`."""

    def __init__(self, conversations: list[Conversation], config: RunConfig, tokenizer: Any):
        if config.num_clients < 1:
            raise ValueError("num_clients must be >= 1")
        k = config.max_active_conversations or config.num_clients
        if k < config.num_clients:
            raise ValueError("max_active_conversations must be >= num_clients")
        self.config = config
        self.tokenizer = tokenizer
        self.run_id = secrets.token_hex(4)
        max_turns = config.max_turns
        self.states = [
            ConversationState(
                conversation=conv,
                num_turns=min(len(conv.turns), max_turns) if max_turns else len(conv.turns),
                session_id=f"{self.run_id}-{conv.id}",
            )
            for conv in conversations
        ]
        p = config.num_clients
        self.capacity = [k // p + (1 if i < k % p else 0) for i in range(p)]
        seeds = np.random.SeedSequence(config.seed).spawn(p)
        self.client_rngs = [np.random.default_rng(s) for s in seeds]
        self._bar: tqdm | None = None

    async def run(self) -> RunResult:
        cfg = self.config
        limits = httpx.Limits(max_connections=cfg.num_clients, max_keepalive_connections=cfg.num_clients)
        timeout = httpx.Timeout(cfg.request_timeout_s)
        async with httpx.AsyncClient(limits=limits, timeout=timeout) as http:
            warmup_records: list[RequestRecord] = []
            warmup_runtime = None
            if cfg.warmup:
                start = time.perf_counter()
                total = sum(1 for s in self.states if not s.done)
                with self._progress(total, "warmup"):
                    await self._run_clients(http, warmup_records, start, warmup=True)
                warmup_runtime = time.perf_counter() - start
            records: list[RequestRecord] = []
            total = sum(s.remaining_turns for s in self.states)
            if cfg.max_num_requests is not None:
                total = min(total, cfg.max_num_requests)
            start = time.perf_counter()
            with self._progress(total, "requests"):
                await self._run_clients(http, records, start, warmup=False)
            runtime = time.perf_counter() - start
        return RunResult(records, warmup_records, runtime, warmup_runtime, self.states, self.run_id)

    def _progress(self, total: int, desc: str) -> tqdm:
        self._bar = tqdm(total=total, desc=desc, unit="req",
                         disable=None if self.config.show_progress else True)
        return self._bar

    async def _run_clients(
        self, http: httpx.AsyncClient, records: list[RequestRecord], start: float, warmup: bool
    ) -> None:
        p = self.config.num_clients
        budget = _RequestBudget(None if warmup else self.config.max_num_requests)
        tasks = [
            self._client(i, self.states[i::p], http, records, start, budget, warmup) for i in range(p)
        ]
        await asyncio.gather(*tasks)

    async def _client(
        self,
        index: int,
        states: list[ConversationState],
        http: httpx.AsyncClient,
        records: list[RequestRecord],
        start: float,
        budget: _RequestBudget,
        warmup: bool,
    ) -> None:
        if warmup:
            for state in states:
                if not state.done:
                    records.append(await self._send_turn(state, index, http, start, warmup=True))
            return
        rng = self.client_rngs[index]
        pending = deque(states)
        active: list[ConversationState] = []
        pos = 0
        while True:
            while len(active) < self.capacity[index] and pending:
                state = pending.popleft()
                if not state.done:
                    active.append(state)
            if not active or not budget.take():
                return
            pos %= len(active)
            if self.config.request_rate > 0:
                await asyncio.sleep(float(rng.exponential(1.0 / self.config.request_rate)))
            state = active[pos]
            records.append(await self._send_turn(state, index, http, start, warmup=False))
            if state.done:
                active.pop(pos)
            else:
                pos += 1

    def build_request(self, state: ConversationState) -> tuple[dict[str, Any], dict[str, str], list[dict[str, str]]]:
        """Body, headers and message list for the next turn of ``state``."""
        cfg = self.config
        turn = state.conversation.turns[state.next_turn]
        messages = [*state.conversation.system, *state.history, {"role": "user", "content": turn.user}]
        body: dict[str, Any] = {"model": cfg.model, "messages": messages, "stream": cfg.stream}
        if cfg.stream:
            body["stream_options"] = {"include_usage": True}
        max_tokens, min_tokens = resolve_output_lengths(
            turn.output_tokens, cfg.limit_min_tokens, cfg.limit_max_tokens
        )
        if max_tokens is not None:
            body["max_tokens"] = max_tokens
        if min_tokens:
            body["min_tokens"] = min_tokens
        headers = dict(cfg.headers)
        if cfg.send_conversation_id:
            body["conversation_id"] = state.session_id
            headers[SESSION_HEADER] = state.session_id
        return body, headers, messages

    async def _send_turn(
        self,
        state: ConversationState,
        client: int,
        http: httpx.AsyncClient,
        start: float,
        warmup: bool,
    ) -> RequestRecord:
        cfg = self.config
        body, headers, messages = self.build_request(state)
        sent_at = time.perf_counter() - start
        resp = await post_chat_completion(http, cfg.url, body, headers, cfg.request_timeout_s)
        turn_number = state.next_turn + 1
        usage = resp.usage
        input_tokens = _usage_int(usage, "prompt_tokens")
        output_tokens = _usage_int(usage, "completion_tokens") if resp.ok else None
        from_server = input_tokens is not None and (output_tokens is not None or not resp.ok)
        if input_tokens is None:
            input_tokens = count_prompt_tokens(self.tokenizer, messages)
        if resp.ok and output_tokens is None:
            output_tokens = len(
                self.tokenizer.encode(resp.reasoning + resp.text, add_special_tokens=False)
            )
        ttft_ms = resp.ttft_s * 1000.0 if (resp.ok and resp.ttft_s is not None) else None
        latency_ms = resp.latency_s * 1000.0
        tpot_ms = None
        if ttft_ms is not None and output_tokens is not None and output_tokens > 1:
            tpot_ms = (latency_ms - ttft_ms) / (output_tokens - 1)
        record = RequestRecord(
            conversation_id=state.conversation.id,
            turn=turn_number,
            client=client,
            start_s=sent_at,
            ok=resp.ok,
            error=resp.error,
            ttft_ms=ttft_ms,
            tpot_ms=tpot_ms,
            latency_ms=latency_ms,
            input_num_tokens=input_tokens,
            output_num_tokens=output_tokens,
            cached_num_tokens=_usage_int(usage, "prompt_tokens_details", "cached_tokens"),
            num_chunks=resp.num_chunks,
            max_tokens=body.get("max_tokens"),
            usage_from_server=from_server,
        )
        if resp.ok:
            state.history += [messages[-1], {"role": "assistant", "content": resp.text}]
            state.next_turn += 1
        else:
            remaining = state.remaining_turns
            state.error = resp.error or "request failed"
            if not warmup and self._bar is not None and self._bar.total is not None:
                # the conversation's later turns will not be sent
                self._bar.total = max(self._bar.n + 1, self._bar.total - remaining + 1)
        if self._bar is not None:
            self._bar.update(1)
        return record


def run_benchmark(conversations: list[Conversation], config: RunConfig, tokenizer: Any) -> RunResult:
    """Run the benchmark to completion in a fresh event loop (blocking)."""
    return asyncio.run(BenchmarkRunner(conversations, config, tokenizer).run())
