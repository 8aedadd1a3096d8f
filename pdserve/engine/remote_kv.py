"""Remote-KV bookkeeping of the scheduler: KV loaded from other instances (synchronously in a
step, or asynchronously while the request waits), failed loads, and finished requests whose
blocks must outlive them. Pure bookkeeping: no torch.

The :class:`~pdserve.engine.scheduler.Scheduler` owns one :class:`RemoteKV` and drives the KV
connector (``pdserve.kv_transfer.base``) through it. :class:`RemoteKV` owns the requests parked
while their KV loads and the blocks held for transfers; what a finished or failed load means for
a request's place in the queues (back to the waiting front, finished with an error, the
prefiller's first token appended) it returns as a :class:`LoadResult` for the scheduler to
apply:

* ``request_added`` when a request is queued; ``get_num_new_matched_tokens`` once per request,
  after its local prefix-cache hit (again only if the allocation that follows fails);
  ``update_state_after_alloc`` with the whole block table once blocks are allocated.
* A load reported in ``finished_recving`` marks ``min(local + external, num_tokens - 1)`` tokens
  computed, so at least the last prompt token is recomputed for its logits; except when the
  connector loads the whole prompt and reports the prefiller's first token in
  ``KVConnectorOutput.first_tokens``: that token is appended as soon as it is reported, while
  the load is still in flight (:meth:`RemoteKV.first_tokens_ready`), without a forward pass;
  the load then covers every token but the appended one, whose KV the first decode step
  computes.
* ``invalid_block_ids`` of a pending load apply ``kv_load_failure_policy`` when the load is
  reported finished: ``FAIL`` ends the request with ``finish_reason="error"``, ``RECOMPUTE``
  rolls ``num_computed_tokens`` back to the first invalid block. Invalid blocks read by a
  synchronous load of this step do the same at once (the step's token is worthless).
* A *partial load* (``KVConnectorOutput.partial_loads``: only the load's leading blocks hold
  KV, maybe none: the owner had no more, or the load was given up before reading) is no
  failure: ``num_computed_tokens`` ends where those blocks do, as ``RECOMPUTE``'s roll-back
  would put it, the request keeps its other blocks and computes the rest; no policy applies and
  no failure is counted (``num_kv_partial_loads_total``).
* ``request_finished`` is called exactly once per request (finish, abort, error). When the
  connector asks for the blocks to be held, they are held until the id appears in
  ``finished_sending``. A request finished while its load is in flight
  (``WAITING_FOR_REMOTE_KVS``) has its blocks held until the id appears in
  ``finished_recving``, so no transfer writes into blocks reused by others.
"""


from __future__ import annotations

import enum
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

from pdserve.engine.block_manager import KVCacheManager
from pdserve.types.kv_transfer_config import FAILURE_POLICIES, KVLoadFailurePolicy
from pdserve.types.outputs import KVConnectorOutput, KVLoadError, KVLoadFailure
from pdserve.types.request import Request, RequestStatus

if TYPE_CHECKING:
    from pdserve.kv_transfer.base import KVConnectorSchedulerSide

logger = logging.getLogger(__name__)


def parse_load_failure_policy(kv_transfer_config: Any) -> KVLoadFailurePolicy:
    """The configured ``kv_load_failure_policy`` (``FAIL`` without a KV transfer config).

    Args:
        kv_transfer_config: the engine's ``kv_transfer_config`` (its policy as a member or as
            its configuration string), or None.

    Raises:
        ValueError: an unknown policy.
    """
    policy = kv_transfer_config.kv_load_failure_policy if kv_transfer_config is not None else None
    policy = policy or KVLoadFailurePolicy.FAIL
    try:
        return KVLoadFailurePolicy(policy)
    except ValueError:
        raise ValueError(
            f"kv_load_failure_policy must be one of {FAILURE_POLICIES}, got {policy!r}"
        ) from None


