"""Engine configuration shared by the CLI, the engine core, the scheduler and the model runner."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pdserve.types.kv_tiers import KVOffloadingConfig
    from pdserve.types.kv_transfer_config import KVTransferConfig

DEFAULT_MODEL = "smollm2-135m-instruct"


class EvictionPolicy(enum.Enum):
    """Order in which free cached blocks of the prefix cache are reused
    (``--prefix-cache-eviction``; :mod:`pdserve.engine.free_blocks` describes both)."""

    LRU = "lru"
    DEPTH_FIRST = "depth-first"

    @classmethod
    def parse(cls, text: str) -> "EvictionPolicy":
        """The member named by ``text`` (``lru`` or ``depth-first``, case-insensitive).

        Raises:
            ValueError: any other value.
        """
        try:
            return cls(text.strip().lower())
        except ValueError:
            names = ", ".join(m.value for m in cls)
            raise ValueError(f"--prefix-cache-eviction must be one of {names}, got {text!r}") \
                from None


class KVCacheDtype(enum.Enum):
    """What the paged KV cache stores (``--kv-cache-dtype``).

    ``AUTO`` stores keys and values in the model's dtype. ``FP8_E4M3`` stores them as float8
    e4m3 (``torch.float8_e4m3fn``, largest finite value 448) with one scale per layer for K and
    one for V (:mod:`pdserve.attention.kv_quant`): half the bytes of a bf16 cache, so twice the
    blocks in the same memory and half the bytes per KV transfer.
    """

    AUTO = "auto"
    FP8_E4M3 = "fp8_e4m3"

    @classmethod
    def parse(cls, text: str) -> "KVCacheDtype":
        """The member named by ``text``: ``auto``, ``fp8`` or ``fp8_e4m3`` (vLLM's spellings;
        case-insensitive).

        Raises:
            ValueError: any other value (vLLM's ``fp8_e5m2`` included: not supported).
        """
        value = text.strip().lower()
        if value == "fp8":
            return cls.FP8_E4M3
        try:
            return cls(value)
        except ValueError:
            raise ValueError(f"--kv-cache-dtype must be one of {list(KV_CACHE_DTYPE_CHOICES)}, "
                             f"got {text!r}") from None


# The command-line spellings accepted by KVCacheDtype.parse.
KV_CACHE_DTYPE_CHOICES = ("auto", "fp8", "fp8_e4m3")


@dataclass
class EngineConfig:
    """Everything one engine instance needs to start.

    Attributes:
        model: a local Hugging Face directory, a ``.gguf`` file, or the built-in name
            ``smollm2-135m-instruct``.
        served_model_name: the name clients use in ``model`` (defaults to ``model``).
        tokenizer: tokenizer directory when it differs from ``model``.
        load_format: ``auto`` (safetensors / GGUF by file type) or ``dummy`` (random weights).
        dtype: ``auto``, ``float32``, ``bfloat16`` or ``float16`` (``auto``: bf16 on CUDA,
            float32 on CPU).
        device: ``auto``, ``cpu`` or ``cuda``.
        kv_cache_dtype: what the KV cache stores (:class:`KVCacheDtype`; ``AUTO`` = ``dtype``).
        seed: global seed for dummy weights and unseeded sampling.
        block_size: tokens per KV cache block.
        enable_prefix_caching: automatic prefix caching with chained block hashes.
        prefix_cache_eviction: which free cached block is reused first (:class:`EvictionPolicy`).
        max_model_len: longest prompt + output in tokens (default: the model's
            ``max_position_embeddings``).
        max_num_batched_tokens: token budget of one step (chunked prefill splits longer prompts).
        max_num_seqs: most requests running at once.
        gpu_memory_utilization: fraction of GPU memory the instance may use (CUDA).
        kv_cache_memory: bytes reserved for the KV cache (CPU; on CUDA overrides the fraction).
        num_gpu_blocks_override: fixed number of KV blocks (tests).
        enforce_eager: disable CUDA graphs.
        piecewise_cuda_graph_max_tokens: steps with prefill tokens of at most this many tokens
            (and at most ``max_num_batched_tokens``) replay the model's stages between
            attentions from CUDA graphs (:mod:`pdserve.runner.piecewise_graphs`; CUDA, not with
            ``enforce_eager``); 0 runs every such step eagerly. The default, 8192, covers every
            step of budgets up to 8192 tokens.
        num_scheduler_steps: decode steps run back to back per scheduling round when every
            running request is decoding (multi-step scheduling, as vLLM's option of that name):
            the sampled tokens stay on the GPU and feed the next step, and the host schedules
            and reads tokens back once per round, so its per-step work overlaps the GPU. Tokens
            then reach clients in bursts of up to this many, and new requests wait up to one
            round. 1 (the default) schedules every step.
        async_scheduling: async scheduling (``--async-scheduling``): the engine core
            schedules and launches step n+1 while the device still runs step n; step n+1's
            decodes take step n's sampled tokens on the device, and the host reads step n's
            tokens after step n+1 is launched, so they reach clients one step later and the
            device never waits for the host between steps. Outputs are those of the
            synchronous path; steps it cannot overlap run synchronously
            (:mod:`pdserve.engine.async_scheduling` lists them). On by default; ignored at
            tensor-parallel size > 1.
        kv_transfer_config: parsed ``--kv-transfer-config`` (None: no connector).
        kv_offloading: the KV cache tiers behind the prefix cache (``--kv-offloading-size``,
            ``--kv-offloading-disk-dir``; :mod:`pdserve.types.kv_tiers`), or None (evicted
            cached blocks are lost).
        trust_remote_code: passed to transformers when reading configs/tokenizers.
        kv_events_endpoint: ZMQ endpoint on which the engine core publishes its prefix-cache
            changes (:mod:`pdserve.engine.kv_events`); None (the default) publishes nothing.
        kv_events_snapshot_endpoint: ZMQ endpoint answering snapshot requests (default: the
            events endpoint's host, port + 1).
        tensor_parallel_size: TP ranks of this instance (``--tensor-parallel-size``): one
            process and device per rank, each with its shard of the weights and the KV cache
            (docs/architecture.md, "Tensor parallelism"); 1 runs the model in the engine-core
            process.

    Data parallelism (vLLM's option names; :mod:`pdserve.engine.data_parallel`): each rank is
    a full engine core with its own device(s), KV cache, connector and side-channel port
    ``base + rank``.

    Attributes:
        data_parallel_size: engine cores (ranks) behind one API server, over all hosts.
        data_parallel_size_local: ranks started on this host (default: all of them).
        data_parallel_start_rank: the first rank started on this host (0 on the head).
        data_parallel_rank: the rank of this engine core (set per core by the launcher of the
            ranks; 0 without data parallelism).
        data_parallel_address: address of the head's rendezvous socket (multi-host), which
            also carries every remote rank's requests and outputs.
        data_parallel_rpc_port: TCP port of the head's rendezvous socket.
        headless: this host runs ranks only, no API server; they join the head.
        data_parallel_join_timeout: seconds a headless host keeps trying to reach the head.
    """

    model: str = DEFAULT_MODEL
    served_model_name: str | None = None
    tokenizer: str | None = None
    load_format: str = "auto"
    dtype: str = "auto"
    device: str = "auto"
    kv_cache_dtype: KVCacheDtype = KVCacheDtype.AUTO
    seed: int = 0
    block_size: int = 16
    enable_prefix_caching: bool = True
    prefix_cache_eviction: EvictionPolicy = EvictionPolicy.LRU
    max_model_len: int | None = None
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 256
    gpu_memory_utilization: float = 0.9
    kv_cache_memory: int | None = None
    num_gpu_blocks_override: int | None = None
    enforce_eager: bool = False
    piecewise_cuda_graph_max_tokens: int = 8192
    num_scheduler_steps: int = 1
    async_scheduling: bool = True
    kv_transfer_config: KVTransferConfig | None = None
    kv_offloading: KVOffloadingConfig | None = None
    trust_remote_code: bool = False
    kv_events_endpoint: str | None = None
    kv_events_snapshot_endpoint: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    # --- tensor parallelism
    tensor_parallel_size: int = 1
    # --- data parallelism (keep together) ---
    data_parallel_size: int = 1
    data_parallel_size_local: int | None = None
    data_parallel_start_rank: int = 0
    data_parallel_rank: int = 0
    data_parallel_address: str | None = None
    data_parallel_rpc_port: int = 13345
    headless: bool = False
    data_parallel_join_timeout: float = 60.0

    @property
    def name(self) -> str:
        """The model name clients must send."""
        return self.served_model_name or self.model

    @property
    def local_data_parallel_size(self) -> int:
        """Ranks started on this host (``data_parallel_size_local``, default all)."""
        if self.data_parallel_size_local is None:
            return self.data_parallel_size
        return self.data_parallel_size_local
