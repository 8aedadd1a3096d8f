"""Requests waiting for their KV to come back from the KV cache tiers (host memory, disk): the
scheduler's side of a tier hit. Pure bookkeeping: no torch.

A waiting request whose prefix-cache lookup stops on the device but goes on in a tier
(:meth:`~pdserve.engine.kv_tiers.TierManager.match`) gets device blocks for the device hit and
the rest of its tokens and LOAD jobs for the tier blocks. When every such block is in the host
tier, the request is computed in the same step: the runner's forward waits for the step's host
LOADs, so a host-tier hit costs no step more than a device hit (the blocks join the prefix
cache at once; their host slots stay pinned until the runner reports the copies). Otherwise
(a block on disk: a file read may fail or take long) the request parks in ``WAITING_FOR_TIER_KVS`` as a request
whose KV loads from another instance does (other requests keep running). When the runner
reports every LOAD done, the loaded blocks join the prefix cache, the request's computed tokens
cover them and it goes back to the front of the waiting queue; its admission then asks the KV
connector (if any) for what lies beyond, as it would have for a fresh request. A request
finished (aborted) while its blocks load keeps them until the loads are reported, so no copy
writes into a block another request got.
"""

from __future__ import annotations

from typing import Sequence

from pdserve.engine.block_manager import KVCacheManager
from pdserve.engine.kv_tiers import TierLoadDone, TierManager
from pdserve.types.kv_tiers import KVTierMedium, KVTierReport
from pdserve.types.request import Request, RequestStatus


