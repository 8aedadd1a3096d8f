"""DeepSeek-V2 (with and without ``q_lora_rank``) and DeepSeek-V3 on tiny random models: greedy
tokens equal ``transformers``' past the YaRN threshold, in mixed batches with chunked prefill
(runner), and through the in-process engine with a prefix-cache hit, small step budgets,
preemption, overlapped scheduling and an fp8 latent cache; the config parse and the refusals."""

from __future__ import annotations

import itertools
import json
import logging
import random

import pytest
import torch

from pdserve.attention.mla import MLAAttentionBackend
from pdserve.engine.llm_engine import LLMEngine
from pdserve.layers.deepseek_moe import RouterScoring, route_deepseek
from pdserve.models.deepseek import DeepseekArchConfig, softmax_scale
from pdserve.models.loader import arch_config_from_hf, iter_safetensors, load_model
from pdserve.runner.model_runner import ModelRunner
from pdserve.testing.tiny_models import make_tiny_model
from pdserve.types.engine_config import EngineConfig, KVCacheDtype
from pdserve.types.kv_cache_kind import KVCacheKind
from pdserve.types.sampling_params import SamplingParams

from tests.support.model_driver import DrivenRequest, MiniScheduler, greedy

ARCHS = ["deepseek_v2", "deepseek_v2_lite", "deepseek_v3"]
ORIGINAL_CTX = 32  # the tiny configs' YaRN original_max_position_embeddings
B = 16
NUM_NEW = 12


def _prompt(length: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 49152) for _ in range(length)]


class Reference:
    """``transformers``' greedy continuations of one tiny model, computed once per prompt."""

    def __init__(self, path: str):
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        self._cache: dict[tuple[tuple[int, ...], int], list[int]] = {}

    def greedy(self, prompt: list[int], n: int) -> list[int]:
        key = (tuple(prompt), n)
        if key not in self._cache:
            ids = torch.tensor([prompt])
            out = self.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                                      do_sample=False, pad_token_id=2)
            self._cache[key] = out[0, len(prompt):].tolist()
        return self._cache[key]


@pytest.fixture(scope="module", params=ARCHS)
def tiny(request, tmp_path_factory) -> tuple[str, Reference]:
    path = str(make_tiny_model(tmp_path_factory.mktemp(request.param), request.param))
    return path, Reference(path)


def _engine(path: str, **kw) -> LLMEngine:
    args = dict(model=path, dtype="float32", device="cpu", block_size=B, max_model_len=128,
                num_gpu_blocks_override=64)
    args.update(kw)
    return LLMEngine(EngineConfig(**args))


GREEDY = SamplingParams(temperature=0.0, max_tokens=NUM_NEW, ignore_eos=True)


