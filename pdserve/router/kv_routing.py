"""Routing decisions of the proxy: KV-cache-aware scoring, session affinity, and their reasons.

``--routing kv-aware`` scores each instance of a leg by the prompt blocks already in its prefix
cache (from its KV events, :mod:`pdserve.router.kv_index`) against its load, and picks the
lowest cost::

    cost(instance) = sum(block_cost) / prompt_blocks + load_weight * in_flight

``block_cost`` of each full block of the prompt: 0 for a leading block in the instance's KV
cache, :data:`TIER_BLOCK_COST` ``["CPU"]`` (0.1) for one in its host-memory tier,
``["DISK"]`` (0.5) for one in its disk tier, and 1 (a recompute) for every block from the first
one held nowhere on. The weights are costs relative to prefilling the block: a host-tier hit
costs a copy into the KV cache (one block of an 8B model in bf16, 2 MiB, crosses PCIe in
~0.1 ms where its 16 tokens of prefill take ~0.5-1 ms), a disk hit a file read at a few GB/s
plus that copy. Without tiers this is ``(prompt_blocks - hit_blocks) / prompt_blocks``.
``hit_blocks``: leading full blocks of the prompt the instance holds (in any tier); ``in_flight``: requests
this proxy has open on it; ``load_weight`` (``--kv-load-weight``, default
:data:`DEFAULT_KV_LOAD_WEIGHT`): a whole prompt found in the cache is worth that many fewer
requests in flight (1 / 0.5 = 2). Ties go to the round-robin order. The prompt's hashes are
the engines' own (:func:`pdserve.types.block_hash.block_hashes`) over the token ids the
engines would build (:class:`PromptTokenizer`), computed at most once per request and block
size: the request's :class:`PromptBlocks` keeps them for both legs' routing and the local
prefill check (:mod:`pdserve.router.local_prefill`). When no instance of the leg has live
events, or the prompt cannot be tokenized, the leg is routed least-loaded. The scheme follows the
overlap-vs-load cost of SGLang's and NVIDIA Dynamo's KV routers.

Every decision has a :class:`RoutingReason`; it is counted per leg and logged at debug level.
"""

from __future__ import annotations

import asyncio
import logging
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from enum import Enum
from typing import Any, Sequence

import aiohttp

from pdserve.types.block_hash import block_hashes
from pdserve.router.kv_index import InstanceKVIndex, KVEventSubscriber
from pdserve.router.upstreams import Upstream, UpstreamPool

logger = logging.getLogger("pdserve.router")

#: Cost of a prompt block found in a KV cache tier, relative to recomputing it (1) and to a
#: block in the KV cache itself (0); see the module docstring.
TIER_BLOCK_COST = {"CPU": 0.1, "DISK": 0.5}
#: Default weight of one request in flight against a whole prompt found in an instance's cache.
DEFAULT_KV_LOAD_WEIGHT = 0.5
#: Context length (tokens) the proxy's prompt-size bound assumes when neither the model nor its
#: tokenizer names one, or an implausible one (:attr:`PromptTokenizer.max_chars`).
MAX_TOKENIZER_CONTEXT = 131072
#: Session affinity (``--session-affinity``): a conversation's decoder is kept while it has at
#: most this many requests in flight more than the least-loaded decoder.
AFFINITY_MAX_EXTRA_IN_FLIGHT = 2


class RoutingReason(str, Enum):
    """Why an instance was chosen for a leg (label value of the decisions metric)."""

    ROUND_ROBIN = "round_robin"      # --routing round-robin
    LEAST_LOADED = "least_loaded"    # --routing least-loaded, or kv-aware with no block cached
    KV_HIT = "kv_hit"                # kv-aware: the chosen instance holds some prompt blocks
    NO_EVENTS = "no_events"          # kv-aware without live events: least-loaded fallback
    CONVERSATION = "conversation"    # --multi-turn: the conversation's previous instance
    AFFINITY = "affinity"            # --session-affinity: the conversation's decoder


