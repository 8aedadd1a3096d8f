"""Sampler: greedy, seeds, top-k / top-p / min-p masks, penalties, min_tokens, logprobs."""

from __future__ import annotations

import dataclasses

import math

import pytest
import torch

from pdserve.types.outputs import ScheduledRequest
from pdserve.types.sampling_params import SamplingParams
from pdserve.runner.logits_processors import (
    apply_min_p,
    apply_min_tokens,
    apply_penalties,
    apply_top_k_top_p,
)
from pdserve.runner.sampler import Sampler

CPU = torch.device("cpu")


def _req(rid: str, params: SamplingParams, prompt=(), output=(), eos: int | None = None):
    return ScheduledRequest(request_id=rid, token_ids=[0], num_computed_tokens=0, block_ids=[0],
                            sample=True, sampling_params=params, prompt_token_ids=list(prompt),
                            output_token_ids=list(output), eos_token_id=eos)


def _draw(sampler: Sampler, logits: torch.Tensor, reqs, steps: int) -> list[list[int]]:
    """``steps`` generation steps: each request's drawn tokens become its output tokens."""
    seqs = [[] for _ in reqs]
    for _ in range(steps):
        batch = [dataclasses.replace(r, output_token_ids=list(r.output_token_ids) + s)
                 for r, s in zip(reqs, seqs)]
        toks, _ = sampler.sample(logits.clone(), batch)
        for s, t in zip(seqs, toks):
            s.append(t)
    return seqs


def test_greedy_is_argmax_and_mixes_with_random_rows():
    torch.manual_seed(0)
    logits = torch.randn(4, 50)
    reqs = [_req("g0", SamplingParams(temperature=0)), _req("r", SamplingParams(temperature=1)),
            _req("g1", SamplingParams(temperature=0)), _req("r2", SamplingParams(temperature=2))]
    toks, lps = Sampler(CPU).sample(logits.clone(), reqs)
    assert toks[0] == int(logits[0].argmax()) and toks[2] == int(logits[2].argmax())
    assert all(0 <= t < 50 for t in toks) and lps == [None] * 4


def test_seed_reproducible_and_independent_of_batch():
    logits = torch.zeros(1, 1000)  # uniform: every draw depends only on the RNG
    seeded = SamplingParams(temperature=1.0, seed=1234)
    alone = _draw(Sampler(CPU, seed=0), logits, [_req("a", seeded)], 20)[0]
    # same seed, different sampler seed, other requests in the batch
    others = [_req("x", SamplingParams(temperature=1.0)), _req("a", seeded),
              _req("y", SamplingParams(temperature=0.7, seed=99))]
    batched = _draw(Sampler(CPU, seed=7), logits.expand(3, -1).contiguous(), others, 20)
    assert batched[1] == alone
    other_seed = _draw(Sampler(CPU), logits, [_req("a", SamplingParams(temperature=1.0,
                                                                         seed=4321))], 20)[0]
    assert other_seed != alone
    assert len(set(alone)) > 10  # really random over 1000 tokens


def test_unseeded_rows_get_different_noise():
    logits = torch.zeros(2, 1000)
    reqs = [_req("a", SamplingParams(temperature=1.0)), _req("b", SamplingParams(temperature=1.0))]
    a, b = _draw(Sampler(CPU), logits, reqs, 10)
    assert a != b


def test_seeded_draw_depends_on_seed_and_position_only():
    """The draw at output position k is the same whoever drew positions 0..k-1 (a prefiller's
    first token, then a decoder; preemption; multi-step rounds); the sampler keeps no state."""
    logits = torch.zeros(1, 1000)
    seeded = SamplingParams(temperature=1.0, seed=77)
    s = Sampler(CPU)
    full = _draw(s, logits, [_req("a", seeded)], 6)[0]
    resumed = _draw(Sampler(CPU, seed=5), logits, [_req("b", seeded, output=full[:4])], 2)[0]
    assert resumed == full[4:]
    assert s.num_generators == 0
    s.drop({"a", "unknown"})


