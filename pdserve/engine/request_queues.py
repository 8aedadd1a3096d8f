"""The scheduler's queues of unfinished requests, ``waiting`` (FCFS; preempted requests and
requests whose KV load ended go back to its front) and ``running``, and a queued request's entry
of a step (:func:`scheduled_request`). Pure bookkeeping: no torch.

Requests parked while their KV loads from another instance are not here: they are
:attr:`RemoteKV.waiting_for_remote <pdserve.engine.remote_kv.RemoteKV.waiting_for_remote>`.
"""

from __future__ import annotations

from collections import deque

from pdserve.types.outputs import PLACEHOLDER_TOKEN, ScheduledRequest
from pdserve.types.request import Request, RequestStatus


class RequestQueues:
    """The waiting and running requests, shared by the scheduler and its helpers (admission,
    multi-step rounds, async scheduling), which take it in their constructors.

    Attributes:
        waiting: requests to schedule, in order (the front first).
        running: requests that hold blocks and are scheduled every step, in arrival order of
            their admission.
    """

    def __init__(self) -> None:
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []

    def requeue_front(self, req: Request) -> None:
        """Put ``req`` (in no queue now) back at the front of ``waiting``, status ``WAITING``."""
        req.status = RequestStatus.WAITING
        self.waiting.appendleft(req)


def scheduled_request(req: Request, start: int, num_new: int, total: int | None = None,
                      pending: bool = False) -> ScheduledRequest:
    """``req``'s entry of a step: its tokens ``start .. start + num_new - 1``.

    Args:
        req: the request (its block table must cover those tokens).
        start: first position to compute (``num_computed_tokens`` in a synchronous step).
        num_new: tokens to compute.
        total: tokens of the request known to the host plus the one in flight (async
            scheduling); the step samples when it computes the last of them. Default:
            ``req.num_tokens``.
        pending: async scheduling: the one token is the placeholder of the output sampled by
            the step still running (the runner feeds it on the device).
    """
    if total is None:
        total = req.num_tokens
    return ScheduledRequest(
        request_id=req.request_id,
        token_ids=[PLACEHOLDER_TOKEN] if pending else req.token_ids(start, start + num_new),
        num_computed_tokens=start,
        block_ids=req.block_ids,
        sample=start + num_new == total,
        sampling_params=req.sampling_params,
        prompt_token_ids=req.prompt_token_ids,
        output_token_ids=req.output_token_ids,
        eos_token_id=req.eos_token_id,
        input_from_previous_step=pending,
        num_output_tokens=len(req.output_token_ids) + 1 if pending else -1,
    )
