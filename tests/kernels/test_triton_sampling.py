"""The fused inverse-CDF draw of the CUDA sampler against its definition.

Without CUDA the kernels run under Triton's interpreter (``TRITON_INTERPRET=1``, set here before
``triton`` is imported) on small shapes. The interpreter is slow, so statistical checks run on a
numpy copy of the draw (:func:`_reference`, Triton's Philox-4x32-10 ``tl.rand`` included) over
many rows, and the kernels are checked to draw exactly the reference's tokens on a few dozen rows.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.support.triton_kernels import import_kernels

ts, HAS_CUDA = import_kernels("pdserve.kernels.sampling", "_pick_kernel")

from pdserve.types.outputs import ScheduledRequest  # noqa: E402
from pdserve.types.sampling_params import SamplingParams  # noqa: E402
from pdserve.runner.sampler import Sampler  # noqa: E402

DEV = torch.device("cuda" if HAS_CUDA else "cpu")


def _args(rows: int, temp: float, seed: int = 5, first_pos: int = 0):
    return (torch.full((rows,), temp, device=DEV), torch.full((rows,), seed, dtype=torch.int64, device=DEV),
            torch.arange(first_pos, first_pos + rows, device=DEV))


def test_greedy_rows_take_the_argmax_and_the_lowest_index_on_ties():
    logits = torch.tensor([[0.1, 3.0, -1.0, 3.0], [5.0, 0.0, 0.0, 0.0], [-2.0, -1.0, -3.0, -1.5]],
                          device=DEV)
    out = ts.draw_tokens(logits, *_args(3, 0.0))
    assert out.tolist() == [1, 0, 1]


def _philox_uniform(keys: np.ndarray) -> np.ndarray:
    """The kernel's uniform per row: Triton's ``tl.rand(key, 0)``, Philox-4x32 with 10 rounds
    (Salmon et al., 2011; constants and the counter/key layout of ``triton/language/random.py``)
    at counter 0, its first word mapped to ``[0, 1)`` as ``uint_to_uniform_float`` does.

    Args:
        keys: ``[R]`` uint64 Philox keys (low word is key 0, high word key 1).

    Returns:
        ``[R]`` float32 uniforms.
    """
    m32 = np.uint64(0xFFFFFFFF)
    ra, rb = np.uint64(0xD2511F53), np.uint64(0xCD9E8D57)
    c0 = c1 = c2 = c3 = np.zeros_like(keys)
    k0, k1 = keys & m32, keys >> np.uint64(32)
    for _ in range(10):
        p0, p2 = ra * c0, rb * c2  # exact: both factors < 2**32
        c0, c2, c1, c3 = ((p2 >> np.uint64(32)) ^ c1 ^ k0, (p0 >> np.uint64(32)) ^ c3 ^ k1,
                          p2 & m32, p0 & m32)
        k0, k1 = (k0 + np.uint64(0x9E3779B9)) & m32, (k1 + np.uint64(0xBB67AE85)) & m32
    x = c0.astype(np.uint32).view(np.int32)
    x = np.where(x < 0, ~x, x)
    return x.astype(np.float32) * np.float32(4.6566127342e-10)


def _reference(logits: torch.Tensor, temps: torch.Tensor, seeds: torch.Tensor,
               positions: torch.Tensor, step: int = 0) -> list[int]:
    """The kernels' draw in numpy float64: the first index whose cumulative probability under
    ``softmax(logits / T)`` (``logits`` times the float32 ``1 / T``) exceeds ``u`` from Philox
    keyed by ``seed * 2**32 + position + step``; plain argmax where ``T == 0``, lowest index on
    ties. Shapes as :func:`pdserve.kernels.sampling.draw_tokens`."""
    x = logits.detach().cpu().float().numpy()
    t = temps.detach().cpu().float().numpy()
    keys = (seeds.cpu().numpy().astype(np.uint64) << np.uint64(32)) + (
        positions.cpu().numpy() + step).astype(np.uint64)
    u = _philox_uniform(keys)
    out = []
    for row, temp, ui in zip(x, t, u):
        if temp == 0:
            out.append(int(np.argmax(row)))
            continue
        z = (row * (np.float32(1) / temp)).astype(np.float64)
        with np.errstate(invalid="ignore"):
            p = np.exp(z - z.max())
        cdf = np.cumsum(p) / p.sum()
        out.append(min(int(np.searchsorted(cdf, ui, side="right")), int(np.nonzero(p)[0][-1])))
    return out


def test_kernel_draws_the_reference_formula():
    gen = torch.Generator().manual_seed(0)
    rows, vocab = 24, 40
    logits = (torch.randn(rows, vocab, generator=gen) * 2).to(DEV)
    temps = torch.tensor([0.0, 0.3, 0.7, 1.0, 1.5, 3.0] * 4, device=DEV)
    seeds = torch.randint(0, 2**31, (rows,), generator=gen).to(DEV)
    positions = torch.randint(0, 5000, (rows,), generator=gen).to(DEV)
    out = ts.draw_tokens(logits, temps, seeds, positions, step=7)
    assert out.tolist() == _reference(logits, temps, seeds, positions, step=7)


@pytest.mark.slow  # a Triton kernel in the interpreter: seconds on a CPU
def test_draws_follow_softmax_of_logits_over_temperature():
    logits = torch.tensor([2.0, 1.0, 0.0, -1.0, 0.5, -3.0], device=DEV)
    temp = 0.7
    n = 20000  # drawn by the reference; the kernel's own draws are checked on the first rows
    args = _args(n, temp)
    ref = _reference(logits.expand(n, -1), *args)
    k = 32
    out = ts.draw_tokens(logits.expand(k, -1).contiguous(), *(a[:k].contiguous() for a in args))
    assert out.tolist() == ref[:k]
    freq = torch.bincount(torch.tensor(ref), minlength=6).double() / n
    expect = torch.softmax(logits.cpu().double() / temp, dim=0)
    # each frequency within 4 standard errors of its probability
    se = (expect * (1 - expect) / n).sqrt()
    assert ((freq - expect).abs() <= 4 * se + 1e-3).all(), (freq, expect)


@pytest.mark.parametrize("block_v", [16, 32])
def test_several_blocks_draw_what_one_block_draws(block_v):
    """Rows cut into several vocabulary blocks draw the reference's tokens, ties across blocks
    included (the lowest index wins), masked entries never, greedy and sampled rows alike."""
    gen = torch.Generator().manual_seed(3)
    rows, vocab = 6, 70
    logits = (torch.randn(rows, vocab, generator=gen) * 2).to(DEV)
    logits[0, [5, 40, 69]] = 50.0  # greedy row: equal maxima in different blocks
    logits[1, :] = float("-inf")
    logits[1, [66, 20]] = 1.0  # only two tokens allowed, in different blocks
    logits[3, :32] = float("-inf")  # whole blocks masked
    temps = torch.tensor([0.0, 1.0, 0.0, 0.5, 1.0, 2.0], device=DEV)
    seeds = torch.randint(0, 2**31, (rows,), generator=gen).to(DEV)
    positions = torch.randint(0, 5000, (rows,), generator=gen).to(DEV)
    out = ts.draw_tokens(logits, temps, seeds, positions, step=2, block_v=block_v)
    assert out.tolist() == _reference(logits, temps, seeds, positions, step=2)
    assert out[0].item() == 5 and out[1].item() in (20, 66) and out[3].item() >= 32
    assert out.tolist() == ts.draw_tokens(logits, temps, seeds, positions, step=2).tolist()


@pytest.mark.slow  # a Triton kernel in the interpreter: seconds on a CPU
def test_two_allowed_tokens_are_drawn_in_proportion():
    """A row whose mass sits on two entries in different blocks: the draws over many positions
    follow the two probabilities (within 4 standard errors)."""
    rows = 200
    logits = torch.full((rows, 64), float("-inf"), device=DEV)
    logits[:, 3], logits[:, 50] = 0.0, 1.0
    out = ts.draw_tokens(logits, *_args(rows, 1.0, seed=9), block_v=16)
    assert set(out.tolist()) == {3, 50}
    p50 = float(torch.sigmoid(torch.tensor(1.0)))
    se = (p50 * (1 - p50) / rows) ** 0.5
    assert abs((out == 50).float().mean().item() - p50) <= 4 * se


@pytest.mark.slow  # a Triton kernel in the interpreter: seconds on a CPU
def test_draw_at_the_top_of_the_distribution_stays_on_allowed_tokens():
    """With ``u`` next to 1 (seed 5 at position 4,165,581: ``u = 1 - 1.2e-7``), the running sums
    that locate ``u * total`` may end below it in float32 (sequential sums of a large entry and
    many small ones lose the small ones; the totals add them): the draw still lands on an entry
    with weight, never past the last one, across blocks and within a block."""
    pos = 4_165_581
    assert _philox_uniform(np.array([(5 << 32) + pos], dtype=np.uint64))[0] > 0.9999998
    tiny = float(np.log(1e-8))
    # row 0: one block of one large and 2,047 small entries, then a masked block
    within = torch.full((1, 4096), float("-inf"))
    within[0, 0], within[0, 1:2048] = 0.0, tiny
    # row 1: 600 blocks of 16 entries: a large entry, 598 blocks of one small entry, a masked one
    across = torch.full((1, 9600), float("-inf"))
    across[0, 0], across[0, 16:9584:16] = 0.0, tiny
    for logits, block_v in ((within, 2048), (across, 16)):
        out = ts.draw_tokens(logits.to(DEV), *_args(1, 1.0, seed=5, first_pos=pos), block_v=block_v)
        assert torch.isfinite(logits[0, out.item()]), out.item()


def test_rejects_bad_block_size():
    for bad in (8, 24):
        with pytest.raises(ValueError, match="block_v"):
            ts.draw_tokens(torch.zeros(2, 4, device=DEV), *_args(2, 1.0), block_v=bad)


@pytest.mark.slow  # a Triton kernel in the interpreter: seconds on a CPU
def test_noise_depends_only_on_seed_and_position():
    rows = 16
    logits = torch.zeros(rows, 50, device=DEV)  # uniform: the token is decided by the noise alone
    a = ts.draw_tokens(logits, *_args(rows, 1.0, seed=11))
    again = ts.draw_tokens(logits, *_args(rows, 1.0, seed=11))
    shifted = ts.draw_tokens(logits, *_args(rows, 1.0, seed=11, first_pos=3))
    stepped = ts.draw_tokens(logits, *_args(rows, 1.0, seed=11), step=3)
    other_seed = ts.draw_tokens(logits, *_args(rows, 1.0, seed=12))
    assert a.tolist() == again.tolist()
    assert shifted.tolist() == stepped.tolist()
    assert a[3:].tolist() == shifted[:-3].tolist()
    assert a.tolist() != other_seed.tolist()
    assert len(set(a.tolist())) > rows // 2  # different positions get different noise


def test_rejects_bad_shapes():
    with pytest.raises(ValueError, match="seeds"):
        ts.draw_tokens(torch.zeros(2, 4, device=DEV), torch.ones(2, device=DEV),
                         torch.zeros(3, dtype=torch.int64, device=DEV),
                         torch.zeros(2, dtype=torch.int64, device=DEV))


def _req(rid: str, sp: SamplingParams, n_out: int = 0) -> ScheduledRequest:
    return ScheduledRequest(request_id=rid, token_ids=[1], num_computed_tokens=4, block_ids=[0],
                            sample=True, sampling_params=sp, prompt_token_ids=[1, 2, 3, 4],
                            output_token_ids=[7] * n_out)


@pytest.mark.slow  # a Triton kernel in the interpreter: seconds on a CPU
def test_fused_sampler_masks_and_seeds():
    sampler = Sampler(DEV, seed=3, fused=True)
    assert sampler.fused
    logits = torch.tensor([1.0, 0.9, 0.8, 0.7, -5.0, 0.6], device=DEV)
    reqs = [_req("greedy", SamplingParams(temperature=0.0)),
            _req("topk1", SamplingParams(temperature=1.0, top_k=1)),
            _req("topk2", SamplingParams(temperature=2.0, top_k=2, seed=1)),
            _req("minp", SamplingParams(temperature=1.0, min_p=0.5, seed=2)),
            _req("free", SamplingParams(temperature=1.0))]
    seen = {r.request_id: set() for r in reqs}
    for n_out in range(16):
        batch = [_req(r.request_id, r.sampling_params, n_out) for r in reqs]
        toks, _ = sampler.sample(logits.expand(len(batch), -1).contiguous(), batch)
        for r, t in zip(batch, toks):
            seen[r.request_id].add(t)
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
    sampler.drop([r.request_id for r in reqs] + ["x", "y"])
    assert sampler.num_generators == 0


@pytest.mark.parametrize("rows", [1, 2, 3, 5])
def test_fused_plan_rows_start_16_byte_aligned(rows):
    """The fused plan's per-row tensors start 16-byte aligned whatever the batch size: Triton
    compiles one kernel variant per pointer alignment, and a one-row batch used to get a second
    one (a compilation inside a decode step)."""
    sampler = Sampler(DEV, seed=3, fused=True)
    reqs = [_req(f"r{i}", SamplingParams(temperature=1.0 + i, top_k=2 + i, top_p=0.9, seed=i), i)
            for i in range(rows)]
    plan = sampler.plan(reqs)
    for t in (plan.temperatures, plan.seeds, plan.positions, plan.top_k, plan.top_p):
        assert t.data_ptr() % 16 == 0
    assert plan.temperatures.tolist() == [1.0 + i for i in range(rows)]
    assert plan.seeds.tolist() == list(range(rows)) and plan.positions.tolist() == list(range(rows))
    assert plan.top_k[:, 0].tolist() == [2 + i for i in range(rows)]
    assert plan.top_p.shape == (rows, 1)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_kernel_reads_model_dtype_logits_as_their_float32_upcast(dtype):
    """bf16 / float16 logits (the LM head's output) draw what their float32 upcast draws: the
    kernel converts its loads to float32."""
    gen = torch.Generator().manual_seed(4)
    rows, vocab = 12, 300
    logits = (torch.randn(rows, vocab, generator=gen) + 5).to(dtype).to(DEV)
    temps = torch.tensor([0.0, 0.5, 0.8, 1.0, 1.3, 2.0] * 2, device=DEV)
    seeds = torch.randint(0, 2**31, (rows,), generator=gen).to(DEV)
    positions = torch.randint(0, 5000, (rows,), generator=gen).to(DEV)
    out = ts.draw_tokens(logits, temps, seeds, positions, step=1, block_v=128)
    up = ts.draw_tokens(logits.float(), temps, seeds, positions, step=1, block_v=128)
    assert out.tolist() == up.tolist() == _reference(logits, temps, seeds, positions, step=1)


@pytest.mark.slow  # a Triton kernel in the interpreter: seconds on a CPU
def test_fused_sampler_on_bf16_logits_draws_as_on_their_upcast():
    """The fused sampler on bf16 logits: greedy only, unmasked (the kernel reads the bf16
    logits), masked (the masks work on a float32 copy) and with penalties, the tokens of the
    float32 upcast; the input is left unmodified."""
    gen = torch.Generator().manual_seed(6)
    rows = 24
    # large logits: bf16 steps of 1/4 near 40, so a temperature division in bf16 would move draws
    logits = (torch.randn(rows, 256, generator=gen) * 2 + 40).to(torch.bfloat16).to(DEV)
    before = logits.clone()
    greedy = [SamplingParams(temperature=0.0)]
    plain = greedy + [SamplingParams(temperature=0.8, seed=3), SamplingParams(temperature=1.2)]
    masked = plain + [SamplingParams(temperature=0.4, top_k=50, seed=4),
                      SamplingParams(temperature=0.6, top_p=0.95, min_p=0.01)]
    penalised = masked + [SamplingParams(temperature=0.9, seed=5, repetition_penalty=1.2)]
    for kinds, n_out in ((greedy, 3), (plain, 3), (masked, 3), (penalised, 3)):
        batch = [_req(f"r{i}", kinds[i % len(kinds)], n_out) for i in range(rows)]
        got = Sampler(DEV, seed=3, fused=True).sample(logits, batch)[0]
        assert got == Sampler(DEV, seed=3, fused=True).sample(logits.float(), batch)[0]
        if not Sampler.samples_on_host(batch):
            dev = Sampler(DEV, seed=3, fused=True).sample_on_device(logits, batch)
            assert dev.tolist() == got
    assert torch.equal(logits, before)
