"""Local prefill (``--local-prefill-max-tokens N``): a request whose decoder already holds all but a
few of its prompt tokens is prefilled by that decoder, without a prefill leg.

Disaggregation pays when the prefill it moves off the decoder is long. A later turn of a chat
whose history the decoder still holds, in its KV cache or in its KV cache tiers (it decoded the
previous turn), needs only the new tokens computed; sending them through a prefiller costs a
second request, the prefiller's queue and a hand-off of the whole history's KV, which for a few
hundred tokens take longer than computing them on the decoder. So the proxy asks, per request,
how many prompt tokens the decoder routing picked would compute: the prompt's leading full
blocks that its KV events say it holds are not computed (a block in a tier is loaded, not
computed; :meth:`pdserve.router.kv_routing.KVAwareRouter.uncached_tokens`, or the count
kv-aware routing's decision carries), the rest are. At most
``N`` -> the request goes to that decoder alone, as the decode-only fallback sends it (no
``kv_transfer_params``: a ``kv_consumer`` computes such a prompt itself, loading what its tiers
hold); more, or no live KV events from the decoder -> the usual prefill leg. This is NVIDIA
Dynamo's conditional disaggregation (prefill remotely only when the prefill length after the
prefix hit exceeds ``max_local_prefill_length``) and llm-d's selective P/D, with the decoder's
tiers counted as held.

A decoder that prefills a request adds it to one of its steps beside its running decodes (their
inter-token latency grows for that step): ``N`` bounds that cost. A request that fails on its
decoder before the first token is retried through a prefiller, as any other.
Counted in ``pdserve:proxy_local_prefills_total``.
"""

from __future__ import annotations

from prometheus_client import Counter

from pdserve.router.kv_routing import KVAwareRouter, PromptBlocks, RoutingDecision


class LocalPrefill:
    """Decides which requests their decoder prefills itself (see the module docstring).

    Args:
        max_tokens: ``--local-prefill-max-tokens`` (>= 1).
        kv: the proxy's per-instance KV indexes and prompt tokenizer.
        counter: ``pdserve:proxy_local_prefills_total``.

    Raises:
        ValueError: ``max_tokens < 1``.
    """

    def __init__(self, max_tokens: int, kv: KVAwareRouter, counter: Counter):
        if max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
        self.max_tokens = max_tokens
        self._kv = kv
        self._counter = counter

    def take(self, decision: RoutingDecision, prompt: PromptBlocks | None) -> bool:
        """True (and counted) when the decoder ``decision`` puts first is to prefill ``prompt``
        itself: it would compute at most ``max_tokens`` of its tokens. False without a
        decoder, without a prompt or token ids (the prompt could not be tokenized) or without
        live KV events from it. The tokens to compute are the decision's
        (:attr:`~pdserve.router.kv_routing.RoutingDecision.uncached_tokens`) when kv-aware
        routing scored that decoder; else ``prompt``'s hashes, computed at most once per
        request and block size (:class:`~pdserve.router.kv_routing.PromptBlocks`)."""
        if not decision.order or prompt is None or not prompt.token_ids:
            return False
        uncached = decision.uncached_tokens
        if uncached is None:  # not scored: round-robin, least-loaded, affinity, index not live
            uncached = self._kv.uncached_tokens(decision.order[0], prompt)
        if uncached is None or uncached > self.max_tokens:
            return False
        self._counter.inc()
        return True
