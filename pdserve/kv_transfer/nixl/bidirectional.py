"""Bidirectional KV transfer for multi-turn conversations (docs/architecture.md, "Multi-turn: bidirectional transfer"): the scheduler-side
decisions, as pure functions (no torch, no I/O).

With ``kv_connector_extra_config.bidirectional_kv_xfer: true`` on both instances:

* **Decoder (D)** — :func:`decoder_hold_blocks`: a request that arrived through P/D
  (``kv_transfer_params`` present) and finished normally holds its blocks for
  ``decoder_kv_blocks_ttl`` seconds (a lease that heartbeats and claims do NOT renew) and returns
  ``{do_remote_decode: true, do_remote_prefill: false, remote_engine_id, remote_block_ids,
  remote_num_tokens, remote_block_hashes, remote_blocks_expiry_time, remote_host, remote_port,
  remote_request_id, tp_size}``. ``remote_num_tokens`` = prompt + output - 1 (the last sampled
  token has no KV yet); ``remote_block_hashes`` are the chained hashes of the full blocks among
  those tokens. The blocks are freed early by the next turn's reader: its "done" notification
  after the READ, or an "abort" when it decides not to read (the conversation moved on).
* **Prefiller (P)** — :func:`plan_pull`: a P-leg request (``do_remote_decode``) that also
  carries D's fields (the multi-turn proxy merges them in) may load the longest block prefix of
  D's KV that equals the new prompt, beyond P's own prefix-cache hit, when that is at least
  ``kv_recompute_threshold`` tokens and D's blocks will still exist ``PULL_SAFETY_MARGIN_S``
  seconds from now (D's expiry time converted to P's clock with the offset measured at the
  handshake). Otherwise P recomputes. A pull that fails never fails the request: the scheduler
  recomputes (per-request ``kv_load_failure_policy`` override).
* **A pull never waits longer than its recompute** — :class:`PrefillPace`: P measures how long
  its own prefills take per prompt token, and a pull's lease claim waits at most the time P
  would take to compute the tokens it loads (``RecvSpec.claim_wait_s``; times
  ``kv_pull_wait_factor``, default 1, 0 for no bound). D answers a claim of
  a turn it demoted under GPU pressure only once the turn is restored into GPU blocks, a few of
  D's engine steps later (:mod:`pdserve.engine.turn_demotion`); when that is longer, P stops
  waiting and computes those tokens (a load of no block, ``KVConnectorOutput.partial_loads``;
  D is told to drop the turn).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pdserve.types.block_hash import block_hashes
from pdserve.kv_transfer.nixl.metadata import SendSpec
from pdserve.types.remote_ref import PackedTokens, RemoteKVRef
from pdserve.kv_transfer.nixl.prefix_match import matched_prefix_tokens, seconds_left, tokens_to_pull
from pdserve.types.block_hash import encode_block_hashes
from pdserve.types.kv_params import KVRole, KVTransferParams, decoder_turn_params

if TYPE_CHECKING:
    from pdserve.types.request import Request

# Seconds D's blocks must still live, on P's clock, for P to start a pull: covers the handshake
# and claim round trips and the READ itself with room to spare (a READ of a few MB takes
# milliseconds; docs/architecture.md, "KV cache layout"). The claim right before the READ checks it again, clock-free.
PULL_SAFETY_MARGIN_S = 5.0

@dataclass
class PullDecision:
    """What P does with a previous turn's KV on D.

    Attributes:
        ref: D's KV reference, or None when the params name no D (first turn) or are malformed.
        num_tokens: tokens to load from D (0: recompute; D is told to free its blocks).
        num_matched_tokens: leading prompt tokens D holds (block-aligned hash match).
        reason: a short explanation, for logs.
        expired: the pull was skipped because D's blocks expire too soon (or already did).
    """

    ref: RemoteKVRef | None
    num_tokens: int
    num_matched_tokens: int
    reason: str
    expired: bool = False


def pull_prefix_tokens(prompt_token_ids: list[int], block_size: int, ref: RemoteKVRef) -> int:
    """Leading prompt tokens whose KV D's held turn ``ref`` holds, verified block by block
    against its ``remote_block_hashes`` (:func:`matched_prefix_tokens`, a multiple of
    ``block_size``; 0 without hashes) and capped by its block table."""
    if not ref.block_hashes:
        return 0
    matched = matched_prefix_tokens(prompt_token_ids, block_size, ref.block_hashes, ref.num_tokens)
    return min(matched, len(ref.block_ids) * block_size)


def plan_pull(
    params: KVTransferParams | dict[str, Any] | None,
    prompt_token_ids: list[int],
    num_local_tokens: int,
    block_size: int,
    threshold: int,
    own_engine_id: str,
    clock_offset_s: float | None = None,
    now: float | None = None,
    safety_margin_s: float = PULL_SAFETY_MARGIN_S,
    matched: int | None = None,
) -> PullDecision:
    """Decide whether P pulls D's KV for this prompt.

    Args:
        params: the request's parsed ``kv_transfer_params`` (a dict is parsed first); a P leg
            that names a previous turn's decoder
            (:attr:`~pdserve.types.kv_params.KVTransferParams.pulls_decoder_kv`) may pull.
        prompt_token_ids: the new prompt.
        num_local_tokens: P's own prefix-cache hit, in tokens.
        block_size: tokens per block (the handshake guarantees both sides use the same).
        threshold: ``kv_recompute_threshold``: fewer tokens to load than this -> recompute.
        own_engine_id: this instance's engine id (a reference to itself is never pulled).
        clock_offset_s: D's clock minus P's clock, or None when not measured yet (0 assumed).
        now: P's ``time.time()`` (default: now).
        safety_margin_s: seconds D's blocks must still live.
        matched: :func:`pull_prefix_tokens` of this prompt and reference when already known
            (computed when None).

    Returns:
        A :class:`PullDecision`; ``num_tokens > 0`` means load that many tokens, starting at
        ``num_local_tokens``, from D's blocks with the same indices.
    """
    params = KVTransferParams.parse(params)
    if params is None or not params.pulls_decoder_kv:
        if params is not None and params.role is KVRole.PREFILL and params.remote_error:
            return PullDecision(None, 0, 0, f"malformed decoder fields: {params.remote_error}")
        return PullDecision(None, 0, 0, "no previous turn on a decoder")
    ref = params.remote
    if ref.endpoint.engine_id == own_engine_id:
        return PullDecision(None, 0, 0, "the previous turn's KV is on this instance")
    if not ref.block_hashes:
        return PullDecision(ref, 0, 0, "the decoder sent no block hashes (prefix unverifiable)")
    if matched is None:
        matched = pull_prefix_tokens(prompt_token_ids, block_size, ref)
    n = tokens_to_pull(len(prompt_token_ids), num_local_tokens, matched)
    if n <= 0 or n < threshold:
        return PullDecision(
            ref, 0, matched,
            f"{n} tokens to load (matched {matched}, local {num_local_tokens}) < threshold "
            f"{threshold}" if n > 0 else
            f"nothing to load (matched {matched}, local {num_local_tokens})",
        )
    if ref.expiry_time is not None:
        now = time.time() if now is None else now
        left = seconds_left(ref.expiry_time, clock_offset_s or 0.0, now)
        if left < safety_margin_s:
            return PullDecision(
                ref, 0, matched,
                f"the decoder's blocks expire in {left:.1f} s (< {safety_margin_s:g} s margin)",
                expired=True,
            )
    return PullDecision(ref, n, matched, f"pull {n} tokens (matched {matched})")


def decoder_hold_blocks(
    request: "Request",
    block_ids: list[int],
    block_size: int,
    ttl_s: float,
    engine_id: str,
    host: str,
    port: int,
    now: float | None = None,
    tp_size: int = 1,
) -> tuple[SendSpec, dict[str, Any]] | None:
    """D's side at the end of a turn: the lease to register and the params to return.

    Args:
        request: the finished request (normal finish).
        block_ids: its block table, in token order.
        block_size: tokens per block.
        ttl_s: ``decoder_kv_blocks_ttl``.
        engine_id, host, port: this instance's engine id and side channel.
        now: ``time.time()`` (default: now).
        tp_size: this instance's TP size (returned as ``tp_size``).

    Returns:
        ``(SendSpec, kv_transfer_params)``, or None when no token has KV (nothing to hold).
    """
    num_tokens = min(request.num_computed_tokens, request.num_tokens - 1)
    if num_tokens <= 0:
        return None
    num_blocks = math.ceil(num_tokens / block_size)
    if len(block_ids) < num_blocks:
        return None
    held = list(block_ids[:num_blocks])
    now = time.time() if now is None else now
    tokens = request.token_ids(0, num_tokens)
    hashes = block_hashes(tokens, block_size)
    spec = SendSpec(request_id=request.request_id, block_ids=held, lease_duration=ttl_s,
                    renew_on_heartbeat=False, tokens=PackedTokens.of(tokens))
    params = decoder_turn_params(engine_id, held, num_tokens, encode_block_hashes(hashes),
                                 now + ttl_s, host, port, request.request_id, tp_size)
    return spec, params


class PrefillPace:
    """Seconds per prompt token of this prefiller's own prefills, for the wait bound of its pulls.

    A P leg that loads nothing (no pull) is timed from the step that allocates its blocks
    (:meth:`started`) to its finish (:meth:`finished`; a P leg samples one token, so that is its
    prefill), over the prompt tokens it computed (its prompt less its prefix-cache and tier
    hits). The pace is the exponentially weighted mean (weight :data:`WEIGHT` for the newest) of
    those per-token times, over legs of at least :data:`MIN_TOKENS` computed tokens (a shorter
    leg's time is mostly a step's fixed cost). Legs batched together each count the whole step,
    so the pace errs long: a pull waits somewhat more than its recompute would take, never less.
    Pure bookkeeping: the caller passes the clock.

    Args:
        wait_factor: ``kv_pull_wait_factor``: a pull's claim waits at most this many times the
            time its tokens take (:meth:`claim_wait_s`; 0: no bound).
    """

    #: Weight of the newest leg in the running mean.
    WEIGHT = 0.2
    #: Fewest computed prompt tokens for a leg to be timed.
    MIN_TOKENS = 32

    def __init__(self, wait_factor: float = 1.0) -> None:
        self.wait_factor = wait_factor
        self._started: dict[str, float] = {}  # request id -> when its blocks were allocated
        self._s_per_token: float | None = None

    def started(self, request_id: str, now: float) -> None:
        """A P leg that loads nothing got its blocks at ``now`` (seconds, a monotonic clock)."""
        self._started[request_id] = now

    def finished(self, request_id: str, num_computed: int, now: float, normal: bool) -> None:
        """The request ended at ``now`` having computed ``num_computed`` prompt tokens;
        ``normal``: its prefill completed (an aborted or failed leg is not timed)."""
        start = self._started.pop(request_id, None)
        if start is None or not normal or num_computed < self.MIN_TOKENS:
            return
        per_token = max(0.0, now - start) / num_computed
        prev = self._s_per_token
        self._s_per_token = per_token if prev is None else \
            prev + self.WEIGHT * (per_token - prev)

    def seconds_for(self, num_tokens: int) -> float | None:
        """Seconds this prefiller takes to compute ``num_tokens`` prompt tokens at its pace;
        None before a leg was timed."""
        return None if self._s_per_token is None else self._s_per_token * num_tokens

    def claim_wait_s(self, num_tokens: int) -> float:
        """The bound on the claim wait of a pull of ``num_tokens`` tokens
        (``RecvSpec.claim_wait_s``): :attr:`wait_factor` times :meth:`seconds_for`; 0 (no
        bound) before a leg was timed or with a factor of 0."""
        return self.wait_factor * (self.seconds_for(num_tokens) or 0.0)
