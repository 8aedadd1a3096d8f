"""The model runner: owns the weights, the paged KV cache and the sampler, and turns one
:class:`SchedulerOutput` into one :class:`ModelRunnerOutput` (docs/architecture.md).

The KV cache is one tensor ``[num_blocks, num_layers, 2, num_kv_heads, block_size, head_dim]``
(docs/architecture.md, "KV cache layout": a block is contiguous across layers, one NIXL
descriptor per block). The engine core
registers it with the KV connector's worker side itself
(``worker.register_kv_cache(runner.kv_cache, runner.kv_cache_spec)``) and hands the worker to
:meth:`ModelRunner.set_kv_connector_worker`; the runner then drives the worker around every
forward pass.

Why one module of about 610 lines: it is the one ``run()`` of the engine (nano-vllm's shape),
the only place that owns tensors: KV cache sizing (the arithmetic itself is torch-free, in
:mod:`pdserve.memory_budget`), input preparation, the forward pass, CUDA-graph replay,
multi-step rounds, overlapped steps (``execute_async``; the launched step and the device-side
input feeding are in :mod:`pdserve.runner.overlap`) and sampling share its device buffers and
must change together.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import dataclasses
import logging
import math
import sys
import time
from itertools import chain

import torch

from pdserve.config import EngineConfig
from pdserve.engine.outputs import ModelRunnerOutput, SchedulerOutput, ScheduledRequest
from pdserve.kv_transfer.base import KVCacheSpec, KVConnectorWorkerSide
from pdserve.attention.kv_quant import kv_cache_torch_dtype
from pdserve.attention.metadata import decode_metadata
from pdserve.model_info import ModelInfo
from pdserve.memory_budget import kv_cache_budget, requested_bytes
from pdserve.distributed.communication import tp_all_gather_object
from pdserve.distributed.parallel_state import get_tp_rank, get_tp_size
from pdserve.distributed.sharding import kv_head_range
from pdserve.models.loader import load_model, model_max_len, resolve_device, tp_device
from pdserve.runner.cuda_graphs import CUDAGraphRunner, StaticInputSpec, default_capture_sizes
from pdserve.runner.overlap import DeviceTokens, PendingRunnerStep, feed_previous_tokens
from pdserve.runner.sampler import Sampler

logger = logging.getLogger("pdserve.model")

GiB = 1 << 30
DEFAULT_CPU_KV_CACHE_BYTES = 1 * GiB
# glibc mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3


def tune_cpu_malloc() -> bool:
    """Keep freed large blocks in the glibc heap instead of returning them to the OS.

    Every layer of a CPU forward pass allocates and frees tens of MB of temporaries (gathered
    KV blocks, MLP activations). With glibc's default dynamic thresholds those pages go back to
    the OS at each free and are page-faulted in again at the next allocation, which measured
    ~180k minor faults and doubled the time of a 32-request SmolLM2 decode step. Fixing
    ``M_MMAP_THRESHOLD`` at its maximum (32 MiB) and ``M_TRIM_THRESHOLD`` at 1 GiB keeps them
    mapped (the process keeps its peak RSS). No-op where glibc is absent.

    Returns:
        True when both settings were applied.
    """
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        ok = libc.mallopt(_M_MMAP_THRESHOLD, 32 << 20) == 1
        return bool(ok and libc.mallopt(_M_TRIM_THRESHOLD, 1 << 30) == 1)
    except (OSError, AttributeError):
        return False


def _cuda_memory_at_start(config: EngineConfig) -> tuple[int, int] | None:
    """``(total, free)`` bytes of the engine's CUDA device before it loads anything, after
    checking that its ``gpu_memory_utilization`` share is free (None on CPU or when
    ``kv_cache_memory`` / ``num_gpu_blocks_override`` size the cache instead).

    Raises:
        GpuMemoryBudgetError: the share is not free (the message has the numbers).
    """
    device = tp_device(resolve_device(config.device), config, get_tp_rank())
    if device.type != "cuda" or config.kv_cache_memory is not None \
            or config.num_gpu_blocks_override:
        return None
    free, total = torch.cuda.mem_get_info(device)
    requested_bytes(total, free, config.gpu_memory_utilization)
    return total, free


class ModelRunner:
    """Runs the model for the scheduler (one tensor-parallel rank's shard of it when the
    process joined a TP group, :mod:`pdserve.distributed`).

    Args:
        config: the engine configuration (model, dtype, device, block size, memory limits, seed).

    Raises:
        ValueError: bad model path / format / dtype / device (see :func:`load_model`), or an fp8
            KV cache on a GPU older than compute capability 8.9 with the Triton backend.

    Attributes:
        model_info: summary of the loaded model.
        max_model_len: longest sequence (prompt + output) in tokens.
        kv_cache: the paged KV cache (after :meth:`allocate_kv_cache`).
        kv_cache_spec: its geometry, for the KV connector.
        kv_cache_dtype: the cache's torch dtype (the model's, or ``torch.float8_e4m3fn`` for
            ``--kv-cache-dtype fp8``, with per-layer scales set on the attention backend).
    """

    def __init__(self, config: EngineConfig):
        self.config = config
        # CUDA: (total, free) before this instance's weights, for its memory budget
        self._cuda_mem_at_start = _cuda_memory_at_start(config)
        loaded = load_model(config)
        self.model = loaded.model
        self.arch = loaded.arch
        self.model_info: ModelInfo = loaded.info
        self.model_path = loaded.path
        self.device = self.model.device
        self.dtype = self.model.dtype
        self.kv_cache_dtype = kv_cache_torch_dtype(config.kv_cache_dtype, self.dtype)
        if self.kv_cache_dtype != self.dtype:
            if (self.device.type == "cuda" and self.model.attn_backend.uses_triton_kernels
                    and torch.cuda.get_device_capability(self.device) < (8, 9)):
                raise ValueError("--kv-cache-dtype fp8 needs a GPU of compute capability 8.9 or "
                                 "newer for its Triton kernels (PDSERVE_ATTENTION_BACKEND=torch "
                                 "runs it with torch ops)")
            self.model.attn_backend.set_kv_cache_scales(self.model.kv_cache_scales())
        self.block_size = config.block_size
        self.max_model_len = model_max_len(config, self.arch)
        self.sampler = Sampler(self.device, config.seed)
        self.kv_cache: torch.Tensor | None = None
        self.kv_cache_spec: KVCacheSpec | None = None
        self._connector: KVConnectorWorkerSide | None = None
        # the last execute_async step's sampled tokens: inputs of the next step's placeholders
        self._previous_tokens: DeviceTokens | None = None
        # CUDA graphs of pure-decode steps (built by allocate_kv_cache; None = eager).
        self.decode_graphs: CUDAGraphRunner | None = None
        self.use_cuda_graphs = (self.device.type == "cuda" and not config.enforce_eager
                                and self.model.attn_backend.supports_cuda_graphs)
        if self.device.type == "cpu":
            tune_cpu_malloc()
        self._weights_bytes = (torch.cuda.memory_allocated(self.device)
                               if self.device.type == "cuda" else 0)

    # ------------------------------------------------------------------ KV cache sizing
    @property
    def num_kv_heads(self) -> int:
        """This rank's KV heads (all of them at TP 1)."""
        return kv_head_range(self.arch.num_kv_heads, get_tp_size(), get_tp_rank())[1]

    @property
    def block_bytes(self) -> int:
        """Bytes of one KV block across all layers, K and V, of this rank's KV heads (in the KV
        cache's dtype: an fp8 block is half a bf16 one, so the same memory holds twice the
        blocks)."""
        a = self.arch
        return (a.num_layers * 2 * self.num_kv_heads * self.block_size * a.head_dim
                * torch.empty(0, dtype=self.kv_cache_dtype).element_size())

    def determine_num_blocks(self) -> int:
        """How many KV blocks to allocate.

        ``num_gpu_blocks_override`` wins. Otherwise ``kv_cache_memory`` bytes when set (CPU and
        CUDA); else on CUDA ``gpu_memory_utilization`` of the device memory minus what a
        profiling forward pass of ``max_num_batched_tokens`` tokens peaks at; else on CPU
        1 GiB, capped at what ``max_num_seqs`` sequences of ``max_model_len`` tokens need.

        Whether one sequence of ``max_model_len`` tokens fits is the engine core's check (it
        caps a defaulted ``max_model_len`` at the cache capacity).
        """
        cfg = self.config
        if cfg.num_gpu_blocks_override:
            return int(cfg.num_gpu_blocks_override)
        if cfg.kv_cache_memory is not None:
            budget = int(cfg.kv_cache_memory)
        elif self.device.type == "cuda":
            budget = self._profile_cuda_budget()
        else:
            need_tokens = self.max_model_len * max(1, cfg.max_num_seqs)
            need = math.ceil(need_tokens / self.block_size) * self.block_bytes
            budget = min(DEFAULT_CPU_KV_CACHE_BYTES, need)
        return int(budget // self.block_bytes)

    def _profile_cuda_budget(self) -> int:
        """Bytes left for the KV cache on CUDA: this instance's share of the GPU
        (``gpu_memory_utilization`` of the total, see :mod:`pdserve.memory_budget`) minus its
        weights and a profiling forward pass's activation peak.

        Raises:
            GpuMemoryBudgetError: the share was not free at start or leaves nothing for the KV
                cache (the message has the numbers).
        """
        cfg = self.config
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        free0, total = torch.cuda.mem_get_info(self.device)
        non_torch0 = (total - free0) - torch.cuda.memory_reserved(self.device)
        num_tokens = max(1, min(cfg.max_num_batched_tokens, self.max_model_len))
        num_seqs = max(1, min(cfg.max_num_seqs, num_tokens))
        self._profile_run(num_tokens, num_seqs)
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device)
        free, total = torch.cuda.mem_get_info(self.device)
        non_torch1 = (total - free) - torch.cuda.memory_reserved(self.device)
        torch.cuda.empty_cache()
        total_start, free_start = self._cuda_mem_at_start or (total, total)
        budget = kv_cache_budget(
            total_start, free_start, self._weights_bytes, peak - self._weights_bytes,
            cfg.gpu_memory_utilization, non_torch_growth_bytes=non_torch1 - non_torch0,
            free_now_bytes=torch.cuda.mem_get_info(self.device)[0])
        logger.info("%s", budget.describe())
        return budget.kv_cache

    def _profile_run(self, num_tokens: int, num_seqs: int) -> None:
        """A forward pass of ``num_tokens`` prompt tokens in ``num_seqs`` requests (sampled with
        top-p, the costliest sampler path) on a scratch KV cache, to measure peak memory."""
        from pdserve.engine.sampling_params import SamplingParams

        per_seq = max(1, num_tokens // num_seqs)
        blocks_per_seq = math.ceil(per_seq / self.block_size)
        scratch = self._new_cache(num_seqs * blocks_per_seq)
        params = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=1)
        reqs = [
            ScheduledRequest(
                req_id=f"profile-{i}", token_ids=[0] * per_seq, num_computed_tokens=0,
                block_ids=list(range(i * blocks_per_seq, (i + 1) * blocks_per_seq)),
                sample=True, sampling_params=params, prompt_token_ids=[0] * per_seq,
                output_token_ids=[])
            for i in range(num_seqs)
        ]
        self._forward_and_sample(reqs, scratch)
        del scratch

    def _new_cache(self, num_blocks: int) -> torch.Tensor:
        a = self.arch
        shape = (num_blocks, a.num_layers, 2, self.num_kv_heads, self.block_size, a.head_dim)
        return torch.zeros(shape, dtype=self.kv_cache_dtype, device=self.device)

    def allocate_kv_cache(self, num_blocks: int) -> None:
        """Allocate the KV cache ``[num_blocks, L, 2, H_kv, block_size, D]`` (zeroed) and its spec.

        Raises:
            ValueError: ``num_blocks`` is not positive.
        """
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        self.kv_cache = self._new_cache(num_blocks)
        a = self.arch
        self.kv_cache_spec = KVCacheSpec(
            num_blocks=num_blocks, block_size=self.block_size, num_layers=a.num_layers,
            num_kv_heads=self.num_kv_heads, head_dim=a.head_dim,
            dtype=str(self.kv_cache_dtype).removeprefix("torch."),
            element_size=self.kv_cache.element_size(), model_name=self.model_info.name,
            total_num_kv_heads=a.num_kv_heads, kv_scales=self._kv_scales_for_spec())
        if self.use_cuda_graphs:
            self._capture_decode_graphs(num_blocks)
        total = num_blocks * self.block_bytes
        logger.info("KV cache: %d blocks x %d tokens = %d tokens, %.2f GiB of %s on %s "
                    "(%.1f sequences of max_model_len=%d)", num_blocks, self.block_size,
                    num_blocks * self.block_size, total / GiB,
                    str(self.kv_cache_dtype).removeprefix("torch."), self.device,
                    num_blocks * self.block_size / self.max_model_len, self.max_model_len)

    def _kv_scales_for_spec(self) -> tuple[float, ...]:
        """The fp8 cache's key scales then value scales, per layer (empty for a full-precision
        cache): part of the KV compatibility check of a P/D pair."""
        scales = self.model.attn_backend.kv_scales
        return () if scales is None else scales.k + scales.v

    @property
    def max_blocks_per_seq(self) -> int:
        """Width of a block table row: blocks of a ``max_model_len``-token sequence."""
        return -(-self.max_model_len // self.block_size)

    def _capture_decode_graphs(self, num_blocks: int) -> None:
        """Capture the model's forward pass of a pure-decode step (one token per sequence, on
        :func:`~pdserve.attention.metadata.decode_metadata` of the static buffers) for padded
        batch sizes up to ``min(max_num_seqs, num_blocks)`` (a running sequence holds at least
        one block)."""
        max_bs = max(1, min(self.config.max_num_seqs, num_blocks))
        specs = {
            "input_ids": StaticInputSpec((), torch.int64, 0),
            "positions": StaticInputSpec((), torch.int64, 0),
            "slot_mapping": StaticInputSpec((), torch.int64, -1),  # padding rows write nothing
            "block_tables": StaticInputSpec((self.max_blocks_per_seq,), torch.int32, 0),
            "context_lens": StaticInputSpec((), torch.int32, 0),  # padding rows attend to nothing
        }
        kv_cache = self.kv_cache
        model = self.model

        def forward(inp: dict[str, torch.Tensor]) -> torch.Tensor:
            meta = decode_metadata(inp["slot_mapping"], inp["block_tables"], inp["context_lens"])
            return model(inp["input_ids"], inp["positions"], kv_cache, meta)

        t0 = time.perf_counter()
        graphs = CUDAGraphRunner(forward, specs, default_capture_sizes(max_bs), self.device)
        if get_tp_size() == 1:
            graphs.capture()
        elif not self._capture_with_collectives(graphs):
            return
        self.decode_graphs = graphs
        logger.info("captured CUDA graphs of decode steps for batch sizes %s in %.1f s",
                    graphs.capture_sizes, time.perf_counter() - t0)

    def _capture_with_collectives(self, graphs: CUDAGraphRunner) -> bool:
        """Capture the decode graphs of a TP rank, NCCL all-reduces and all-gathers inside.

        The ranks agree after each batch size (over the gloo CPU group); when any rank failed
        to capture one, every rank drops its graphs and decodes eagerly, with a warning line
        saying so (a replay and an eager pass issue the same collectives, but graphs of some
        ranks only would be a needless asymmetry).

        Returns:
            True when every rank captured every size.
        """
        failures: list[str] = []

        def agree(error: str | None) -> bool:
            failures.extend(e for e in tp_all_gather_object(error) if e is not None)
            return not failures

        if not graphs.capture(agree):
            logger.warning("CUDA graph capture with tensor-parallel collectives failed (%s); "
                           "decode steps run eagerly", failures[0])
            return False
        return True

    def set_kv_connector_worker(self, worker: KVConnectorWorkerSide | None) -> None:
        """Attach (or detach with None) the KV connector's worker side.

        The runner does not register the KV cache with it; the engine core calls
        ``worker.register_kv_cache(runner.kv_cache, runner.kv_cache_spec)``.
        """
        self._connector = worker

    # ------------------------------------------------------------------ stepping
    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        """Run one engine step.

        Drops the sampler state of ``sched.finished_req_ids``; with a connector, binds its
        metadata and starts KV loads before the forward pass and polls it afterwards (also for
        an empty batch); computes KV for every scheduled token and samples a token for each
        request with ``sample=True``.

        Raises:
            RuntimeError: the KV cache was not allocated.
            ValueError: a malformed scheduled request (no tokens, short block table, position
                beyond ``max_model_len``).
        """
        self.sampler.drop(sched.finished_req_ids)
        self._previous_tokens = None
        worker = self._connector
        if worker is not None:
            worker.bind_connector_metadata(sched.kv_connector_metadata)
            worker.start_load_kv()
        out = ModelRunnerOutput()
        if sched.scheduled and sched.num_steps > 1:
            if self.kv_cache is None:
                raise RuntimeError("allocate_kv_cache() must be called before execute()")
            out.sampled_token_id_lists = self._multi_step_decode(sched.scheduled, sched.num_steps)
        elif sched.scheduled:
            if self.kv_cache is None:
                raise RuntimeError("allocate_kv_cache() must be called before execute()")
            sampled, tokens, logprobs = self._forward_and_sample(sched.scheduled, self.kv_cache)
            for req, tok, lp in zip(sampled, tokens, logprobs):
                out.sampled_token_ids[req.req_id] = tok
                if lp is not None:
                    out.logprobs[req.req_id] = lp
        if worker is not None:
            out.kv_connector_output = worker.get_finished(sched.finished_req_ids)
        return out

    @torch.inference_mode()
    def execute_async(self, sched: SchedulerOutput) -> PendingRunnerStep:
        """Launch one engine step whose sampled tokens stay on the device (overlapped
        scheduling, :mod:`pdserve.engine.async_step`): as :meth:`execute`, except that
        placeholder inputs (``input_from_previous_step``) take the previous
        ``execute_async`` step's sampled tokens on the device, and the result is read later
        through the returned step. A batch with logprobs or penalties samples on the host
        (:meth:`Sampler.samples_on_host <pdserve.runner.sampler.Sampler.samples_on_host>`).

        Raises:
            RuntimeError: the KV cache was not allocated.
            ValueError: a malformed scheduled request, a multi-step round, or a placeholder
                whose request the previous step did not sample.
        """
        if sched.num_steps > 1:
            raise ValueError("multi-step rounds run through execute()")
        if self.kv_cache is None:
            raise RuntimeError("allocate_kv_cache() must be called before execute_async()")
        self.sampler.drop(sched.finished_req_ids)
        worker = self._connector
        if worker is not None:
            worker.bind_connector_metadata(sched.kv_connector_metadata)
            worker.start_load_kv()
        sampled: list[ScheduledRequest] = []
        logprobs = {}
        tokens = torch.empty(0, dtype=torch.int64, device=self.device)
        if sched.scheduled:
            sampled, logits = self._forward_logits(sched.scheduled, self.kv_cache,
                                                   self._previous_tokens)
        if sampled and self.sampler.samples_on_host(sampled):
            token_list, lps = self.sampler.sample(logits, sampled)
            tokens = torch.tensor(token_list, dtype=torch.int64).to(self.device, non_blocking=True)
            logprobs = {r.req_id: lp for r, lp in zip(sampled, lps) if lp is not None}
        elif sampled:
            tokens = self.sampler.sample_on_device(logits, sampled)
        req_ids = [r.req_id for r in sampled]
        self._previous_tokens = DeviceTokens({rid: i for i, rid in enumerate(req_ids)}, tokens)
        kv_out = worker.get_finished(sched.finished_req_ids) if worker is not None else None
        return PendingRunnerStep(req_ids, tokens, logprobs, kv_out)

    def _forward_and_sample(self, scheduled: list[ScheduledRequest], kv_cache: torch.Tensor):
        """Flatten the batch (prefills first, then single-token decodes), run the model and
        sample. Returns ``(sampled_requests, token_ids, logprobs)`` in matching order."""
        sampled, logits = self._forward_logits(scheduled, kv_cache)
        if not sampled:
            return [], [], []
        tokens, logprobs = self.sampler.sample(logits, sampled)
        return sampled, tokens, logprobs

    def _forward_logits(self, scheduled: list[ScheduledRequest], kv_cache: torch.Tensor,
                        previous: DeviceTokens | None = None):
        """Flatten the batch (prefills first, then single-token decodes) and run the model
        (replaying a decode graph when it can); placeholder inputs are fed from ``previous``.

        Returns:
            ``(sampled_requests, logits)``: the requests with ``sample=True`` and their
            ``[len(sampled_requests), vocab]`` float32 logits (None when none samples).
        """
        prefills = [r for r in scheduled if len(r.token_ids) > 1]
        decodes = [r for r in scheduled if len(r.token_ids) == 1]
        if len(prefills) + len(decodes) != len(scheduled):
            bad = next(r.req_id for r in scheduled if not r.token_ids)
            raise ValueError(f"request {bad} was scheduled with no tokens")
        graphs = self.decode_graphs
        if (graphs is not None and not prefills and kv_cache is self.kv_cache
                and len(decodes) <= graphs.max_batch_size):
            return self._decode_with_graph(decodes, graphs, previous)
        fed: list[tuple[int, str]] = []  # (input row, req_id) of placeholders
        input_ids: list[int] = []
        positions: list[int] = []
        logits_idx: list[int] = []
        sampled: list[ScheduledRequest] = []
        for r in prefills:
            n = r.num_computed_tokens
            input_ids.extend(r.token_ids)
            positions.extend(range(n, n + len(r.token_ids)))
            if r.sample:
                logits_idx.append(len(input_ids) - 1)
                sampled.append(r)
        for r in decodes:
            if r.input_from_previous_step:
                fed.append((len(input_ids), r.req_id))
            input_ids.append(r.token_ids[0])
            positions.append(r.num_computed_tokens)
            if r.sample:
                logits_idx.append(len(input_ids) - 1)
                sampled.append(r)
        last = max(r.num_computed_tokens + len(r.token_ids) for r in scheduled)
        if last > self.max_model_len:
            raise ValueError(f"a scheduled request reaches {last} tokens, beyond max_model_len="
                             f"{self.max_model_len}")
        meta = self.model.attn_backend.build_metadata(
            [(r.num_computed_tokens, r.block_ids, len(r.token_ids)) for r in prefills],
            [(r.block_ids, r.num_computed_tokens) for r in decodes], self.device)
        dev = self.device
        ids_t = torch.tensor(input_ids, dtype=torch.int64).to(dev, non_blocking=True)
        pos_t = torch.tensor(positions, dtype=torch.int64).to(dev, non_blocking=True)
        idx_t = torch.tensor(logits_idx, dtype=torch.int64).to(dev, non_blocking=True)
        feed_previous_tokens(ids_t, fed, previous)
        logits = self.model(ids_t, pos_t, kv_cache, meta, idx_t)
        return sampled, (logits if sampled else None)

    def _multi_step_decode(self, decodes: list[ScheduledRequest], num_steps: int
                           ) -> dict[str, list[int]]:
        """A multi-step round (:attr:`SchedulerOutput.num_steps`): ``num_steps`` decode steps in
        which each step's sampled tokens are the next step's inputs, read back to the host once
        at the end. With CUDA graphs the steps after the first only update the graph's static
        inputs on the device (token, position, slot, context length) and replay, so the host
        never waits for the GPU inside the round; without them each step is an ordinary step.

        Returns:
            req_id -> its ``num_steps`` sampled tokens, in order.

        Raises:
            ValueError: a request that is not a sampled single-token decode, or positions
                beyond ``max_model_len``.
        """
        if any(len(r.token_ids) != 1 or not r.sample for r in decodes):
            raise ValueError("a multi-step round takes only sampled single-token decodes")
        last = max(r.num_computed_tokens for r in decodes) + num_steps
        if last > self.max_model_len:
            raise ValueError(f"a multi-step round reaches {last} tokens, beyond max_model_len="
                             f"{self.max_model_len}")
        graphs = self.decode_graphs
        if graphs is None or len(decodes) > graphs.max_batch_size:
            return self._multi_step_eager(decodes, num_steps)
        n = len(decodes)
        plan = self.sampler.plan(decodes)
        tokens = torch.empty((num_steps, n), dtype=torch.int64, device=self.device)
        logits = self._replay_decode_graph(decodes, graphs)
        buf = graphs.buffers
        bs = self.block_size
        for step in range(num_steps):
            if step:
                positions = buf["positions"][:n]
                positions.add_(1)
                buf["context_lens"][:n].add_(1)
                buf["input_ids"][:n].copy_(tokens[step - 1])
                blocks = buf["block_tables"][:n].gather(1, (positions // bs).unsqueeze(1)).squeeze(1)
                torch.add(positions % bs, blocks.to(torch.int64), alpha=bs,
                          out=buf["slot_mapping"][:n])
                logits = graphs.replay(n)
            tokens[step] = self.sampler.draw(logits, plan, step)
        rows = tokens.t().tolist()
        return {r.req_id: row for r, row in zip(decodes, rows)}

    def _multi_step_eager(self, decodes: list[ScheduledRequest], num_steps: int
                          ) -> dict[str, list[int]]:
        """:meth:`_multi_step_decode` as ordinary steps (CPU, ``enforce_eager``, or a batch
        larger than the captured graphs); the host sees every step's tokens."""
        out: dict[str, list[int]] = {r.req_id: [] for r in decodes}
        for step in range(num_steps):
            batch = [dataclasses.replace(
                r, token_ids=[out[r.req_id][-1]] if step else r.token_ids,
                num_computed_tokens=r.num_computed_tokens + step,
                output_token_ids=r.output_token_ids + out[r.req_id]) for r in decodes]
            sampled, tokens, _ = self._forward_and_sample(batch, self.kv_cache)
            for r, tok in zip(sampled, tokens):
                out[r.req_id].append(tok)
        return out

    def _replay_decode_graph(self, decodes: list[ScheduledRequest], graphs: CUDAGraphRunner,
                             previous: DeviceTokens | None = None) -> torch.Tensor:
        """Fill the graph's static inputs for a pure-decode batch (placeholder tokens fed from
        ``previous`` on the device) and replay it.

        Returns:
            ``[len(decodes), vocab]`` float32 logits (a view of the graph's output buffer).

        Raises:
            ValueError: a position beyond ``max_model_len`` or a block table too short.
        """
        bs = self.block_size
        width = self.max_blocks_per_seq
        ids, positions, slots, lens, num_blocks = [], [], [], [], []
        for r in decodes:
            n = r.num_computed_tokens
            if n >= self.max_model_len:
                raise ValueError(f"a scheduled request reaches {n + 1} tokens, beyond "
                                 f"max_model_len={self.max_model_len}")
            need = n // bs + 1
            if len(r.block_ids) < need:
                raise ValueError(f"block table of {len(r.block_ids)} blocks cannot hold {n + 1} "
                                 f"tokens (block_size {bs})")
            ids.append(r.token_ids[0])
            positions.append(n)
            slots.append(r.block_ids[n // bs] * bs + n % bs)
            lens.append(n + 1)
            num_blocks.append(min(len(r.block_ids), width))
        # Block tables: one flat host list scattered into a [B, widest row] tensor.
        rows = max(num_blocks)
        flat = torch.tensor(list(chain.from_iterable(
            r.block_ids if len(r.block_ids) <= width else r.block_ids[:width] for r in decodes)),
            dtype=torch.int32)
        counts = torch.tensor(num_blocks, dtype=torch.int64)
        table = torch.zeros((len(decodes), rows), dtype=torch.int32)
        table[torch.arange(rows)[None, :] < counts[:, None]] = flat
        ids_t = torch.tensor(ids, dtype=torch.int64)
        fed = [(i, r.req_id) for i, r in enumerate(decodes) if r.input_from_previous_step]
        if fed:
            ids_t = ids_t.to(self.device, non_blocking=True)
            feed_previous_tokens(ids_t, fed, previous)
        return graphs.run({
            "input_ids": ids_t,
            "positions": torch.tensor(positions, dtype=torch.int64),
            "slot_mapping": torch.tensor(slots, dtype=torch.int64),
            "block_tables": table,
            "context_lens": torch.tensor(lens, dtype=torch.int32),
        })

    def _decode_with_graph(self, decodes: list[ScheduledRequest], graphs: CUDAGraphRunner,
                           previous: DeviceTokens | None = None):
        """A pure-decode step replayed from the captured graph of the next padded batch size;
        sampling happens outside the graph. Same return value as :meth:`_forward_logits`.

        Raises:
            ValueError: a position beyond ``max_model_len`` or a block table too short.
        """
        logits = self._replay_decode_graph(decodes, graphs, previous)
        sampled = [r for r in decodes if r.sample]
        if not sampled:
            return [], None
        if len(sampled) != len(decodes):
            rows_idx = [i for i, r in enumerate(decodes) if r.sample]
            logits = logits[torch.tensor(rows_idx, device=logits.device)]
        return sampled, logits

    def shutdown(self) -> None:
        """Release the KV cache and the weights (the connector is shut down by its owner)."""
        self._connector = None
        self.decode_graphs = None
        self.kv_cache = None
        self.kv_cache_spec = None
        self.model = None  # type: ignore[assignment]
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
