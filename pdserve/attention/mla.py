"""Multi-head latent attention (MLA, DeepSeek-V2/V3) over a paged latent cache, with torch ops:
the latent write, prefill by up-projecting the cached latent to per-head keys and values or in
the weight-absorbed form (whichever costs less), and decode in the absorbed form.

A token's cache entry is its compressed latent ``c`` (``kv_lora_rank`` values, after the
``kv_a_layernorm``) followed by the rotated rotary key ``k_pe`` (``qk_rope_head_dim`` values),
the same for every query head. It lives in the shared cache tensor
``[num_blocks, num_layers, 2, 1, block_size, W / 2]`` (``W = kv_lora_rank + qk_rope_head_dim``):
one "KV head", the first half of the entry in the K slot and the second half in the V slot, so
no byte is wasted and every block keeps the per-head layout the runner, the prefix cache and
the KV transfer already handle (docs/architecture.md, "KV cache layout", MLA).

With the up-projection ``kv_b_proj`` seen per head as ``W_UK`` ``[H, qk_nope, r]`` (keys) and
``W_UV`` ``[H, v_head, r]`` (values):

- up-projected (expanded) form: ``k = [c W_UK^T | k_pe]``, ``v = c W_UV^T`` per head, then
  causal SDPA over the context (the step's tokens included);
- absorbed form: ``q_lat = q_nope W_UK`` (``[H, r]``), scores ``[q_lat | q_pe] . [c | k_pe]``,
  output ``softmax(..) c`` then ``W_UV``: one shared key per token, no per-head expansion of the
  context (the arithmetic of Hugging Face's expanded form, reassociated).

Decode always runs absorbed; a prefill chunk runs the form with fewer multiply-adds for its query
and context lengths (:func:`prefill_uses_absorbed`): expanding costs ``C * H * r * (nope + v)``
once per chunk, absorbing costs ``2r - nope - v`` more per query and key pair, so short chunks
over long contexts (chunked prefill, prefix-cache hits, turns of a chat) run absorbed.

With an fp8 cache the K slot is stored with the layer's key scale and the V slot with its value
scale (:mod:`pdserve.attention.kv_quant`), and attention reads the values as stored.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pdserve.attention.base import AttentionBackend
from pdserve.attention.kv_quant import FP8_KV_DTYPE, dequantize, quantize
from pdserve.attention.metadata import AttentionMetadata
from pdserve.types.kv_cache_kind import KVCacheKind


@dataclass(frozen=True)
class MLAGeometry:
    """The shapes of one rank's MLA layers.

    Attributes:
        num_heads: this rank's query heads ``H``.
        kv_lora_rank: latent width ``r``.
        qk_nope_head_dim: per-head key/query dims without rotary.
        qk_rope_head_dim: the rotary dims (shared key ``k_pe``).
        v_head_dim: per-head value dims.
    """

    num_heads: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int

    @property
    def entry_width(self) -> int:
        """``W = kv_lora_rank + qk_rope_head_dim``: one token's cache entry."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def slot_width(self) -> int:
        """``W / 2``: the cache's ``head_dim`` (each of the K and V slots holds half an entry).

        Raises:
            ValueError: ``W`` is odd.
        """
        if self.entry_width % 2:
            raise ValueError(f"kv_lora_rank + qk_rope_head_dim = {self.entry_width} must be even "
                             "to split over the cache's K and V slots")
        return self.entry_width // 2


def prefill_uses_absorbed(query_len: int, context_len: int, g: MLAGeometry) -> bool:
    """Whether a prefill chunk of ``query_len`` tokens over ``context_len`` keys costs fewer
    multiply-adds per head in the absorbed form than up-projected (module docstring).

    Up-projected: ``C * r * (nope + v)`` (expanding the context) ``+ L * C * (nope + rope + v)``;
    absorbed: ``L * r * (nope + v)`` (absorbing queries and outputs) ``+ L * C * (2r + rope)``.
    """
    r, nope, rope, v = g.kv_lora_rank, g.qk_nope_head_dim, g.qk_rope_head_dim, g.v_head_dim
    expanded = context_len * r * (nope + v) + query_len * context_len * (nope + rope + v)
    absorbed = query_len * r * (nope + v) + query_len * context_len * (2 * r + rope)
    return absorbed < expanded


