"""Transfer planning across tensor-parallel ranks: which owner ranks a reader rank reads, which
byte regions, and whom it notifies (pure functions, no torch, no I/O).

KV head ownership (the instance's TP contract): with ``H`` KV heads and ``T`` ranks, if
``H >= T`` (``H % T == 0``) rank ``r`` holds heads ``[r*H/T, (r+1)*H/T)``; if ``H < T``
(``T % H == 0``) rank ``r`` holds the one head ``r*H // T`` (replicated ``T/H`` times). Each
rank's KV cache is ``[num_blocks, L, 2, heads_of_rank, block_size, head_dim]``; every rank of an
instance has the same block ids for a request.

The *owner* (source) of a transfer has ``src_tp`` ranks, the *reader* (destination) ``dst_tp``:
a decoder reading a prefiller's prompt, or a prefiller pulling a decoder's previous turn.

* :func:`plan_reads`: for each global head a reader rank holds, the owner rank it reads it from
  (one replica when the owner replicates: replica ``dst_rank % replicas``, so that with equal TP
  rank ``r`` reads rank ``r``), grouped into :class:`HeadRead` runs of consecutive heads.
* :func:`read_regions`: the byte regions of one :class:`HeadRead` for a request's blocks,
  ``(dst_offset, src_offset, nbytes)`` relative to the two ranks' cache bases, merged wherever
  both sides are contiguous. A read of whole blocks on both sides (equal heads per rank) merges
  into one region per run of consecutive blocks; a head slice of either side is one region per
  block, layer and K/V (docs/architecture.md, "KV transfer across TP sizes").
* :func:`notice_targets` / :func:`expected_notices`: every owner rank must learn that a request
  was read (or will not be): reader rank ``j`` notifies the owner ranks it reads, owner rank 0
  (which answers the lease claims of every reader rank, so it must outlive all of them), and the
  owner ranks nobody reads that are assigned to it (owner rank ``p`` to reader rank
  ``p % dst_tp``). A "done" notice carries how many an owner rank must receive before its lease
  ends.

The plan knows the cache kind (:class:`~pdserve.types.kv_cache_kind.KVCacheKind`). A multi-head
latent (MLA) cache is one entry per token, identical on every TP rank (replicated, never split
by head): a reader rank reads it once, whole blocks, from the one owner rank
``dst_rank % src_tp`` (so reader ranks spread over the owner ranks), and a request moves one
rank's bytes per reader rank whatever the two TP sizes (docs/architecture.md, "MLA latent
cache").
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from pdserve.types.kv_cache_kind import KVCacheKind


class TPLayoutError(ValueError):
    """KV heads that cannot be split over a TP size by the ownership rule, or two instances
    whose KV heads differ."""


@dataclass(frozen=True)
class HeadRange:
    """Global KV heads ``[start, start + count)`` held by one rank."""

    start: int
    count: int


def layout_error(total_heads: int, tp_size: int) -> str | None:
    """Why ``total_heads`` KV heads cannot be split over ``tp_size`` ranks, or None when they
    can (``H % T == 0`` or ``T % H == 0``)."""
    if total_heads <= 0 or tp_size <= 0:
        return f"{total_heads} KV heads over {tp_size} ranks is not a valid layout"
    if total_heads % tp_size and tp_size % total_heads:
        return (f"{total_heads} KV heads cannot be split over {tp_size} ranks (neither number "
                f"divides the other)")
    return None


def rank_heads(total_heads: int, tp_size: int, rank: int) -> HeadRange:
    """The global KV heads rank ``rank`` of ``tp_size`` holds.

    Raises:
        TPLayoutError: the heads cannot be split over ``tp_size`` ranks, or ``rank`` is out of
            range.
    """
    err = layout_error(total_heads, tp_size)
    if err is not None:
        raise TPLayoutError(err)
    if not 0 <= rank < tp_size:
        raise TPLayoutError(f"rank {rank} is outside a TP group of {tp_size}")
    if total_heads >= tp_size:
        per = total_heads // tp_size
        return HeadRange(rank * per, per)
    return HeadRange(rank * total_heads // tp_size, 1)


def heads_per_rank(total_heads: int, tp_size: int) -> int:
    """KV heads in each rank's cache (``H/T``, or 1 when heads are replicated)."""
    return rank_heads(total_heads, tp_size, 0).count


