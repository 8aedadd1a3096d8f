"""Incoming notices of the NIXL connector: NIXL notifications and side-channel notices about
the blocks this rank holds, applied on the engine thread; rank 0 forwards side-channel notices
to the other TP ranks of its instance by NIXL."""

from __future__ import annotations

import logging
import queue
from collections.abc import Callable
from typing import Any

from pdserve.kv_transfer.nixl.agent import NixlAgent
from pdserve.kv_transfer.nixl.notifications import Notice, decode_notif, encode_notif
from pdserve.kv_transfer.nixl.stats import StatsRecorder

# the worker's logger: its log lines keep the name they always had
logger = logging.getLogger("pdserve.kv_transfer.nixl.worker")


class NoticeInbox:
    """The notices this rank receives (side channel: any thread; the rest: engine thread).

    Args:
        agent: this rank's NIXL agent (its notifications; forwarding to sibling ranks).
        tp_rank: this worker's TP rank.
        apply: applies one notice to the held blocks
            (:meth:`~pdserve.kv_transfer.nixl.held.HeldBlocks.apply`).
        wake: wakes the engine loop (called from the side-channel thread).
        stats: the transfer counters (failed forwards).
    """

    def __init__(self, agent: NixlAgent, tp_rank: int, apply: Callable[[Notice], None],
                 wake: Callable[[], None], stats: StatsRecorder):
        self._agent = agent
        self._tp_rank = tp_rank
        self._apply = apply
        self._wake = wake
        self._stats = stats
        # (notice, tp_rank) received by the side-channel thread (tp_rank None: for every rank)
        self._side: queue.SimpleQueue[tuple[Notice, int | None]] = queue.SimpleQueue()
        # rank 0: the other ranks' agent metadata, and the names of those loaded (on first use)
        self._sibling_metadata: dict[int, bytes] = {}
        self._siblings: dict[int, str] = {}

    def set_siblings(self, metadata: dict[int, bytes]) -> None:
        """Rank 0: the NIXL agent metadata of the instance's other ranks, by rank."""
        self._sibling_metadata = dict(metadata)

    def on_side_channel_notice(self, kind: str, request_id: str, block_ids: Any = None,
                               tp_rank: int | None = None, expected: int = 1,
                               reader: str | None = None) -> None:
        """Side-channel thread: queue a notice (for TP rank ``tp_rank``, None: every rank; from
        the reader id ``reader``, :mod:`.readers`) for the engine thread and wake it."""
        self._side.put((Notice(kind, request_id, expected, block_ids, reader), tp_rank))
        self._wake()

    def has_side_notices(self) -> bool:
        """True while side-channel notices wait for :meth:`process`."""
        return not self._side.empty()

    def process(self) -> None:
        """Apply this rank's NIXL notifications and side-channel notices; forward the
        side-channel notices meant for other ranks."""
        try:
            notifs = self._agent.get_notifs()
        except Exception as e:
            logger.warning("NIXL: reading notifications failed: %s", e)
            notifs = {}
        for messages in notifs.values():
            for msg in messages:
                parsed = decode_notif(bytes(msg))
                if parsed is None:
                    logger.warning("NIXL: ignoring an unknown notification %r", bytes(msg)[:64])
                    continue
                self._apply(parsed)
        while True:
            try:
                notice, tp_rank = self._side.get_nowait()
            except queue.Empty:
                break
            if tp_rank is None or tp_rank == self._tp_rank:
                self._apply(notice)
            if tp_rank != self._tp_rank:
                self._forward(notice, tp_rank)

    def _forward(self, notice: Notice, tp_rank: int | None) -> None:
        """Rank 0: pass a side-channel notice on to the rank(s) it is for, by NIXL (a rank not
        reached lets its lease expire)."""
        ranks = list(self._sibling_metadata) if tp_rank is None else \
            [tp_rank] if tp_rank in self._sibling_metadata else []
        for rank in ranks:
            try:
                if rank not in self._siblings:  # loaded on first use
                    self._siblings[rank] = self._agent.load_agent(self._sibling_metadata[rank])
                self._agent.send_notif(self._siblings[rank], encode_notif(
                    notice.kind, notice.request_id, notice.expected, notice.block_ids,
                    notice.reader))
            except Exception as e:
                self._stats.current.num_failed_notifications += 1
                logger.warning("NIXL: forwarding a %s notice to TP rank %d failed: %s",
                               notice.kind, rank, e)
