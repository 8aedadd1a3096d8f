"""The model runner: owns the weights, the paged KV cache and the sampler, and turns one
:class:`SchedulerOutput` into one :class:`ModelRunnerOutput` (docs/architecture.md).

The KV cache is one tensor ``[num_blocks, num_layers, 2, num_kv_heads, block_size, head_dim]``
(docs/architecture.md, "KV cache layout": a block is contiguous across layers, one NIXL
descriptor per block). The engine core
registers it with the KV connector's worker side itself
(``worker.register_kv_cache(runner.kv_cache, runner.kv_cache_spec)``) and hands the worker to
:meth:`ModelRunner.set_kv_connector_worker`; the runner then drives the worker around every
forward pass.

The runner loads the model, sizes and owns the KV cache and runs one step (input preparation,
the forward pass, sampling); the arithmetic of the cache size is torch-free, in
:mod:`pdserve.runner.memory_budget`. Its CUDA graphs are captured by :mod:`pdserve.runner.decode_graphs`
(whose :class:`~pdserve.runner.decode_graphs.DecodeGraphReplay` also replays decode steps; steps
with prefills of up to ``piecewise_cuda_graph_max_tokens`` tokens replay
:mod:`pdserve.runner.piecewise_graphs`), multi-step rounds run in :mod:`pdserve.runner.multi_step`
and the steps of async scheduling (``execute_async``, outputs read one step later) are launched
by :mod:`pdserve.runner.step_launch`. Each of these helpers gets its collaborators (the sampler,
a bound forward method, the block tables) from the runner's constructor.
"""

from __future__ import annotations

import logging
import math

import torch

from pdserve.types.engine_config import EngineConfig
from pdserve.types.outputs import ModelRunnerOutput, SchedulerOutput, ScheduledRequest
from pdserve.kv_transfer.base import KVCacheSpec, KVConnectorWorkerSide
from pdserve.attention.kv_quant import kv_cache_torch_dtype
from pdserve.types.model_info import ModelInfo
from pdserve.runner.memory_profile import cuda_memory_at_start, measure_cuda_budget
from pdserve.distributed.parallel_state import get_tp_rank, get_tp_size
from pdserve.distributed.sharding import kv_head_range
from pdserve.models.loader import load_model, model_max_len, resolve_device, tp_device
from pdserve.runner.block_tables import DecodeBlockTables
from pdserve.runner.cpu_malloc import tune_cpu_malloc
from pdserve.runner.cuda_graphs import CUDAGraphRunner
from pdserve.runner.decode_graphs import (
    DecodeGraphReplay, capture_decode_graphs, capture_piecewise_graphs,
)
from pdserve.attention.host_tensors import int_tensor
from pdserve.runner.device_tokens import DeviceTokens, feed_previous_tokens
from pdserve.runner.multi_step import MultiStepDecoder
from pdserve.runner.piecewise_graphs import PiecewiseGraphs
from pdserve.runner.kv_tier_store import KVTierStore, block_namespace
from pdserve.runner.step_launch import PendingRunnerStep, StepLauncher
from pdserve.runner.sampler import Sampler

logger = logging.getLogger("pdserve.model")