def test_sampling_follows_distribution():
    probs = torch.tensor([0.6, 0.3, 0.1])
    logits = probs.log().expand(4000, -1).contiguous()
    reqs = [_req(f"r{i}", SamplingParams(temperature=1.0)) for i in range(4000)]
    toks, _ = Sampler(CPU, seed=3).sample(logits, reqs)
    freq = torch.bincount(torch.tensor(toks), minlength=3).float() / 4000
    assert torch.allclose(freq, probs, atol=0.03), freq


def test_temperature_sharpens():
    logits = torch.tensor([[2.0, 1.0, 0.0]]).expand(3000, -1).contiguous()
    cold = [_req(f"c{i}", SamplingParams(temperature=0.2)) for i in range(3000)]
    hot = [_req(f"h{i}", SamplingParams(temperature=5.0)) for i in range(3000)]
    c, _ = Sampler(CPU, seed=0).sample(logits.clone(), cold)
    h, _ = Sampler(CPU, seed=0).sample(logits.clone(), hot)
    assert c.count(0) > 2900 and h.count(0) < 1500


def _probs_logits(p):
    return torch.tensor([p]).log()


def test_top_k_mask():
    torch.manual_seed(1)
    logits = torch.randn(3, 30)
    params = [SamplingParams(top_k=3), SamplingParams(top_k=0), SamplingParams(top_k=1)]
    masked = logits.clone()
    apply_top_k_top_p(masked, params)
    kept = torch.isfinite(masked)
    assert set(kept[0].nonzero().flatten().tolist()) == set(logits[0].topk(3).indices.tolist())
    assert kept[1].all()
    assert kept[2].nonzero().flatten().tolist() == [int(logits[2].argmax())]
    assert torch.equal(masked[kept], logits[kept])  # survivors unchanged


@pytest.mark.parametrize("top_p,expected", [(0.45, 1), (0.75, 2), (0.85, 3), (1.0, 4)])
def test_top_p_mask(top_p, expected):
    logits = _probs_logits([0.15, 0.5, 0.05, 0.3])  # sorted: 0.5, 0.3, 0.15, 0.05
    apply_top_k_top_p(logits, [SamplingParams(top_p=top_p)])
    kept = torch.isfinite(logits[0]).nonzero().flatten().tolist()
    assert sorted(kept) == sorted([1, 3, 0, 2][:expected])


def test_top_k_and_top_p_together():
    logits = _probs_logits([0.4, 0.3, 0.2, 0.1])
    apply_top_k_top_p(logits, [SamplingParams(top_k=2, top_p=0.95)])
    assert torch.isfinite(logits[0]).tolist() == [True, True, False, False]


def test_min_p_mask():
    logits = _probs_logits([0.5, 0.3, 0.15, 0.05])
    apply_min_p(logits, [SamplingParams(min_p=0.2)])  # threshold 0.1
    assert torch.isfinite(logits[0]).tolist() == [True, True, True, False]


def test_top_k_restricts_samples():
    torch.manual_seed(2)
    logits = torch.randn(1, 100).expand(500, -1).contiguous()
    allowed = set(logits[0].topk(5).indices.tolist())
    reqs = [_req(f"r{i}", SamplingParams(temperature=1.0, top_k=5)) for i in range(500)]
    toks, _ = Sampler(CPU).sample(logits, reqs)
    assert set(toks) <= allowed and len(set(toks)) > 1


def test_repetition_penalty():
    logits = torch.tensor([[2.0, -2.0, 2.0, -2.0, 1.0]])
    reqs = [_req("a", SamplingParams(repetition_penalty=2.0), prompt=[0], output=[1])]
    apply_penalties(logits, reqs)
    assert logits.tolist() == [[1.0, -4.0, 2.0, -2.0, 1.0]]


def test_presence_and_frequency_penalties():
    logits = torch.zeros(2, 5)
    reqs = [_req("a", SamplingParams(presence_penalty=0.5, frequency_penalty=0.25),
                 prompt=[4, 4], output=[1, 1, 1, 3]),
            _req("b", SamplingParams())]
    apply_penalties(logits, reqs)
    # token 1: 3 * 0.25 + 0.5; token 3: 0.25 + 0.5; prompt tokens are not penalised
    assert logits[0].tolist() == [0.0, -1.25, 0.0, -0.75, 0.0]
    assert logits[1].tolist() == [0.0] * 5


