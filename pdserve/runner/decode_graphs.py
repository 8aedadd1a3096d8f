"""The model runner's CUDA graphs: capture of pure-decode steps and of the piecewise stages of
steps with prefills (also across tensor-parallel ranks), and a decode batch's replay.

A pure-decode step (one token per sequence) of at most the largest captured batch size is
replayed from the graph of the next padded size (:mod:`pdserve.runner.cuda_graphs`: static
buffers, padding rows that write and attend to nothing); sampling runs outside the graph. The
runner decides when a step takes this path (:meth:`ModelRunner.forward_logits
<pdserve.runner.model_runner.ModelRunner.forward_logits>`) and replays it through
:class:`DecodeGraphReplay`; multi-step rounds replay the same graphs
(:mod:`pdserve.runner.multi_step`). docs/architecture.md, "Model runner".
"""

from __future__ import annotations

import logging
import time

import numpy as np
import torch

from pdserve.attention.metadata import decode_metadata
from pdserve.distributed.communication import tp_all_gather_object
from pdserve.distributed.parallel_state import get_tp_size
from pdserve.types.engine_config import EngineConfig
from pdserve.types.outputs import ScheduledRequest
from pdserve.runner.block_tables import DecodeBlockTables
from pdserve.runner.cuda_graphs import CUDAGraphRunner, StaticInputSpec, default_capture_sizes
from pdserve.attention.host_tensors import int_tensor
from pdserve.runner.device_tokens import DeviceTokens, feed_previous_tokens
from pdserve.runner.piecewise_graphs import PiecewiseGraphs, piecewise_capture_sizes

logger = logging.getLogger("pdserve.model")


def capture_decode_graphs(model: torch.nn.Module, kv_cache: torch.Tensor, config: EngineConfig,
                          max_blocks_per_seq: int) -> CUDAGraphRunner | None:
    """Capture the model's forward pass of a pure-decode step (one token per sequence, on
    :func:`~pdserve.attention.metadata.decode_metadata` of the static buffers) for padded
    batch sizes up to ``min(max_num_seqs, num_blocks)`` (a running sequence holds at least
    one block), on the runner's allocated KV cache.

    Args:
        model: the loaded model (``model(input_ids, positions, kv_cache, meta)`` -> logits).
        kv_cache: the allocated KV cache ``[num_blocks, L, 2, H_kv, block_size, D]``.
        config: the engine configuration (``max_num_seqs``).
        max_blocks_per_seq: width of a block table row.

    Returns:
        The captured graphs, or None when a tensor-parallel rank failed to capture (every rank
        then decodes eagerly, :func:`capture_with_collectives`).
    """
    max_bs = max(1, min(config.max_num_seqs, kv_cache.shape[0]))
    specs = {
        "input_ids": StaticInputSpec((), torch.int64, 0),
        "positions": StaticInputSpec((), torch.int64, 0),
        "slot_mapping": StaticInputSpec((), torch.int64, -1),  # padding rows write nothing
        "block_tables": StaticInputSpec((max_blocks_per_seq,), torch.int32, 0),
        "context_lens": StaticInputSpec((), torch.int32, 0),  # padding rows attend to nothing
    }

    def forward(inp: dict[str, torch.Tensor]) -> torch.Tensor:
        meta = decode_metadata(inp["slot_mapping"], inp["block_tables"], inp["context_lens"])
        return model(inp["input_ids"], inp["positions"], kv_cache, meta)

    t0 = time.perf_counter()
    graphs = CUDAGraphRunner(forward, specs, default_capture_sizes(max_bs), kv_cache.device)
    if get_tp_size() == 1:
        graphs.capture()
    elif not capture_with_collectives(graphs, "decode steps"):
        return None
    logger.info("captured CUDA graphs of decode steps for batch sizes %s in %.1f s",
                graphs.capture_sizes, time.perf_counter() - t0)
    return graphs


def capture_piecewise_graphs(model: torch.nn.Module, config: EngineConfig
                             ) -> PiecewiseGraphs | None:
    """Capture the model's stages between attentions (:mod:`pdserve.runner.piecewise_graphs`)
    for steps of up to ``min(piecewise_cuda_graph_max_tokens, max_num_batched_tokens)`` tokens
    of ``config``.

    Returns:
        The captured pieces; None when the option is 0, or when a tensor-parallel rank failed
        to capture (every rank then runs those steps eagerly).
    """
    max_tokens = min(config.piecewise_cuda_graph_max_tokens, config.max_num_batched_tokens)
    if max_tokens < 1:
        return None
    pieces = PiecewiseGraphs(model, piecewise_capture_sizes(max_tokens))
    if get_tp_size() == 1:
        pieces.capture()
    elif not capture_with_collectives(pieces, "steps with prefills"):
        return None
    return pieces


