"""The prefix cache's two eviction orders (``--prefix-cache-eviction lru`` and ``depth-first``)
on two request streams, through the real block manager (no model: prompts of token ids whose
blocks are registered as computed at once).

* **loop**: ``--conversations`` multi-turn conversations revisited in turn (the order of
  ``pd_multi_turn.py --kv-tiers``: every conversation open, turns round-robin), each turn its
  history plus ``--new-blocks`` blocks, with a cache of ``final working set / pressure`` blocks
  for each ``--pressure``. Printed per policy: the blocks of history each later turn misses
  (mean, p90), which a host tier would load or the engine recompute.
* **skewed**: one shared system prompt of ``--system-blocks`` blocks, then requests that either
  open a new conversation (probability ``--new-share``) or continue an earlier one chosen with
  weights ``1 / rank ** 1.1`` by recency of creation, each adding 5-30 blocks; for each
  ``--cache-blocks``. Printed per policy: the share of history blocks found in the cache.

The block manager works in blocks here (``block_size`` 1), so one token id is one block.

Example::

    python benchmarks/prefix_eviction.py
"""

from __future__ import annotations

import argparse
import random
import statistics

from pdserve.engine.block_manager import KVCacheManager
from pdserve.types.engine_config import EvictionPolicy
from pdserve.types.request import Request
from pdserve.types.sampling_params import SamplingParams


def _turn(kvm: KVCacheManager, request_id: str, blocks: list[int]) -> int:
    """One request of these block-sized tokens (plus one token to compute): its prefix hit in
    blocks; its blocks are registered and freed."""
    r = Request(request_id=request_id, prompt_token_ids=blocks + [-1],
                sampling_params=SamplingParams())
    hit, num_hit = kvm.get_computed_blocks(r)
    if kvm.allocate_slots(r, r.num_tokens - num_hit, hit) is None:
        raise SystemExit(f"the cache of {kvm.num_blocks} blocks cannot hold one request of "
                         f"{r.num_tokens}")
    r.num_computed_tokens = r.num_tokens
    kvm.cache_blocks(r, r.num_tokens)
    kvm.free(r)
    return num_hit


def loop(policy: EvictionPolicy, pressure: float, conversations: int, turns: int,
         first_blocks: int, new_blocks: int) -> tuple[float, int]:
    """Mean and p90 of the history blocks that later turns miss (blocks)."""
    final = first_blocks + (turns - 1) * new_blocks
    kvm = KVCacheManager(max(final + 1, int(conversations * final / pressure)), 1,
                         eviction=policy)
    missed = []
    for t in range(turns):
        for c in range(conversations):
            n = first_blocks + t * new_blocks
            hit = _turn(kvm, f"{c}-{t}", [c * 1_000_000 + i for i in range(n)])
            if t:
                missed.append(n - new_blocks - hit)
    missed.sort()
    return statistics.mean(missed), missed[int(0.9 * len(missed))]


def skewed(policy: EvictionPolicy, cache_blocks: int, requests: int, system_blocks: int,
           new_share: float, seed: int) -> float:
    """Share of the history blocks (system prompt included) found in the prefix cache."""
    rng = random.Random(seed)
    kvm = KVCacheManager(cache_blocks, 1, eviction=policy)
    system = list(range(-system_blocks - 1, -1))
    lengths: list[int] = []
    found = wanted = 0
    for i in range(requests):
        if not lengths or rng.random() < new_share:
            lengths.append(0)
            c = len(lengths) - 1
        else:
            ranks = range(len(lengths))
            c = rng.choices(ranks[::-1], weights=[1 / (r + 1) ** 1.1 for r in ranks])[0]
        history = lengths[c]
        lengths[c] += rng.randint(5, 30)
        found += _turn(kvm, str(i), system + [c * 1_000_000 + j for j in range(lengths[c])])
        wanted += system_blocks + history
    return found / wanted


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--conversations", type=int, default=32)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--first-blocks", type=int, default=128,
                    help="blocks of a first turn (default 128: 2,048 tokens of 16)")
    ap.add_argument("--new-blocks", type=int, default=20,
                    help="blocks a later turn adds (default 20: 256 + 64 tokens)")
    ap.add_argument("--pressure", type=float, nargs="+", default=[1.25, 1.5, 1.75, 2.0, 3.0],
                    help="final working set / cache (loop)")
    ap.add_argument("--cache-blocks", type=int, nargs="+", default=[500, 1000, 2000, 4000],
                    help="cache sizes (skewed)")
    ap.add_argument("--requests", type=int, default=4000, help="requests (skewed)")
    ap.add_argument("--system-blocks", type=int, default=8)
    ap.add_argument("--new-share", type=float, default=0.3)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    policies = list(EvictionPolicy)
    print(f"loop: {args.conversations} conversations x {args.turns} turns, {args.first_blocks} "
          f"+ {args.new_blocks} blocks a turn; history blocks a later turn misses, mean / p90")
    print(f"{'pressure':>9} " + " ".join(f"{p.value:>14}" for p in policies))
    for pressure in args.pressure:
        cells = [loop(p, pressure, args.conversations, args.turns, args.first_blocks,
                      args.new_blocks) for p in policies]
        print(f"{pressure:>9g} " + " ".join(f"{m:>8.1f} / {p90:>3}" for m, p90 in cells))
    print(f"skewed: {args.requests} requests, {args.new_share:g} of them new conversations, "
          f"{args.system_blocks} shared blocks; history blocks found in the cache")
    print(f"{'blocks':>9} " + " ".join(f"{p.value:>14}" for p in policies))
    for blocks in args.cache_blocks:
        cells = [skewed(p, blocks, args.requests, args.system_blocks, args.new_share, args.seed)
                 for p in policies]
        print(f"{blocks:>9} " + " ".join(f"{c:>14.3f}" for c in cells))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
