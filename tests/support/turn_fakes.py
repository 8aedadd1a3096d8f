"""A fake decoder connector with turn leases, for the demotion of held turn blocks
(pdserve/engine/turn_demotion.py): the scheduler side holds every finished request's blocks as
a turn lease (as a bidirectional decoder does); the worker side keeps them in the real
:class:`~pdserve.kv_transfer.nixl.held.HeldBlocks` / :class:`~pdserve.kv_transfer.nixl.leases.LeaseTable`,
so claims, demotions, restores and "done"/"abort" notices follow the production rules.
:meth:`TurnReader.read` plays the next turn's prefiller: it claims the lease as the side
channel would and reads the fake KV of the blocks the answer names, so any block of foreign or
missing KV shows as wrong ``(position, token)`` pairs. :class:`TPTurnConnectorWorker` plays a TP
instance: one lease table per rank, their outputs merged by the executor's real merger.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from pdserve.kv_transfer.base import KVConnectorSchedulerSide, KVConnectorWorkerSide, TurnMove
from pdserve.kv_transfer.nixl.held import HeldBlocks
from pdserve.kv_transfer.nixl.leases import ClaimStatus, LeaseTable
from pdserve.kv_transfer.nixl.metadata import SendSpec
from pdserve.types.remote_ref import PackedTokens
from pdserve.kv_transfer.nixl.notifications import Notice
from pdserve.kv_transfer.nixl.stats import StatsRecorder
from pdserve.types.outputs import KVConnectorOutput
from pdserve.types.remote_ref import token_digest
from pdserve.types.request import RequestStatus
from tests.support.engine_fakes import add, reference_generate, run_until_done
from tests.support.tier_fakes import make_tiered_core


@dataclass
class TurnMeta:
    sends: dict[str, SendSpec] = field(default_factory=dict)
    demote: set[str] = field(default_factory=set)
    keep: set[str] = field(default_factory=set)
    restored: dict[str, list[int]] = field(default_factory=dict)
    serve: set[str] = field(default_factory=set)
    lost: set[str] = field(default_factory=set)


class TurnConnectorScheduler(KVConnectorSchedulerSide):
    """Holds every normally finished request's blocks under a turn lease of ``ttl_s``."""

    def __init__(self, block_size: int, ttl_s: float, tp_size: int = 1):
        self.block_size, self.ttl_s, self.tp_size = block_size, ttl_s, tp_size
        self.turns: dict[str, None] = {}
        self.advertised: dict[str, tuple[list[int], list[int]]] = {}  # blocks, tokens
        self._meta = TurnMeta()

    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        return 0, False

    def update_state_after_alloc(self, request, block_ids, num_external_tokens):
        pass

    def build_connector_meta(self, scheduler_output):
        meta, self._meta = self._meta, TurnMeta()
        return meta

    def update_connector_output(self, output):
        for request_id in output.finished_sending:
            self.turns.pop(request_id, None)

    def request_finished(self, request, block_ids):
        if request.status not in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH):
            return False, None
        num_tokens = min(request.num_computed_tokens, request.num_tokens - 1)
        held = list(block_ids[:math.ceil(num_tokens / self.block_size)])
        tokens = request.token_ids(0, num_tokens)
        self._meta.sends[request.request_id] = SendSpec(request.request_id, held, self.ttl_s,
                                                        renew_on_heartbeat=False,
                                                        tokens=PackedTokens.of(tokens))
        self.turns[request.request_id] = None
        self.advertised[request.request_id] = (held, tokens)
        return True, {"remote_block_ids": held}

    def has_pending_work(self):
        return bool(self.turns)

    def turn_leases(self):
        return list(self.turns)

    def move_turn(self, request_id, move, block_ids=()):
        if move is TurnMove.DEMOTE:
            self._meta.demote.add(request_id)
        elif move is TurnMove.KEEP:
            self._meta.keep.add(request_id)
        elif move is TurnMove.RESTORED:
            self._meta.restored[request_id] = list(block_ids)
        elif move is TurnMove.SERVE:
            self._meta.serve.add(request_id)
        else:
            self._meta.lost.add(request_id)


class TurnConnectorWorker(KVConnectorWorkerSide):
    """The owner's half (one TP rank's): the real lease table and held-blocks rules."""

    def __init__(self, tp_size: int = 1) -> None:
        self.leases = LeaseTable()
        self.held = HeldBlocks(self.leases, StatsRecorder(3600.0), serve_restores=tp_size == 1)
        self.kv: list | None = None

    def register_kv_cache(self, kv_cache, spec):
        self.kv = kv_cache

    def bind_connector_metadata(self, metadata):
        if metadata is None:
            return
        import time
        for request_id, send in metadata.sends.items():
            self.held.send(request_id, send, time.monotonic())
        self.held.apply_turn_moves(metadata.demote, metadata.restored, metadata.lost,
                                   metadata.keep, metadata.serve)

    def start_load_kv(self):
        pass

    def get_finished(self, finished_request_ids):
        out = KVConnectorOutput()
        self.held.expire()
        out.finished_sending = self.held.take_finished()
        self.held.report_turns(out)
        return out