class PromptBlocks:
    """One request's prompt as kv-aware routing reads it: its token ids and, per block size,
    the chained hashes of its full blocks, computed on first use and kept, so that the
    routing of both legs and the local prefill check hash the prompt at most once per block
    size (instances of one model share one block size: once per request).

    Args:
        token_ids: the prompt token ids an instance builds (:meth:`PromptTokenizer.token_ids`).

    Attributes:
        token_ids: as given (not copied; not to be changed once hashed).
    """

    __slots__ = ("token_ids", "_hashes")

    def __init__(self, token_ids: list[int]):
        self.token_ids = token_ids
        self._hashes: dict[int, list[int]] = {}  # block size (tokens) -> hashes

    def hashes(self, block_size: int) -> list[int]:
        """Chained hashes of the prompt's full blocks of ``block_size`` tokens
        (:func:`~pdserve.types.block_hash.block_hashes`, ``len(token_ids) // block_size`` of
        them), hashed on the first call for that size."""
        hashes = self._hashes.get(block_size)
        if hashes is None:
            hashes = self._hashes[block_size] = block_hashes(self.token_ids, block_size)
        return hashes


@dataclass
class RoutingDecision:
    """One leg's routing decision.

    Attributes:
        order: instances to try, the chosen one first (fallbacks when it cannot be connected to).
        reason: why the first one.
        hit_blocks: prompt blocks cached on the chosen instance (kv-aware; else 0).
        prompt_blocks: full blocks of the prompt (kv-aware; else 0).
        uncached_tokens: prompt tokens the first instance of ``order`` would compute
            (:meth:`KVAwareRouter.uncached_tokens`), when kv-aware scoring read its live index
            (local prefill decides on it without hashing the prompt again); else None.
    """

    order: list[Upstream]
    reason: RoutingReason
    hit_blocks: int = 0
    prompt_blocks: int = 0
    uncached_tokens: int | None = None


def route_plain(pool: UpstreamPool, preferred: Upstream | None) -> RoutingDecision:
    """Round-robin / least-loaded routing, the conversation's previous instance first."""
    order = pool.order(preferred)
    if preferred is not None and order and order[0] is preferred:
        reason = RoutingReason.CONVERSATION
    else:
        reason = RoutingReason.LEAST_LOADED if pool.least_loaded else RoutingReason.ROUND_ROBIN
    return RoutingDecision(order, reason)


def affinity_allows(pool: UpstreamPool, up: Upstream | None) -> bool:
    """True when ``up`` is at most :data:`AFFINITY_MAX_EXTRA_IN_FLIGHT` requests busier than
    the least-loaded instance of ``pool``."""
    if up is None:
        return False
    least = min(u.in_flight for u in pool.upstreams)
    return up.in_flight <= least + AFFINITY_MAX_EXTRA_IN_FLIGHT


def chat_messages(body: dict[str, Any]) -> list[dict[str, Any]]:
    """The messages as the engine front end hands them to the chat template: fields that are
    null dropped, text parts joined into one ``content`` string (``pdserve/entrypoints/serving.py``).

    Raises:
        TypeError / AttributeError: malformed messages (the instances reject them anyway).
    """
    out = []
    for m in body["messages"]:
        d = {k: v for k, v in m.items() if v is not None}
        content = m.get("content")
        if isinstance(content, list):
            content = "".join(part.get("text") or "" for part in content)
        d["content"] = content or ""
        out.append(d)
    return out


