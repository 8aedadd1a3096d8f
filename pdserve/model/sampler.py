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
   A request with a ``seed`` draws its noise from its own ``torch.Generator``, so its tokens
   do not depend on the other requests in the batch; the others share one generator seeded from
   the engine seed.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch

from pdserve.engine.outputs import ScheduledRequest, TokenLogprobs
from pdserve.engine.sampling_params import SamplingParams


class Sampler:
    """Samples one token per row of a logits batch.

    Args:
        device: where logits live (the per-request generators are created there).
        seed: seed of the shared generator used by requests without their own seed.
    """

    def __init__(self, device: torch.device, seed: int = 0):
        self.device = device
        self._shared = torch.Generator(device=device)
        self._shared.manual_seed(seed)
        self._generators: dict[str, torch.Generator] = {}

    def drop(self, req_ids: Iterable[str]) -> None:
        """Forget the per-request generators of finished requests."""
        for rid in req_ids:
            self._generators.pop(rid, None)

    @property
    def num_generators(self) -> int:
        """Per-request generators currently held (for tests and leak checks)."""
        return len(self._generators)

    def _generator(self, req_id: str, seed: int) -> torch.Generator:
        gen = self._generators.get(req_id)
        if gen is None:
            gen = torch.Generator(device=self.device)
            gen.manual_seed(seed)
            self._generators[req_id] = gen
        return gen

    @torch.inference_mode()
    def sample(self, logits: torch.Tensor, reqs: Sequence[ScheduledRequest]
               ) -> tuple[list[int], list[TokenLogprobs | None]]:
        """Sample one token per row.

        Args:
            logits: ``[S, vocab]`` float32, row ``i`` belongs to ``reqs[i]``; modified in place.
            reqs: the requests being sampled, in row order.

        Returns:
            ``(token_ids, logprobs)``: one token per row, and per row a :class:`TokenLogprobs`
            when the request asked for logprobs, else None.
        """
        params = [r.sampling_params for r in reqs]
        apply_penalties(logits, reqs)
        apply_min_tokens(logits, reqs)
        want_lp = [i for i, p in enumerate(params) if p.logprobs is not None]
        logprobs_rows = torch.log_softmax(logits[want_lp], dim=-1) if want_lp else None

        tokens = torch.empty(logits.shape[0], dtype=torch.int64, device=logits.device)
        greedy = [i for i, p in enumerate(params) if p.temperature == 0.0]
        random = [i for i, p in enumerate(params) if p.temperature != 0.0]
        if greedy:
            if len(greedy) == len(params):
                tokens = logits.argmax(dim=-1)
            else:
                tokens[greedy] = logits[greedy].argmax(dim=-1)
        if random:
            tokens[random] = self._sample_random(logits[random], [reqs[i] for i in random])

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

    def _sample_random(self, logits: torch.Tensor, reqs: Sequence[ScheduledRequest]
                       ) -> torch.Tensor:
        """Temperature, top-k/top-p/min-p, then a draw per row: ``[R, V]`` -> ``[R]``."""
        params = [r.sampling_params for r in reqs]
        temps = torch.tensor([p.temperature for p in params], dtype=logits.dtype,
                             device=logits.device)
        logits = logits / temps[:, None]
        apply_top_k_top_p(logits, params)
        apply_min_p(logits, params)
        probs = torch.softmax(logits, dim=-1)
        noise = torch.empty_like(probs)
        unseeded = [i for i, p in enumerate(params) if p.seed is None]
        if len(unseeded) == len(params):
            noise.exponential_(generator=self._shared)
        else:
            if unseeded:
                shared = torch.empty((len(unseeded), probs.shape[1]), dtype=probs.dtype,
                                     device=probs.device).exponential_(generator=self._shared)
                noise[unseeded] = shared
            for i, (r, p) in enumerate(zip(reqs, params)):
                if p.seed is not None:
                    noise[i].exponential_(generator=self._generator(r.req_id, p.seed))
        return (probs / noise).argmax(dim=-1)