class TierLoads:
    """Requests parked while their KV loads from the tiers, and requests whose blocks a tier
    load still writes after they finished.

    Args:
        kv_cache_manager: the engine's block manager.
        tiers: the tier bookkeeping.

    Attributes:
        waiting: request id -> request parked in ``WAITING_FOR_TIER_KVS``.
        loaded: ids of requests whose tier load ended and that were not admitted since (their
            admission asks the KV connector, as for a fresh request).
        prompt_tokens_loaded_total: prompt tokens whose KV came back from a tier.
        num_failed_loads_total: tier loads with at least one unreadable block.
    """

    def __init__(self, kv_cache_manager: KVCacheManager, tiers: TierManager):
        self.kv_cache_manager = kv_cache_manager
        self.tiers = tiers
        self.waiting: dict[str, Request] = {}
        self.loaded: set[str] = set()
        self._num_local: dict[str, int] = {}
        self._held: dict[str, Request] = {}
        self.prompt_tokens_loaded_total = 0
        self.num_failed_loads_total = 0
        self._others: list[TierLoadDone] = []  # ended loads not of a request (turn restores)

    def has_pending_work(self) -> bool:
        """True while tier loads are in flight (the engine must keep stepping to see them end,
        and a detached load's host slots stay pinned until then)."""
        return bool(self.waiting or self._held or self.tiers.has_unreported_loads())

    def try_load(self, req: Request, computed_blocks: Sequence[int], num_local: int) -> int | None:
        """Start loading the tier blocks that follow a fresh request's device hit.

        Args:
            req: a request with no blocks (new or preempted), taken off the waiting queue.
            computed_blocks / num_local: its device prefix-cache hit (blocks, tokens).

        Returns:
            None when no tier holds the next block (admit it as usual); 0 when the blocks
            could not be allocated (the request stays waiting); else the tokens that load.
            Blocks all in the host tier load in this step: the request's computed tokens
            cover them already, it is in :attr:`loaded` and the caller schedules it now.
            Otherwise (a disk block) the request is parked in ``WAITING_FOR_TIER_KVS`` until
            the runner reports its loads.
        """
        kvm = self.kv_cache_manager
        bs = kvm.block_size
        max_blocks = (req.num_tokens - 1) // bs  # the last token is always computed
        if max_blocks <= len(computed_blocks):
            return None
        hashes = kvm.request_block_hashes(req, max_blocks * bs)[len(computed_blocks):]
        media = self.tiers.match(hashes)
        if not media:
            return None
        n = len(media)
        # Blocks for the whole sequence, not only the loaded part: a request back from its
        # load then never waits for blocks while holding some (parked requests that each held
        # part of what they need could otherwise hold every block, none able to run).
        if kvm.allocate_slots(req, req.num_tokens - num_local, computed_blocks) is None:
            return 0
        # Matched again: the allocation may have evicted cached device blocks into the host
        # tier, pushing some of these blocks from the host tier to disk (or out). Whether the
        # load is host-only (computed in this very step) must be decided on where they are now.
        media = self.tiers.match(hashes[:n])
        n = len(media)
        first = len(computed_blocks)
        host_only = all(m is KVTierMedium.CPU for m in media)
        loading = self.tiers.start_load(req.request_id, hashes[:n], req.block_ids[first:first + n],
                                        detached=host_only) if n else 0
        if loading == 0:  # every host slot is pinned: admit it as usual
            kvm.free(req)
            return None
        if host_only:
            # The runner's forward waits for this step's host LOADs (a host copy never fails),
            # so the request is computed in this very step, like a device hit. The load is
            # detached from it: the request may finish, be preempted or come back before the
            # copies are reported; anything that writes its blocks later is ordered after them
            # on the device (and a KV connector's writes wait on the host for them).
            good = num_local + loading * bs
            req.num_computed_tokens = good
            self.prompt_tokens_loaded_total += min(good, req.num_prompt_tokens) - min(
                num_local, req.num_prompt_tokens)
            kvm.cache_blocks(req, good)
            self.loaded.add(req.request_id)
            return loading * bs
        req.num_computed_tokens = num_local
        req.status = RequestStatus.WAITING_FOR_TIER_KVS
        self.waiting[req.request_id] = req
        self._num_local[req.request_id] = num_local
        return loading * bs

    def report(self, report: KVTierReport) -> list[Request]:
        """Apply the runner's report of tier jobs. Returns the parked requests whose load is
        over, with their loaded blocks in the prefix cache and their computed tokens covering
        them (up to the first unreadable block), for the scheduler to put back at the front of
        the waiting queue. Requests finished meanwhile have their blocks freed."""
        ready: list[Request] = []
        for done in self.tiers.loads_reported(report):
            held = self._held.pop(done.request_id, None)
            if held is not None:
                self.kv_cache_manager.free(held)
                continue
            req = self.waiting.pop(done.request_id, None)
            if req is None:
                self._others.append(done)
                continue
            num_local = self._num_local.pop(done.request_id)
            good = num_local + done.num_good * self.kv_cache_manager.block_size
            if done.num_good < done.num_blocks:
                self.num_failed_loads_total += 1
            req.num_computed_tokens = good
            self.prompt_tokens_loaded_total += min(good, req.num_prompt_tokens) - min(
                num_local, req.num_prompt_tokens)
            self.kv_cache_manager.cache_blocks(req, good)
            req.status = RequestStatus.WAITING
            self.loaded.add(req.request_id)
            ready.append(req)
        return ready

    def take_other_loads(self) -> list[TierLoadDone]:
        """Ended loads that no parked or finished request of this class started (a decoder's
        turn blocks coming back, :mod:`pdserve.engine.turn_demotion`), since the last call."""
        out, self._others = self._others, []
        return out

    def request_finished(self, req: Request) -> bool:
        """The request finishes (abort, error). Returns True when a tier load still writes its
        blocks: they stay allocated until the load is reported (the caller must not free
        them); False otherwise."""
        request_id = req.request_id
        self.loaded.discard(request_id)
        self.waiting.pop(request_id, None)
        self._num_local.pop(request_id, None)
        if self.tiers.is_loading(request_id):
            self._held[request_id] = req
            return True
        return False

    def stats(self) -> dict:
        """:meth:`TierManager.stats <pdserve.engine.kv_tiers.TierManager.stats>` plus the
        prompt tokens loaded and the failed loads."""
        return {**self.tiers.stats(), "prompt_tokens_loaded": self.prompt_tokens_loaded_total,
                "failed_loads": self.num_failed_loads_total}

    @property
    def num_held_blocks(self) -> int:
        """Blocks of finished requests that a tier load still writes."""
        return sum(len(self.kv_cache_manager.get_block_ids(r)) for r in self._held)