def test_min_tokens_suppresses_eos_and_stop_ids():
    params = SamplingParams(min_tokens=2, stop_token_ids=[3])
    logits = torch.zeros(3, 6)
    reqs = [_req("a", params, output=[], eos=2), _req("b", params, output=[5, 5], eos=2),
            _req("c", SamplingParams(), eos=2)]
    apply_min_tokens(logits, reqs)
    assert torch.isinf(logits[0]).nonzero().flatten().tolist() == [2, 3]
    assert torch.isfinite(logits[1:]).all()
    # through the sampler: greedy on a logit vector where EOS is the argmax
    eos_best = torch.tensor([[0.0, 0.0, 9.0, 8.0, 1.0, 0.0]])
    toks, _ = Sampler(CPU).sample(eos_best.clone(), [_req("d", SamplingParams(
        temperature=0, min_tokens=1, stop_token_ids=[3]), eos=2)])
    assert toks == [4]


def test_logprobs():
    torch.manual_seed(3)
    logits = torch.randn(3, 10)
    reqs = [_req("a", SamplingParams(temperature=0, logprobs=10)),
            _req("b", SamplingParams(temperature=1.0, seed=5, logprobs=0)),
            _req("c", SamplingParams(temperature=0))]
    toks, lps = Sampler(CPU).sample(logits.clone(), reqs)
    ref = torch.log_softmax(logits, dim=-1)
    a, b, c = lps
    assert c is None
    assert a.token_id == toks[0] and math.isclose(a.logprob, ref[0, toks[0]].item(), rel_tol=1e-5)
    assert len(a.top) == 10
    assert math.isclose(sum(math.exp(lp) for _, lp in a.top), 1.0, rel_tol=1e-5)
    assert [lp for _, lp in a.top] == sorted((lp for _, lp in a.top), reverse=True)
    assert a.top[0] == (toks[0], pytest.approx(a.logprob))  # greedy picks the top token
    assert b.top == [] and math.isclose(b.logprob, ref[1, toks[1]].item(), rel_tol=1e-5)


def test_logprobs_are_temperature_free_but_penalised():
    logits = torch.tensor([[1.0, 2.0, 3.0]])
    req = _req("a", SamplingParams(temperature=0.5, seed=0, logprobs=3, frequency_penalty=1.0),
               output=[2])
    _, (lp,) = Sampler(CPU).sample(logits.clone(), [req])
    ref = torch.log_softmax(torch.tensor([1.0, 2.0, 2.0]), dim=-1)
    assert dict(lp.top) == pytest.approx({i: ref[i].item() for i in range(3)})



def _bf16_batch(host_steps: bool):
    """Logits in bf16 (the model dtype on CUDA) and requests of every kind of draw: greedy,
    seeded, shared-generator, top-k / top-p / min-p; with ``host_steps`` also penalties,
    min_tokens and logprobs (which make the sampler work on a float32 copy)."""
    gen = torch.Generator().manual_seed(11)
    rows, vocab = 64, 1000
    # flat and away from 0: bf16 rounding of logits / T (steps of 2**-5 near 5) would move draws
    logits = (torch.randn(rows, vocab, generator=gen) + 5).to(torch.bfloat16)
    kinds = [SamplingParams(temperature=0),
             SamplingParams(temperature=0.7, seed=1),
             SamplingParams(temperature=1.3),  # the shared generator
             SamplingParams(temperature=0.9, seed=2, top_k=20),
             SamplingParams(temperature=1.1, seed=3, top_p=0.8),
             SamplingParams(temperature=0.8, seed=4, min_p=0.05)]
    if host_steps:
        kinds += [SamplingParams(temperature=0.6, seed=5, repetition_penalty=1.3,
                                 presence_penalty=0.4, frequency_penalty=0.3),
                  SamplingParams(temperature=0, min_tokens=10),
                  SamplingParams(temperature=1.0, seed=6, logprobs=3),
                  SamplingParams(temperature=0, logprobs=2, frequency_penalty=0.5)]
    reqs = []
    for i in range(rows):
        p = kinds[i % len(kinds)]
        top = logits[i].float().topk(4).indices.tolist()
        # the EOS / stop ids of the min_tokens rows are their best tokens: min_tokens decides
        p = dataclasses.replace(p, stop_token_ids=[top[1]]) if p.min_tokens else p
        reqs.append(_req(f"r{i}", p, prompt=top[:2], output=top[1:4], eos=top[0]))
    return logits, reqs