def _owner_of(head: int, total_heads: int, src_tp: int, dst_rank: int) -> int:
    """The owner rank a reader rank reads global head ``head`` from."""
    if total_heads >= src_tp:
        return head // (total_heads // src_tp)
    replicas = src_tp // total_heads
    return head * replicas + dst_rank % replicas


@dataclass(frozen=True)
class HeadRead:
    """One reader rank's read from one owner rank: ``count`` heads starting at the owner's local
    head ``src_head`` into the reader's local head ``dst_head``."""

    src_rank: int
    src_head: int
    dst_head: int
    count: int


def latent_error(total_heads: int) -> str | None:
    """Why a multi-head latent cache of ``total_heads`` cache heads cannot be planned (it holds
    one entry per token, declared as one KV head on every rank), or None when it can."""
    if total_heads != 1:
        return (f"a multi-head latent (MLA) cache holds one latent entry per token (1 cache "
                f"head on every TP rank), not {total_heads}")
    return None


def plan_reads(total_heads: int, src_tp: int, dst_tp: int, dst_rank: int,
               kind: KVCacheKind = KVCacheKind.PER_HEAD) -> list[HeadRead]:
    """What reader rank ``dst_rank`` of ``dst_tp`` reads from an owner with ``src_tp`` ranks.

    Args:
        kind: the caches' content; a latent (:attr:`KVCacheKind.MLA_LATENT`) is read once, whole,
            from owner rank ``dst_rank % src_tp``.

    Returns:
        The reads, by reader head; every head of the reader rank is read exactly once.

    Raises:
        TPLayoutError: either side cannot hold ``total_heads`` by the ownership rule, a latent
            cache of other than one head, or a TP size or rank out of range.
    """
    if kind is KVCacheKind.MLA_LATENT:
        err = latent_error(total_heads) or layout_error(1, src_tp) or layout_error(1, dst_tp)
        if err is None and not 0 <= dst_rank < dst_tp:
            err = f"rank {dst_rank} is outside a TP group of {dst_tp}"
        if err is not None:
            raise TPLayoutError(err)
        return [HeadRead(dst_rank % src_tp, 0, 0, 1)]
    mine = rank_heads(total_heads, dst_tp, dst_rank)
    reads: list[HeadRead] = []
    for i in range(mine.count):
        head = mine.start + i
        src = _owner_of(head, total_heads, src_tp, dst_rank)
        src_local = head - rank_heads(total_heads, src_tp, src).start
        last = reads[-1] if reads else None
        if last is not None and last.src_rank == src and \
                last.src_head + last.count == src_local and last.dst_head + last.count == i:
            reads[-1] = HeadRead(src, last.src_head, last.dst_head, last.count + 1)
        else:
            reads.append(HeadRead(src, src_local, i, 1))
    return reads


def is_whole(read: HeadRead, src_heads: int, dst_heads: int) -> bool:
    """True when a read moves whole blocks on both sides (all heads of both ranks)."""
    return read.count == src_heads == dst_heads


def notice_targets(total_heads: int, src_tp: int, dst_tp: int, dst_rank: int,
                   kind: KVCacheKind = KVCacheKind.PER_HEAD) -> tuple[int, ...]:
    """The owner ranks reader rank ``dst_rank`` tells about a request (done, abort, heartbeat):
    the ranks it reads, owner rank 0, and the owner ranks no reader rank reads that fall to it
    (owner rank ``p`` to reader rank ``p % dst_tp``). Sorted."""
    targets = {r.src_rank for r in plan_reads(total_heads, src_tp, dst_tp, dst_rank, kind)}
    targets.add(0)
    read_by_any = {r.src_rank for j in range(dst_tp)
                   for r in plan_reads(total_heads, src_tp, dst_tp, j, kind)}
    targets.update(p for p in range(src_tp) if p not in read_by_any and p % dst_tp == dst_rank)
    return tuple(sorted(targets))


