"""DeepSeek (multi-head latent attention, DeepSeek-MoE) on CUDA (skipped without a GPU): the
Triton MLA backend (latent write, split-K absorbed decode), the layers' Triton ops and the fused
MoE of the routed experts, checked against ``transformers`` (float32 on the GPU, float64 on the
CPU) and pdserve's own CPU run (torch path) of the same model; CUDA graphs (decode and piecewise) against eager steps; the engine with chunked
prefill, a prefix-cache hit, overlapped scheduling and an fp8 latent cache."""

from __future__ import annotations

import random

import pytest
import torch

from pdserve.attention.mla_triton import TritonMLAAttentionBackend
from pdserve.engine.llm_engine import LLMEngine
from pdserve.runner.model_runner import ModelRunner
from pdserve.testing.tiny_models import make_tiny_model
from pdserve.types.engine_config import EngineConfig, KVCacheDtype
from pdserve.types.sampling_params import SamplingParams

from tests.support.model_driver import DrivenRequest, MiniScheduler, greedy

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)
pytest.importorskip("triton")

ARCHS = ["deepseek_v2", "deepseek_v2_lite", "deepseek_v3"]
ORIGINAL_CTX = 32  # the tiny configs' YaRN original context
B = 16
NUM_BLOCKS = 64
NUM_NEW = 10


def _prompt(length: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 49152) for _ in range(length)]


@pytest.fixture(scope="module", params=ARCHS)
def tiny(request, tmp_path_factory) -> str:
    return str(make_tiny_model(tmp_path_factory.mktemp(request.param), request.param))


def _runner(path: str, device: str, dtype: str, **kw) -> ModelRunner:
    runner = ModelRunner(EngineConfig(model=path, device=device, dtype=dtype, max_model_len=128,
                                      block_size=B, max_num_seqs=8,
                                      num_gpu_blocks_override=NUM_BLOCKS, **kw))
    runner.allocate_kv_cache(NUM_BLOCKS)
    return runner


def _mixed_requests(n: int) -> list[DrivenRequest]:
    """A one-token prompt, a block-boundary one and one past the YaRN threshold prefilled in two
    chunks, joining at different steps."""
    return [DrivenRequest(f"r{i}", _prompt(length, seed=length), n, greedy(n), start_step=i,
                          chunks=[length // 2, length - length // 2] if length > B + 1 else None)
            for i, length in enumerate([1, B + 1, 2 * ORIGINAL_CTX + 3])]


def test_float32_triton_path_matches_transformers_and_the_cpu_path(tiny, monkeypatch):
    """Greedy tokens of the Triton path in float32 (CUDA graphs on) equal ``transformers``' on
    the GPU in float32 and on the CPU in float64, and pdserve's float32 run on the CPU (torch
    path)."""
    from transformers import AutoModelForCausalLM

    monkeypatch.setenv("PDSERVE_ATTENTION_BACKEND", "triton")
    runner = _runner(tiny, "cuda", "float32")
    assert isinstance(runner.model.attn_backend, TritonMLAAttentionBackend)
    assert runner.decode_graphs is not None and runner.piecewise_graphs is not None
    reqs = _mixed_requests(NUM_NEW)
    MiniScheduler(runner, NUM_BLOCKS).run(reqs)
    runner.shutdown()
    cpu = _runner(tiny, "cpu", "float32")
    on_cpu = _mixed_requests(NUM_NEW)
    MiniScheduler(cpu, NUM_BLOCKS).run(on_cpu)
    hf = AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32).cuda().eval()
    # the experts as a loop: torch._grouped_mm has no float64 kernel
    hf64 = AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float64,
                                                experts_implementation="eager").eval()
    for r, r_cpu in zip(reqs, on_cpu):
        for model, device in ((hf, "cuda"), (hf64, "cpu")):
            ids = torch.tensor([r.prompt], device=device)
            want = model.generate(ids, attention_mask=torch.ones_like(ids),
                                  max_new_tokens=NUM_NEW, do_sample=False,
                                  pad_token_id=2)[0, len(r.prompt):].tolist()
            assert r.output == want, f"prompt {len(r.prompt)}: transformers on {device}"
        assert r.output == r_cpu.output, f"prompt {len(r.prompt)}: pdserve on the CPU"


