"""A decoder's held turn blocks under GPU pressure: demoted to the prefix cache (and from there
the KV cache tiers), restored into GPU blocks when the next turn's prefiller claims them. Pure
bookkeeping: no torch.

With ``bidirectional_kv_xfer`` a decoder (D) holds a finished turn's blocks under a lease of
``decoder_kv_blocks_ttl`` seconds (:mod:`pdserve.kv_transfer.nixl.bidirectional`).
:class:`TurnDemoter` keeps those leases from starving new requests (without KV cache tiers too:
a demoted turn's blocks then live only as evictable cached blocks on the GPU):

1. **Pressure** (:meth:`TurnDemoter.relieve`, as each step closes): the head of the waiting
   queue was not scheduled and needs more blocks than are free (evictable cached blocks
   included). The oldest turn leases are asked to demote (``TurnMove.DEMOTE``), until the
   blocks they hold cover the shortfall.
2. **Demote**: the worker side agrees unless a reader's claim was already granted (its READ
   may be under way); from then on the lease holds no GPU blocks and claims of it wait. The
   scheduler then frees the turn's blocks: its full blocks stay in the prefix cache as
   evictable cached blocks, and the block manager's eviction stores them in the host tier
   (:meth:`~pdserve.engine.kv_tiers.TierManager.on_evict`) when they are taken. A refusal
   (``kept_turns``) is answered with ``TurnMove.KEEP``: the lease holds its blocks as before
   and is not asked again (``TurnState.KEPT``).
3. **Restore** (a reader's claim waits, ``KVConnectorOutput.turns_to_restore``; done as the
   next step closes): the leading full blocks still in the GPU prefix cache are re-pinned, the
   following ones found in a tier get fresh blocks and LOAD jobs (when blocks are short, other
   turn leases are demoted first and the restore waits for them); once the LOADs are reported
   (at once when none is needed) the lease is told the blocks that hold the KV now
   (``TurnMove.RESTORED``); once it took them (``restored_turns``) the turn counts as restored
   and the waiting claim is answered with them (``TurnMove.SERVE``): maybe only the turn's
   leading blocks, of which the reader reads those its pull planned and computes the rest (a
   partial load, :mod:`pdserve.kv_transfer.nixl.granted_claims`). Nothing found, or the
   lease could not take them (``failed_turns``): ``TurnMove.LOST``, the lease ends, the claim
   is rejected and the reader recomputes (its pull's failure path).
4. **End**: the lease still ends by the reader's "done"/"abort" or its TTL (``finished_sending``);
   restored blocks are freed then, a demoted lease holds nothing to free.

Tensor parallelism: every TP rank holds its shard of the turn's blocks (the same block ids) under
its own lease and gets every move; the executor merges the ranks' answers
(:mod:`pdserve.executor.kv_merge`), so a turn is demoted (its blocks freed) or restored only
once every rank did it, kept when one rank refused, and lost when one rank failed. Tier LOADs
are reported once every rank copied its shard
(:class:`~pdserve.executor.kv_merge.TierReportMerger`), and rank 0, which answers the claims for
every rank, serves a restore only at ``SERVE``: after every rank took the blocks.

Hashes make it safe: a block is found in the prefix cache or a tier only under the chained hash
of exactly the turn's tokens, and the lease's claim still checks the reader's token digest.
"""

from __future__ import annotations

import enum
import logging
import math
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Sequence

from pdserve.engine.block_manager import KVCacheManager
from pdserve.engine.remote_kv import RemoteKV
from pdserve.engine.request_queues import RequestQueues
from pdserve.engine.tier_loads import TierLoads
from pdserve.kv_transfer.base import TurnMove
from pdserve.types.request import RequestStatus

if TYPE_CHECKING:
    from pdserve.engine.kv_tiers import TierLoadDone
    from pdserve.kv_transfer.base import KVConnectorSchedulerSide
    from pdserve.types.outputs import KVConnectorOutput, ScheduledRequest

logger = logging.getLogger(__name__)

#: Seconds a claimed turn may wait for GPU blocks to be restored into before it is given up (its
#: lease ends; the reader's claim waits ``kv_handshake_timeout`` at most, then recomputes).
RESTORE_WAIT_S = 10.0


class TurnState(enum.Enum):
    """Where a demoted turn lease's KV is, as the scheduler sees it."""

    DEMOTING = "demoting"  # asked; the blocks are still held until every rank agrees
    KEPT = "kept"  # a rank refused: held as before (the scheduler frees them at the lease's end)
    DEMOTED = "demoted"  # freed into the prefix cache (then a tier); the lease holds none
    RESTORING = "restoring"  # fresh blocks allocated, tier LOADs in flight
    CONFIRMING = "confirming"  # the KV is in the blocks; waiting for every rank to take them
    RESTORED = "restored"  # the lease holds the restored blocks and serves its claims
    ENDED = "ended"  # the lease ended while RESTORING: the blocks go when the LOADs end