def expected_notices(total_heads: int, src_tp: int, dst_tp: int, src_rank: int,
                     kind: KVCacheKind = KVCacheKind.PER_HEAD) -> int:
    """How many reader ranks notify owner rank ``src_rank`` about each request (its lease ends
    after that many "done" notices, or at the first "abort")."""
    return sum(src_rank in notice_targets(total_heads, src_tp, dst_tp, j, kind)
               for j in range(dst_tp))


@dataclass(frozen=True)
class RankCache:
    """The byte geometry of one rank's KV cache ``[num_blocks, L, 2, heads, block_size,
    head_dim]``.

    Attributes:
        num_layers: layers ``L``.
        heads: KV heads in this rank's cache.
        head_bytes: bytes of one head in one block, layer and K/V (``block_size * head_dim *
            element_size``).
    """

    num_layers: int
    heads: int
    head_bytes: int

    @property
    def block_bytes(self) -> int:
        """Bytes of one block (all layers, K and V, this rank's heads)."""
        return self.num_layers * 2 * self.heads * self.head_bytes


def read_regions(read: HeadRead, src: RankCache, dst: RankCache, dst_blocks: list[int],
                 src_blocks: list[int]) -> np.ndarray:
    """The byte regions of one :class:`HeadRead` for a request's blocks, merged.

    Args:
        read: what to read.
        src, dst: the owner rank's and the reader rank's cache geometry (same ``num_layers`` and
            ``head_bytes``).
        dst_blocks: the reader's destination block ids, in token order.
        src_blocks: the owner's source block ids (same length).

    Returns:
        ``int64 [n, 3]``: ``(dst_offset, src_offset, nbytes)`` per region, in bytes from each
        cache's base, in block order. Consecutive regions that are contiguous on both sides are
        one region.

    Raises:
        ValueError: the block lists differ in length, or the geometries differ in layers or head
            size.
    """
    if len(dst_blocks) != len(src_blocks):
        raise ValueError("destination and source block lists differ in length")
    if src.num_layers != dst.num_layers or src.head_bytes != dst.head_bytes:
        raise ValueError("owner and reader caches differ in layers or head size")
    if not dst_blocks:
        return np.zeros((0, 3), dtype=np.int64)
    planes = 2 * src.num_layers  # (layer, K/V) planes per block
    plane = np.arange(planes, dtype=np.int64)
    d = np.asarray(dst_blocks, dtype=np.int64)[:, None] * planes + plane
    s = np.asarray(src_blocks, dtype=np.int64)[:, None] * planes + plane
    dst_off = ((d * dst.heads + read.dst_head) * dst.head_bytes).reshape(-1)
    src_off = ((s * src.heads + read.src_head) * src.head_bytes).reshape(-1)
    size = read.count * src.head_bytes
    # a region starts a new descriptor unless it continues the previous one on both sides
    starts = np.ones(dst_off.shape[0], dtype=bool)
    starts[1:] = (dst_off[1:] != dst_off[:-1] + size) | (src_off[1:] != src_off[:-1] + size)
    first = np.flatnonzero(starts)
    lengths = np.diff(np.append(first, dst_off.shape[0])) * size
    return np.stack([dst_off[first], src_off[first], lengths], axis=1)