@pytest.mark.parametrize("host_steps", [False, True])
def test_bf16_logits_sample_as_their_float32_upcast(host_steps):
    """The sampler on model-dtype (bf16) logits draws what it draws on their float32 upcast
    (the same numbers), on the host and on the device: greedy, seeded and shared-generator
    draws, top-k / top-p / min-p; with ``host_steps`` penalties, min_tokens and logprobs too
    (logprobs equal); the input logits, bf16 or float32, are left unmodified."""
    logits, reqs = _bf16_batch(host_steps)
    before = logits.clone()
    up = logits.float()
    for steps in range(3):  # several positions of the seeded rows
        batch = [dataclasses.replace(r, output_token_ids=r.output_token_ids + [1] * steps)
                 for r in reqs]
        toks, lps = Sampler(CPU, seed=9).sample(logits, batch)
        ref_toks, ref_lps = Sampler(CPU, seed=9).sample(up, batch)
        assert toks == ref_toks
        assert lps == ref_lps
        assert torch.equal(logits, before)
        assert torch.equal(up, before.float())  # float32 input: not modified either
        if Sampler.samples_on_host(batch):
            continue
        on_device = Sampler(CPU, seed=9).sample_on_device(logits, batch)
        assert on_device.tolist() == Sampler(CPU, seed=9).sample_on_device(up, batch).tolist()
        assert on_device.tolist() == ref_toks and torch.equal(logits, before)
    greedy = [i for i, r in enumerate(reqs) if r.sampling_params.temperature == 0]
    g_reqs = [reqs[i] for i in greedy]
    g_toks, _ = Sampler(CPU).sample(logits[greedy], g_reqs)  # a greedy-only batch: argmax
    assert g_toks == Sampler(CPU).sample(up[greedy], g_reqs)[0]
    if not host_steps:
        assert g_toks == up[greedy].argmax(dim=-1).tolist()
        assert Sampler(CPU).sample_on_device(logits[greedy], g_reqs).tolist() == g_toks
    else:
        want = [r.sampling_params.logprobs is not None for r in reqs]
        assert [lp is not None for lp in lps] == want and any(want)
        # the rows under min_tokens would take their EOS / stop token without it
        assert all(t not in (r.eos_token_id, *r.sampling_params.stop_token_ids)
                   for t, r in zip(toks, batch) if r.sampling_params.min_tokens)


def test_sample_on_device_applies_min_tokens_on_a_copy():
    """min_tokens on the device path: bf16 logits give their float32 upcast's tokens, EOS and
    stop ids stay out, and the input logits are left unmodified."""
    logits = torch.tensor([[0.0, 0.0, 9.0, 8.0, 1.0, 0.0]] * 2).to(torch.bfloat16)
    before = logits.clone()
    reqs = [_req("a", SamplingParams(temperature=0, min_tokens=1, stop_token_ids=[3]), eos=2),
            _req("b", SamplingParams(temperature=0.5, seed=1, min_tokens=1, stop_token_ids=[3]),
                 eos=2)]
    toks = Sampler(CPU).sample_on_device(logits, reqs)
    assert toks.tolist()[0] == 4 and toks.tolist()[1] not in (2, 3)
    assert toks.tolist() == Sampler(CPU).sample_on_device(logits.float(), reqs).tolist()
    assert torch.equal(logits, before)
