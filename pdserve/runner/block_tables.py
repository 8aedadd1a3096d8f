"""The block tables of replayed decode steps, kept on the host from one step to the next.

A decode batch of 256 requests carries some 20k block ids as Python ints; converting all of them to
an int32 array every step is a large part of the step's host time
(``benchmarks/runner_host_overhead.py`` times it; docs/benchmarks.md, "Measurements moved out of
code comments"), while a decoding request gains a block only every ``block_size`` steps.
:class:`DecodeBlockTables` keeps one numpy row per request it has seen and converts only the blocks
a row lacks; the step's ``[B, widest]`` table is then one gather of those rows.

A row is reused only when it is right: each step compares the request's block list with the
copy the row was written from (a C-level list comparison, no conversion), appends what is new,
and rewrites the row when the list changed otherwise (a preempted request's new blocks, a
request id used again). Correctness therefore never depends on which requests finished or on
whether the list is the scheduler's own object (tensor-parallel workers get a pickled copy each
step). Rows of requests absent from a step are evicted only when the table is full.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from pdserve.types.outputs import ScheduledRequest

_MIN_ROWS = 64


class DecodeBlockTables:
    """Host block-table rows of decoding requests, updated in place between steps.

    Args:
        width: blocks per row (the longest sequence's); a longer block list is cut to it.

    Raises:
        ValueError: ``width < 1``.
    """

    def __init__(self, width: int):
        if width < 1:
            raise ValueError(f"width must be at least 1, got {width}")
        self.width = width
        self._table = np.zeros((0, width), dtype=np.int32)
        self._free: list[int] = []
        # request_id -> (its row of _table, the block ids written in that row)
        self._rows: dict[str, tuple[int, list[int]]] = {}

    @property
    def num_rows(self) -> int:
        """Requests whose row is kept now."""
        return len(self._rows)

    def rows(self, reqs: Sequence[ScheduledRequest]) -> tuple[np.ndarray, np.ndarray]:
        """Bring the rows of ``reqs`` up to date with their ``block_ids``.

        Returns:
            ``(index, num_blocks)``: ``[len(reqs)]`` int64 each, the table row of each request
            (in :meth:`table`) and how many of its blocks the row holds
            (``min(len(block_ids), width)``).
        """
        table, rows, width = self._table, self._rows, self.width
        index: list[int] = []
        num_blocks: list[int] = []
        for r in reqs:
            blocks = r.block_ids
            row = rows.get(r.request_id)
            if row is None:
                if not self._free:
                    self._make_room(reqs)
                    table = self._table
                row = rows[r.request_id] = (self._free.pop(), [])
            slot, known = row
            if blocks != known:
                k = len(known)
                if blocks[:k] != known:  # not an extension of the row: write it anew
                    table[slot, :k] = 0
                    known.clear()
                    k = 0
                new = blocks[k:width]
                if new:
                    table[slot, k:k + len(new)] = new
                    known.extend(new)
            index.append(slot)
            num_blocks.append(len(known))
        return np.array(index, dtype=np.int64), np.array(num_blocks, dtype=np.int64)

    def table(self, index: np.ndarray, width: int) -> np.ndarray:
        """``[len(index), width]`` int32: the first ``width`` columns of rows ``index`` (a
        copy), zero past each row's blocks."""
        return self._table[index, :width]

    def _make_room(self, reqs: Sequence[ScheduledRequest]) -> None:
        """Free the rows of requests not in ``reqs``; then, while fewer than ``len(reqs)``
        rows are free, double the table (so that evictions stay rare)."""
        wanted = {r.request_id for r in reqs}
        for request_id in [request_id for request_id in self._rows if request_id not in wanted]:
            slot, known = self._rows.pop(request_id)
            self._table[slot, :len(known)] = 0
            self._free.append(slot)
        old = len(self._table)
        if len(self._free) < len(reqs):
            new = max(_MIN_ROWS, 2 * old)
            while new - len(self._rows) < len(reqs):
                new *= 2
            grown = np.zeros((new, self.width), dtype=np.int32)
            grown[:old] = self._table
            self._table = grown
            self._free.extend(range(new - 1, old - 1, -1))
