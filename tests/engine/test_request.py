"""Request's token accessors."""

from __future__ import annotations

from pdserve.types.request import Request
from pdserve.types.sampling_params import SamplingParams


def test_token_ids_is_a_slice_of_all_token_ids():
    req = Request(request_id="r", prompt_token_ids=[10, 11, 12, 13], sampling_params=SamplingParams())
    req.output_token_ids.extend([20, 21, 22])
    assert req.num_prompt_tokens == 4 and req.num_tokens == 7
    everything = req.all_token_ids
    for start in range(9):
        for end in range(start, 10):
            assert req.token_ids(start, end) == everything[start:end], (start, end)
    # a new list each time: the scheduler hands it to the runner
    got = req.token_ids(0, 4)
    got.append(99)
    assert req.prompt_token_ids == [10, 11, 12, 13]
