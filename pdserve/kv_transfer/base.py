"""KV connector interface: a scheduler side that decides which blocks move, and a worker side
that moves bytes.

The split follows vLLM's v1 KV connector design. Both sides are created in the engine-core
process; the scheduler side is called by the scheduler (no torch), the worker side by the model
runner (owns the KV cache tensor). The scheduler side talks to the worker side only through the
``kv_connector_metadata`` object it builds each step; the worker side reports back through
:class:`pdserve.types.outputs.KVConnectorOutput`.

Call order inside one engine step::

    # scheduler (once, when a request arrives; optional hook)
    connector.request_added(req)
    # scheduler
    n, load_async = connector.get_num_new_matched_tokens(req, num_local_computed_tokens)
    ... allocate blocks for local + n tokens ...
    connector.update_state_after_alloc(req, block_ids, n)
    meta = connector.build_connector_meta(sched_out)
    # runner
    worker.bind_connector_metadata(meta)
    worker.start_load_kv()            # posts async reads, never blocks
    ... forward pass ...
    out = worker.get_finished(finished_request_ids)   # polls, never blocks
    # scheduler
    connector.update_connector_output(out)
    hold_blocks, params = connector.request_finished(req, block_ids)   # for each finished request

The engine keeps stepping (``execute`` with an empty batch if need be) while
``connector.has_pending_work()`` is True (``connector``: the scheduler side,
``worker``: the worker side).
"""

from __future__ import annotations

import abc
import enum
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple

from pdserve.types.kv_cache_kind import KVCacheKind

if TYPE_CHECKING:
    from pdserve.types.outputs import KVConnectorOutput, SchedulerOutput
    from pdserve.types.request import Request
    from pdserve.types.kv_transfer_config import KVLoadFailurePolicy


class TurnMove(enum.Enum):
    """What the scheduler tells the connector about a decoder's turn lease under GPU pressure
    (:meth:`KVConnectorSchedulerSide.move_turn`). Every TP rank gets every move; the worker
    side answers in :class:`~pdserve.types.outputs.KVConnectorOutput` (``demoted_turns`` /
    ``kept_turns`` for ``DEMOTE``, ``restored_turns`` / ``failed_turns`` for ``RESTORED``)."""

    DEMOTE = "demote"  # give up the GPU blocks (they stay in the prefix cache, then a tier)
    KEEP = "keep"  # a rank refused the demotion: every rank holds the lease's own blocks again
    RESTORED = "restored"  # the KV is back in GPU blocks (named with it); claims still wait
    SERVE = "serve"  # every rank took the restored blocks: claims are answered with them
    LOST = "lost"  # no tier holds the blocks any more, or a rank lost the lease: end it


@dataclass(frozen=True)
class KVCacheSpec:
    """Geometry of the paged KV cache, shared by both connector sides.

    The cache is one contiguous tensor of shape
    ``[num_blocks, num_layers, 2, num_kv_heads, block_size, head_dim]`` so that one block is one
    contiguous region of ``block_bytes`` bytes (docs/architecture.md, "KV cache layout").

    Attributes:
        num_blocks: blocks in the cache.
        block_size: tokens per block.
        num_layers: transformer layers.
        num_kv_heads: KV heads (per tensor-parallel rank).
        head_dim: head size.
        dtype: torch dtype name of the cache, e.g. ``"bfloat16"`` or ``"float8_e4m3fn"``
            (``--kv-cache-dtype fp8``).
        element_size: bytes per element.
        model_name: served model identity (for the compatibility hash).
        total_num_kv_heads: KV heads of the whole model (all TP ranks); 0 means equal to
            num_kv_heads (TP 1).
        kv_scales: an fp8 cache's per-layer key scales then value scales (empty otherwise;
            :mod:`pdserve.attention.kv_quant`): two instances must store with the same ones.
        kind: what a block holds (:class:`~pdserve.types.kv_cache_kind.KVCacheKind`): per-head
            K/V, or DeepSeek's latent (one KV head, replicated on every TP rank).
    """

    num_blocks: int
    block_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    element_size: int
    model_name: str
    total_num_kv_heads: int = 0
    kv_scales: tuple[float, ...] = ()
    kind: KVCacheKind = KVCacheKind.PER_HEAD

    @property
    def block_bytes(self) -> int:
        """Bytes of one block across all layers, K and V."""
        return (
            self.num_layers * 2 * self.num_kv_heads * self.block_size * self.head_dim
            * self.element_size
        )

    @property
    def layout(self) -> str:
        return "NLKHBD"  # num_blocks, num_layers, k/v, heads, block_size, head_dim


