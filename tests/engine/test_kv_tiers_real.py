"""KV cache tiers on the real engine (ModelRunner on the tiny random Llama, CPU, float32,
in-process): multi-turn chats whose histories do not fit in the device cache give the same
greedy tokens with tiers on and off, the histories come back from the host or the disk tier
(the tier counters prove it), and a corrupted block file is a miss with a warning."""

from __future__ import annotations

import glob
import time
import logging
import os

import pytest

from tests.support import engine_fakes
from pdserve.engine.llm_engine import LLMEngine
from pdserve.types.engine_config import EngineConfig, KVCacheDtype
from pdserve.types.kv_tiers import KVOffloadingConfig
from pdserve.types.sampling_params import SamplingParams

BS = 4
GREEDY = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)

pytestmark = pytest.mark.usefixtures("scheduling_mode")


def make_engine(path: str, off: KVOffloadingConfig | None,
                kv_cache_dtype: KVCacheDtype = KVCacheDtype.AUTO) -> LLMEngine:
    return LLMEngine(EngineConfig(
        model=path, dtype="float32", device="cpu", block_size=BS, max_model_len=96,
        num_gpu_blocks_override=24, async_scheduling=engine_fakes.ASYNC_SCHEDULING,
        kv_offloading=off, kv_cache_dtype=kv_cache_dtype))


def three_turns(engine: LLMEngine, before_turn=None) -> list[list[int]]:
    """Three turns of four conversations, one request at a time (each turn's history is
    evicted by the others'); returns every answer in order."""
    convs = [[(7 * c + 3 * i) % 3000 + 50 for i in range(30)] for c in range(4)]
    answers = []
    for turn in range(3):
        if before_turn is not None:
            before_turn(turn)
        for c in range(4):
            out = engine.generate([convs[c]], GREEDY)[0]
            assert out.finish_reason == "length"
            answers.append(out.token_ids)
            convs[c] = convs[c] + out.token_ids + [(11 * c + turn + j) % 3000 + 60
                                                   for j in range(5)]
    return answers


def finish(engine: LLMEngine) -> dict:
    stats = engine.stats()
    kvm = engine.kv_cache_manager
    kvm.check_consistency()
    assert kvm.num_free_blocks == kvm.num_blocks
    if engine.scheduler.tiers is not None:
        engine.scheduler.tiers.check_consistency()
    engine.shutdown()
    return stats


@pytest.fixture(scope="module")
def tiers_off(tiny_llama_path) -> tuple[list[list[int]], dict]:
    engine = make_engine(tiny_llama_path, None)
    answers = three_turns(engine)
    return answers, finish(engine)


def test_host_tier_gives_the_same_tokens_and_serves_the_histories(tiny_llama_path, tiers_off):
    # 2 KiB blocks (2 layers, 2 KV heads, head_dim 32, float32, 4 tokens): room for 512
    engine = make_engine(tiny_llama_path, KVOffloadingConfig(host_bytes=512 * 2048))
    answers = three_turns(engine)
    stats = finish(engine)
    assert answers == tiers_off[0]
    tiers = stats["kv_tiers"]
    assert tiers["media"]["CPU"]["hits"] >= 30 and tiers["prompt_tokens_loaded"] >= 120
    assert stats["prompt_tokens_computed_total"] < tiers_off[1]["prompt_tokens_computed_total"] - 120


def test_disk_tier_below_a_tiny_host_tier_and_a_corrupt_file(tiny_llama_path, tiers_off, tmp_path,
                                                            caplog):
    off = KVOffloadingConfig(host_bytes=4 * 2048, disk_dir=str(tmp_path), disk_bytes=400 * 2048)
    engine = make_engine(tiny_llama_path, off)

    def corrupt(turn: int) -> None:
        if turn != 2:
            return
        files = sorted(glob.glob(str(tmp_path / "*" / "*.kvblock")))
        assert len(files) > 10
        for f in files[::2]:  # flip bytes in every other file, truncate one more
            with open(f, "r+b") as fh:
                fh.seek(200)
                fh.write(b"\x00\xff\x00\xff")
        os.truncate(files[1], 40)

    with caplog.at_level(logging.WARNING, logger="pdserve.model"):
        answers = three_turns(engine, corrupt)
    stats = finish(engine)
    assert answers == tiers_off[0]
    media = stats["kv_tiers"]["media"]
    assert media["DISK"]["hits"] >= 20 and stats["kv_tiers"]["failed_loads"] >= 1
    assert any("fails its checksum" in r.getMessage() for r in caplog.records)
    assert not glob.glob(str(tmp_path / "*" / "*.kvblock"))  # removed at shutdown


