"""A step's scheduled requests flattened into the rows of one forward pass: prefill tokens
first, then one token per decode (the order of :mod:`pdserve.attention.metadata`)."""

from __future__ import annotations

from dataclasses import dataclass, field

from pdserve.types.outputs import ScheduledRequest


@dataclass
class FlatBatch:
    """The inputs of one forward pass over ``T`` rows.

    Attributes:
        prefills: requests computing more than one token this step, in row order.
        decodes: requests computing exactly one token, after the prefills.
        input_ids: ``T`` token ids.
        positions: ``T`` absolute positions.
        logits_rows: the row of each sampled request's last token, in ``sampled`` order.
        sampled: the requests with ``sample=True``.
        fed: ``(row, request_id)`` of the decode rows whose token is the previous launched
            step's sample (``input_from_previous_step``), filled on the device.
    """

    prefills: list[ScheduledRequest]
    decodes: list[ScheduledRequest]
    input_ids: list[int] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)
    logits_rows: list[int] = field(default_factory=list)
    sampled: list[ScheduledRequest] = field(default_factory=list)
    fed: list[tuple[int, str]] = field(default_factory=list)

    def add_rows(self) -> None:
        """Fill the row lists from :attr:`prefills` and :attr:`decodes`."""
        for r in self.prefills:
            n = r.num_computed_tokens
            self.input_ids.extend(r.token_ids)
            self.positions.extend(range(n, n + len(r.token_ids)))
            self._sample(r)
        for r in self.decodes:
            if r.input_from_previous_step:
                self.fed.append((len(self.input_ids), r.request_id))
            self.input_ids.append(r.token_ids[0])
            self.positions.append(r.num_computed_tokens)
            self._sample(r)

    def _sample(self, r: ScheduledRequest) -> None:
        if r.sample:
            self.logits_rows.append(len(self.input_ids) - 1)
            self.sampled.append(r)


def split_batch(scheduled: list[ScheduledRequest]) -> FlatBatch:
    """The batch's prefills and decodes (rows not filled yet: :meth:`FlatBatch.add_rows`).

    Raises:
        ValueError: a request scheduled with no tokens.
    """
    prefills = [r for r in scheduled if len(r.token_ids) > 1]
    decodes = [r for r in scheduled if len(r.token_ids) == 1]
    if len(prefills) + len(decodes) != len(scheduled):
        bad = next(r.request_id for r in scheduled if not r.token_ids)
        raise ValueError(f"request {bad} was scheduled with no tokens")
    return FlatBatch(prefills, decodes)