def test_bf16_graphs_replay_the_eager_steps(tiny):
    """bf16: decode steps replayed from CUDA graphs (MLA kernel and fused MoE captured) and
    prefill steps through the piecewise graphs give the eager runner's tokens."""
    outputs = {}
    for eager in (True, False):
        runner = _runner(tiny, "cuda", "bfloat16", enforce_eager=eager)
        assert (runner.decode_graphs is None) == eager
        assert (runner.piecewise_graphs is None) == eager
        reqs = [DrivenRequest(f"r{i}", _prompt(n, 10 + i), 12, greedy(12))
                for i, n in enumerate([3, B, B + 5, 2 * B + 3])]
        MiniScheduler(runner, NUM_BLOCKS).run(reqs)
        outputs[eager] = [r.output for r in reqs]
        runner.shutdown()
    assert outputs[False] == outputs[True]


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_engine_prefix_cache_chunked_prefill_on_cuda(tiny, async_scheduling):
    """The engine on CUDA (float32, graphs on): a prompt past the YaRN threshold in chunks of 16
    tokens, then again over a prefix-cache hit, equal pdserve's CPU tokens (torch path)."""
    prompt = _prompt(ORIGINAL_CTX + 21, seed=7)
    sp = SamplingParams(temperature=0.0, max_tokens=NUM_NEW, ignore_eos=True)
    runs = {}
    for device, dtype in (("cuda", "float32"), ("cpu", "float32")):
        engine = LLMEngine(EngineConfig(
            model=tiny, device=device, dtype=dtype, block_size=B, max_model_len=128,
            num_gpu_blocks_override=NUM_BLOCKS, max_num_batched_tokens=16,
            enable_prefix_caching=True, async_scheduling=async_scheduling))
        try:
            first = engine.generate([prompt], sp)[0]
            second = engine.generate([prompt], sp)[0]
        finally:
            engine.shutdown()
        assert second.num_cached_tokens > 0 and second.token_ids == first.token_ids
        runs[device] = first.token_ids
    assert runs["cuda"] == runs["cpu"]


def test_fp8_latent_cache_triton_equals_torch_path(tmp_path, monkeypatch):
    """An fp8 latent cache with per-layer scales: the Triton path (fp8 store in the write
    kernel, dequantizing decode kernel) gives the torch path's tokens on the same GPU, whole and
    chunked with a prefix-cache hit."""
    path = str(make_tiny_model(tmp_path / "v2", "deepseek_v2"))
    prompt = _prompt(ORIGINAL_CTX + 13, seed=3)
    sp = SamplingParams(temperature=0.0, max_tokens=NUM_NEW, ignore_eos=True)
    runs = {}
    for backend in ("triton", "torch"):
        monkeypatch.setenv("PDSERVE_ATTENTION_BACKEND", backend)
        for budget in (2048, 16):
            engine = LLMEngine(EngineConfig(
                model=path, device="cuda", dtype="float32", block_size=B, max_model_len=128,
                num_gpu_blocks_override=NUM_BLOCKS, kv_cache_dtype=KVCacheDtype.FP8_E4M3,
                max_num_batched_tokens=budget, enable_prefix_caching=True))
            try:
                assert engine.core.runner.kv_cache.dtype == torch.float8_e4m3fn
                assert isinstance(engine.core.runner.model.attn_backend,
                                  TritonMLAAttentionBackend) == (backend == "triton")
                runs[backend, budget] = engine.generate([prompt], sp)[0].token_ids
                again = engine.generate([prompt], sp)[0]
                assert again.num_cached_tokens > 0
                assert again.token_ids == runs[backend, budget]
            finally:
                engine.shutdown()
    assert len(set(map(tuple, runs.values()))) == 1, runs


def test_mla_decode_kernel_at_v2_lite_shapes_matches_the_torch_path():
    """The split-K kernel at DeepSeek-V2-Lite's latent (512 + 64, 16 heads) in bf16, long and
    uneven contexts, against the torch path in float32."""
    from pdserve.attention.mla import decode_absorbed
    from pdserve.kernels.mla_decode import mla_decode_attention

    gen = torch.Generator(device="cuda").manual_seed(0)
    lens = [1, 300, 4096, 77]
    blocks = sum(-(-n // B) for n in lens)
    cache = torch.randn(blocks + 4, 2, 2, 1, B, 288, device="cuda", generator=gen,
                        dtype=torch.bfloat16)
    tables = torch.zeros(len(lens), -(-max(lens) // B), dtype=torch.int32, device="cuda")
    perm = torch.randperm(blocks, device="cuda", generator=gen).to(torch.int32)
    used = 0
    for i, n in enumerate(lens):
        k = -(-n // B)
        tables[i, :k] = perm[used:used + k]
        used += k
    ctx = torch.tensor(lens, dtype=torch.int32, device="cuda")
    q = torch.randn(len(lens), 16, 576, device="cuda", generator=gen, dtype=torch.bfloat16)
    scale = 0.1
    out = mla_decode_attention(q, cache, 1, tables, ctx, scale, 512)
    ref = decode_absorbed(q.float(), cache[:, 1].float(), tables, ctx, scale, 512)
    err = ((out.float() - ref).norm() / ref.norm()).item()
    assert err < 2e-2, err