def write_latent(kv_cache: torch.Tensor, layer: int, entry: torch.Tensor,
                 meta: AttentionMetadata, k_scale: float = 1.0, v_scale: float = 1.0) -> None:
    """Store this step's latent entries of one layer in their slots.

    Args:
        kv_cache: ``[num_blocks, num_layers, 2, 1, block_size, W / 2]``, the entries' dtype or fp8.
        layer: layer index.
        entry: ``[T, W]``: ``[c | k_pe]`` of each token (``k_pe`` rotated).
        meta: gives ``slot_block`` and ``slot_offset`` of each token.
        k_scale, v_scale: the layer's fp8 scales of the first and second half.
    """
    half = kv_cache.shape[-1]
    first, second = entry[:, :half], entry[:, half:]
    if kv_cache.dtype == FP8_KV_DTYPE:
        first, second = quantize(first, k_scale), quantize(second, v_scale)
    kv_cache[meta.slot_block, layer, 0, 0, meta.slot_offset] = first
    kv_cache[meta.slot_block, layer, 1, 0, meta.slot_offset] = second


def _entries(blocks: torch.Tensor, dtype: torch.dtype, k_scale: float, v_scale: float
             ) -> torch.Tensor:
    """Gathered cache blocks ``[..., 2, 1, bs, W/2]`` -> entries ``[..., bs, W]`` in ``dtype``."""
    k, v = blocks[..., 0, 0, :, :], blocks[..., 1, 0, :, :]
    if blocks.dtype == FP8_KV_DTYPE:
        k, v = dequantize(k, k_scale, dtype), dequantize(v, v_scale, dtype)
    return torch.cat((k.to(dtype), v.to(dtype)), dim=-1)


def decode_absorbed(q: torch.Tensor, blocks_of_layer: torch.Tensor, block_tables: torch.Tensor,
                    seq_lens: torch.Tensor, scale: float, kv_lora_rank: int,
                    k_scale: float = 1.0, v_scale: float = 1.0) -> torch.Tensor:
    """Absorbed-form decode attention with torch ops: the reference of
    :func:`pdserve.kernels.mla_decode.mla_decode_attention` (same arguments, the layer's blocks
    given instead of the cache and a layer index).

    The ``H`` heads of a request play SDPA's query positions over its one shared key sequence
    ``[c | k_pe]`` (values: ``c``). The mask is built on the device from ``seq_lens``, so the
    call makes no host synchronisation; a row of length 0 (CUDA graph padding) attends to its
    first slot instead of nothing (finite garbage, never read).

    Args:
        q: ``[B, H, W]`` absorbed queries ``[q_nope W_UK | q_pe]``.
        blocks_of_layer: ``[num_blocks, 2, 1, block_size, W / 2]`` (``kv_cache[:, layer]``).
        block_tables: ``[B, M]`` int block ids (padded with any valid id).
        seq_lens: ``[B]`` int tokens to attend to, the new one included.
        scale: softmax scale.
        kv_lora_rank: ``r``.
        k_scale, v_scale: fp8 scales of the K and V slots (ignored for a full-precision cache).

    Returns:
        ``[B, H, r]`` in ``q``'s dtype.
    """
    b, m = block_tables.shape
    block_size = blocks_of_layer.shape[3]
    blocks = blocks_of_layer.index_select(0, block_tables.flatten().long())  # [B*M, 2, 1, bs, .]
    keys = _entries(blocks, q.dtype, k_scale, v_scale).reshape(b, m * block_size, -1)
    key_pos = torch.arange(m * block_size, device=q.device)
    mask = (key_pos[None, :] < seq_lens.clamp(min=1)[:, None])[:, None, None, :]  # [B, 1, 1, S]
    o_lat = F.scaled_dot_product_attention(q.unsqueeze(1), keys.unsqueeze(1),
                                           keys[..., :kv_lora_rank].unsqueeze(1),
                                           attn_mask=mask, scale=scale)
    return o_lat.squeeze(1)