class TPTurnConnectorWorker(KVConnectorWorkerSide):
    """A TP instance's turn-lease workers as its engine core sees them (the executor's
    ``TPConnectorWorker`` and :class:`~pdserve.executor.kv_merge.KVOutputMerger`): every rank
    binds the same metadata and keeps its own leases over the same block ids; their outputs
    are merged by the real merger. Rank 0 answers the claims.

    Args:
        size: TP ranks.
        lag_steps: the outputs of the ranks but 0 reach the merge this many steps late (a
            rank whose answers come in a later step).
    """

    def __init__(self, size: int = 2, lag_steps: int = 0) -> None:
        from pdserve.executor.kv_merge import KVOutputMerger

        self.ranks = [TurnConnectorWorker(size) for _ in range(size)]
        self.merger = KVOutputMerger(size)
        self.lag_steps = lag_steps
        self._late: list[list[KVConnectorOutput]] = []

    def register_kv_cache(self, kv_cache, spec):
        for rank in self.ranks:
            rank.register_kv_cache(kv_cache, spec)

    def bind_connector_metadata(self, metadata):
        for rank in self.ranks:
            rank.bind_connector_metadata(metadata)

    def start_load_kv(self):
        pass

    def get_finished(self, finished_request_ids):
        outs = [rank.get_finished(finished_request_ids) for rank in self.ranks]
        if self.lag_steps:
            self._late.append(outs[1:])
            late = self._late.pop(0) if len(self._late) > self.lag_steps else \
                [KVConnectorOutput() for _ in outs[1:]]
            outs = [outs[0], *late]
        return self.merger.merge(outs)


class TurnReader:
    """The next turn's prefiller reading a turn lease of ``core``'s decoder."""

    def __init__(self, core: Any, runner: Any, sched: TurnConnectorScheduler,
                 ranks: list[TurnConnectorWorker]):
        self.core, self.runner, self.sched = core, runner, sched
        self.ranks = ranks
        self.worker = ranks[0]  # the rank that answers claims

    def claim(self, request_id: str, max_steps: int = 50) -> tuple[ClaimStatus, list[int]]:
        """Claim as the side channel does, stepping the engine while the answer is
        :attr:`~pdserve.kv_transfer.nixl.leases.ClaimStatus.WAIT`.
        Returns ``(status, block ids to read)``."""
        blocks, tokens = self.sched.advertised[request_id]
        n = len(tokens) // self.runner.block_size * self.runner.block_size
        for _ in range(max_steps):
            answer = self.worker.leases.claim_answer(request_id, blocks, n,
                                                     token_digest(tokens[:n]))
            if answer.status is not ClaimStatus.WAIT:
                return answer.status, (answer.block_ids if answer.block_ids is not None
                                       else blocks)
            self.core.step()
        return ClaimStatus.WAIT, []

    def read(self, block_ids: list[int], num_blocks: int) -> list[Any]:
        """The fake KV of the first ``num_blocks`` blocks named: ``(position, token)`` pairs."""
        bs = self.runner.block_size
        return [self.runner.kv[b * bs + i] for b in block_ids[:num_blocks] for i in range(bs)]

    def expected(self, request_id: str, num_blocks: int) -> list[Any]:
        tokens = self.sched.advertised[request_id][1]
        bs = self.runner.block_size
        return [(p, tokens[p]) for p in range(num_blocks * bs)]

    def notify(self, request_id: str, kind: str, block_ids: list[int]) -> None:
        """A reader's notice, to every rank (as rank 0 forwards side-channel notices)."""
        for rank in self.ranks:
            rank.held.apply(Notice(kind, request_id, 1, list(block_ids)))

    def abort_all(self) -> None:
        """Abort every lease still open (naming the advertised blocks, as a reader does)."""
        for request_id in list(self.sched.turns):
            self.notify(request_id, "abort", self.sched.advertised[request_id][0])


def make_turn_core(num_blocks: int, block_size: int = 4, host_blocks: int = 64,
                   ttl_s: float = 60.0, load_delay_steps: int = 0, disk_blocks: int = 0,
                   tp_size: int = 1, lag_steps: int = 0, **cfg: Any
                   ) -> tuple[Any, Any, TurnReader]:
    """An EngineCore with KV cache tiers over the tiered fake runner, whose every finished
    request holds its blocks under a turn lease; returns ``(core, runner, reader)``. With
    ``tp_size`` > 1 the leases live on that many ranks whose outputs are merged
    (:class:`TPTurnConnectorWorker`, ``lag_steps``)."""
    from types import SimpleNamespace

    sched = TurnConnectorScheduler(block_size, ttl_s, tp_size)
    if tp_size == 1:
        worker: KVConnectorWorkerSide = TurnConnectorWorker()
        ranks = [worker]
    else:
        worker = TPTurnConnectorWorker(tp_size, lag_steps)
        ranks = worker.ranks
    core, runner = make_tiered_core(
        num_blocks, block_size, host_blocks, disk_blocks, load_delay_steps,
        connectors=(sched, worker),
        kv_transfer_config=SimpleNamespace(kv_load_failure_policy="fail"), **cfg)
    return core, runner, TurnReader(core, runner, sched, ranks)


def turn_prompt(seed: int, n: int) -> list[int]:
    """``n`` token ids of conversation ``seed`` (deterministic, distinct per seed)."""
    return [(seed * 131 + 7 * i) % 900 for i in range(n)]


def finish_turns(core, turns: dict[str, list[int]], max_tokens: int = 5) -> None:
    """Run each turn to its end (one after the other); answers equal the reference."""
    for rid, ids in turns.items():
        add(core, rid, ids, max_tokens=max_tokens)
        assert run_until_done(core)[rid].tokens == reference_generate(ids, max_tokens), rid