def apply_penalties(logits: torch.Tensor, reqs: Sequence[ScheduledRequest]) -> None:
    """Repetition, presence and frequency penalties, in place on ``logits`` ``[S, V]``.

    Only rows whose request uses a penalty are touched.
    """
    rows = [i for i, r in enumerate(reqs)
            if r.sampling_params.repetition_penalty != 1.0
            or r.sampling_params.presence_penalty != 0.0
            or r.sampling_params.frequency_penalty != 0.0]
    if not rows:
        return
    vocab = logits.shape[1]
    dev = logits.device
    sub = logits[rows]
    counts = torch.zeros_like(sub)
    seen = torch.zeros(sub.shape, dtype=torch.bool, device=dev)
    for j, i in enumerate(rows):
        r = reqs[i]
        if r.output_token_ids:
            out = torch.tensor(r.output_token_ids, dtype=torch.int64, device=dev).clamp_(0, vocab - 1)
            counts[j].scatter_add_(0, out, torch.ones_like(out, dtype=sub.dtype))
        if r.sampling_params.repetition_penalty != 1.0 and r.prompt_token_ids:
            prompt = torch.tensor(r.prompt_token_ids, dtype=torch.int64, device=dev).clamp_(0, vocab - 1)
            seen[j, prompt] = True
    seen |= counts > 0
    params = [reqs[i].sampling_params for i in rows]
    rep = torch.tensor([p.repetition_penalty for p in params], dtype=sub.dtype, device=dev)[:, None]
    pres = torch.tensor([p.presence_penalty for p in params], dtype=sub.dtype, device=dev)[:, None]
    freq = torch.tensor([p.frequency_penalty for p in params], dtype=sub.dtype, device=dev)[:, None]
    penalised = torch.where(sub > 0, sub / rep, sub * rep)
    sub = torch.where(seen, penalised, sub)
    sub = sub - freq * counts - pres * (counts > 0).to(sub.dtype)
    logits[rows] = sub


def apply_min_tokens(logits: torch.Tensor, reqs: Sequence[ScheduledRequest]) -> None:
    """Set EOS and ``stop_token_ids`` to ``-inf`` for requests below ``min_tokens``, in place."""
    rows: list[int] = []
    cols: list[int] = []
    vocab = logits.shape[1]
    for i, r in enumerate(reqs):
        p = r.sampling_params
        if p.min_tokens and len(r.output_token_ids) < p.min_tokens:
            ids = list(p.stop_token_ids)
            if r.eos_token_id is not None:
                ids.append(r.eos_token_id)
            for t in ids:
                if 0 <= t < vocab:
                    rows.append(i)
                    cols.append(t)
    if rows:
        logits[rows, cols] = float("-inf")


def apply_top_k_top_p(logits: torch.Tensor, params: Sequence[SamplingParams]) -> None:
    """Mask (``-inf``) tokens outside each row's top-k and top-p sets, in place on ``[R, V]``.

    The most likely token always survives. Rows with ``top_k <= 0`` and ``top_p == 1`` are
    left alone.
    """
    vocab = logits.shape[1]
    ks = [p.top_k if 0 < p.top_k < vocab else vocab for p in params]
    ps = [p.top_p for p in params]
    if all(k == vocab for k in ks) and all(p >= 1.0 for p in ps):
        return
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    ranks = torch.arange(vocab, device=logits.device)[None, :]
    k_t = torch.tensor(ks, device=logits.device)[:, None]
    remove = ranks >= k_t
    if any(p < 1.0 for p in ps):
        p_t = torch.tensor(ps, dtype=logits.dtype, device=logits.device)[:, None]
        probs = torch.softmax(sorted_logits.masked_fill(remove, float("-inf")), dim=-1)
        # mass strictly before this token; drop tokens once the kept mass reaches top_p
        before = probs.cumsum(dim=-1) - probs
        remove |= before >= p_t
    remove[:, 0] = False
    logits.scatter_(1, order, sorted_logits.masked_fill(remove, float("-inf")))


def apply_min_p(logits: torch.Tensor, params: Sequence[SamplingParams]) -> None:
    """Mask tokens with probability below ``min_p * max_prob``, in place on ``[R, V]``."""
    if all(p.min_p <= 0.0 for p in params):
        return
    min_p = torch.tensor([p.min_p for p in params], dtype=logits.dtype, device=logits.device)
    probs = torch.softmax(logits, dim=-1)
    threshold = probs.max(dim=-1, keepdim=True).values * min_p[:, None]
    logits.masked_fill_(probs < threshold, float("-inf"))
