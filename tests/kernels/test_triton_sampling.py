"""The fused Gumbel-max draw of the CUDA sampler against its definition.

Without CUDA the kernel runs under Triton's interpreter (``TRITON_INTERPRET=1``, set here before
``triton`` is imported) on small shapes.
"""

from __future__ import annotations

import pytest
import torch

from triton_kernels import import_kernels

ts, HAS_CUDA = import_kernels("pdserve.kernels.sampling", "_gumbel_argmax_kernel")

from pdserve.engine.outputs import ScheduledRequest  # noqa: E402
from pdserve.engine.sampling_params import SamplingParams  # noqa: E402
from pdserve.runner.sampler import Sampler  # noqa: E402

DEV = torch.device("cuda" if HAS_CUDA else "cpu")


def _args(rows: int, temp: float, seed: int = 5, first_pos: int = 0):
    return (torch.full((rows,), temp, device=DEV), torch.full((rows,), seed, dtype=torch.int64, device=DEV),
            torch.arange(first_pos, first_pos + rows, device=DEV))


def test_greedy_rows_take_the_argmax_and_the_lowest_index_on_ties():
    logits = torch.tensor([[0.1, 3.0, -1.0, 3.0], [5.0, 0.0, 0.0, 0.0], [-2.0, -1.0, -3.0, -1.5]],
                          device=DEV)
    out = ts.gumbel_argmax(logits, *_args(3, 0.0))
    assert out.tolist() == [1, 0, 1]


def test_draws_follow_softmax_of_logits_over_temperature():
    logits = torch.tensor([2.0, 1.0, 0.0, -1.0, 0.5, -3.0], device=DEV)
    temp = 0.7
    n = 2000
    out = ts.gumbel_argmax(logits.expand(n, -1).contiguous(), *_args(n, temp)).cpu()
    freq = torch.bincount(out, minlength=6).double() / n
    expect = torch.softmax(logits.cpu().double() / temp, dim=0)
    # each frequency within 4 standard errors of its probability
    se = (expect * (1 - expect) / n).sqrt()
    assert ((freq - expect).abs() <= 4 * se + 1e-3).all(), (freq, expect)


def test_noise_depends_only_on_seed_and_position():
    logits = torch.zeros(64, 50, device=DEV)  # uniform: the token is decided by the noise alone
    a = ts.gumbel_argmax(logits, *_args(64, 1.0, seed=11))
    again = ts.gumbel_argmax(logits, *_args(64, 1.0, seed=11))
    shifted = ts.gumbel_argmax(logits, *_args(64, 1.0, seed=11, first_pos=3))
    stepped = ts.gumbel_argmax(logits, *_args(64, 1.0, seed=11), step=3)
    other_seed = ts.gumbel_argmax(logits, *_args(64, 1.0, seed=12))
    assert a.tolist() == again.tolist()
    assert shifted.tolist() == stepped.tolist()
    assert a[3:].tolist() == shifted[:-3].tolist()
    assert a.tolist() != other_seed.tolist()
    assert len(set(a.tolist())) > 20  # different positions get different noise


def test_rejects_bad_shapes():
    with pytest.raises(ValueError, match="seeds"):
        ts.gumbel_argmax(torch.zeros(2, 4, device=DEV), torch.ones(2, device=DEV),
                         torch.zeros(3, dtype=torch.int64, device=DEV),
                         torch.zeros(2, dtype=torch.int64, device=DEV))


def _req(rid: str, sp: SamplingParams, n_out: int = 0) -> ScheduledRequest:
    return ScheduledRequest(req_id=rid, token_ids=[1], num_computed_tokens=4, block_ids=[0],
                            sample=True, sampling_params=sp, prompt_token_ids=[1, 2, 3, 4],
                            output_token_ids=[7] * n_out)


def test_fused_sampler_masks_and_seeds():
    sampler = Sampler(DEV, seed=3, fused=True)
    assert sampler.fused
    logits = torch.tensor([1.0, 0.9, 0.8, 0.7, -5.0, 0.6], device=DEV)
    reqs = [_req("greedy", SamplingParams(temperature=0.0)),
            _req("topk1", SamplingParams(temperature=1.0, top_k=1)),
            _req("topk2", SamplingParams(temperature=2.0, top_k=2, seed=1)),
            _req("minp", SamplingParams(temperature=1.0, min_p=0.5, seed=2)),
            _req("free", SamplingParams(temperature=1.0))]
    seen = {r.req_id: set() for r in reqs}
    for n_out in range(40):
        batch = [_req(r.req_id, r.sampling_params, n_out) for r in reqs]
        toks, _ = sampler.sample(logits.expand(len(batch), -1).contiguous(), batch)
        for r, t in zip(batch, toks):
            seen[r.req_id].add(t)
    assert seen["greedy"] == {0} and seen["topk1"] == {0}
    assert seen["topk2"] == {0, 1}
    assert 4 not in seen["minp"] and seen["minp"] <= {0, 1, 2, 3, 5}
    assert len(seen["free"]) >= 3
    # A seeded request draws the same token at the same position, whatever the batch.
    alone, _ = sampler.sample(logits[None].clone(), [_req("x", SamplingParams(temperature=2.0, seed=1), 9)])
    batched, _ = sampler.sample(logits.expand(2, -1).contiguous(),
                                [_req("y", SamplingParams(temperature=1.0), 9),
                                 _req("x", SamplingParams(temperature=2.0, seed=1), 9)])
    assert alone[0] == batched[1]
    sampler.drop([r.req_id for r in reqs] + ["x", "y"])
    assert sampler.num_generators == 0
