"""Merge the KV connector outputs (and KV cache tier reports, :class:`TierReportMerger`) of an
instance's tensor-parallel ranks into the one :class:`~pdserve.types.outputs.KVConnectorOutput`
the scheduler consumes.

Rules (shared with the connector; docs/architecture.md, "Tensor parallelism"):

- a request_id enters ``finished_recving`` / ``finished_sending`` once EVERY rank has reported it,
  possibly over several steps (a rank reports each request once);
- a failure on any rank fails the load: ``invalid_block_ids`` are united at once, ``load_errors``
  kept per request (the first rank's error) and handed over with the request's merged
  ``finished_recving``;
- ``first_tokens`` and ``remote_clock_offsets`` come from rank 0, in the step rank 0 reports
  them (a first token is known from the lease claim, before the load is finished anywhere);
- ``partial_loads`` (a load that brought only its leading blocks): the fewest blocks any rank
  reported, handed over with the merged ``finished_recving`` (a rank that reports none loaded
  them all; a rank that failed fails the load, above);
- a decoder's turn leases (every rank has its own lease of a turn, over the same block ids;
  :mod:`pdserve.engine.turn_demotion`): a turn enters ``demoted_turns`` once EVERY rank gave up
  its blocks, ``kept_turns`` once every rank answered the demotion and one refused;
  ``restored_turns`` once every rank took the restored blocks; ``failed_turns`` as soon as ANY
  rank could not (the scheduler then ends the lease on every rank); ``turns_to_restore`` (claims
  come to rank 0) are united;
- ``stats``: numbers are summed over the ranks, nested dicts merged the same way, lists
  concatenated, anything else taken from the lowest rank that has it.
"""

from __future__ import annotations

from typing import Any

from pdserve.types.outputs import KVConnectorOutput
from pdserve.types.outputs import KVLoadError
from pdserve.types.kv_tiers import KVTierReport


def merge_stats(parts: list[dict[str, Any]]) -> dict[str, Any]:
    """Merge the ranks' stats dicts (the rule in the module docstring), by rank order."""
    out: dict[str, Any] = {}
    for part in parts:
        for key, value in part.items():
            if key not in out:
                out[key] = value
            elif isinstance(value, bool) or not isinstance(value, (int, float, dict, list)):
                continue
            elif isinstance(value, (int, float)) and isinstance(out[key], (int, float)):
                out[key] = out[key] + value
            elif isinstance(value, dict) and isinstance(out[key], dict):
                out[key] = merge_stats([out[key], value])
            elif isinstance(value, list) and isinstance(out[key], list):
                out[key] = out[key] + value
    return out


class KVOutputMerger:
    """Per-instance state of the merge: who reported which request so far.

    Args:
        size: the TP size (number of outputs per step).
    """

    def __init__(self, size: int):
        self.size = size
        self._recving: dict[str, set[int]] = {}
        self._sending: dict[str, set[int]] = {}
        self._load_errors: dict[str, KVLoadError] = {}
        self._partial: dict[str, int] = {}
        self._turns = TurnAnswerMerger(size)

    def merge(self, outputs: list[KVConnectorOutput | None]) -> KVConnectorOutput:
        """One step's outputs, by rank (None: that rank has no report) -> the merged output.

        Raises:
            ValueError: not one output per rank.
        """
        if len(outputs) != self.size:
            raise ValueError(f"{len(outputs)} connector outputs for TP size {self.size}")
        merged = KVConnectorOutput()
        stats = []
        for rank, out in enumerate(outputs):
            if out is None:
                continue
            merged.invalid_block_ids |= out.invalid_block_ids
            for request_id, err in out.load_errors.items():
                self._load_errors.setdefault(request_id, err)
            for request_id, num_blocks in out.partial_loads.items():
                self._partial[request_id] = min(num_blocks,
                                                self._partial.get(request_id, num_blocks))
            if rank == 0:
                merged.first_tokens.update(out.first_tokens)
                merged.remote_clock_offsets.update(out.remote_clock_offsets)
            _count(self._recving, out.finished_recving, rank, self.size, merged.finished_recving)
            _count(self._sending, out.finished_sending, rank, self.size, merged.finished_sending)
            self._turns.add(rank, out, merged)
            if out.stats:
                stats.append(out.stats)
        self._turns.close_step(merged)
        for request_id in merged.finished_recving:
            if request_id in self._load_errors:
                merged.load_errors[request_id] = self._load_errors.pop(request_id)
            if request_id in self._partial:
                merged.partial_loads[request_id] = self._partial.pop(request_id)
        merged.stats = merge_stats(stats) if stats else None
        return merged

    @property
    def num_pending(self) -> int:
        """Requests (and turn moves) reported by some ranks but not yet by all."""
        return len(self._recving) + len(self._sending) + self._turns.num_pending