class PromptTokenizer:
    """The served model's tokenizer in the proxy, loaded once, used in one worker thread.

    Attributes:
        max_chars: the longest prompt text (characters) tokenized: the engines' bound
            (:func:`pdserve.model_files.tokenizer.max_prompt_chars`) for the model's context
            length (:func:`~pdserve.model_files.client_tokenizer.model_context_length`), else
            the tokenizer's ``model_max_length``, or :data:`MAX_TOKENIZER_CONTEXT` tokens when
            neither names one.

    Args:
        source: the built-in model name, a model/tokenizer directory, or a ``.gguf`` file.

    Raises:
        pdserve.model_files.client_tokenizer.TokenizerLoadError: the tokenizer cannot be loaded.
    """

    def __init__(self, source: str):
        from pdserve.model_files.client_tokenizer import load_tokenizer, model_context_length
        from pdserve.model_files.tokenizer import max_prompt_chars

        self.tokenizer = load_tokenizer(source)
        context = model_context_length(source)  # what the engines default to
        if context is None:
            context = self.tokenizer.model_max_length  # transformers' "unset" is 1e30
        if not isinstance(context, int) or not 0 < context <= MAX_TOKENIZER_CONTEXT:
            context = MAX_TOKENIZER_CONTEXT
        self.max_chars = max_prompt_chars(self.tokenizer, context)
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="pdserve-proxy-tok")

    def token_ids(self, endpoint: str, body: dict[str, Any]) -> list[int] | None:
        """The prompt token ids an instance builds for ``body``, as ``pdserve serve`` does:
        completions encode the (first) prompt with special tokens; chat renders the template
        (``add_generation_prompt``, ``chat_template_kwargs``) and encodes without. None when
        the body has no usable prompt, or a text longer than :attr:`max_chars` (more tokens
        than the model takes: an engine refuses it, and tokenizing it would hold the one
        worker thread, and so every other request's routing, for seconds).

        Raises:
            Exception: whatever the tokenizer or the template raises on bad input.
        """
        tok = self.tokenizer
        if endpoint == "completions":
            prompt = body.get("prompt")
            if isinstance(prompt, list) and prompt:
                if all(isinstance(t, int) for t in prompt):
                    return list(prompt)
                prompt = prompt[0]
                if isinstance(prompt, list):
                    return list(prompt)
            if isinstance(prompt, str) and prompt and len(prompt) <= self.max_chars:
                return list(tok.encode(prompt, add_special_tokens=True))
            return None
        messages = chat_messages(body)
        if sum(len(m["content"]) for m in messages) > self.max_chars:
            return None
        add_generation_prompt = body.get("add_generation_prompt")  # null: the default, as served
        text = tok.apply_chat_template(
            messages, tokenize=False,
            add_generation_prompt=True if add_generation_prompt is None else add_generation_prompt,
            **(body.get("chat_template_kwargs") or {}))
        return list(tok.encode(text, add_special_tokens=False))

    async def token_ids_async(self, endpoint: str, body: dict[str, Any]) -> list[int] | None:
        """:meth:`token_ids` in the worker thread; None (and a debug log) when it fails."""
        loop = asyncio.get_running_loop()
        try:
            return await loop.run_in_executor(self._pool, self.token_ids, endpoint, body)
        except Exception as e:  # noqa: BLE001 - routing falls back; the instance reports errors
            logger.debug("cannot tokenize the prompt for routing: %s", e)
            return None

    def close(self) -> None:
        """Stop the worker thread."""
        self._pool.shutdown(wait=False, cancel_futures=True)