@dataclass
class TurnBlocks:
    """The block manager's view of a restored turn (it stands for the finished request).

    Attributes:
        request_id: the turn's request id (its own blocks were freed at the demotion).
        tokens: the tokens of the turn's full blocks, in order.
        num_computed_tokens: always 0 (the blocks come from the prefix cache or a tier).
        block_ids: the blocks allocated to it.
    """

    request_id: str
    tokens: list[int]
    num_computed_tokens: int = 0
    block_ids: list[int] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return len(self.tokens)

    def token_ids(self, start: int, end: int) -> list[int]:
        return self.tokens[start:end]


@dataclass
class _Turn:
    state: TurnState
    tokens: list[int]  # the tokens of its full blocks
    hashes: list[int]  # their chained hashes (``remote_block_hashes``)
    num_blocks: int  # GPU blocks it held before the demotion
    blocks: TurnBlocks | None = None
    num_from_gpu: int = 0  # restored blocks found in the GPU prefix cache
    num_good: int = 0  # restored blocks holding the KV (named to the lease)
    claim_waits: bool = False  # a claim came while DEMOTING (not every rank had answered yet)


class TurnDemoter:
    """Demotes a decoder's held turn blocks under pressure and restores them when claimed.

    Args:
        queues: the scheduler's queues (the waiting head's need for blocks).
        kv_cache_manager: the block manager.
        remote_kv: the finished requests whose blocks are held for a transfer.
        connector: the KV connector's scheduler side (``turn_leases``, ``move_turn``).
        tier_loads: the tier loads (their tiers' ``match`` / ``start_load``, and the ended
            loads that are restores); None without tiers: a demoted turn's blocks then stay
            in the GPU prefix cache only, as evictable cached blocks, and a claim finds them
            there or is refused (the reader recomputes).
        clock: ``time.monotonic`` (tests pass their own).

    Attributes:
        num_turns_demoted_total: turn leases whose blocks left the GPU.
        num_turns_restored_total: demoted turns whose blocks came back for a reader.
        num_turn_blocks_from_gpu_total: blocks of those still in the GPU prefix cache.
        num_turn_blocks_from_tiers_total: blocks of those that came back from a tier.
        num_turns_lost_total: demoted turns claimed after their blocks left every tier (or
            that a TP rank's lease could not take back).
    """

    def __init__(self, queues: RequestQueues, kv_cache_manager: KVCacheManager,
                 remote_kv: RemoteKV, connector: "KVConnectorSchedulerSide",
                 tier_loads: TierLoads | None, clock: Callable[[], float] = time.monotonic):
        self.queues = queues
        self._clock = clock
        self.kv_cache_manager = kv_cache_manager
        self.remote_kv = remote_kv
        self.connector = connector
        self.tier_loads = tier_loads
        self.tiers = tier_loads.tiers if tier_loads is not None else None
        self._turns: dict[str, _Turn] = {}
        # demoted turns a claim waits for, oldest first -> give up at (``clock()``)
        self._wanted: dict[str, float] = {}
        self.num_turns_demoted_total = 0
        self.num_turns_restored_total = 0
        self.num_turn_blocks_from_gpu_total = 0
        self.num_turn_blocks_from_tiers_total = 0
        self.num_turns_lost_total = 0

    def state(self, request_id: str) -> TurnState | None:
        """The turn's state, or None when it was never demoted (or is forgotten)."""
        turn = self._turns.get(request_id)
        return turn.state if turn is not None else None

    # ----------------------------------------------------------------------------- pressure
    def shortfall(self) -> int:
        """Blocks the waiting head (new, or preempted when its decode ran out of blocks) needs
        beyond the free ones (0: none, or no waiting request)."""
        if not self.queues.waiting:
            return 0
        head = self.queues.waiting[0]
        if head.status not in (RequestStatus.WAITING, RequestStatus.PREEMPTED):
            return 0
        kvm = self.kv_cache_manager
        need = math.ceil((head.num_tokens + 1) / kvm.block_size)
        need -= len(kvm.get_block_ids(head.request_id))
        return max(0, need - kvm.num_free_blocks)

    def relieve(self, scheduled: Sequence["ScheduledRequest"]) -> int:
        """As a step closes: restore the claimed turns that wait for blocks, then, when a
        claimed turn or the waiting head (not among ``scheduled``, this step's requests) lacks
        blocks, ask the oldest turn leases to demote until their blocks (with those already
        being demoted) cover the shortfall.

        Returns:
            How many leases were asked to demote now.
        """
        short = 0
        for request_id, give_up_at in list(self._wanted.items()):
            short = self._restore(request_id, self._turns[request_id])
            if short and self._clock() >= give_up_at:
                self._lose(request_id, f"no GPU blocks for {RESTORE_WAIT_S:g} s")
                short = 0
            elif short:
                break  # the oldest claim first
        if not short and self.queues.waiting:
            short = self.shortfall()
            head = self.queues.waiting[0].request_id
            if short and any(sr.request_id == head for sr in scheduled):
                short = 0
        return self._demote(short) if short > 0 else 0

    def _demote(self, short: int) -> int:
        """Ask the oldest turn leases not demoted yet to demote, for ``short`` blocks."""
        short -= sum(t.num_blocks for t in self._turns.values() if t.state is TurnState.DEMOTING)
        asked = 0
        for request_id in self.connector.turn_leases():
            if short <= 0:
                break
            held = self.remote_kv.held.get(request_id)
            if request_id in self._turns or held is None or not held.until_sent:
                continue
            req = held.request
            num_tokens = min(req.num_computed_tokens, req.num_tokens - 1)
            kvm = self.kv_cache_manager
            tokens = req.token_ids(0, num_tokens // kvm.block_size * kvm.block_size)
            hashes = kvm.request_block_hashes(req, len(tokens))  # memoised since its prefill
            self._turns[request_id] = _Turn(TurnState.DEMOTING, tokens, hashes,
                                            len(req.block_ids))
            self.connector.move_turn(request_id, TurnMove.DEMOTE)
            short -= len(req.block_ids)
            asked += 1
        return asked

    # ----------------------------------------------------------------------------- reports
    def update(self, kv_out: "KVConnectorOutput | None") -> None:
        """Apply a step's reports (before the scheduler's own ``finished_sending`` handling;
        at TP > 1 merged over the ranks): ended restore LOADs, leases that agreed to demote
        (their blocks are freed now) or refused, leases that ended, restores the lease took
        (its claims are served now) or could not (it ends), and claims waiting for a demoted
        lease (restored now, or after LOADs)."""
        for done in self.tier_loads.take_other_loads() if self.tier_loads is not None else ():
            self._load_done(done)
        if kv_out is None:
            return
        for request_id in kv_out.demoted_turns:
            turn = self._turns.get(request_id)
            if turn is not None and turn.state is TurnState.DEMOTING:
                turn.state = TurnState.DEMOTED
                self.num_turns_demoted_total += 1
                self.remote_kv.transfer_sent(request_id)  # its blocks: free, cached, evictable
                if turn.claim_waits:
                    self._want(request_id)
        for request_id in kv_out.kept_turns:
            turn = self._turns.get(request_id)
            if turn is not None and turn.state is TurnState.DEMOTING:
                turn.state = TurnState.KEPT  # the ranks that agreed take the blocks back
                self.connector.move_turn(request_id, TurnMove.KEEP)
        for request_id in kv_out.finished_sending:
            turn = self._turns.get(request_id)
            self._wanted.pop(request_id, None)
            if turn is None:
                continue
            if turn.state is TurnState.RESTORING:
                turn.state = TurnState.ENDED
                continue
            if turn.state is TurnState.CONFIRMING and request_id in kv_out.restored_turns:
                # the lease took the blocks and, at TP 1, answered its claim at once; the
                # reader ended it before this report (between the launch that bound the restore
                # and the report taken after the step's work): restored all the same
                self._count_restored(turn)
            if turn.state in (TurnState.CONFIRMING, TurnState.RESTORED):
                self.kv_cache_manager.free(turn.blocks)
            del self._turns[request_id]  # DEMOTING, KEPT: the scheduler frees the held blocks
        for request_id in kv_out.restored_turns:
            turn = self._turns.get(request_id)
            if turn is not None and turn.state is TurnState.CONFIRMING:
                self._served(request_id, turn)
        for request_id in kv_out.failed_turns:
            turn = self._turns.get(request_id)
            if turn is not None and turn.state is TurnState.CONFIRMING:
                self._lose(request_id, "a TP rank's lease could not take the restored blocks")
        for request_id in kv_out.turns_to_restore:
            turn = self._turns.get(request_id)
            if turn is not None and turn.state is TurnState.DEMOTED:
                self._want(request_id)  # restored as the next step closes
            elif turn is not None and turn.state is TurnState.DEMOTING:
                turn.claim_waits = True  # restored once every rank agreed to the demotion

    def _want(self, request_id: str) -> None:
        self._wanted[request_id] = self._clock() + RESTORE_WAIT_S

    def _restore(self, request_id: str, turn: _Turn) -> int:
        """Bring a claimed, demoted turn's leading full blocks back: re-pin those in the GPU
        prefix cache, load the following ones that a tier holds into fresh blocks.

        Returns:
            0, or the blocks missing to do it now (the turn stays wanted; other turns are
            demoted for it).
        """
        kvm, bs = self.kv_cache_manager, self.kv_cache_manager.block_size
        gpu = kvm.cached_prefix(turn.hashes)
        rest = turn.hashes[len(gpu):]
        media = self.tiers.match(rest) if rest and self.tiers is not None else []
        total = len(gpu) + len(media)
        holder = TurnBlocks(request_id, turn.tokens[:total * bs])
        if total == 0:
            self._lose(request_id, "no block found")
            return 0
        if kvm.allocate_slots(holder, len(media) * bs, gpu) is None:
            return max(1, kvm.num_blocks_needed(holder, len(media) * bs, gpu)
                       - kvm.num_free_blocks)
        del self._wanted[request_id]
        turn.blocks, turn.num_from_gpu = holder, len(gpu)
        loading = self.tiers.start_load(request_id, rest[:len(media)],
                                        holder.block_ids[len(gpu):]) if media else 0
        if loading:
            turn.state = TurnState.RESTORING
            return 0
        self._restored(request_id, turn, len(gpu))
        return 0

    def _load_done(self, done: "TierLoadDone") -> None:
        turn = self._turns.get(done.request_id)
        if turn is None or turn.blocks is None:
            return
        if turn.state is TurnState.ENDED:
            self.kv_cache_manager.free(turn.blocks)
            del self._turns[done.request_id]
            return
        good = turn.num_from_gpu + done.num_good
        self.kv_cache_manager.cache_blocks(turn.blocks, good * self.kv_cache_manager.block_size)
        self._restored(done.request_id, turn, good)

    def _restored(self, request_id: str, turn: _Turn, good: int) -> None:
        """The KV of ``good`` leading blocks is in ``turn.blocks``: name them to the lease
        (every rank's), which reports that it took them (:meth:`_served`) or could not."""
        if good == 0:  # the first block's read failed, or no host slot was free for it
            self._lose(request_id, "no block could be loaded")
            return
        turn.state, turn.num_good = TurnState.CONFIRMING, good
        self.connector.move_turn(request_id, TurnMove.RESTORED, turn.blocks.block_ids[:good])

    def _served(self, request_id: str, turn: _Turn) -> None:
        """Every rank's lease took the restored blocks: its claims are answered with them."""
        turn.state = TurnState.RESTORED
        self._count_restored(turn)
        self.connector.move_turn(request_id, TurnMove.SERVE)
        logger.debug("turn %s restored: %d blocks (%d from the GPU prefix cache)", request_id,
                     turn.num_good, turn.num_from_gpu)

    def _count_restored(self, turn: _Turn) -> None:
        self.num_turns_restored_total += 1
        self.num_turn_blocks_from_gpu_total += turn.num_from_gpu
        self.num_turn_blocks_from_tiers_total += turn.num_good - turn.num_from_gpu

    def _lose(self, request_id: str, why: str) -> None:
        self._wanted.pop(request_id, None)
        turn = self._turns.pop(request_id)
        if turn.blocks is not None:
            self.kv_cache_manager.free(turn.blocks)
        self.num_turns_lost_total += 1
        self.connector.move_turn(request_id, TurnMove.LOST)  # every rank's lease ends
        logger.debug("turn %s cannot be restored (%s): the reader recomputes", request_id, why)

    # ------------------------------------------------------------------------------ status
    def has_pending_work(self) -> bool:
        """True while a claimed turn waits for blocks (its restore is retried as each step
        closes); its tier LOADs are the tier loads' pending work
        (:meth:`TierLoads.has_pending_work <pdserve.engine.tier_loads.TierLoads.has_pending_work>`),
        which the scheduler asks as well."""
        return bool(self._wanted)

    @property
    def num_held_blocks(self) -> int:
        """Blocks that restored (or restoring) turns hold."""
        return sum(len(t.blocks.block_ids) for t in self._turns.values() if t.blocks is not None)

    def stats(self) -> dict:
        """The cumulative turn counters (the engine snapshot's ``kv_turns``, exported as
        ``pdserve:kv_offload_turn*`` with or without KV cache tiers)."""
        return {"turns_demoted": self.num_turns_demoted_total,
                "turns_restored": self.num_turns_restored_total,
                "turn_blocks_from_gpu": self.num_turn_blocks_from_gpu_total,
                "turn_blocks_from_tiers": self.num_turn_blocks_from_tiers_total,
                "turns_lost": self.num_turns_lost_total}