class LoadOutcome(enum.Enum):
    """How a KV load into a request's blocks ended (see :class:`LoadResult`)."""

    LOADED = "loaded"  # its KV is in place: back to the waiting front (or its first token)
    RECOMPUTE = "recompute"  # failed; rolled back to the first invalid block: back to the waiting front
    FAIL = "fail"  # failed under the ``fail`` policy: the request finishes with an error


@dataclass
class LoadResult:
    """What the scheduler must do with a request whose KV load ended; :class:`RemoteKV` has
    already updated the request's computed and transferred tokens and the prefix cache.

    Attributes:
        request: the request (no longer parked, or still ``RUNNING`` for a synchronous load).
        outcome: see :class:`LoadOutcome`.
        first_token: ``LOADED``: the prefiller's first token, reported during the load and
            kept for its end because it finishes the request (:meth:`RemoteKV.first_tokens_ready`);
            else None.
        error: ``FAIL``: the request's error message.
        kv_load_failure: ``FAIL``: the worker's kind of failure, when it reported one.
    """

    request: Request
    outcome: LoadOutcome
    first_token: int | None = None
    error: str | None = None
    kv_load_failure: KVLoadFailure | None = None


class _Held:
    """A finished request whose blocks must outlive it (KV being read by another instance, or a
    load into its blocks still in flight)."""

    __slots__ = ("request", "until_sent", "until_recved")

    def __init__(self, request: Request, until_sent: bool, until_recved: bool):
        self.request = request
        self.until_sent = until_sent
        self.until_recved = until_recved


