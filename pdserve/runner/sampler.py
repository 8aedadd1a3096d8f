"""Token sampling for a batch of requests, each with its own :class:`SamplingParams`.

Order of operations per row (as in vLLM):

1. penalties on the raw logits: repetition penalty (CTRL, Keskar et al. 2019: positive logits of
   tokens seen in the prompt or output are divided by the penalty, negative ones multiplied),
   then the OpenAI presence / frequency penalties on output tokens
   (``logit -= frequency * count + presence * (count > 0)``);
2. ``min_tokens``: EOS and ``stop_token_ids`` get ``-inf`` until enough tokens exist;
3. logprobs, when requested, from ``log_softmax`` of these logits (before temperature);
4. greedy rows (temperature 0): ``argmax``;
5. other rows: divide by temperature, then top-k, top-p (nucleus, Holtzman et al. 2019) and
   min-p (drop tokens with probability below ``min_p * p_max``) masks, then draw one token with
   the exponential race ``argmax(p / E)``, ``E ~ Exp(1)`` (equivalent to sampling from ``p``).
   A request with a ``seed`` draws the noise of output position ``k`` from a
   ``torch.Generator`` seeded with ``(seed, k)``, so its tokens do not depend on the other
   requests in the batch or on where earlier tokens were drawn; the others share one generator
   seeded from the engine seed. On CUDA fused kernels draw the same distribution by inverting
   its cumulative distribution with one uniform per row (:mod:`pdserve.kernels.sampling`),
   keyed the same way.

The logits arrive in the model's dtype (bf16 on CUDA) and are never modified. Every step that
computes on them (penalties, ``min_tokens``, logprobs, temperature, the masks, the torch draw)
works on a float32 copy holding the same numbers; argmax of greedy rows and the fused draw
without masks read the model-dtype logits directly (the kernel converts its loads to float32),
so a plain decode step makes no float32 copy of its ``[S, vocab]`` logits at all. Penalties,
``min_tokens`` and the masks are in :mod:`pdserve.runner.logits_processors`.
"""

from __future__ import annotations

import random
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from pdserve.types.outputs import ScheduledRequest, TokenLogprobs
from pdserve.runner.logits_processors import (
    any_min_tokens, apply_min_tokens, apply_penalties, mask_min_p, mask_top_k_top_p,
)