class TurnAnswerMerger:
    """The ranks' answers to the moves of a decoder's turn leases
    (:class:`~pdserve.kv_transfer.base.TurnMove`), merged by the rules in the module docstring.

    Every rank answers a move in the step whose metadata carried it, so a turn's answers are
    normally complete within one step; they are counted across steps all the same, and
    forgotten once the turn failed or its lease ended on every rank.

    Args:
        size: the TP size.
    """

    def __init__(self, size: int):
        self.size = size
        self._demote: dict[str, dict[int, bool]] = {}  # turn -> rank -> agreed
        self._restored: dict[str, set[int]] = {}  # turn -> ranks that took the blocks

    def add(self, rank: int, out: KVConnectorOutput, merged: KVConnectorOutput) -> None:
        """Count one rank's answers of a step into ``merged`` (the instance's output)."""
        for request_id, agreed in [*((r, True) for r in out.demoted_turns),
                                   *((r, False) for r in out.kept_turns)]:
            votes = self._demote.setdefault(request_id, {})
            votes[rank] = agreed
            if len(votes) == self.size:
                del self._demote[request_id]
                (merged.demoted_turns if all(votes.values()) else merged.kept_turns).add(
                    request_id)
        _count(self._restored, out.restored_turns, rank, self.size, merged.restored_turns)
        merged.failed_turns |= out.failed_turns
        merged.turns_to_restore |= out.turns_to_restore

    def close_step(self, merged: KVConnectorOutput) -> None:
        """After every rank's :meth:`add` of a step: forget the turns that failed or whose
        lease ended on every rank (their other answers no longer matter)."""
        for request_id in merged.failed_turns | merged.finished_sending:
            self._restored.pop(request_id, None)
            self._demote.pop(request_id, None)

    @property
    def num_pending(self) -> int:
        """Turn moves answered by some ranks but not yet by all."""
        return len(self._demote) + len(self._restored)


def _count(seen: dict[str, set[int]], reported: set[str], rank: int, size: int,
           done: set[str]) -> None:
    """Count ``rank``'s reports of ``reported`` ids in ``seen`` (id -> ranks so far); an id
    every one of ``size`` ranks reported moves to ``done``."""
    for request_id in reported:
        ranks = seen.setdefault(request_id, set())
        ranks.add(rank)
        if len(ranks) == size:
            del seen[request_id]
            done.add(request_id)


class TierReportMerger:
    """Merge the ranks' KV cache tier reports (:class:`~pdserve.types.kv_tiers.KVTierReport`):
    a LOAD job is finished once EVERY rank has reported it (each rank copies its own shard,
    possibly in different steps), and failed as soon as any rank failed it (its shard's file
    was bad: the block's KV is incomplete); copy times are rank 0's.

    Args:
        size: TP ranks.
    """

    def __init__(self, size: int):
        self.size = size
        self._seen: dict[int, set[int]] = {}  # job -> ranks that reported it
        self._failed: set[int] = set()

    def merge(self, reports: "list[KVTierReport | None]") -> "KVTierReport | None":
        """One step's reports by rank (None: a rank without tiers) -> the scheduler's."""
        if all(r is None for r in reports):
            return None
        out = KVTierReport()
        for rank, report in enumerate(reports):
            if report is None:
                continue
            if rank == 0:
                out.copy_times_s.extend(report.copy_times_s)
            self._failed |= report.failed_loads
            for job in report.finished_loads | report.failed_loads:
                self._seen.setdefault(job, set()).add(rank)
        for job in [j for j, ranks in self._seen.items() if len(ranks) == self.size]:
            del self._seen[job]
            if job in self._failed:
                self._failed.discard(job)
                out.failed_loads.add(job)
            else:
                out.finished_loads.add(job)
        return out