@dataclass(frozen=True)
class TPRank:
    """Where one connector worker side sits in its instance's tensor-parallel group.

    Attributes:
        rank: this worker's TP rank, ``0 <= rank < size``.
        size: the instance's TP size.
        all_gather: collective over the instance's TP ranks: each rank passes one picklable
            object and gets the list of every rank's object, by rank. None when ``size == 1``.
    """

    rank: int = 0
    size: int = 1
    all_gather: Callable[[Any], list[Any]] | None = None


class FinishedRequestKV(NamedTuple):
    """What the scheduler side decides for a finished request (vLLM's
    ``(delay_free_blocks, kv_transfer_params)`` pair; it unpacks as that pair).

    Attributes:
        hold_blocks: True when the scheduler holds the request's blocks (does not free them)
            until its id appears in ``finished_sending``: a remote reader will read them.
        params: the ``kv_transfer_params`` returned to the client, or None.
    """

    hold_blocks: bool
    params: dict[str, Any] | None


NOT_HELD = FinishedRequestKV(False, None)


class KVConnectorSchedulerSide(abc.ABC):
    """Decides which blocks move. Pure bookkeeping: no torch, no I/O on the engine loop."""

    @abc.abstractmethod
    def get_num_new_matched_tokens(
        self, request: "Request", num_computed_tokens: int
    ) -> tuple[int, bool]:
        """Tokens beyond ``num_computed_tokens`` (the local prefix-cache hit, in tokens) that
        can be loaded from another instance.

        Returns:
            ``(num_tokens, load_async)``: ``load_async`` True means the request must wait in
            ``WAITING_FOR_REMOTE_KVS`` until the worker reports it in ``finished_recving``.
        """

    @abc.abstractmethod
    def update_state_after_alloc(
        self, request: "Request", block_ids: list[int], num_external_tokens: int
    ) -> None:
        """Record the blocks allocated for a request that will load ``num_external_tokens``
        tokens (the tail after the local prefix-cache hit).

        Args:
            block_ids: the request's whole block table after allocation, in token order
                (local prefix-hit blocks first).
        """

    @abc.abstractmethod
    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> Any:
        """Build the metadata the worker side needs for this step (loads to start, requests
        to heartbeat or to notify, blocks to hold). Resets per-step state."""

    @abc.abstractmethod
    def update_connector_output(self, output: "KVConnectorOutput") -> None:
        """Consume the worker side's report of this step."""

    @abc.abstractmethod
    def request_finished(
        self, request: "Request", block_ids: list[int]
    ) -> FinishedRequestKV:
        """Called once when a request finishes (or is aborted).

        Returns:
            :class:`FinishedRequestKV` ``(hold_blocks, params)``: ``hold_blocks`` True means
            the scheduler holds the blocks until the request id appears in
            ``finished_sending``; ``params`` (``kv_transfer_params``) is returned to the client.

        A request finished while its asynchronous load is in flight holds its blocks until its
        id appears in ``finished_recving`` (the worker reports it once nothing writes them).
        """

    def release_held_blocks(self, request_id: str) -> None:
        """Optional hook: a finished request whose blocks :meth:`request_finished` held for a
        remote reader was aborted by its front end (its client went away before it got the
        ``kv_transfer_params``), so no reader will come: end the hold now (its id then appears
        in ``finished_sending``). Default: nothing (the hold ends by itself)."""

    def release_early(self, request_id: str, block_ids: list[int]) -> None:
        """Optional hook: the proxy's early release of blocks held for a remote reader that
        will not read them (``POST /v1/kv_transfer/release``, delivered by the engine core):
        end the hold when it is of exactly ``block_ids`` for ``request_id`` (its id then
        appears in ``finished_sending``); otherwise nothing. Default: nothing (the hold ends by
        itself)."""

    def turn_leases(self) -> list[str]:
        """Optional hook: the finished requests whose blocks are held under a decoder's turn
        lease (bidirectional transfer) that may be demoted to the KV cache tiers, oldest first
        (:mod:`pdserve.engine.turn_demotion`). Default: none."""
        return []

    def move_turn(self, request_id: str, move: TurnMove, block_ids: list[int] = ()) -> None:
        """Optional hook: tell the worker side (every TP rank) about a turn lease from
        :meth:`turn_leases` (:class:`TurnMove`): demote it, keep it, it is restored into
        ``block_ids``, serve its claims from those, or end it. Default: nothing (no turn lease
        is ever offered)."""

    def request_added(self, request: "Request") -> None:
        """Optional hook: a request entered the scheduler's queue (before any scheduling).

        Lets the connector start work early for requests that will load KV (handshakes,
        keeping the remote's lease alive while the request waits). Default: nothing.
        """

    def take_early_metadata(self) -> Any:
        """Optional hook: the worker-side metadata that should not wait for the next step,
        taken out of it, or None. The engine core binds it to an in-process worker side (TP 1)
        right after a step and after an arrival: the holds of the requests the committed step
        finished (their KV was computed: the step's tokens were read back after its forward),
        so a lease starts in the step that finished its request; and an arriving request's
        early claim. Default: None (the next step's metadata carries everything)."""
        return None

    def load_failure_policy(self, request: "Request") -> "KVLoadFailurePolicy | None":
        """Optional hook: the ``kv_load_failure_policy`` (``FAIL`` or ``RECOMPUTE``) for
        this request's failed load, overriding the configured one; None keeps the configured
        policy. (A bidirectional pull on a prefiller is always recomputed.) Default: None."""
        return None

    def has_pending_work(self) -> bool:
        """True while the connector needs engine steps even with nothing to compute
        (transfers in flight, leases to expire, notifications to send). Default: False."""
        return False

    def has_pending_metadata(self) -> bool:
        """Optional hook: True when :meth:`build_connector_meta` has something for the worker
        side, so the engine loop steps at once instead of waiting. Default: False."""
        return False

    def shutdown(self) -> None:
        """Release resources (threads, sockets)."""


