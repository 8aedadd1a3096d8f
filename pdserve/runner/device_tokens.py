"""The sampled tokens of a step kept on the device, and the feeding of them into the next step's
placeholder inputs (``ScheduledRequest.input_from_previous_step``) by a device-side gather.

Used by a launched step (:mod:`pdserve.runner.step_launch`, async scheduling), whose tokens
stay on the device, and by decode steps that take their inputs from the previous step's tokens
(:mod:`pdserve.runner.decode_graphs`, :meth:`ModelRunner.forward_logits
<pdserve.runner.model_runner.ModelRunner.forward_logits>`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass
class DeviceTokens:
    """The sampled tokens of the last launched step, on the device.

    Attributes:
        rows: request_id -> its row in ``tokens``.
        tokens: ``[S]`` int64 on the runner's device.
    """

    rows: dict[str, int]
    tokens: torch.Tensor


def feed_previous_tokens(input_ids: torch.Tensor, rows: list[tuple[int, str]],
                         previous: DeviceTokens | None) -> None:
    """Write the previous step's sampled token of each request into its input row, on the
    device and without waiting for it.

    Args:
        input_ids: ``[T]`` int64 input tokens of the step, on the device; modified in place.
        rows: ``(row in input_ids, request_id)`` of the placeholder rows.
        previous: the previous step's tokens.

    Raises:
        ValueError: a request was not sampled in the previous step (a scheduling bug).
    """
    if not rows:
        return
    sampled_rows = previous.rows if previous is not None else {}
    try:
        src = [sampled_rows[request_id] for _, request_id in rows]
    except KeyError:
        missing = [request_id for _, request_id in rows if request_id not in sampled_rows]
        raise ValueError(f"requests {missing[:5]} take their input token from a previous step "
                         "that did not sample them") from None
    # [2, R]: destination rows, then source rows; one host-to-device copy
    index = torch.from_numpy(np.array([[i for i, _ in rows], src], dtype=np.int64))
    index = index.to(input_ids.device, non_blocking=True)
    input_ids[index[0]] = previous.tokens[index[1]]