class Sampler:
    """Samples one token per row of a logits batch.

    On CUDA (with Triton) the draw is fused (:func:`pdserve.kernels.sampling.draw_tokens`), its
    random number for a request depending only on its seed and the output position of the
    token; requests without a seed get one
    from a host RNG seeded with ``seed``. Elsewhere the draw is the torch exponential race, a
    seeded request's noise coming from a ``torch.Generator`` seeded with its seed and the output
    position. Either way a seeded request's draw at a position depends only on its seed and
    that position: not on the batch, on multi-step rounds, or on which instance drew the
    earlier tokens (a prefiller's first token, then the decoder's).

    Args:
        device: where logits live (the per-request generators are created there).
        seed: seed of the shared generator (or host RNG) used for requests without their own.
        fused: use the fused CUDA draw; default: on CUDA when Triton is importable.
    """

    def __init__(self, device: torch.device, seed: int = 0, fused: bool | None = None):
        self.device = device
        self._shared = torch.Generator(device=device)
        self._shared.manual_seed(seed)
        self._row_seeds: dict[str, int] = {}
        self._seed_rng = random.Random(seed)
        self._draw_tokens = None
        if fused is None:
            fused = device.type == "cuda"
        if fused:
            try:
                from pdserve.kernels.sampling import draw_tokens
            except ImportError:
                draw_tokens = None
            self._draw_tokens = draw_tokens

    @property
    def fused(self) -> bool:
        """True when draws use the fused CUDA kernel."""
        return self._draw_tokens is not None

    def drop(self, request_ids: Iterable[str]) -> None:
        """Forget the seeds drawn for unseeded finished requests (fused draw)."""
        for request_id in request_ids:
            self._row_seeds.pop(request_id, None)

    @property
    def num_generators(self) -> int:
        """Per-request seeds currently held (for tests and leak checks)."""
        return len(self._row_seeds)

    @torch.inference_mode()
    def sample(self, logits: torch.Tensor, reqs: Sequence[ScheduledRequest]
               ) -> tuple[list[int], list[TokenLogprobs | None]]:
        """Sample one token per row.

        Args:
            logits: ``[S, vocab]`` float32, bfloat16 or float16 (the model's dtype), row ``i``
                belongs to ``reqs[i]``; left unmodified.
            reqs: the requests being sampled, in row order.

        Returns:
            ``(token_ids, logprobs)``: one token per row, and per row a :class:`TokenLogprobs`
            when the request asked for logprobs, else None.
        """
        params = [r.sampling_params for r in reqs]
        want_lp = [i for i, p in enumerate(params) if p.logprobs is not None]
        if want_lp or any(p.uses_penalties for p in params) or any_min_tokens(reqs):
            logits = _float32_copy(logits)
            apply_penalties(logits, reqs)
            apply_min_tokens(logits, reqs)
        logprobs_rows = torch.log_softmax(logits[want_lp], dim=-1) if want_lp else None

        tokens = self.draw(logits, self.plan(reqs))

        token_list = tokens.tolist()
        out_lp: list[TokenLogprobs | None] = [None] * len(params)
        if logprobs_rows is not None:
            sel = torch.tensor([token_list[i] for i in want_lp], device=logits.device)
            chosen = logprobs_rows.gather(1, sel[:, None]).squeeze(1).tolist()
            k_max = max(params[i].logprobs or 0 for i in want_lp)
            top_vals = top_ids = None
            if k_max > 0:
                tv, ti = logprobs_rows.topk(k_max, dim=-1)
                top_vals, top_ids = tv.tolist(), ti.tolist()
            for j, i in enumerate(want_lp):
                k = params[i].logprobs or 0
                top = ([(top_ids[j][m], top_vals[j][m]) for m in range(k)]
                       if k and top_ids is not None else [])
                out_lp[i] = TokenLogprobs(token_id=token_list[i], logprob=chosen[j], top=top)
        return token_list, out_lp

    @staticmethod
    def samples_on_host(reqs: Sequence[ScheduledRequest]) -> bool:
        """True when :meth:`sample` must read tokens on the host (logprobs) or needs output
        token values (penalties); otherwise :meth:`sample_on_device` gives the same tokens."""
        return any(r.sampling_params.logprobs is not None or r.sampling_params.uses_penalties
                   for r in reqs)

    @torch.inference_mode()
    def sample_on_device(self, logits: torch.Tensor, reqs: Sequence[ScheduledRequest]) -> torch.Tensor:
        """:meth:`sample` for a batch without logprobs or penalties, leaving the tokens on the
        device (async scheduling: nothing here waits for the GPU).

        Args:
            logits: ``[S, vocab]`` float32, bfloat16 or float16 (the model's dtype), row ``i``
                belongs to ``reqs[i]``; left unmodified.
            reqs: the requests being sampled, in row order.

        Returns:
            ``[S]`` int64 tokens on the device, those :meth:`sample` would return.
        """
        if any_min_tokens(reqs):
            logits = _float32_copy(logits)
            apply_min_tokens(logits, reqs)
        return self.draw(logits, self.plan(reqs))

    def plan(self, reqs: Sequence[ScheduledRequest]) -> "SamplingPlan":
        """The per-row drawing parameters of ``reqs`` as device tensors, built once so that
        :meth:`draw` can run several times (one per decode step of a multi-step round) without
        host-to-device copies, which would wait for the GPU."""
        if self.fused:
            return self._fused_plan(reqs)
        params = [r.sampling_params for r in reqs]
        dev = self.device
        greedy = [i for i, p in enumerate(params) if p.temperature == 0.0]
        sampled = [i for i, p in enumerate(params) if p.temperature != 0.0]
        plan = SamplingPlan(num_rows=len(params))
        if greedy and sampled:
            plan.greedy_rows = torch.tensor(greedy, dtype=torch.int64, device=dev)
            plan.random_rows = torch.tensor(sampled, dtype=torch.int64, device=dev)
        plan.any_greedy, plan.any_random = bool(greedy), bool(sampled)
        if not sampled:
            return plan
        rp = [params[i] for i in sampled]
        plan.temperatures = torch.tensor([p.temperature for p in rp], dtype=torch.float32,
                                         device=dev)[:, None]
        vocab_unbounded = [p.top_k <= 0 for p in rp]
        if not all(vocab_unbounded):
            plan.top_k = torch.tensor([p.top_k if p.top_k > 0 else 2**62 for p in rp],
                                      dtype=torch.int64, device=dev)[:, None]
        if any(p.top_p < 1.0 for p in rp):
            plan.top_p = torch.tensor([p.top_p for p in rp], dtype=torch.float32, device=dev)[:, None]
        if any(p.min_p > 0.0 for p in rp):
            plan.min_p = torch.tensor([p.min_p for p in rp], dtype=torch.float32, device=dev)[:, None]
        unseeded = [j for j, p in enumerate(rp) if p.seed is None]
        plan.seeded = [(j, params[i].seed, reqs[i].output_position())
                       for j, i in enumerate(sampled) if params[i].seed is not None]
        if plan.seeded and unseeded:
            plan.unseeded_rows = torch.tensor(unseeded, dtype=torch.int64, device=dev)
        plan.any_unseeded = bool(unseeded)
        return plan

    def _fused_plan(self, reqs: Sequence[ScheduledRequest]) -> "SamplingPlan":
        """:meth:`plan` for the fused draw: per-row temperature (0 = greedy), Philox seed and
        output position for every row, and the masks' limits for every row when any uses one."""
        dev = self.device
        params = [r.sampling_params for r in reqs]
        plan = SamplingPlan(num_rows=len(params), fused=True)
        plan.any_random = any(p.temperature != 0.0 for p in params)
        plan.any_greedy = not all(p.temperature != 0.0 for p in params)
        if not plan.any_random:
            return plan  # plain argmax: nothing to copy to the device
        seeds = []
        for r, p in zip(reqs, params):
            if p.seed is not None:
                seeds.append(p.seed & 0x7FFFFFFF)
                continue
            seed = self._row_seeds.get(r.request_id)
            if seed is None:
                seed = self._row_seeds[r.request_id] = self._seed_rng.getrandbits(31)
            seeds.append(seed)
        # One row per field, each row a multiple of 16 bytes long: every field starts 16-byte
        # aligned on the device and is read in place. (Triton specialises a kernel on the
        # alignment of its pointers: one-row batches, whose column views were left in place by
        # .contiguous(), compiled a second draw-kernel variant inside a step.)
        n = len(params)
        pad = [0] * (-n % 4)
        host = torch.from_numpy(np.array(
            [[p.temperature for p in params] + pad, [p.top_p for p in params] + pad,
             [p.min_p for p in params] + pad], dtype=np.float32))
        ints = torch.from_numpy(np.array(
            [seeds + pad, [r.output_position() for r in reqs] + pad,
             [p.top_k if p.top_k > 0 else 2**62 for p in params] + pad], dtype=np.int64))
        host, ints = host.to(dev, non_blocking=True), ints.to(dev, non_blocking=True)
        plan.temperatures, plan.seeds, plan.positions = host[0, :n], ints[0, :n], ints[1, :n]
        if any(p.top_k > 0 or p.top_p < 1.0 or p.min_p > 0.0 for p in params if p.temperature):
            plan.top_k = ints[2, :n, None] if any(p.top_k > 0 for p in params) else None
            plan.top_p = host[1, :n, None] if any(p.top_p < 1.0 for p in params) else None
            plan.min_p = host[2, :n, None] if any(p.min_p > 0.0 for p in params) else None
            plan.scale = torch.where(plan.temperatures > 0, plan.temperatures, 1.0)[:, None]
            plan.unit_temperatures = (plan.temperatures > 0).to(torch.float32)
        return plan

    def draw(self, logits: torch.Tensor, plan: "SamplingPlan", step: int = 0) -> torch.Tensor:
        """One token per row of ``logits`` ``[S, V]`` (float32, bfloat16 or float16; left
        unmodified) as described by ``plan``: argmax for greedy rows; for the others
        temperature, top-k / top-p / min-p masks and a random draw (the fused inverse-CDF draw
        on CUDA, the exponential race elsewhere). Argmax and the fused draw without masks read
        ``logits`` in their dtype; temperature division, the masks and the exponential race
        work in float32 (the division by the float32 temperatures makes the float32 copy).
        ``step`` is the step inside a multi-step round (the fused draw's random number follows
        the output position). Returns ``[S]`` int64 on the device, without waiting for the GPU."""
        if plan.fused and plan.any_random:
            if plan.scale is None:
                return self._draw_tokens(logits, plan.temperatures, plan.seeds, plan.positions, step)
            scaled = logits / plan.scale  # float32 ([S, 1] float32 scale)
            if plan.top_k is not None or plan.top_p is not None:
                mask_top_k_top_p(scaled, plan.top_k, plan.top_p)
            if plan.min_p is not None:
                mask_min_p(scaled, plan.min_p)
            return self._draw_tokens(scaled, plan.unit_temperatures, plan.seeds, plan.positions, step)
        if not plan.any_random:
            return logits.argmax(dim=-1)
        rows = logits if plan.random_rows is None else logits[plan.random_rows]
        scaled = rows / plan.temperatures  # float32 ([R, 1] float32 temperatures)
        if plan.top_k is not None or plan.top_p is not None:
            mask_top_k_top_p(scaled, plan.top_k, plan.top_p)
        if plan.min_p is not None:
            mask_min_p(scaled, plan.min_p)
        probs = torch.softmax(scaled, dim=-1)
        noise = torch.empty_like(probs)
        if not plan.seeded:
            noise.exponential_(generator=self._shared)
        else:
            if plan.any_unseeded:
                shared = torch.empty((plan.unseeded_rows.numel(), probs.shape[1]), dtype=probs.dtype,
                                     device=probs.device).exponential_(generator=self._shared)
                noise[plan.unseeded_rows] = shared
            for j, seed, position in plan.seeded:
                gen = torch.Generator(device=probs.device)
                gen.manual_seed(_mix_seed(seed, position + step))
                noise[j].exponential_(generator=gen)
        drawn = (probs / noise).argmax(dim=-1)
        if plan.random_rows is None:
            return drawn
        tokens = torch.empty(plan.num_rows, dtype=torch.int64, device=logits.device)
        tokens[plan.greedy_rows] = logits[plan.greedy_rows].argmax(dim=-1)
        tokens[plan.random_rows] = drawn
        return tokens