@pytest.mark.parametrize("host_blocks", [10, 24])
def test_a_history_pushed_to_disk_by_its_own_allocation_is_not_read_as_host_blocks(
        tiny_llama_path, tiers_off, tmp_path, host_blocks):
    """A history matched in the host tier can move to disk while the request's blocks are
    allocated (the allocation evicts cached device blocks into the host tier, which pushes
    older host blocks down): the load then waits for the file reads instead of being computed
    in the same step as a host-only load (which read blocks not loaded yet: other tokens)."""
    off = KVOffloadingConfig(host_bytes=host_blocks * 2048, disk_dir=str(tmp_path),
                             disk_bytes=400 * 2048)
    engine = make_engine(tiny_llama_path, off)
    answers = three_turns(engine)
    stats = finish(engine)
    assert answers == tiers_off[0]
    assert stats["kv_tiers"]["media"]["DISK"]["hits"] >= 20


def test_fp8_cache_with_host_and_disk_tiers_gives_the_same_tokens(tiny_llama_path, tmp_path,
                                                                  scheduling_mode):
    """The tiers copy an fp8 cache's bytes as they are (1-byte elements, the same scales)."""
    if scheduling_mode:
        pytest.skip("the tiers' copies do not depend on the scheduling mode: once is enough")
    fp8 = KVCacheDtype.FP8_E4M3
    engine = make_engine(tiny_llama_path, None, fp8)
    expected = three_turns(engine)
    finish(engine)
    off = KVOffloadingConfig(host_bytes=6 * 512, disk_dir=str(tmp_path), disk_bytes=400 * 512)
    engine = make_engine(tiny_llama_path, off, fp8)
    answers = three_turns(engine)
    stats = finish(engine)
    assert answers == expected
    assert stats["kv_tiers"]["media"]["DISK"]["hits"] >= 20


@pytest.mark.slow
def test_tp2_with_host_and_disk_tiers_gives_the_tp1_tokens(tiny_llama_path, tiers_off, tmp_path,
                                                          scheduling_mode):
    """At TP 2 every rank keeps its shard of each block in its own host pool and files (the
    reports merged: a load is done when both ranks did it)."""
    if scheduling_mode:
        pytest.skip("tensor-parallel engines run synchronous steps")
    off = KVOffloadingConfig(host_bytes=8 * 2048, disk_dir=str(tmp_path), disk_bytes=400 * 2048)
    engine = LLMEngine(EngineConfig(
        model=tiny_llama_path, dtype="float32", device="cpu", block_size=BS, max_model_len=96,
        num_gpu_blocks_override=24, tensor_parallel_size=2, kv_offloading=off))
    answers = three_turns(engine)
    stats = finish(engine)
    assert answers == tiers_off[0]
    media = stats["kv_tiers"]["media"]
    assert media["DISK"]["hits"] >= 20


def test_an_abort_while_a_block_file_is_read_leaks_no_block(tiny_llama_path, tmp_path,
                                                            monkeypatch):
    """A request parked on a disk read (slowed down here) is aborted: its blocks stay held
    until the read is over, then everything is free and the engine serves on."""
    from pdserve.runner import kv_tier_store
    from pdserve.types.core_messages import AddRequest
    from pdserve.types.request import RequestStatus

    off = KVOffloadingConfig(host_bytes=2 * 2048, disk_dir=str(tmp_path), disk_bytes=400 * 2048)
    engine = make_engine(tiny_llama_path, off)
    history = [(5 * i) % 3000 + 70 for i in range(40)]
    engine.generate([history], GREEDY)
    engine.generate([[(9 * i) % 3000 + 80 for i in range(80)]], GREEDY)  # evicts the history
    read = kv_tier_store._DiskIO.read

    def slow_read(self, block_hash, expected_len):
        time.sleep(0.3)
        return read(self, block_hash, expected_len)

    monkeypatch.setattr(kv_tier_store._DiskIO, "read", slow_read)
    core = engine.core
    core.add_request(AddRequest("victim", history + [7, 8, 9], GREEDY))
    core.step()
    loads = core.scheduler.tier_loads
    assert loads.waiting["victim"].status is RequestStatus.WAITING_FOR_TIER_KVS
    core.abort_requests(["victim"])
    assert loads.num_held_blocks > 0  # the read still writes into them
    deadline = time.monotonic() + 30
    while core.has_work():
        assert time.monotonic() < deadline
        core.step()
        time.sleep(0.01)
    assert loads.num_held_blocks == 0
    again = engine.generate([history + [7, 8, 9]], GREEDY)[0]
    assert again.finish_reason == "length"
    finish(engine)
