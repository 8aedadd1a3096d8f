"""CUDA graphs of the model's stages between attention calls, for steps with prefill tokens.

A step with prefills cannot be one CUDA graph: its attention depends on how the tokens split into
requests and on their cached contexts. What lies between two attention calls does not: the output
projection, norms, MLP and the next layer's QKV projection depend only on the number of tokens.
Eagerly, a few-hundred-token prefill of an 8B model is bound by the host's ~100 operator calls per
layer, not by its kernels (``benchmarks/profile_prefill.py``; docs/benchmarks.md, "Measurements
moved out of code comments"). Here each stage between attentions is captured once per padded token
count (vLLM's "piecewise" CUDA graphs do the same with ``torch.compile`` splitting the model at its
attention op), up to ``piecewise_cuda_graph_max_tokens`` tokens
(:class:`pdserve.types.engine_config.EngineConfig`; by default every step of the engine's token
budget); a step replays them with the attention of each layer run eagerly in between
(:meth:`pdserve.models.llama.DecoderLayer.attend`).

For ``L`` layers and a padded size ``N`` there are ``L + 1`` pieces:

- piece 0: embeddings, layer 0's :meth:`~pdserve.models.llama.DecoderLayer.attention_inputs`;
- piece ``i`` (``1 <= i < L``): layer ``i - 1``'s ``attention_output``, layer ``i``'s
  ``attention_inputs``;
- piece ``L``: the last layer's ``attention_output``.

Each piece reads the token ids from a static buffer and its predecessor's layer
state, and its QKV projection writes into a static buffer ``[N, q_size + 2 * kv_size]`` whose
views are the queries, keys and values attention reads (the q/k norms and the rotary embedding
run in attention, on them in place with Triton; where a model's own q/k norms return new tensors,
as Gemma 3's do, those are copied in). Three copies per layer into separate buffers would be a
noticeable share of a long prefill step (docs/benchmarks.md, "Measurements moved out of code
comments"). The model defines these buffers (``stage_buffers``,
:class:`~pdserve.models.stage_buffers.StageBuffers`): DeepSeek's layers project queries and a
latent into no buffer, and both are copied into buffers of their own. Attention writes its output into a static buffer that the next piece reads. The logits
of the sampled rows are computed eagerly from the last piece's state (their count varies). Rows
``n .. N - 1`` of a step of ``n`` tokens are padding: they hold earlier steps' ids and attention
outputs, go through the row-wise stages without touching the real rows, and never reach attention
or the KV cache.

All pieces of all sizes share one memory pool, and a piece's layer state lives in it: pieces are
replayed in the order they were captured (as the pool's sharing rules ask), so memory that a
later piece reuses is dead by the time it runs.

The pieces contain no attention and no host synchronisation, so every attention backend of the
model (torch or Triton, any prefill mode) keeps its behaviour. Without a GPU, ``capture=False``
runs the same pieces eagerly on the same buffers (the CPU tests check the composition).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence

import torch

from pdserve.attention.metadata import AttentionMetadata
from pdserve.models.llama import CausalLM, LayerState
from pdserve.runner.cuda_graphs import capture_agreed, padded_batch_size, warm_up

logger = logging.getLogger("pdserve.model")

def piecewise_capture_sizes(max_tokens: int) -> list[int]:
    """Token counts to capture: 16, 32, then from 64 on in steps of an eighth of the size
    (rounded down to a multiple of 64, at least 64: 64, 128, ..., 512, 576, ..., 1024, 1152,
    ...), and last ``max_tokens`` rounded up to a multiple of 16.

    A step pads to the next size: at most 15 rows up to 64 tokens, at most an eighth of the
    step above 512 (where its kernels, not the host, set its time).

    Raises:
        ValueError: ``max_tokens < 1``.
    """
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be at least 1, got {max_tokens}")
    top = -(-max_tokens // 16) * 16
    sizes, size = [], 16
    while size < top:
        sizes.append(size)
        size = 2 * size if size < 64 else size + max(64, size // 8 // 64 * 64)
    return sizes + [top]


def _capture(fn: Callable[[], None], pool) -> torch.cuda.CUDAGraph:
    """One CUDA graph of ``fn`` on the current (side) stream, in ``pool``.

    ``capture_begin``/``capture_end`` rather than the ``torch.cuda.graph`` context, which runs
    a garbage collection and empties the allocator's cache before every capture (hundreds of
    pieces here). ``fn``'s layer state moves on through its ``carry`` dict, so a piece's input
    state stays alive (its memory not reused in the pool) until the next piece is captured.
    """
    graph = torch.cuda.CUDAGraph()
    graph.capture_begin(pool=pool)
    try:
        fn()
    except BaseException:
        try:
            graph.capture_end()
        except RuntimeError:  # the failed launch may have invalidated the capture
            pass
        raise
    graph.capture_end()
    return graph


class PiecewiseGraphs:
    """The stages between attentions of one model, captured per padded token count.

    Args:
        model: the model (its stages: :meth:`CausalLM.embed`, the layers'
            ``attention_inputs`` / ``attend`` / ``attention_output``,
            :meth:`CausalLM.compute_logits`).
        sizes: token counts to capture (:func:`piecewise_capture_sizes`).
        capture: capture CUDA graphs (CUDA only); False runs the pieces eagerly.
        num_warmup: eager runs of each size before its capture (Triton compiles and cuBLAS
            picks its kernels outside the capture).

    Raises:
        ValueError: no sizes, or ``capture`` on a device that is not CUDA.
    """

    def __init__(self, model: CausalLM, sizes: Sequence[int], capture: bool = True,
                 num_warmup: int = 1):
        self.sizes = sorted(set(int(s) for s in sizes))
        if not self.sizes or self.sizes[0] < 1:
            raise ValueError(f"sizes must be positive token counts, got {list(sizes)}")
        device = model.device
        if capture and device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device, got {device}")
        self.model = model
        self.device = device
        self.capture_graphs = capture
        self.num_warmup = num_warmup
        self.max_tokens = self.sizes[-1]
        self.input_ids = torch.zeros(self.max_tokens, dtype=torch.int64, device=device)
        # what the stages hand attention and back, as the model defines them (Llama: the QKV
        # projection writes into one buffer; queries, keys and values are its views)
        self.buffers = model.stage_buffers(self.max_tokens)
        self._pieces: dict[int, list[Callable[[], None]]] = {}
        # per size: the dict whose "state" is the last piece's layer state after a replay
        self._carry: dict[int, dict[str, LayerState]] = {}
        self._pool = None

    def padded_size(self, num_tokens: int) -> int | None:
        """The captured size a step of ``num_tokens`` tokens runs at, or None if too large."""
        return padded_batch_size(num_tokens, self.sizes)

    # ------------------------------------------------------------------ pieces
    def _piece_functions(self, size: int) -> tuple[list[Callable[[], None]], dict]:
        """The ``L + 1`` piece functions of ``size`` rows and the dict through which they hand
        the layer state on (``carry["state"]``)."""
        model, layers = self.model, self.model.layers
        ids = self.input_ids[:size]
        bufs = self.buffers.rows(size)
        attn_out = bufs.out
        carry: dict[str, LayerState] = {}

        def inputs_of(i: int, state: LayerState) -> LayerState:
            q, k, v, state = layers[i].attention_inputs(state, qkv_out=bufs.projection)
            # Queries, keys and values are views of the buffer (the rotary embedding runs in
            # attend), except Gemma 3's normed queries and keys and the tensors of a model that
            # projects into no buffer (DeepSeek's queries and latent), which are copied in.
            for src, dst in zip((q, k, v), bufs.inputs):
                if dst is not None and src.data_ptr() != dst.data_ptr():
                    dst.copy_(src)
            return state

        def first() -> None:
            carry["state"] = inputs_of(0, model.embed(ids))

        def middle(i: int) -> Callable[[], None]:
            def piece() -> None:
                carry["state"] = inputs_of(i, layers[i - 1].attention_output(attn_out,
                                                                              carry["state"]))
            return piece

        def last() -> None:
            carry["state"] = layers[-1].attention_output(attn_out, carry["state"])

        return [first, *(middle(i) for i in range(1, len(layers))), last], carry

    @torch.inference_mode()
    def capture(self, agree: Callable[[str | None], bool] | None = None) -> bool:
        """Build the pieces of every size (largest first); with ``capture``, warm each size up
        eagerly and capture its pieces into CUDA graphs sharing one memory pool.

        Args:
            agree: for pieces with collectives (tensor parallelism), as
                :meth:`pdserve.runner.cuda_graphs.CUDAGraphRunner.capture`: called after each
                size on every rank with this rank's error (None: captured); returns whether
                every rank captured it. None: an error raises.

        Returns:
            True when every size was captured; False when ``agree`` said a rank failed (no
            piece is kept).
        """
        t0 = time.perf_counter()
        if not self.capture_graphs:
            for size in self.sizes:
                self._pieces[size], self._carry[size] = self._piece_functions(size)
            return True
        self._pool = torch.cuda.graph_pool_handle()
        with torch.cuda.device(self.device):
            for size in reversed(self.sizes):
                functions, carry = self._piece_functions(size)
                side = warm_up(lambda fns=functions: [fn() for fn in fns], self.num_warmup)

                def capture(side=side, functions=functions):
                    with torch.cuda.stream(side):
                        return [_capture(fn, self._pool) for fn in functions]

                ok, graphs = capture_agreed(capture, agree)
                if not ok:
                    self._pieces.clear()
                    self._carry.clear()
                    return False
                self._pieces[size] = [g.replay for g in graphs]
                self._carry[size] = carry  # holds the last piece's output tensors
            torch.cuda.synchronize()
        logger.info("captured CUDA graphs of the stages between attentions (%d pieces) for "
                    "steps of up to %d tokens, sizes %s, in %.1f s",
                    len(self.model.layers) + 1, self.max_tokens, self.sizes,
                    time.perf_counter() - t0)
        return True

    @property
    def captured(self) -> bool:
        """True once :meth:`capture` has built the pieces."""
        return bool(self._pieces)

    @torch.inference_mode()
    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_cache: torch.Tensor,
            meta: AttentionMetadata, logits_indices: torch.Tensor) -> torch.Tensor:
        """One step: copy the inputs into the static buffers, replay the pieces of the step's
        padded size with each layer's attention run eagerly in between, then the logits.

        Args:
            input_ids, positions: ``[T]`` int64 on the model's device (as
                :meth:`CausalLM.forward <pdserve.models.llama.CausalLM.forward>`).
            kv_cache, meta: the step's KV cache and attention metadata (for ``T`` tokens).
            logits_indices: ``[S]`` int64 rows to sample.

        Returns:
            ``[S, vocab_size]`` logits, as :meth:`CausalLM.forward` returns them.

        Raises:
            RuntimeError: :meth:`capture` has not run.
            ValueError: ``T`` is 0 or larger than the largest size.
        """
        if not self._pieces:
            raise RuntimeError("PiecewiseGraphs.run() before capture()")
        n = int(input_ids.shape[0])
        size = self.padded_size(n)
        if size is None or n < 1:
            raise ValueError(f"a step of {n} tokens is outside the captured sizes "
                             f"1..{self.max_tokens}")
        self.input_ids[:n].copy_(input_ids, non_blocking=True)
        bufs = self.buffers.rows(n)
        (q, k, v), out = bufs.inputs, bufs.out
        pieces = self._pieces[size]
        for piece, layer in zip(pieces, self.model.layers):
            piece()
            layer.attend(q, k, v, positions, kv_cache, meta, out)
        pieces[-1]()
        state = tuple(t[:n] for t in self._carry[size]["state"])
        return self.model.compute_logits(state, logits_indices)