def pairing_error(total_heads_src: int, src_tp: int, total_heads_dst: int,
                  dst_tp: int, kind: KVCacheKind = KVCacheKind.PER_HEAD) -> str | None:
    """Why an owner (``src_tp`` ranks, ``total_heads_src`` KV heads) and a reader cannot move
    KV between them, or None when they can: the KV heads must be the same model's and split by
    the ownership rule on both sides (a latent cache: one head, any TP sizes). The TP sizes may
    differ."""
    if total_heads_src != total_heads_dst:
        return "the models have different numbers of KV heads"
    if kind is KVCacheKind.MLA_LATENT and latent_error(total_heads_src) is not None:
        return latent_error(total_heads_src)
    return layout_error(total_heads_src, src_tp) or layout_error(total_heads_dst, dst_tp)


def descriptors_per_request(total_heads: int, src_tp: int, dst_tp: int, num_layers: int,
                            num_blocks: int, contiguous: bool = True,
                            kind: KVCacheKind = KVCacheKind.PER_HEAD,
                            dst_rank: int | None = None) -> int:
    """NIXL descriptors one request of ``num_blocks`` blocks needs over all reader ranks (or
    over reader rank ``dst_rank`` alone).

    Args:
        contiguous: the request's blocks are one run of consecutive ids on both sides (else
            every block is its own run).
        kind: the caches' content (a latent is read whole from one owner rank: as many
            descriptors per reader rank as runs of blocks).
    """
    src = RankCache(num_layers, heads_per_rank(total_heads, src_tp), 1)
    dst = RankCache(num_layers, heads_per_rank(total_heads, dst_tp), 1)
    ids = list(range(num_blocks)) if contiguous else list(range(0, 2 * num_blocks, 2))
    ranks = range(dst_tp) if dst_rank is None else [dst_rank]
    return sum(len(read_regions(r, src, dst, ids, ids))
               for j in ranks for r in plan_reads(total_heads, src_tp, dst_tp, j, kind))


@dataclass(frozen=True)
class Route:
    """Everything one reader rank needs to read from one owner instance (fixed per pairing).

    Attributes:
        src_tp, dst_tp: the owner's and the reader's TP sizes.
        reads: :func:`plan_reads` of this reader rank.
        targets: :func:`notice_targets` of this reader rank.
        expected: owner rank -> :func:`expected_notices`, for every target.
        src, dst: the owner ranks' and this rank's cache geometry.
    """

    src_tp: int
    dst_tp: int
    reads: tuple[HeadRead, ...]
    targets: tuple[int, ...]
    expected: dict[int, int]
    src: RankCache
    dst: RankCache

    def whole(self, read: HeadRead) -> bool:
        """True when ``read`` moves whole blocks on both sides (see :func:`is_whole`)."""
        return is_whole(read, self.src.heads, self.dst.heads)

    def regions(self, read: HeadRead, dst_blocks: list[int], src_blocks: list[int]) -> np.ndarray:
        """:func:`read_regions` of one of this route's reads."""
        return read_regions(read, self.src, self.dst, dst_blocks, src_blocks)


def plan_route(total_heads: int, src_tp: int, dst_tp: int, dst_rank: int, num_layers: int,
               head_bytes: int, kind: KVCacheKind = KVCacheKind.PER_HEAD) -> Route:
    """The :class:`Route` of reader rank ``dst_rank``.

    Args:
        head_bytes: bytes of one head in one block, layer and K/V (``block_size * head_dim *
            element_size``), the same on both sides.
        kind: the caches' content (see :func:`plan_reads`).

    Raises:
        TPLayoutError: either side cannot hold ``total_heads`` by the ownership rule (or a
            latent cache of other than one head).
    """
    targets = notice_targets(total_heads, src_tp, dst_tp, dst_rank, kind)
    return Route(
        src_tp, dst_tp, tuple(plan_reads(total_heads, src_tp, dst_tp, dst_rank, kind)), targets,
        {p: expected_notices(total_heads, src_tp, dst_tp, p, kind) for p in targets},
        RankCache(num_layers, heads_per_rank(total_heads, src_tp), head_bytes),
        RankCache(num_layers, heads_per_rank(total_heads, dst_tp), head_bytes),
    )