def capture_with_collectives(graphs: CUDAGraphRunner | PiecewiseGraphs, what: str) -> bool:
    """Capture the graphs of a TP rank, NCCL all-reduces and all-gathers inside.

    The ranks agree after each size (over the gloo CPU group); when any rank failed to
    capture one, every rank drops these graphs and runs ``what`` (e.g. ``"decode steps"``)
    eagerly, with a warning line saying so (a replay and an eager pass issue the same
    collectives, but graphs of some ranks only would be a needless asymmetry).

    Returns:
        True when every rank captured every size.
    """
    failures: list[str] = []

    def agree(error: str | None) -> bool:
        failures.extend(e for e in tp_all_gather_object(error) if e is not None)
        return not failures

    if not graphs.capture(agree):
        logger.warning("CUDA graph capture with tensor-parallel collectives failed (%s); "
                       "%s run eagerly", failures[0], what)
        return False
    return True


class DecodeGraphReplay:
    """Replays pure-decode batches from the captured decode graphs: builds the batch's inputs
    on the host (the block tables from the rows it keeps between steps) and copies them into the
    graph's static buffers.

    Args:
        block_tables: the host block-table rows of the requests of replayed decode steps, kept
            between steps (owned by this replay).
        block_size: tokens per KV block.
        max_model_len: longest sequence (prompt + output) in tokens.
        device: the runner's device (of fed placeholder tokens).
    """

    def __init__(self, block_tables: DecodeBlockTables, block_size: int, max_model_len: int,
                 device: torch.device):
        self._tables = block_tables
        self._block_size = block_size
        self._max_model_len = max_model_len
        self._device = device

    def replay(self, decodes: list[ScheduledRequest], graphs: CUDAGraphRunner,
               previous: DeviceTokens | None = None) -> torch.Tensor:
        """Fill the graph's static inputs for a pure-decode batch (placeholder tokens fed from
        ``previous`` on the device) and replay it.

        Returns:
            ``[len(decodes), vocab]`` logits in the model's dtype (a view of the graph's output
            buffer, which the sampler leaves unmodified).

        Raises:
            ValueError: a position beyond ``max_model_len``, a block table too short, or a
                placeholder whose request ``previous`` did not sample.
        """
        bs = self._block_size
        tables = self._tables
        positions = np.fromiter([r.num_computed_tokens for r in decodes], np.int64, len(decodes))
        if positions.max() >= self._max_model_len:
            self._raise_bad_row(decodes)
        index, num_blocks = tables.rows(decodes)
        block_of = positions // bs  # < tables.width: a row cut to the width holds its position
        if (num_blocks <= block_of).any():
            self._raise_bad_row(decodes)
        table = tables.table(index, int(num_blocks.max()))
        slots = table[np.arange(len(decodes)), block_of].astype(np.int64) * bs + positions % bs
        ids_t = int_tensor([r.token_ids[0] for r in decodes])
        fed = [(i, r.request_id) for i, r in enumerate(decodes) if r.input_from_previous_step]
        if fed:
            ids_t = ids_t.to(self._device, non_blocking=True)
            feed_previous_tokens(ids_t, fed, previous)
        return graphs.run({
            "input_ids": ids_t,
            "positions": torch.from_numpy(positions),
            "slot_mapping": torch.from_numpy(slots),
            "block_tables": torch.from_numpy(table),
            "context_lens": torch.from_numpy((positions + 1).astype(np.int32)),
        })

    def _raise_bad_row(self, decodes: list[ScheduledRequest]) -> None:
        """Raise the error of the first row of ``decodes`` whose position is beyond
        ``max_model_len`` or whose block table is too short.

        Raises:
            ValueError: always (for the first such row).
        """
        bs = self._block_size
        max_model_len = self._max_model_len
        for r in decodes:
            n = r.num_computed_tokens
            if n >= max_model_len:
                raise ValueError(f"a scheduled request reaches {n + 1} tokens, beyond "
                                 f"max_model_len={max_model_len}")
            if len(r.block_ids) < n // bs + 1:
                raise ValueError(f"block table of {len(r.block_ids)} blocks cannot hold {n + 1} "
                                 f"tokens (block_size {bs})")
        raise AssertionError("no bad row")

    def decode(self, decodes: list[ScheduledRequest], graphs: CUDAGraphRunner,
               previous: DeviceTokens | None = None):
        """A pure-decode step replayed from the captured graph of the next padded batch size;
        sampling happens outside the graph. Same return value as
        :meth:`ModelRunner.forward_logits
        <pdserve.runner.model_runner.ModelRunner.forward_logits>`.

        Raises:
            ValueError: as :meth:`replay`.
        """
        logits = self.replay(decodes, graphs, previous)
        sampled = [r for r in decodes if r.sample]
        if not sampled:
            return [], None
        if len(sampled) != len(decodes):
            rows_idx = [i for i, r in enumerate(decodes) if r.sample]
            logits = logits[int_tensor(rows_idx).to(logits.device, non_blocking=True)]
        return sampled, logits
