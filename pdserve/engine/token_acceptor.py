"""Accepting sampled tokens into requests and the stop conditions they may meet (EOS, stop
tokens, ``max_tokens``, ``max_model_len``). Pure bookkeeping: no torch."""

from __future__ import annotations

import time
from typing import Iterable

from pdserve.types.request import Request, RequestStatus


class TokenAcceptor:
    """Appends sampled tokens to requests, says which token finishes a request, and counts
    the tokens generated.

    Args:
        eos_token_ids: every token id that means end of sequence (in addition to each
            request's ``eos_token_id``).
        max_model_len: most tokens (prompt plus output) of a request.

    Attributes:
        generation_tokens_total: tokens accepted so far, over all requests.
    """

    def __init__(self, eos_token_ids: Iterable[int], max_model_len: int):
        self.eos_token_ids = frozenset(eos_token_ids)
        self.max_model_len = max_model_len
        self.generation_tokens_total = 0

    def accept(self, req: Request, token: int) -> tuple[RequestStatus | None, int | None]:
        """Append a sampled token to ``req``'s output; returns ``(finish status or None, stop
        token or None)`` (the request itself is not finished here)."""
        req.output_token_ids.append(token)
        if req.first_token_time is None:
            req.first_token_time = time.monotonic()
        self.generation_tokens_total += 1
        return self._stop(req, token, len(req.output_token_ids))

    def finishes(self, req: Request, token: int) -> bool:
        """Whether accepting ``token`` next would finish ``req`` (nothing is changed)."""
        return self._stop(req, token, len(req.output_token_ids) + 1)[0] is not None

    def _stop(self, req: Request, token: int, n_out: int) -> tuple[RequestStatus | None, int | None]:
        """The stop condition ``token`` meets as ``req``'s ``n_out``-th output token."""
        sp = req.sampling_params
        if n_out >= sp.min_tokens:
            if not sp.ignore_eos and (token == req.eos_token_id or token in self.eos_token_ids):
                return RequestStatus.FINISHED_STOPPED, None
            if token in sp.stop_token_ids:
                return RequestStatus.FINISHED_STOPPED, token
        if n_out >= sp.max_tokens or req.num_prompt_tokens + n_out >= self.max_model_len:
            return RequestStatus.FINISHED_LENGTH, None
        return None, None