class KVConnectorWorkerSide(abc.ABC):
    """Moves bytes. Owns the transfer agent; reads and writes the runner's KV cache tensor."""

    @abc.abstractmethod
    def register_kv_cache(self, kv_cache: Any, spec: KVCacheSpec) -> None:
        """Register the runner's KV cache tensor (shape per :class:`KVCacheSpec`) for transfer."""

    @abc.abstractmethod
    def bind_connector_metadata(self, metadata: Any) -> None:
        """Receive this step's metadata from the scheduler side."""

    @abc.abstractmethod
    def start_load_kv(self) -> None:
        """Post the reads named in the bound metadata; must not block."""

    @abc.abstractmethod
    def get_finished(self, finished_request_ids: set[str]) -> "KVConnectorOutput":
        """Poll transfers and notifications; must not block.

        A load reported in ``finished_recving`` loaded all its tokens, or failed (its blocks in
        ``invalid_block_ids``: ``kv_load_failure_policy`` applies), or, named in
        ``partial_loads``, loaded only its leading blocks (maybe none) because the owner held no
        more or the load was given up before reading (the scheduler computes the rest; not a
        failure).

        Args:
            finished_request_ids: requests the scheduler finished this step.
        """

    # Optional hooks for an event-driven engine loop. Without them the loop polls the worker
    # every KV_POLL_INTERVAL_S (pdserve/engine/core.py) while KV work is pending.
    def wakeup_handles(self) -> list[Any]:
        """ZMQ sockets or file descriptors that become readable when the worker has work for
        the engine thread (for example a side-channel answer); the engine loop polls them with
        its input socket. Default: none."""
        return []

    def handle_wakeup(self) -> None:
        """Consume what made :meth:`wakeup_handles` readable (must not block); the engine's
        next step acts on it. Default: nothing."""

    def expects_answer(self) -> bool:
        """True while an answer the worker waits for would give the scheduler something to send
        before the running step ends (a lease claim whose answer carries a prefiller's first
        token): an async-scheduling engine at TP 1 then watches :meth:`wakeup_handles` while
        it waits for a launched step, and applies a report (:meth:`get_finished`) taken when
        one wakes it. Default: False."""
        return False

    def next_poll_in(self) -> float | None:
        """Seconds until the worker needs a step although no wake-up came (transfers that
        cannot signal, lease deadlines), or None when it only needs steps after wake-ups.
        A worker that does not override this is polled every engine loop tick while KV work
        is pending. Default: 0.001 (that tick)."""
        return 0.001

    def next_stats_log_in(self) -> float | None:
        """Seconds until the worker's periodic summary log line is due, or None when none is
        pending. The engine loop then calls :meth:`log_stats` whether or not it steps, so the
        line is not held back while the engine is idle. Default: None."""
        return None

    def log_stats(self) -> None:
        """Write the periodic summary log line if it is due (must not block). Default: nothing."""

    def shutdown(self) -> None:
        """Release the agent and registered memory."""
