"""In-place logits processors of the sampler (:mod:`pdserve.runner.sampler`): repetition,
presence and frequency penalties, ``min_tokens``, and the top-k / top-p / min-p masks, each on
float32 logits ``[rows, vocab]``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from pdserve.types.outputs import ScheduledRequest
from pdserve.types.sampling_params import SamplingParams


def below_min_tokens(r: ScheduledRequest) -> bool:
    """True when ``r`` samples a token before its ``min_tokens`` are out (EOS and stop tokens
    are then masked)."""
    return bool(r.sampling_params.min_tokens) and r.output_position() < r.sampling_params.min_tokens


def any_min_tokens(reqs: Sequence[ScheduledRequest]) -> bool:
    """True when some request is still below its ``min_tokens`` (:func:`apply_min_tokens`)."""
    return any(below_min_tokens(r) for r in reqs)


def apply_penalties(logits: torch.Tensor, reqs: Sequence[ScheduledRequest]) -> None:
    """Repetition, presence and frequency penalties, in place on ``logits`` ``[S, V]``.

    Only rows whose request uses a penalty are touched.
    """
    rows = [i for i, r in enumerate(reqs) if r.sampling_params.uses_penalties]
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
        if below_min_tokens(r):
            for t in r.sampling_params.min_tokens_mask(r.eos_token_id):
                if 0 <= t < vocab:
                    rows.append(i)
                    cols.append(t)
    if rows:  # index tensors copied without waiting for the device (async scheduling)
        idx = torch.tensor([rows, cols], dtype=torch.int64).to(logits.device, non_blocking=True)
        logits[idx[0], idx[1]] = float("-inf")


def apply_top_k_top_p(logits: torch.Tensor, params: Sequence[SamplingParams]) -> None:
    """Mask (``-inf``) tokens outside each row's top-k and top-p sets, in place on ``[R, V]``.

    The most likely token always survives. Rows with ``top_k <= 0`` and ``top_p == 1`` are
    left alone.
    """
    dev = logits.device
    top_k = top_p = None
    if any(p.top_k > 0 for p in params):
        top_k = torch.tensor([p.top_k if p.top_k > 0 else 2**62 for p in params], device=dev)[:, None]
    if any(p.top_p < 1.0 for p in params):
        top_p = torch.tensor([p.top_p for p in params], dtype=logits.dtype, device=dev)[:, None]
    mask_top_k_top_p(logits, top_k, top_p)


def mask_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor | None,
                     top_p: torch.Tensor | None) -> None:
    """:func:`apply_top_k_top_p` with the limits as device tensors: ``top_k`` ``[R, 1]`` int64
    (values at or above the vocabulary size keep everything) and ``top_p`` ``[R, 1]``, either
    None when unused. In place on ``logits`` ``[R, V]``."""
    if top_k is None and top_p is None:
        return
    vocab = logits.shape[1]
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    ranks = torch.arange(vocab, device=logits.device)[None, :]
    remove = ranks >= top_k if top_k is not None else torch.zeros_like(sorted_logits, dtype=torch.bool)
    if top_p is not None:
        probs = torch.softmax(sorted_logits.masked_fill(remove, float("-inf")), dim=-1)
        # mass strictly before this token; drop tokens once the kept mass reaches top_p
        before = probs.cumsum(dim=-1) - probs
        remove |= before >= top_p
    remove[:, 0] = False
    logits.scatter_(1, order, sorted_logits.masked_fill(remove, float("-inf")))


def apply_min_p(logits: torch.Tensor, params: Sequence[SamplingParams]) -> None:
    """Mask tokens with probability below ``min_p * max_prob``, in place on ``[R, V]``."""
    if all(p.min_p <= 0.0 for p in params):
        return
    mask_min_p(logits, torch.tensor([p.min_p for p in params], dtype=logits.dtype,
                                    device=logits.device)[:, None])


def mask_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> None:
    """:func:`apply_min_p` with ``min_p`` ``[R, 1]`` on the device, in place on ``[R, V]``."""
    probs = torch.softmax(logits, dim=-1)
    threshold = probs.max(dim=-1, keepdim=True).values * min_p
    logits.masked_fill_(probs < threshold, float("-inf"))
