"""A small in-process stand-in for ``AsyncEngine`` (same interface, no model, no core process).

It uses the real ``RequestOutput`` / ``EngineStats`` / ``EngineDeadError`` types so that a change
of those types shows up here. Generated tokens are a deterministic function of the prompt, the
seed and the position (:meth:`FakeEngine.expected_tokens`), which the tests use as the oracle.

Knobs for tests: ``token_delay_s`` (pause between tokens), ``gate`` (an event that must be set
before the first token: keeps requests "in the queue"), ``fail_reason`` (finish every request
with ``finish_reason="error"`` after ``fail_after`` tokens), ``dead`` (health check fails),
``cached_tokens`` (reported prefix-cache hits). Returned ``kv_transfer_params`` carry the
prompt ids when the request's params carry a prompt digest, as the real connector's scheduler
side builds them (:func:`pdserve.types.kv_params.with_prompt_handoff`); early releases are
recorded in ``released``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import types
from typing import Any, AsyncIterator

from tokenizers import Tokenizer, decoders, models
from transformers import PreTrainedTokenizerFast

from pdserve.types.engine_config import EngineConfig
from pdserve.engine.async_engine import EngineDeadError, EngineStats, RequestOutput
from pdserve.types.outputs import TokenLogprobs
from pdserve.types.sampling_params import SamplingParams
from pdserve.types.outputs import KVLoadFailure
from pdserve.types.kv_params import with_prompt_handoff

SPECIAL_TOKENS = ["<eos>", "<|im_start|>", "<|im_end|>"]
EOS_ID = 0
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def make_char_tokenizer() -> PreTrainedTokenizerFast:
    """A character-level tokenizer (special tokens, printable ASCII, newline) with a ChatML-like
    chat template; built in memory, nothing downloaded."""
    vocab = {t: i for i, t in enumerate(SPECIAL_TOKENS)}
    for c in range(32, 127):
        vocab[chr(c)] = len(vocab)
    vocab["\n"] = len(vocab)
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=None))
    backend.decoder = decoders.Fuse()
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<eos>",
                                  additional_special_tokens=SPECIAL_TOKENS[1:])
    tok.chat_template = CHAT_TEMPLATE
    return tok


class FakeEngine:
    """Implements the ``AsyncEngine`` interface the server uses."""

    def __init__(self, max_model_len: int = 64, served_model_name: str | None = None):
        self.tokenizer = make_char_tokenizer()
        self.config = EngineConfig(model="fake-model", served_model_name=served_model_name,
                                   max_model_len=max_model_len)
        self.max_model_len = max_model_len
        self.model_info = types.SimpleNamespace(
            name="fake-model", vocab_size=len(self.tokenizer), eos_token_ids=[EOS_ID])
        self._letter_ids = [self.tokenizer.convert_tokens_to_ids(c)
                            for c in "abcdefghijklmnopqrstuvwxyz"]
        # knobs
        self.token_delay_s = 0.0
        self.gate: asyncio.Event | None = None
        self.fail_reason: str | None = None
        self.fail_kv_load: KVLoadFailure | None = None  # the failure is a KV load's, of this kind
        self.fail_after = 1
        self.dead = False
        self.cached_tokens = 0
        self.returned_kv_params: dict[str, Any] | None = None
        # records
        self.calls: dict[str, dict[str, Any]] = {}
        self.active: set[str] = set()
        self.aborted: list[str] = []
        self.released: list[tuple[int, str, list[int]]] = []  # (rank, request id, block ids)
        self._abort_events: dict[str, asyncio.Event] = {}
        self._listeners: list[Any] = []
        self.stats_value = EngineStats(num_blocks=100, num_free_blocks=100)
        self.shutdown_called = False
        self.core_silence = 0.0  # what core_silence_s() reports (s)

    # ---- oracle ---------------------------------------------------------------------------
    def expected_tokens(self, prompt_ids: list[int], seed: int | None, n: int) -> list[int]:
        """The ``n`` tokens generated for this prompt and seed."""
        base = sum(prompt_ids) + (seed or 0)
        return [self._letter_ids[(base + i) % 26] for i in range(n)]

    def expected_text(self, prompt_ids: list[int], seed: int | None, n: int) -> str:
        return self.tokenizer.decode(self.expected_tokens(prompt_ids, seed, n))

    # ---- AsyncEngine interface ------------------------------------------------------------
    def core_silence_s(self) -> float:
        return self.core_silence

    async def generate(self, request_id: str, prompt_token_ids: list[int],
                       sampling_params: SamplingParams,
                       kv_transfer_params: dict[str, Any] | None = None,
                       resumed_output_ids: list[int] = (),
                       data_parallel_rank: int | None = None,
                       ) -> AsyncIterator[RequestOutput]:
        # A resumed request (AsyncEngine.generate's contract): the tokens continue those of the
        # uninterrupted request after the resumed ones, which count as output tokens.
        if self.dead:
            raise EngineDeadError("fake engine is dead")
        if request_id in self.active:
            raise ValueError(f"request id {request_id!r} is already in use")
        sampling_params.validate()
        self.calls[request_id] = dict(prompt=list(prompt_token_ids), params=sampling_params,
                                      kv=kv_transfer_params.to_dict() if kv_transfer_params else None,
                                      resumed=list(resumed_output_ids),
                                      rank=data_parallel_rank)
        n_resumed = len(resumed_output_ids)
        self.active.add(request_id)
        abort_event = self._abort_events[request_id] = asyncio.Event()
        finished = False
        sp = sampling_params
        tokens = self.expected_tokens(prompt_token_ids, sp.seed, n_resumed + sp.max_tokens)[n_resumed:]
        try:
            if self.gate is not None:
                await self.gate.wait()
            for i, tok in enumerate(tokens):
                if self.token_delay_s:
                    await asyncio.sleep(self.token_delay_s)
                else:
                    await asyncio.sleep(0)
                if abort_event.is_set():
                    finished = True
                    yield RequestOutput(request_id=request_id, finished=True,
                                        finish_reason="abort",
                                        num_prompt_tokens=len(prompt_token_ids),
                                        num_output_tokens=i)
                    return
                if self.fail_reason is not None and i >= self.fail_after:
                    finished = True
                    yield RequestOutput(request_id=request_id, finished=True,
                                        finish_reason="error", error=self.fail_reason,
                                        kv_load_failure=self.fail_kv_load,
                                        num_prompt_tokens=len(prompt_token_ids),
                                        num_output_tokens=i)
                    return
                last = i == len(tokens) - 1
                stop = tok in sp.stop_token_ids
                done = last or stop
                logprobs = []
                if sp.logprobs is not None:
                    top = [(tok, -0.25)] + [(self._letter_ids[(j + 1) % 26], -1.0 - j)
                                            for j in range(sp.logprobs)]
                    logprobs = [TokenLogprobs(token_id=tok, logprob=-0.25,
                                              top=top[: sp.logprobs])]
                if done:
                    finished = True
                yield RequestOutput(
                    request_id=request_id,
                    new_token_ids=[tok],
                    # a stop token's text is left out (AsyncEngine's contract, as vLLM's)
                    new_text="" if stop else self.tokenizer.decode([tok]),
                    new_logprobs=logprobs,
                    finished=done,
                    finish_reason=("stop" if stop else "length") if done else None,
                    num_prompt_tokens=len(prompt_token_ids),
                    num_output_tokens=n_resumed + i + 1,
                    num_cached_tokens=self.cached_tokens,
                    kv_transfer_params=self._kv_out(kv_transfer_params, prompt_token_ids)
                    if done else None,
                )
                if done:
                    return
        finally:
            self.active.discard(request_id)
            self._abort_events.pop(request_id, None)
            if not finished:
                self.aborted.append(request_id)

    def _kv_out(self, kv_in: Any, prompt_token_ids: list[int]) -> dict[str, Any] | None:
        if self.returned_kv_params is not None:
            return with_prompt_handoff(dict(self.returned_kv_params), list(prompt_token_ids),
                                       kv_in.prompt_digest if kv_in is not None else None)
        if kv_in is None:
            return None
        return {"received": kv_in.to_dict(), "remote_engine_id": "fake-engine"}

    async def release_early(self, rank: int, request_id: str, block_ids: list[int]) -> bool:
        if self.dead:
            raise EngineDeadError("fake engine is dead")
        self.released.append((rank, request_id, list(block_ids)))
        return True

    async def abort(self, request_id: str) -> None:
        ev = self._abort_events.get(request_id)
        if ev is not None:
            ev.set()
            if request_id not in self.aborted:
                self.aborted.append(request_id)

    def stats(self) -> EngineStats:
        return dataclasses.replace(self.stats_value, num_running=len(self.active))

    def add_stats_listener(self, fn: Any) -> None:
        self._listeners.append(fn)

    def emit_connector_stats(self, delta: dict[str, Any]) -> None:
        for fn in self._listeners:
            fn(delta)

    async def check_health(self) -> None:
        if self.dead:
            raise EngineDeadError("fake engine is dead")

    async def shutdown(self) -> None:
        self.shutdown_called = True
