"""Per-conversation state of the multi-turn proxy (docs/proxy.md), bounded by LRU and TTL.

After each turn the proxy remembers, per ``conversation_id``:

* the decoder's returned ``kv_transfer_params`` (where D keeps the turn's KV blocks), which the
  next turn's prefill request carries so that P can pull those blocks instead of recomputing;
* which prefill and decode instances served the turn, so the next turn prefers them (D holds the
  blocks; P's prefix cache may still hold the earlier prompt).

The params are single-use: :meth:`ConversationStore.take` hands them to one turn (its prefill
leg), and the table keeps none until a later turn records D's new ones. A prefiller that pulls
D's blocks ends D's lease on them, so a turn given the same params again (after a failed turn,
or beside a concurrent one) would only have its pull refused.

Expiry: an entry lives ``ttl`` seconds after its last turn (default: the decoder's
``decoder_kv_blocks_ttl``). The stored params expire sooner when D says so in
``remote_blocks_expiry_time``, an absolute wall-clock time in seconds since the Unix epoch
(``time.time()`` on D); after that D has freed the blocks and the params are dropped. At most
``max_entries`` conversations are kept; the least recently used is dropped first.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass, replace
from typing import Any, Callable


def params_life_s(kv_transfer_params: dict[str, Any], wall_now: float) -> float:
    """Seconds from ``wall_now`` (``time.time()``) until D's params expire by their
    ``remote_blocks_expiry_time`` (negative once past it; ``inf`` without a numeric one)."""
    expiry = kv_transfer_params.get("remote_blocks_expiry_time")
    if isinstance(expiry, (int, float)) and not isinstance(expiry, bool):
        return float(expiry) - wall_now
    return float("inf")


@dataclass
class ConversationState:
    """What the proxy knows about one conversation.

    Attributes:
        prefiller_url, decoder_url: base URLs of the instances that served the last turn.
        kv_transfer_params: D's params from the last turn, until taken, or None.
        params_expire_at: monotonic time (s) after which ``kv_transfer_params`` is dropped.
        expires_at: monotonic time (s) after which the whole entry is dropped.
    """

    prefiller_url: str | None
    decoder_url: str | None
    kv_transfer_params: dict[str, Any] | None
    params_expire_at: float
    expires_at: float


class ConversationStore:
    """LRU- and TTL-bounded map ``conversation_id -> ConversationState``.

    Args:
        max_entries: most conversations kept (>= 1).
        ttl: seconds an entry lives after its last turn (> 0).
        clock: monotonic clock in seconds; wall_clock: Unix time in seconds (injectable for tests).

    Raises:
        ValueError: ``max_entries < 1`` or ``ttl <= 0``.
    """

    def __init__(self, max_entries: int, ttl: float,
                 clock: Callable[[], float] = time.monotonic,
                 wall_clock: Callable[[], float] = time.time):
        if max_entries < 1:
            raise ValueError(f"max_entries must be >= 1, got {max_entries}")
        if not ttl > 0:
            raise ValueError(f"ttl must be > 0, got {ttl}")
        self.max_entries = max_entries
        self.ttl = ttl
        self._clock = clock
        self._wall_clock = wall_clock
        self._entries: OrderedDict[str, ConversationState] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, conversation_id: str) -> ConversationState | None:
        """The live state of ``conversation_id`` (marked most recently used), or None.

        Expired entries are removed; expired params are cleared (routing stickiness is kept
        until the entry itself expires).
        """
        state = self._entries.get(conversation_id)
        if state is None:
            return None
        now = self._clock()
        if now >= state.expires_at:
            del self._entries[conversation_id]
            return None
        if state.kv_transfer_params is not None and now >= state.params_expire_at:
            state.kv_transfer_params = None
        self._entries.move_to_end(conversation_id)
        return state

    def take(self, conversation_id: str) -> ConversationState | None:
        """As :meth:`get`, with the params taken (single-use, module docstring): the returned
        state carries them, the stored one no longer does."""
        state = self.get(conversation_id)
        if state is None or state.kv_transfer_params is None:
            return state
        taken = replace(state)
        state.kv_transfer_params = None
        return taken

    def record_turn(self, conversation_id: str, prefiller_url: str | None, decoder_url: str | None,
                    kv_transfer_params: dict[str, Any] | None) -> ConversationState:
        """Store the outcome of a finished turn.

        Args:
            kv_transfer_params: D's returned params, or None (the conversation then has none).

        Returns:
            The stored state.
        """
        now = self._clock()
        expires_at = now + self.ttl
        if kv_transfer_params is not None:
            params_expire_at = min(expires_at,
                                   now + params_life_s(kv_transfer_params, self._wall_clock()))
        else:
            params_expire_at = now
        state = ConversationState(prefiller_url, decoder_url, kv_transfer_params, params_expire_at,
                                  expires_at)
        self._entries[conversation_id] = state
        self._entries.move_to_end(conversation_id)
        self._evict(now)
        return state

    def _evict(self, now: float) -> None:
        entries = self._entries
        while len(entries) > self.max_entries:
            entries.popitem(last=False)
        # Drop expired entries at the cold end (the rest expire lazily in get(); the LRU bound
        # already caps memory).
        while entries:
            oldest = next(iter(entries.values()))
            if now < oldest.expires_at:
                break
            entries.popitem(last=False)