def _mix_seed(seed: int, position: int) -> int:
    """A 64-bit generator seed from ``(seed, position)``: SplitMix64's finaliser (Steele, Lea &
    Flood, *Fast splittable pseudorandom number generators*, 2014) over ``seed * 2**32 +
    position``, so that every bit depends on both (torch's CPU generator keeps only the low 32
    bits of its seed)."""
    x = (((seed & 0xFFFFFFFF) << 32) | (position & 0xFFFFFFFF)) + 0x9E3779B97F4A7C15
    x &= 0xFFFFFFFFFFFFFFFF
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return (x ^ (x >> 31)) & 0x7FFFFFFFFFFFFFFF


@dataclass
class SamplingPlan:
    """How :meth:`Sampler.draw` picks the token of each row, with per-row parameters on the
    device.

    Attributes:
        num_rows: rows of the batch.
        any_greedy, any_random: whether some rows are greedy (temperature 0) / sampled.
        greedy_rows, random_rows: ``[G]`` / ``[R]`` int64 row indices, only for mixed batches.
        temperatures: ``[R, 1]`` float32 temperatures of the sampled rows.
        top_k: ``[R, 1]`` int64 (``2**62`` = no limit), None when no row uses top-k.
        top_p, min_p: ``[R, 1]`` float32, None when no row uses them.
        seeded: ``(index among the sampled rows, seed, output position)`` of requests with a
            seed.
        unseeded_rows: ``[U]`` int64 indices among the sampled rows of the unseeded ones, only
            when seeded and unseeded rows are mixed.
        any_unseeded: whether some sampled rows draw from the shared generator.
        fused: the plan is for the fused CUDA draw; then ``temperatures`` is ``[S]`` for every
            row (0 = greedy), ``seeds`` / ``positions`` are ``[S]`` int64 Philox seeds and output
            positions, the masks' limits cover every row, and when any row is masked ``scale``
            ``[S, 1]`` (temperature, 1 for greedy rows) and ``unit_temperatures`` ``[S]`` (1 or 0)
            are set.
    """

    num_rows: int
    fused: bool = False
    any_greedy: bool = False
    any_random: bool = False
    greedy_rows: torch.Tensor | None = None
    random_rows: torch.Tensor | None = None
    temperatures: torch.Tensor | None = None
    top_k: torch.Tensor | None = None
    top_p: torch.Tensor | None = None
    min_p: torch.Tensor | None = None
    seeded: list[tuple[int, int, int]] = field(default_factory=list)
    unseeded_rows: torch.Tensor | None = None
    any_unseeded: bool = True
    seeds: torch.Tensor | None = None
    positions: torch.Tensor | None = None
    scale: torch.Tensor | None = None
    unit_temperatures: torch.Tensor | None = None


def _float32_copy(logits: torch.Tensor) -> torch.Tensor:
    """A float32 copy of ``logits`` to modify (a copy even when they are float32 already)."""
    return logits.to(torch.float32, copy=True)