class KVAwareRouter:
    """KV-aware routing over both legs' instances (see the module docstring).

    Args:
        urls: base URLs of every instance (both legs).
        tokenizer: the served model's :class:`PromptTokenizer`.
        load_weight: ``--kv-load-weight``.
        stale_after: seconds without KV events after which an instance's index is ignored.

    Attributes:
        indexes: per instance URL, its :class:`InstanceKVIndex`.
    """

    def __init__(self, urls: Sequence[str], tokenizer: PromptTokenizer, load_weight: float,
                 stale_after: float):
        self.tokenizer = tokenizer
        self.load_weight = load_weight
        self.stale_after = stale_after
        self.indexes = {u: InstanceKVIndex(u) for u in urls}
        self._subscribers: list[KVEventSubscriber] = []

    def start(self, session: aiohttp.ClientSession, auth: str | None) -> None:
        """Start one event subscriber per instance (in the running event loop)."""
        for index in self.indexes.values():
            sub = KVEventSubscriber(index, session, auth)
            sub.start()
            self._subscribers.append(sub)

    async def stop_events(self) -> None:
        """Stop the event subscribers: no index is live any more, routing is least-loaded."""
        subs, self._subscribers = self._subscribers, []
        for sub in subs:
            await sub.close()

    async def close(self) -> None:
        """Stop the subscribers and the tokenizer thread."""
        await self.stop_events()
        self.tokenizer.close()

    def live(self, urls: Sequence[str]) -> bool:
        """True when every instance in ``urls`` has a live index (tests wait on this)."""
        return all(self.indexes[u].live(self.stale_after) for u in urls)

    def uncached_tokens(self, up: Upstream, prompt: PromptBlocks) -> int | None:
        """Tokens of ``prompt`` that ``up`` would compute: those after the leading full blocks
        it holds in its KV cache or one of its KV cache tiers (a tier hit is loaded, not
        computed); ``prompt`` hashes its blocks only if no earlier call for this request did
        at ``up``'s block size. None when ``up``'s index is not live (no KV events from it
        within ``stale_after`` seconds, or none yet)."""
        index = self.indexes.get(up.url)
        if index is None or not index.live(self.stale_after):
            return None
        hits = len(index.hit_media(prompt.hashes(index.block_size)))
        return len(prompt.token_ids) - hits * index.block_size

    def route(self, pool: UpstreamPool, prompt: PromptBlocks | None) -> RoutingDecision:
        """Score ``pool``'s instances for ``prompt`` (None: not tokenized) and order them, best
        first; ``prompt`` keeps the hashes it computes for the request's other routing."""
        live = [(u, self.indexes[u.url]) for u in pool.upstreams]
        live = [(u, ix) for u, ix in live if ix.live(self.stale_after)]
        if not live or prompt is None or not prompt.token_ids:
            reason = RoutingReason.NO_EVENTS if not live else RoutingReason.LEAST_LOADED
            return RoutingDecision(pool.order(None), reason)
        num_tokens = len(prompt.token_ids)
        order = pool.order(None)  # least-loaded, ties in round-robin order
        if not order:  # every instance of the leg is out of rotation
            return RoutingDecision(order, RoutingReason.LEAST_LOADED)
        best: Upstream | None = None
        best_cost = best_hits = best_blocks = 0
        uncached: dict[str, int] = {}  # per URL of an instance with a live index
        for up in order:
            index = self.indexes[up.url]
            hits = blocks = 0
            miss_cost = 0.0
            if index.live(self.stale_after):
                hashes = prompt.hashes(index.block_size)
                blocks = len(hashes)
                media = index.hit_media(hashes)
                hits = len(media)
                miss_cost = blocks - hits + sum(TIER_BLOCK_COST.get(m, 0.0) for m in media)
                uncached[up.url] = num_tokens - hits * index.block_size
            cost = (miss_cost / blocks if blocks else 1.0) + self.load_weight * up.in_flight
            if best is None or cost < best_cost:
                best, best_cost, best_hits, best_blocks = up, cost, hits, blocks
        if best is not order[0] and not pool.is_down(best):
            order.remove(best)
            order.insert(0, best)
        first_uncached = uncached.get(order[0].url)
        if order[0] is not best:  # the best one is cooling down: least-loaded order stands
            return RoutingDecision(order, RoutingReason.LEAST_LOADED, 0, best_blocks,
                                   first_uncached)
        reason = RoutingReason.KV_HIT if best_hits else RoutingReason.LEAST_LOADED
        return RoutingDecision(order, reason, best_hits, best_blocks, first_uncached)