GiB = 1 << 30
DEFAULT_CPU_KV_CACHE_BYTES = 1 * GiB


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
        self._cuda_mem_at_start = cuda_memory_at_start(config)
        # torch memory this process already held (an earlier engine of the same process whose
        # objects the garbage collector has not freed yet): not this instance's weights
        device0 = tp_device(resolve_device(config.device), config, get_tp_rank())
        self._held_before = (torch.cuda.memory_allocated(device0)
                             if device0.type == "cuda" else 0)
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
        self._tiers: KVTierStore | None = None  # the KV cache tiers' memory and copies
        # replays decode graphs; keeps the host block tables of their requests between steps
        self._decode_replay = DecodeGraphReplay(DecodeBlockTables(self.max_blocks_per_seq),
                                                self.block_size, self.max_model_len, self.device)
        self._multi_step = MultiStepDecoder(self.forward_and_sample, self._decode_replay,
                                            self.sampler, self.block_size, self.max_model_len,
                                            self.device)
        # launches execute_async steps; keeps the last one's sampled tokens on the device
        self._launcher = StepLauncher(self.forward_logits, self.sampler, self.device)
        # CUDA graphs of pure-decode steps, and of the stages between attentions of steps with
        # prefills (both built by allocate_kv_cache; None = eager).
        self.decode_graphs: CUDAGraphRunner | None = None
        self.piecewise_graphs: PiecewiseGraphs | None = None
        self._piecewise_captured = False  # captured by the CUDA budget or allocate_kv_cache
        self.use_cuda_graphs = (self.device.type == "cuda" and not config.enforce_eager
                                and self.model.attn_backend.supports_cuda_graphs)
        if config.piecewise_cuda_graph_max_tokens < 0:
            raise ValueError("piecewise_cuda_graph_max_tokens must be >= 0, got "
                             f"{config.piecewise_cuda_graph_max_tokens}")
        if self.device.type == "cpu":
            tune_cpu_malloc()
        self._weights_bytes = (torch.cuda.memory_allocated(self.device) - self._held_before
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
        (``gpu_memory_utilization`` of the total, see :mod:`pdserve.runner.memory_budget`) minus its
        weights, a profiling forward pass's activation peak and the pool of the CUDA graphs of
        steps with prefills, captured here, before the KV cache (they do not read it).

        Raises:
            GpuMemoryBudgetError: the share was not free at start or leaves nothing for the KV
                cache (the message has the numbers).
        """
        cfg = self.config
        num_tokens = max(1, min(cfg.max_num_batched_tokens, self.max_model_len))
        num_seqs = max(1, min(cfg.max_num_seqs, num_tokens))
        budget = measure_cuda_budget(
            self.device, cfg.gpu_memory_utilization, self._cuda_mem_at_start,
            self._weights_bytes, self._held_before,
            profile_run=lambda: self._profile_run(num_tokens, num_seqs),
            capture_graphs=self._capture_piecewise_graphs)
        logger.info("%s", budget.describe())
        return budget.kv_cache

    def _capture_piecewise_graphs(self) -> None:
        """Capture the pieces between attentions once (they never read the KV cache, so they
        may be captured before it exists and their memory charged to the budget)."""
        if self.use_cuda_graphs and not self._piecewise_captured:
            self.piecewise_graphs = capture_piecewise_graphs(self.model, self.config)
            self._piecewise_captured = True

    def _profile_run(self, num_tokens: int, num_seqs: int) -> None:
        """A forward pass of ``num_tokens`` prompt tokens in ``num_seqs`` requests (sampled with
        a repetition penalty and top-p, the costliest sampler path: a float32 copy of the
        logits, then the masks' sort) on a scratch KV cache, to measure peak memory."""
        from pdserve.types.sampling_params import SamplingParams

        per_seq = max(1, num_tokens // num_seqs)
        blocks_per_seq = math.ceil(per_seq / self.block_size)
        scratch = self._new_cache(num_seqs * blocks_per_seq)
        params = SamplingParams(temperature=1.0, top_p=0.9, repetition_penalty=1.1, max_tokens=1)
        reqs = [
            ScheduledRequest(
                request_id=f"profile-{i}", token_ids=[0] * per_seq, num_computed_tokens=0,
                block_ids=list(range(i * blocks_per_seq, (i + 1) * blocks_per_seq)),
                sample=True, sampling_params=params, prompt_token_ids=[0] * per_seq,
                output_token_ids=[])
            for i in range(num_seqs)
        ]
        self.forward_and_sample(reqs, scratch)
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
            total_num_kv_heads=a.num_kv_heads, kv_scales=self._kv_scales_for_spec(),
            kind=self.model.attn_backend.kv_cache_kind)
        if self.use_cuda_graphs:
            self.decode_graphs = capture_decode_graphs(self.model, self.kv_cache, self.config,
                                                       self.max_blocks_per_seq)
            self._capture_piecewise_graphs()
        total = num_blocks * self.block_bytes
        # A defaulted max_model_len is the model's context length here; the engine core may
        # still cap it at the cache's capacity (and says so), so name it for what it is.
        length = "max_model_len=" if self.config.max_model_len else "the model's context of "
        logger.info("KV cache: %d blocks x %d tokens = %d tokens, %.2f GiB of %s on %s "
                    "(%.1f sequences of %s%d tokens)", num_blocks, self.block_size,
                    num_blocks * self.block_size, total / GiB,
                    str(self.kv_cache_dtype).removeprefix("torch."), self.device,
                    num_blocks * self.block_size / self.max_model_len, length,
                    self.max_model_len)

    def _kv_scales_for_spec(self) -> tuple[float, ...]:
        """The fp8 cache's key scales then value scales, per layer (empty for a full-precision
        cache): part of the KV compatibility check of a P/D pair."""
        scales = self.model.attn_backend.kv_scales
        return () if scales is None else scales.k + scales.v

    @property
    def max_blocks_per_seq(self) -> int:
        """Width of a block table row: blocks of a ``max_model_len``-token sequence."""
        return -(-self.max_model_len // self.block_size)

    def allocate_kv_tiers(self, host_blocks: int, disk_dir: str | None) -> None:
        """Allocate the KV cache tiers of this rank: a host pool of ``host_blocks`` blocks
        shaped like the KV cache's (pinned on CUDA) and, with ``disk_dir``, a directory of
        block files (:mod:`pdserve.runner.kv_tier_store`). Files are tagged with this engine's
        model, cache dtype, block shape, fp8 scales and TP rank.

        Raises:
            RuntimeError: the KV cache was not allocated.
            ValueError: ``host_blocks < 1``.
            OSError: the disk directory cannot be created.
        """
        if self.kv_cache is None or self.kv_cache_spec is None:
            raise RuntimeError("allocate_kv_cache() must be called before allocate_kv_tiers()")
        s = self.kv_cache_spec
        self._tiers = KVTierStore(self.kv_cache, host_blocks, block_namespace(
            self.model_info.name, s.dtype, tuple(self.kv_cache.shape[1:]), s.kind.value,
            s.kv_scales, get_tp_rank(), get_tp_size()), disk_dir)

    def set_kv_connector_worker(self, worker: KVConnectorWorkerSide | None) -> None:
        """Attach (or detach with None) the KV connector's worker side.

        The runner does not register the KV cache with it; the engine core calls
        ``worker.register_kv_cache(runner.kv_cache, runner.kv_cache_spec)``.
        """
        self._connector = worker

    # ------------------------------------------------------------------ stepping
    @torch.inference_mode()
    def execute(self, sched_out: SchedulerOutput) -> ModelRunnerOutput:
        """Run one engine step.

        Drops the sampler state of ``sched_out.finished_request_ids``; with a connector, binds its
        metadata and starts KV loads before the forward pass and polls it afterwards (also for
        an empty batch); computes KV for every scheduled token and samples a token for each
        request with ``sample=True``.

        Raises:
            RuntimeError: the KV cache was not allocated.
            ValueError: a malformed scheduled request (no tokens, short block table, position
                beyond ``max_model_len``).
        """
        self.sampler.drop(sched_out.finished_request_ids)
        self._launcher.reset()
        worker = self._connector
        self._run_tier_jobs(sched_out)
        if worker is not None:
            worker.bind_connector_metadata(sched_out.kv_connector_metadata)
            worker.start_load_kv()
        runner_out = ModelRunnerOutput()
        if sched_out.scheduled and self.kv_cache is None:
            raise RuntimeError("allocate_kv_cache() must be called before execute()")
        if sched_out.scheduled and sched_out.num_steps > 1:
            runner_out.sampled_token_id_lists = self._multi_step.decode(
                sched_out.scheduled, sched_out.num_steps, self.kv_cache, self.decode_graphs)
        elif sched_out.scheduled:
            sampled, tokens, logprobs = self.forward_and_sample(sched_out.scheduled,
                                                                self.kv_cache)
            for req, tok, lp in zip(sampled, tokens, logprobs):
                runner_out.sampled_token_ids[req.request_id] = tok
                if lp is not None:
                    runner_out.logprobs[req.request_id] = lp
        if worker is not None:
            runner_out.kv_connector_output = worker.get_finished(sched_out.finished_request_ids)
        if self._tiers is not None:
            runner_out.kv_tier_report = self._tiers.report()
        return runner_out

    def _run_tier_jobs(self, sched_out: SchedulerOutput) -> None:
        """Issue the step's tier copies before anything writes the KV cache (a connector's
        READ into a block whose old KV is being stored, or that an earlier step's LOAD wrote,
        waits for that copy)."""
        if self._tiers is not None:
            self._tiers.run(sched_out.kv_tier_jobs)
            if self._connector is not None:
                self._tiers.wait_before_connector_writes()

    @torch.inference_mode()
    def execute_async(self, sched_out: SchedulerOutput) -> PendingRunnerStep:
        """Launch one engine step whose sampled tokens stay on the device (async scheduling,
        :mod:`pdserve.engine.async_scheduling`); see :meth:`StepLauncher.launch
        <pdserve.runner.step_launch.StepLauncher.launch>` for what differs from :meth:`execute`
        and the errors raised."""
        self._run_tier_jobs(sched_out)
        step = self._launcher.launch(sched_out, self.kv_cache, self._connector)
        if self._tiers is not None:
            step.kv_tier_report = self._tiers.report()
        return step

    def forward_and_sample(self, scheduled: list[ScheduledRequest], kv_cache: torch.Tensor):
        """Flatten the batch (prefills first, then single-token decodes), run the model on
        ``kv_cache`` and sample on the host.

        Returns:
            ``(sampled_requests, token_ids, logprobs)`` in matching order: the requests with
            ``sample=True``, one token id each, and their logprobs (None where not asked).

        Raises:
            ValueError: as :meth:`forward_logits`.
        """
        sampled, logits = self.forward_logits(scheduled, kv_cache)
        if not sampled:
            return [], [], []
        tokens, logprobs = self.sampler.sample(logits, sampled)
        return sampled, tokens, logprobs

    def forward_logits(self, scheduled: list[ScheduledRequest], kv_cache: torch.Tensor,
                       previous: DeviceTokens | None = None):
        """Flatten the batch (prefills first, then single-token decodes) and run the model
        (replaying a decode graph, or the piecewise graphs of a small step with prefills, when it
        can); placeholder inputs are fed from ``previous``.

        Returns:
            ``(sampled_requests, logits)``: the requests with ``sample=True`` and their
            ``[len(sampled_requests), vocab]`` logits in the model's dtype (as
            :meth:`CausalLM.forward <pdserve.models.llama.CausalLM.forward>`; None when none
            samples).

        Raises:
            ValueError: a request scheduled with no tokens, a position beyond
                ``max_model_len``, a block table too short, or a placeholder whose request
                ``previous`` did not sample.
        """
        prefills = [r for r in scheduled if len(r.token_ids) > 1]
        decodes = [r for r in scheduled if len(r.token_ids) == 1]
        if len(prefills) + len(decodes) != len(scheduled):
            bad = next(r.request_id for r in scheduled if not r.token_ids)
            raise ValueError(f"request {bad} was scheduled with no tokens")
        graphs = self.decode_graphs
        if (graphs is not None and not prefills and kv_cache is self.kv_cache
                and len(decodes) <= graphs.max_batch_size):
            return self._decode_replay.decode(decodes, graphs, previous)
        fed: list[tuple[int, str]] = []  # (input row, request_id) of placeholders
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
                fed.append((len(input_ids), r.request_id))
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
        ids_t = int_tensor(input_ids).to(dev, non_blocking=True)
        pos_t = int_tensor(positions).to(dev, non_blocking=True)
        idx_t = int_tensor(logits_idx).to(dev, non_blocking=True)
        feed_previous_tokens(ids_t, fed, previous)
        pieces = self.piecewise_graphs
        if (pieces is not None and kv_cache is self.kv_cache
                and len(input_ids) <= pieces.max_tokens):
            logits = pieces.run(ids_t, pos_t, kv_cache, meta, idx_t)
        else:
            logits = self.model(ids_t, pos_t, kv_cache, meta, idx_t)
        return sampled, (logits if sampled else None)

    def shutdown(self) -> None:
        """Release the KV cache and the weights (the connector is shut down by its owner)."""
        self._connector = None
        if self._tiers is not None:
            self._tiers.shutdown()
            self._tiers = None
        self.decode_graphs = None
        self.piecewise_graphs = None
        self.kv_cache = None
        self.kv_cache_spec = None
        self.model = None  # type: ignore[assignment]
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