def test_mixed_batch_matches_transformers(tiny):
    """A one-token prompt, a block-boundary one and one prefilled in two chunks, joining at
    different steps; prompt + output pass the YaRN threshold."""
    path, ref = tiny
    runner = ModelRunner(EngineConfig(model=path, max_model_len=128, block_size=B,
                                      num_gpu_blocks_override=64))
    runner.allocate_kv_cache(runner.determine_num_blocks())
    assert isinstance(runner.model.attn_backend, MLAAttentionBackend)
    assert runner.kv_cache.shape[2:5] == (2, 1, B)  # one latent "head", halves in K and V
    spec = runner.kv_cache_spec
    assert spec.kind is KVCacheKind.MLA_LATENT and (spec.num_kv_heads, spec.head_dim) == (1, 20)
    lens = [1, B + 1, 2 * ORIGINAL_CTX + 3]
    n = 2 * NUM_NEW
    reqs = [DrivenRequest(f"r{i}", _prompt(length, seed=length), n, greedy(n), start_step=i,
                          chunks=[length // 2, length - length // 2] if length > B + 1 else None)
            for i, length in enumerate(lens)]
    MiniScheduler(runner, 64).run(reqs)
    outputs = set()
    for r in reqs:
        expected = ref.greedy(r.prompt, n)
        assert r.output == expected, f"prompt {len(r.prompt)}: {r.output} != {expected}"
        outputs.add(tuple(expected))
    assert len(outputs) == len(reqs)  # the model is not degenerate


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_engine_prefix_cache_and_chunked_prefill(tiny, async_scheduling):
    """A prompt past the YaRN threshold prefilled in chunks of at most 16 tokens, then the same
    prompt again served from the prefix cache: both equal ``transformers``."""
    path, ref = tiny
    prompt = _prompt(ORIGINAL_CTX + 21, seed=7)
    engine = _engine(path, max_num_batched_tokens=16, enable_prefix_caching=True,
                     async_scheduling=async_scheduling)
    try:
        first = engine.generate([prompt], GREEDY)[0]
        second = engine.generate([prompt], GREEDY)[0]
    finally:
        engine.shutdown()
    expected = ref.greedy(prompt, NUM_NEW)
    assert first.token_ids == expected
    assert first.num_cached_tokens == 0
    assert second.num_cached_tokens >= (len(prompt) // B) * B - B  # whole blocks hit
    assert second.num_cached_tokens > 0
    assert second.token_ids == expected


def test_engine_preemption(tiny):
    """Four requests that cannot all keep their blocks (12 blocks of 16 tokens for 4 x 4): some
    are preempted and recomputed, and every output still equals ``transformers``."""
    path, ref = tiny
    prompts = [_prompt(ORIGINAL_CTX + 5 + i, seed=100 + i) for i in range(4)]
    sp = SamplingParams(temperature=0.0, max_tokens=2 * NUM_NEW, ignore_eos=True)
    engine = _engine(path, num_gpu_blocks_override=12, enable_prefix_caching=False)
    try:
        outs = engine.generate(prompts, sp)
        preemptions = engine.stats()["num_preemptions_total"]
    finally:
        engine.shutdown()
    assert preemptions > 0
    for p, o in zip(prompts, outs):
        assert o.token_ids == ref.greedy(p, 2 * NUM_NEW)


def test_fp8_latent_cache_chunked_and_cached_equal_whole(tmp_path):
    """An fp8 latent cache (per-layer scales of the K and V halves): a prompt gives the same
    tokens prefilled whole, in chunks, or over a prefix-cache hit."""
    path = str(make_tiny_model(tmp_path / "v2", "deepseek_v2"))
    prompt = _prompt(ORIGINAL_CTX + 13, seed=3)
    runs = {}
    for budget in (2048, 16):
        engine = _engine(path, kv_cache_dtype=KVCacheDtype.FP8_E4M3,
                         max_num_batched_tokens=budget, enable_prefix_caching=True)
        try:
            assert engine.core.runner.kv_cache.dtype == torch.float8_e4m3fn
            scales = engine.core.runner.model.attn_backend.kv_scales
            runs[budget] = engine.generate([prompt], GREEDY)[0].token_ids
            again = engine.generate([prompt], GREEDY)[0]
        finally:
            engine.shutdown()
        assert again.num_cached_tokens > 0 and again.token_ids == runs[budget]
    assert scales is not None and len(scales.k) == 3 and all(s > 0 for s in scales.k + scales.v)
    assert runs[2048] == runs[16]


def test_dummy_weights_generate(tmp_path):
    """``--load-format dummy`` fills every DeepSeek parameter (routers, correction bias, latent
    norms) and the engine generates from them."""
    path = str(make_tiny_model(tmp_path / "v3", "deepseek_v3"))
    engine = _engine(path, load_format="dummy")
    try:
        out = engine.generate([_prompt(20, seed=1)], GREEDY)[0]
    finally:
        engine.shutdown()
    assert len(out.token_ids) == NUM_NEW and out.error is None


def _hf_config(**fields) -> dict:
    base = {"architectures": ["DeepseekV3ForCausalLM"], "hidden_size": 64,
            "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
            "vocab_size": 100, "q_lora_rank": 16, "kv_lora_rank": 32, "qk_nope_head_dim": 16,
            "qk_rope_head_dim": 8, "v_head_dim": 16, "n_routed_experts": 8,
            "num_experts_per_tok": 2, "moe_intermediate_size": 32, "n_group": 4,
            "topk_group": 2, "first_k_dense_replace": 1, "n_shared_experts": 1}
    base.update(fields)
    return base


def test_config_parse():
    cfg = arch_config_from_hf(_hf_config(rope_parameters={
        "rope_type": "yarn", "rope_theta": 1e4, "factor": 40.0, "mscale": 1.0,
        "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096}))
    assert isinstance(cfg, DeepseekArchConfig)
    assert (cfg.num_kv_heads, cfg.head_dim, cfg.qk_head_dim) == (1, 20, 24)
    assert cfg.deepseek_moe.scoring is RouterScoring.SIGMOID
    assert not cfg.deepseek_moe.is_moe_layer(0) and cfg.deepseek_moe.is_moe_layer(1)
    m = 0.1 * 1.0 * torch.log(torch.tensor(40.0)).item() + 1.0
    assert softmax_scale(cfg) == pytest.approx(24 ** -0.5 * m * m)
    lite = arch_config_from_hf(_hf_config(architectures=["DeepseekV2ForCausalLM"],
                                          q_lora_rank=None, topk_method="greedy"))
    assert lite.q_lora_rank is None and lite.deepseek_moe.num_groups == 1
    assert lite.deepseek_moe.scoring is RouterScoring.SOFTMAX


@pytest.mark.parametrize("fields, message", [
    ({"kv_lora_rank": 31}, "must be even"),
    ({"topk_method": "group_limited_greedy"}, "topk_method"),
    ({"n_group": 3}, "do not fit"),
    ({"num_experts_per_tok": 9}, "exceeds"),
    ({"kv_lora_rank": None}, "'kv_lora_rank'"),
    ({"scoring_func": "softmax"}, "scoring_func"),
])
def test_config_refusals(fields, message):
    with pytest.raises(ValueError, match=message):
        arch_config_from_hf(_hf_config(**fields))


def test_v3_router_matches_transformers():
    """The sigmoid router with correction bias, groups, renormalisation and scaling, on random
    logits, against ``DeepseekV3TopkRouter``."""
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    hf_cfg = DeepseekV3Config(hidden_size=16, n_routed_experts=8, num_experts_per_tok=3,
                              n_group=4, topk_group=2, norm_topk_prob=True,
                              routed_scaling_factor=2.5)
    router = DeepseekV3TopkRouter(hf_cfg)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        router.weight.normal_(generator=gen)
        router.e_score_correction_bias.normal_(0.0, 0.3, generator=gen)
    x = torch.randn(32, 16, generator=gen)
    logits, hf_w, hf_ids = router(x)
    moe = arch_config_from_hf(_hf_config(num_experts_per_tok=3, norm_topk_prob=True,
                                         routed_scaling_factor=2.5)).deepseek_moe
    w, ids = route_deepseek(logits.detach(), moe, router.e_score_correction_bias, torch.float32)
    order, hf_order = ids.sort(-1), hf_ids.sort(-1)
    assert torch.equal(order.values, hf_order.values)
    torch.testing.assert_close(w.gather(1, order.indices),
                               hf_w.detach().gather(1, hf_order.indices))


@pytest.mark.slow  # starts a TP worker process
@pytest.mark.parametrize("arch", ["deepseek_v2", "deepseek_v3"])
def test_tp2_greedy_equals_tp1(tmp_path, arch):
    """Query heads, ``kv_b_proj`` and ``o_proj`` split by heads, the latent replicated, dense
    and shared-expert MLPs and the routed experts sharded: TP 2 (CPU, gloo) equals TP 1, with
    chunked prefill and multi-step decode rounds, past the YaRN threshold."""
    path = str(make_tiny_model(tmp_path / arch, arch))
    prompts = [_prompt(n, seed=n) for n in (1, 7, ORIGINAL_CTX + 13)]

    def run(tp: int) -> list[list[int]]:
        engine = LLMEngine(EngineConfig(
            model=path, device="cpu", tensor_parallel_size=tp, max_model_len=128, block_size=B,
            num_gpu_blocks_override=64, max_num_batched_tokens=16, num_scheduler_steps=3))
        try:
            return [o.token_ids for o in engine.generate(prompts, GREEDY)]
        finally:
            engine.shutdown()

    single = run(1)
    assert all(len(t) == NUM_NEW for t in single)
    assert run(2) == single


@pytest.mark.parametrize("query_len, num_computed", [(5, 0), (4, 11), (17, 30)])
def test_absorbed_and_expanded_prefill_agree(query_len, num_computed):
    """The two forms of a prefill chunk (with and without cached context) give the same
    attention output; which one runs is a cost choice only."""
    from pdserve.attention.mla import MLAGeometry, prefill_uses_absorbed

    g = MLAGeometry(num_heads=4, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8,
                    v_head_dim=16)
    backend = MLAAttentionBackend(g, block_size=B, scale=0.2)
    gen = torch.Generator().manual_seed(query_len)
    ctx_len = num_computed + query_len
    q_nope = torch.randn(query_len, 4, 16, generator=gen, dtype=torch.float64)
    q_pe = torch.randn(query_len, 4, 8, generator=gen, dtype=torch.float64)
    ctx = torch.randn(ctx_len, 40, generator=gen, dtype=torch.float64)
    w = torch.randn(4, 32, 32, generator=gen, dtype=torch.float64) * 0.2
    mask = None
    if num_computed:
        q_pos = torch.arange(num_computed, ctx_len)[:, None]
        mask = torch.arange(ctx_len)[None, :] <= q_pos
    expanded = backend._prefill(q_nope, q_pe, ctx, w, mask)
    absorbed = backend._prefill_absorbed(q_nope, q_pe, ctx, w[:, :16], w[:, 16:], mask)
    torch.testing.assert_close(absorbed, expanded)
    # short chunks over long contexts go absorbed, whole prompts expanded (this geometry:
    # absorbed below about r * (nope + v) / (2r - nope - v) = 32 queries)
    assert prefill_uses_absorbed(4, 400, g) and not prefill_uses_absorbed(64, 64, g)


def test_start_up_summary_and_multi_token_prediction_layers_skipped(caplog, tmp_path):
    """The start-up line counts the active experts and the latent cache (1 head of W / 2, K and
    V slots); V3's multi-token-prediction layer past ``num_hidden_layers`` is not loaded."""
    path = make_tiny_model(tmp_path / "v3", "deepseek_v3", tokenizer_dir=tmp_path)
    with caplog.at_level(logging.INFO, logger="pdserve.model"):
        loaded = load_model(EngineConfig(model=str(path)))
    line = next(r.getMessage() for r in caplog.records if "parameters" in r.getMessage())
    total = sum(p.numel() for p in loaded.model.parameters())
    active = total - 2 * (8 - 2) * 3 * 64 * 32  # layers 1 and 2: 6 of 8 experts idle
    assert line.startswith("DeepSeek-V3: "), line
    assert f"{total / 1e6:.1f}M parameters ({active / 1e6:.1f}M active per token)" in line
    assert f"KV 3 layers x 1 heads x 20 = {2 * 3 * 20 * 4 / 1024:.1f} KiB per token, rope yarn" \
        in line, line
    cfg = json.loads((path / "config.json").read_text())
    extra = [(f"model.layers.{cfg['num_hidden_layers']}.eh_proj.weight", torch.zeros(64, 128))]
    # each lazy weight is read while its file is open: chained, not listed first
    loaded.model.load_weights(itertools.chain(iter_safetensors([path / "model.safetensors"]),
                                              extra))  # no "unexpected weight"


def test_latent_blocks_read_into_another_instance_continue_the_sequence(tiny):
    """What a P/D transfer does, in-process: P prefills a prompt past the YaRN threshold; its
    latent blocks, copied whole into other block ids of D's cache, let D recompute only the last
    prompt token and generate ``transformers``' continuation (a block holds everything about
    its tokens: the latent and the rotated ``k_pe``, nothing of the instance)."""
    path, ref = tiny
    config = EngineConfig(model=path, max_model_len=128, block_size=B, num_gpu_blocks_override=16)
    p, d = ModelRunner(config), ModelRunner(config)
    p.allocate_kv_cache(16)
    d.allocate_kv_cache(16)
    prompt = _prompt(2 * ORIGINAL_CTX + 7, seed=11)
    n_blocks = -(-len(prompt) // B)
    p_blocks, d_blocks = list(range(n_blocks)), list(range(16 - n_blocks, 16))[::-1]
    first = DrivenRequest("p", prompt, 1, greedy(1), block_ids=list(p_blocks))
    MiniScheduler(p, 16).run([first])
    d.kv_cache[d_blocks] = p.kv_cache[p_blocks]
    n = NUM_NEW
    cont = DrivenRequest("d", prompt, n, greedy(n), num_computed=len(prompt) - 1,
                         block_ids=list(d_blocks), chunks=[1])
    MiniScheduler(d, 16 - n_blocks).run([cont])  # free: the ids below the copied blocks
    expected = ref.greedy(prompt, n)
    assert first.output == expected[:1]
    assert cont.output == expected