class RemoteKV:
    """The scheduler's state about KV that crosses instances (see the module docstring).

    Args:
        kv_cache_manager: the engine's block manager (blocks are freed, cached and uncached
            through it).
        connector: the KV connector's scheduler side, or None (then nothing is ever loaded,
            held or reported).
        policy: the configured ``kv_load_failure_policy``.

    Attributes:
        waiting_for_remote: req id -> request parked in ``WAITING_FOR_REMOTE_KVS`` while its
            KV loads asynchronously.
        pending_load: req id -> ``(num_local, num_external)`` tokens of each such load.
        failed_load: req id -> index in its block table of the first invalid block reported
            for its pending load.
        kept_first_token: req id -> the prefiller's first token of a pending load, kept for the
            load's end because it finishes the request (:meth:`first_tokens_ready`).
        sync_loads: req id -> ``(num_local, num_external)`` tokens for synchronous loads of the
            step being scheduled.
        held: finished requests whose blocks are held for a transfer.
        prompt_tokens_transferred_total / num_kv_load_failures_total /
            num_kv_partial_loads_total: counters for metrics.
    """

    def __init__(self, kv_cache_manager: KVCacheManager, connector: "KVConnectorSchedulerSide | None",
                 policy: KVLoadFailurePolicy):
        self.kv_cache_manager = kv_cache_manager
        self.connector = connector
        self.policy = policy
        self.waiting_for_remote: dict[str, Request] = {}
        self.pending_load: dict[str, tuple[int, int]] = {}
        self.failed_load: dict[str, int] = {}
        self.kept_first_token: dict[str, int] = {}
        self.sync_loads: dict[str, tuple[int, int]] = {}
        self.held: dict[str, _Held] = {}
        # requests whose connector lookup already happened (never ask twice).
        self._consulted: set[str] = set()
        self.prompt_tokens_transferred_total = 0
        self.num_kv_load_failures_total = 0
        self.num_kv_partial_loads_total = 0

    def has_pending_work(self) -> bool:
        """True while the connector has transfers, notifications or leases to poll."""
        if self.connector is None:
            return False
        if self.waiting_for_remote or self.held:
            return True
        return bool(self.connector.has_pending_work())

    # ================================================================ admission
    def num_matched_tokens(self, req: Request, num_local: int) -> tuple[int, bool]:
        """The connector's external hit beyond the local one: ``(num_external, load_async)``,
        ``(0, False)`` without a connector or once the connector was asked for this request."""
        if self.connector is None or req.request_id in self._consulted:
            return 0, False
        num_external, load_async = self.connector.get_num_new_matched_tokens(req, num_local)
        num_external = max(0, min(num_external, req.num_tokens - num_local))
        return num_external, load_async and num_external > 0

    def start_async_load(self, req: Request, num_local: int, num_external: int) -> None:
        """The request's blocks for ``num_local + num_external`` tokens are allocated: tell the
        connector and park the request in ``WAITING_FOR_REMOTE_KVS`` until its load ends
        (the caller took it off the waiting queue)."""
        self._consulted.add(req.request_id)
        self.connector.update_state_after_alloc(req, list(req.block_ids), num_external)
        self.pending_load[req.request_id] = (num_local, num_external)
        req.status = RequestStatus.WAITING_FOR_REMOTE_KVS
        self.waiting_for_remote[req.request_id] = req

    def blocks_allocated(self, req: Request, num_local: int, num_external: int, start: int) -> None:
        """A fresh request got its blocks and starts computing at token ``start``: tell the
        connector (once) and note the tokens loaded synchronously during this step."""
        request_id = req.request_id
        if self.connector is not None and request_id not in self._consulted:
            self._consulted.add(request_id)
            self.connector.update_state_after_alloc(req, list(req.block_ids), num_external)
        if start > num_local:
            self.sync_loads[request_id] = (num_local, start - num_local)

    # ================================================================ step results
    def sync_load_failed(self, req: Request, invalid: set[int],
                         error: KVLoadError | None = None) -> LoadResult | None:
        """When this step's synchronous load of ``req`` left an invalid block, apply the
        failure policy and return what the scheduler must do with ``req``; None when the load
        was good (or there was none). ``error`` is the worker's reason, for the error message."""
        load = self.sync_loads.get(req.request_id)
        if load is None:
            return None
        bad = self.first_invalid_block(req, load, invalid)
        if bad is None:
            return None
        # The forward pass read missing KV: its token is worthless.
        return self.apply_load_failure(req, bad, load[0], error)

    def commit_sync_load(self, req: Request) -> None:
        """Count the tokens this step loaded synchronously for ``req`` (if any)."""
        load = self.sync_loads.get(req.request_id)
        if load is not None:
            num_local, num_ext = load
            req.num_transferred_tokens = num_ext
            self.prompt_tokens_transferred_total += min(num_ext, req.num_prompt_tokens - num_local)

    def request_finished(self, req: Request, free_blocks: bool = True) -> dict[str, Any] | None:
        """Forget the request's loads (it leaves ``waiting_for_remote`` if it was parked there),
        tell the connector, and free its blocks or hold them for a transfer (``free_blocks``
        False: the caller frees them later, a tier load still writes them). Returns the
        connector's ``kv_transfer_params`` for the client, or None."""
        request_id = req.request_id
        self.waiting_for_remote.pop(request_id, None)
        was_loading = self.pending_load.pop(request_id, None) is not None
        self.failed_load.pop(request_id, None)
        self.kept_first_token.pop(request_id, None)
        self._consulted.discard(request_id)
        hold, params = False, None
        if self.connector is not None:
            hold, params = self.connector.request_finished(req, list(req.block_ids))
        if (hold or was_loading) and req.block_ids:
            self.held[request_id] = _Held(req, until_sent=bool(hold), until_recved=was_loading)
        elif free_blocks:
            self.kv_cache_manager.free(req)
        return params

    def release_held(self, request_id: str) -> None:
        """A finished request held for a transfer was aborted by the front end (its client is
        gone): the connector may end the hold at once (``release_held_blocks``)."""
        held = self.held.get(request_id)
        if held is not None and held.until_sent and self.connector is not None:
            self.connector.release_held_blocks(request_id)

    # ---------------------------------------------------------------- connector
    def first_invalid_block(
        self, req: Request, load: tuple[int, int], invalid: set[int]
    ) -> int | None:
        """Index in the block table of the first invalid block among the loaded ones."""
        num_local, num_ext = load
        block_size = self.kv_cache_manager.block_size
        first = num_local // block_size
        last = -(-(num_local + num_ext) // block_size)
        for i in range(first, min(last, len(req.block_ids))):
            if req.block_ids[i] in invalid:
                return i
        return None

    def apply_load_failure(self, req: Request, bad_block: int, num_local: int,
                           error: KVLoadError | None = None) -> LoadResult:
        """Apply ``kv_load_failure_policy`` to a request whose KV load left block index
        ``bad_block`` (and possibly later ones) invalid: uncache those blocks and, under
        ``recompute``, roll the request back to them. ``error`` (the worker's reason) goes into
        the request's error message. Returns what the scheduler must do with the request
        (``FAIL`` or ``RECOMPUTE``)."""
        self.num_kv_load_failures_total += 1
        request_id = req.request_id
        self.kv_cache_manager.uncache_blocks(req, bad_block)
        override = self.connector.load_failure_policy(req)  # per-request override, or None
        policy = KVLoadFailurePolicy(override) if override is not None else self.policy
        if policy == KVLoadFailurePolicy.FAIL:
            logger.warning("request %s: KV load failed at block index %d; failing it", request_id, bad_block)
            why = f": {error}" if error is not None else ""
            # The worker's reason says what failed (and names remote blocks when they are the
            # cause); only without one is the first invalid local block all there is to say.
            where = (f"block {req.block_ids[bad_block]} of request {request_id}" if error is None
                     else f"request {request_id}")
            return LoadResult(
                req, LoadOutcome.FAIL,
                error=(f"KV cache load from the remote instance failed{why} ({where}); "
                       f"kv_load_failure_policy is 'fail'"),
                kv_load_failure=error.reason if error is not None else None,
            )
        good = self._roll_back(req, bad_block, num_local)
        logger.warning(
            "request %s: KV load failed at block index %d; recomputing from token %d", request_id, bad_block, good
        )
        return LoadResult(req, LoadOutcome.RECOMPUTE)

    def _roll_back(self, req: Request, bad_block: int, num_local: int) -> int:
        """Mark the tokens before block index ``bad_block`` computed (at least the local hit,
        at most all but the last token) and count those loaded; returns that token count."""
        good = max(num_local, bad_block * self.kv_cache_manager.block_size)
        good = min(good, req.num_tokens - 1)
        req.num_computed_tokens = good
        req.num_transferred_tokens = good - num_local
        self.prompt_tokens_transferred_total += min(good, req.num_prompt_tokens) - min(num_local, req.num_prompt_tokens)
        return good

    def partial_load(self, req: Request, num_local: int, num_ext: int,
                     num_blocks: int) -> LoadResult:
        """A load that brought only its first ``num_blocks`` blocks, maybe none (the owner held no
        more, or the load was given up; ``KVConnectorOutput.partial_loads``): the request
        computes from the block after them, as a ``RECOMPUTE`` roll-back to it would, but
        nothing failed (no policy, no failure counted). Its loaded blocks enter the prefix
        cache; it keeps the others."""
        self.num_kv_partial_loads_total += 1
        bs = self.kv_cache_manager.block_size
        # never past the load's last full block, whatever the count says
        good = self._roll_back(req, min(num_local // bs + num_blocks, (num_local + num_ext) // bs),
                               num_local)
        self.kv_cache_manager.cache_blocks(req, good)
        logger.info("request %s: its KV load brought %d of %d tokens; computing from token %d",
                    req.request_id, good - num_local, num_ext, good)
        return LoadResult(req, LoadOutcome.LOADED)

    def update_connector_output(self, kv_out: KVConnectorOutput) -> None:
        """Hand the worker side's report of a step to the connector and note the invalid
        blocks of pending loads (``kv_out.invalid_block_ids``; their policy applies when the
        load is reported finished).
        The scheduler then calls :meth:`load_finished` for each id of ``finished_recving``
        and :meth:`transfer_sent` for each id of ``finished_sending``, in that order."""
        if self.connector is not None:
            self.connector.update_connector_output(kv_out)
        invalid = kv_out.invalid_block_ids
        if invalid:
            for request_id, load in self.pending_load.items():
                bad = self.first_invalid_block(self.waiting_for_remote[request_id], load, invalid)
                if bad is not None:
                    prev = self.failed_load.get(request_id)
                    self.failed_load[request_id] = bad if prev is None else min(prev, bad)

    def load_finished(self, request_id: str, kv_out: KVConnectorOutput) -> LoadResult | None:
        """A load into ``request_id``'s blocks is over (``finished_recving``). A finished
        request's held blocks may be freed now (None is returned); a parked request leaves
        ``waiting_for_remote`` and its :class:`LoadResult` is returned. None for an unknown id."""
        held = self.held.get(request_id)
        if held is not None:
            held.until_recved = False
            self.maybe_release(request_id)
            return None
        req = self.waiting_for_remote.pop(request_id, None)
        if req is None:
            return None
        num_local, num_ext = self.pending_load.pop(request_id)
        bad = self.failed_load.pop(request_id, None)
        # At least the last token is left to compute: the last prompt token for its logits, or
        # the prefiller's first token (appended already, or kept for now), for its KV. (A
        # failed load recomputes its own; a partial load is a pull of a restored turn, which
        # brings no first token.)
        first = self.kept_first_token.pop(request_id, None)
        if bad is not None:
            return self.apply_load_failure(req, bad, num_local, kv_out.load_errors.get(request_id))
        partial = kv_out.partial_loads.get(request_id)
        if partial is not None:
            return self.partial_load(req, num_local, num_ext, partial)
        loaded = min(num_local + num_ext, req.num_tokens - (first is None))
        req.num_computed_tokens = loaded
        req.num_transferred_tokens = loaded - num_local
        self.prompt_tokens_transferred_total += min(loaded, req.num_prompt_tokens) - min(num_local, req.num_prompt_tokens)
        self.kv_cache_manager.cache_blocks(req, loaded)
        return LoadResult(req, LoadOutcome.LOADED, first_token=first)

    def first_tokens_ready(self, kv_out: KVConnectorOutput,
                           finishes: Callable[[Request, int], bool]) -> list[tuple[Request, int]]:
        """The parked requests whose prefiller's first token (``kv_out.first_tokens``) may be
        appended now, each with its token: the load brings the whole prompt, no token was
        appended yet, and no invalid block was reported for it. The token does not depend on
        the local KV, so the caller appends it while the blocks are still being read. A token
        that would finish the request (``finishes``: EOS, a stop token, ``max_tokens``) is kept
        for the load's end instead (:class:`LoadResult`'s ``first_token``): a request finished
        before its KV has landed would offer a bidirectional reader blocks still being written.
        A token that the request's ``min_tokens`` mask forbids (a prefill leg drawn without
        it) is dropped: the load then ends one token short and the request draws its first
        token itself (:func:`~pdserve.types.kv_params.may_use_first_token` says when that is
        the masked draw).
        """
        ready = []
        for request_id, token in kv_out.first_tokens.items():
            req = self.waiting_for_remote.get(request_id)
            if req is None or request_id in self.failed_load or req.output_token_ids:
                continue
            num_local, num_ext = self.pending_load[request_id]
            if num_local + num_ext < req.num_tokens:
                continue
            sp = req.sampling_params
            if sp.min_tokens > 0 and token in sp.min_tokens_mask(req.eos_token_id):
                continue
            if finishes(req, token):
                self.kept_first_token[request_id] = token
            else:
                ready.append((req, token))
        return ready

    def transfer_sent(self, request_id: str) -> None:
        """Another instance finished reading ``request_id``'s blocks (``finished_sending``):
        free them once no transfer needs them any more."""
        held = self.held.get(request_id)
        if held is not None:
            held.until_sent = False
            self.maybe_release(request_id)

    def maybe_release(self, request_id: str) -> None:
        """Free a held request's blocks once no transfer needs them any more."""
        held = self.held[request_id]
        if not held.until_sent and not held.until_recved:
            del self.held[request_id]
            self.kv_cache_manager.free(held.request)