class MLAAttentionBackend(AttentionBackend):
    """Paged multi-head latent attention with torch ops (CPU and CUDA), for the DeepSeek family.

    To the runner it is an :class:`~pdserve.attention.base.AttentionBackend` of one KV head of
    ``head_dim = W / 2`` (metadata, fp8 scales; no CUDA graphs, no Triton ops); layers attend
    through :meth:`forward_mla`, which needs the layer's up-projection.

    Args:
        geometry: the rank's MLA shapes.
        block_size: tokens per cache block.
        scale: softmax scale (``qk_head_dim ** -0.5``, times YaRN's ``mscale`` squared).

    Raises:
        ValueError: an odd latent entry width (:attr:`MLAGeometry.slot_width`).
    """

    kv_cache_kind = KVCacheKind.MLA_LATENT

    def __init__(self, geometry: MLAGeometry, block_size: int, scale: float):
        super().__init__(geometry.num_heads, 1, geometry.slot_width, block_size, scale)
        self.geometry = geometry

    def forward(self, layer: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                kv_cache: torch.Tensor, meta: AttentionMetadata,
                sliding_window: int | None = None, out: torch.Tensor | None = None,
                rotation: object = None) -> torch.Tensor:
        """Per-head attention is not MLA's: layers call :meth:`forward_mla`.

        Raises:
            NotImplementedError: always.
        """
        raise NotImplementedError("MLA layers attend through MLAAttentionBackend.forward_mla")

    def forward_mla(self, layer: int, q_nope: torch.Tensor, q_pe: torch.Tensor,
                    entry: torch.Tensor, kv_b_weight: torch.Tensor, kv_cache: torch.Tensor,
                    meta: AttentionMetadata, out: torch.Tensor | None = None) -> torch.Tensor:
        """Write this step's latent entries of layer ``layer``, then attend every token.

        Args:
            layer: layer index into ``kv_cache`` (dim 1).
            q_nope: ``[T, H, qk_nope_head_dim]``.
            q_pe: ``[T, H, qk_rope_head_dim]``, rotated.
            entry: ``[T, W]``: normalised latent ``c`` then rotated ``k_pe``.
            kv_b_weight: ``[H * (qk_nope_head_dim + v_head_dim), kv_lora_rank]``: this rank's
                rows of ``kv_b_proj`` (per head: the key rows, then the value rows).
            kv_cache: ``[num_blocks, num_layers, 2, 1, block_size, W / 2]``.
            meta: the step's metadata (prefill tokens first, then one token per decode).
            out: where to write the output (``[T, H, v_head_dim]``, e.g. a CUDA graph's static
                buffer); None allocates it.

        Returns:
            ``[T, H, v_head_dim]`` attention output (before ``o_proj``; ``out`` when given).
        """
        g = self.geometry
        k_scale, v_scale = self.kv_scale(layer)
        self._write(kv_cache, layer, entry, meta, k_scale, v_scale)
        w = kv_b_weight.view(g.num_heads, g.qk_nope_head_dim + g.v_head_dim, g.kv_lora_rank)
        w_uk, w_uv = w[:, :g.qk_nope_head_dim], w[:, g.qk_nope_head_dim:]
        t = q_nope.shape[0]
        if out is None:
            out = q_nope.new_empty(t, g.num_heads, g.v_head_dim)
        blocks_of_layer = kv_cache[:, layer]
        for span in meta.prefills:
            rows = slice(span.query_start, span.query_start + span.query_len)
            blocks = blocks_of_layer.index_select(0, span.block_table)  # [n, 2, 1, bs, W/2]
            ctx = _entries(blocks, q_nope.dtype, k_scale, v_scale).reshape(
                -1, g.entry_width)[:span.context_len]
            if prefill_uses_absorbed(span.query_len, span.context_len, g):
                out[rows] = self._prefill_absorbed(q_nope[rows], q_pe[rows], ctx, w_uk, w_uv,
                                                   span.mask)
            else:
                out[rows] = self._prefill(q_nope[rows], q_pe[rows], ctx, w, span.mask)
        if meta.num_decodes:
            p = meta.num_prefill_tokens
            q_lat = torch.einsum("bhd,hdr->bhr", q_nope[p:], w_uk)
            q = torch.cat((q_lat, q_pe[p:]), dim=-1)  # [B, H, W]
            o_lat = self._decode_latent(q, kv_cache, layer, meta, k_scale, v_scale)
            out[p:] = torch.einsum("bhr,hvr->bhv", o_lat, w_uv)
        return out

    def _write(self, kv_cache: torch.Tensor, layer: int, entry: torch.Tensor,
               meta: AttentionMetadata, k_scale: float, v_scale: float) -> None:
        """Store the step's latent entries ``[T, W]`` of ``layer`` (:func:`write_latent`)."""
        write_latent(kv_cache, layer, entry, meta, k_scale, v_scale)

    def _decode_latent(self, q: torch.Tensor, kv_cache: torch.Tensor, layer: int,
                       meta: AttentionMetadata, k_scale: float, v_scale: float) -> torch.Tensor:
        """The decode rows' absorbed queries ``[B, H, W]`` -> attention-weighted latents
        ``[B, H, r]`` (:func:`decode_absorbed`)."""
        assert meta.decode_block_tables is not None and meta.decode_seq_lens is not None
        return decode_absorbed(q, kv_cache[:, layer], meta.decode_block_tables,
                               meta.decode_seq_lens, self.scale, self.geometry.kv_lora_rank,
                               k_scale, v_scale)

    def _prefill(self, q_nope: torch.Tensor, q_pe: torch.Tensor, ctx: torch.Tensor,
                 w: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        """One prefill chunk by up-projection: ``q_*`` ``[L, H, *]``, ``ctx`` ``[C, W]`` (its
        whole context, the chunk's tokens last), ``w`` ``[H, nope + v, r]``, ``mask``
        ``[L, C]`` or None (plain causal, ``C == L``) -> ``[L, H, v_head_dim]``."""
        g = self.geometry
        c, k_pe = ctx[:, :g.kv_lora_rank], ctx[:, g.kv_lora_rank:]
        kv = torch.einsum("cr,hdr->hcd", c, w)  # [H, C, nope + v]
        k_nope, v = kv[..., :g.qk_nope_head_dim], kv[..., g.qk_nope_head_dim:]
        k = torch.cat((k_nope, k_pe.unsqueeze(0).expand(g.num_heads, -1, -1)), dim=-1)
        q = torch.cat((q_nope, q_pe), dim=-1).transpose(0, 1)  # [H, L, qk_head_dim]
        o = F.scaled_dot_product_attention(q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0),
                                           attn_mask=mask, is_causal=mask is None,
                                           scale=self.scale)
        return o.squeeze(0).transpose(0, 1)

    def _prefill_absorbed(self, q_nope: torch.Tensor, q_pe: torch.Tensor, ctx: torch.Tensor,
                          w_uk: torch.Tensor, w_uv: torch.Tensor, mask: torch.Tensor | None
                          ) -> torch.Tensor:
        """One prefill chunk in the absorbed form (arguments as :meth:`_prefill`, ``w_uk``
        ``[H, nope, r]``, ``w_uv`` ``[H, v, r]``): the context's latent is attended by every
        head as it is, ``[L, H, v_head_dim]``."""
        g = self.geometry
        q_lat = torch.einsum("lhd,hdr->hlr", q_nope, w_uk)
        q = torch.cat((q_lat, q_pe.transpose(0, 1)), dim=-1)  # [H, L, W]
        k = ctx.unsqueeze(0).expand(g.num_heads, -1, -1)  # [H, C, W], no copy
        o_lat = F.scaled_dot_product_attention(q.unsqueeze(0), k.unsqueeze(0),
                                               k[..., :g.kv_lora_rank].unsqueeze(0),
                                               attn_mask=mask, is_causal=mask is None,
                                               scale=self.scale)
        return torch.einsum("hlr,hvr->lhv", o_lat.squeeze(0), w_uv)
