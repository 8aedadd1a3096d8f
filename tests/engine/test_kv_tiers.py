"""KV cache tiers: the TierManager's bookkeeping on its own, and the scheduler with tiers over a
fake runner that copies its fake KV exactly as the tier jobs say (tests/support/tier_fakes.py):
every multi-turn history is evicted from the small device cache and must come back from the
host or disk tier with the reference tokens."""

from __future__ import annotations

import random

import pytest

from pdserve.engine.kv_tiers import TierManager
from pdserve.types.kv_events import BlockRemoved, BlockStored
from pdserve.types.kv_tiers import KVOffloadingConfig, KVTierMedium, KVTierReport, TierJobKind
from pdserve.types.request import RequestStatus
from tests.support.engine_fakes import (
    add, assert_all_free, collect, reference_generate, run_until_done,
)
from tests.support.tier_fakes import make_tiered_core

pytestmark = pytest.mark.usefixtures("scheduling_mode")

CPU, DISK = KVTierMedium.CPU, KVTierMedium.DISK


# ---------------------------------------------------------------- TierManager alone
def test_evicted_blocks_go_to_host_then_disk_in_lru_order():
    tm = TierManager(host_blocks=2, disk_blocks=2, block_bytes=10)
    tm.enable_events()
    for b, h in enumerate([101, 102, 103]):
        tm.on_evict(b, h)
    jobs = tm.take_jobs().jobs
    kinds = [(j.kind, j.block_hash) for j in jobs]
    # the third store evicts the least recent host block (101) to disk, into the freed slot
    assert kinds == [(TierJobKind.STORE, 101), (TierJobKind.STORE, 102),
                     (TierJobKind.DISK_WRITE, 101), (TierJobKind.STORE, 103)]
    assert jobs[2].slot == jobs[0].slot == jobs[3].slot
    assert tm.match([101, 102, 103, 104]) == [DISK, CPU, CPU]
    events = tm.take_events()
    assert BlockStored([101, 102], medium="CPU") in events
    assert BlockRemoved([101], medium="CPU") in events and BlockStored([101], medium="DISK") in events
    assert tm.snapshot() == {"CPU": [102, 103], "DISK": [101]}
    tm.check_consistency()


def test_a_hash_already_held_is_not_copied_again():
    tm = TierManager(host_blocks=4)
    tm.on_evict(0, 7)
    tm.take_jobs()
    tm.on_evict(3, 7)  # the same tokens evicted again from another block
    assert tm.take_jobs() is None
    assert tm.stats()["media"]["CPU"]["stored"] == 1


def test_pinned_slots_are_never_evicted_and_a_filling_slot_is_not_matched():
    tm = TierManager(host_blocks=1, disk_blocks=4)
    tm.on_evict(0, 1)
    tm.on_evict(1, 2)  # 1 goes to disk
    tm.take_jobs()
    assert tm.match([1, 2]) == [DISK, CPU]
    assert tm.start_load("r", [1], [5]) == 1  # 1 from disk evicts 2 (to disk) from the slot
    load = [j for j in tm.take_jobs().jobs if j.kind is TierJobKind.LOAD][0]
    assert load.from_disk and load.block_id == 5
    assert tm.match([1]) == []  # its file read is in flight
    tm.on_evict(2, 3)  # the only slot is pinned: block 3 is dropped
    assert tm.stats()["dropped"] == 1 and tm.take_jobs() is None
    done = tm.loads_reported(KVTierReport(finished_loads={load.job_id}))
    assert [(d.request_id, d.num_blocks, d.num_good) for d in done] == [("r", 1, 1)]
    assert tm.match([1]) == [CPU]
    tm.check_consistency()


def test_a_failed_read_forgets_the_block_in_every_tier():
    tm = TierManager(host_blocks=1, disk_blocks=4)
    tm.on_evict(0, 1)
    tm.on_evict(1, 2)
    tm.take_jobs()
    tm.start_load("r", [1], [5])
    load = [j for j in tm.take_jobs().jobs if j.kind is TierJobKind.LOAD][0]
    done = tm.loads_reported(KVTierReport(failed_loads={load.job_id}))
    assert [(d.num_blocks, d.num_good) for d in done] == [(1, 0)]
    assert tm.match([1]) == []
    assert [(j.kind, j.block_hash) for j in tm.take_jobs().jobs] == [(TierJobKind.DISK_DELETE, 1)]
    tm.check_consistency()


@pytest.mark.parametrize("flags, message", [
    ((0.0, None, None, None), "must be a finite number > 0"),
    ((float("inf"), None, None, None), "must be a finite number > 0"),
    ((1.0, "lmcache", None, None), "must be 'native'"),
    ((None, None, "/tmp/x", 1.0), "need --kv-offloading-size"),
    ((1.0, None, "/tmp/x", None), "go together"),
    ((1.0, None, "/tmp/x", -2.0), "must be a finite number > 0"),
    ((1.0, None, "/tmp/x", float("inf")), "must be a finite number > 0"),
])
def test_bad_flags_are_refused_with_the_flag_named(flags, message):
    with pytest.raises(ValueError, match=message):
        KVOffloadingConfig.from_flags(*flags)


def test_a_tier_smaller_than_a_block_is_refused():
    off = KVOffloadingConfig.from_flags(1e-9, "native", None, None)
    with pytest.raises(ValueError, match="holds no KV block"):
        off.capacity(block_bytes=4096)
    assert KVOffloadingConfig.from_flags(None, None, None, None) is None


# ---------------------------------------------------------------- scheduler with tiers
def conversations(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(0, 900) for _ in range(rng.randint(9, 15))] for _ in range(n)]


def chat(core, runner, convs, turns: int = 3, max_tokens: int = 4, batch: bool = False):
    """Run ``turns`` turns of every conversation (one at a time, or all at once with
    ``batch``), checking each answer against the reference; returns the core's stats."""
    rng = random.Random(1)
    for turn in range(turns):
        ids = [f"c{c}-t{turn}" for c in range(len(convs))]
        for group in ([list(range(len(convs)))] if batch else [[c] for c in range(len(convs))]):
            for c in group:
                add(core, ids[c], convs[c], max_tokens=max_tokens)
            res = run_until_done(core)
            for c in group:
                out = res[ids[c]].tokens
                assert out == reference_generate(convs[c], max_tokens), (turn, c)
                convs[c] = convs[c] + out + [rng.randrange(0, 900) for _ in range(3)]
    return core.stats()


@pytest.mark.parametrize("batch", [False, True], ids=["one-by-one", "batched"])
@pytest.mark.parametrize("delay", [0, 2], ids=["sync-copy", "delayed-copy"])
def test_histories_come_back_from_the_host_tier_with_reference_tokens(batch, delay):
    core, runner = make_tiered_core(num_blocks=20, host_blocks=200, load_delay_steps=delay)
    stats = chat(core, runner, conversations(5, seed=3), batch=batch)
    tiers = stats["kv_tiers"]
    assert tiers["media"]["CPU"]["hits"] > 10 and tiers["prompt_tokens_loaded"] > 40
    assert stats["prompt_tokens_computed_total"] < stats["prompt_tokens_total"] - 40
    assert_all_free(core)
    core.scheduler.tiers.check_consistency()


def test_histories_come_back_from_the_disk_tier_below_a_tiny_host_tier():
    core, runner = make_tiered_core(num_blocks=20, host_blocks=3, disk_blocks=500)
    stats = chat(core, runner, conversations(5, seed=4))
    media = stats["kv_tiers"]["media"]
    assert media["DISK"]["hits"] > 10 and media["CPU"]["evictions"] > 10
    assert_all_free(core)
    core.scheduler.tiers.check_consistency()


def test_a_corrupt_file_is_a_miss_and_the_tokens_stay_exact():
    core, runner = make_tiered_core(num_blocks=20, host_blocks=3, disk_blocks=500)
    convs = conversations(6, seed=5)
    chat(core, runner, convs, turns=2)
    assert len(runner.disk) > 10
    runner.corrupt = set(runner.disk)  # every file written so far is bad
    stats = chat(core, runner, convs, turns=1)
    assert stats["kv_tiers"]["failed_loads"] > 0
    assert_all_free(core)
    core.scheduler.tiers.check_consistency()


def test_tiers_on_and_off_give_the_same_tokens_under_preemption():
    convs = conversations(6, seed=6)
    core, runner = make_tiered_core(num_blocks=14, host_blocks=40, disk_blocks=40,
                                    max_num_batched_tokens=8)
    stats = chat(core, runner, [list(c) for c in convs], batch=True)
    assert stats["num_preemptions_total"] > 0 and stats["kv_tiers"]["media"]["CPU"]["hits"] > 0
    assert_all_free(core)


def steps_to_first_token(core, request_id: str, prompt: list[int]) -> int:
    add(core, request_id, prompt, max_tokens=4)
    for n in range(1, 50):
        outputs, _ = core.step()
        if any(o.request_id == request_id and o.new_token_ids for o in outputs):
            return n
    raise AssertionError("no first token")


def test_a_host_tier_hit_costs_no_step_more_than_a_device_hit():
    """Oracle of the swap-in latency: a history in the host tier is loaded and computed in the
    step that admits it (the runner's forward waits for the step's host LOADs), so its first
    token comes after as many engine steps as with the history still in the device cache. A
    disk hit parks the request until its reads are reported: at least one step more."""
    convs = conversations(6, seed=8)
    steps = {}
    for name, num_blocks, host, disk in (("device", 200, 50, 0), ("host", 12, 50, 0),
                                         ("disk", 12, 1, 500)):
        core, runner = make_tiered_core(num_blocks=num_blocks, host_blocks=host, disk_blocks=disk)
        cs = [list(c) for c in convs]
        chat(core, runner, cs, turns=1)
        before = core.stats()["kv_tiers"]["media"]
        steps[name] = steps_to_first_token(core, "again", cs[0])
        after = core.stats()["kv_tiers"]["media"]
        medium = {"device": None, "host": "CPU", "disk": "DISK"}[name]
        if medium is None:
            assert after["CPU"]["hits"] == before["CPU"]["hits"]
        else:
            assert after[medium]["hits"] > before[medium]["hits"]
        run_until_done(core)
        assert_all_free(core)
        core.scheduler.tiers.check_consistency()
    assert steps["host"] == steps["device"], steps
    assert steps["disk"] > steps["device"], steps


@pytest.mark.parametrize("end", ["abort", "preempt"])
def test_a_host_tier_hit_that_ends_before_its_copies_are_reported_leaks_nothing(end,
                                                                              scheduling_mode):
    """A host-tier hit runs in the step that loads it; the load is detached from the request,
    so it may be aborted (or preempted and admitted again) while the copies' report lags: its
    blocks are freed at once, the host slots stay pinned until the report."""
    if end == "preempt" and scheduling_mode:
        pytest.skip("preempting by hand while a launched step holds the request")
    core, runner = make_tiered_core(num_blocks=12, host_blocks=50, load_delay_steps=3)
    convs = conversations(6, seed=7)
    chat(core, runner, convs, turns=1)
    add(core, "victim", convs[0], max_tokens=4)
    results: dict = {}
    collect(results, core.step()[0])
    sched = core.scheduler
    req = sched.requests["victim"]
    assert req.status is RequestStatus.RUNNING and not sched.tiers.is_loading("victim")
    assert sched.tiers._slot_pins  # the copies are not reported yet
    if end == "abort":
        core.abort_requests(["victim"])
        assert not sched.kv_cache_manager.get_block_ids("victim")
    else:
        sched.running_batch.preempt(req)
        res = run_until_done(core, results)
        assert res["victim"].tokens == reference_generate(convs[0], 4)
    for _ in range(6):
        core.step()
    assert not sched.has_pending_kv_work() and not sched.tiers._slot_pins
    assert_all_free(core)
    sched.tiers.check_consistency()
    chat(core, runner, convs, turns=1)


def test_an_abort_during_a_swap_in_leaks_no_block():
    # a disk tier below a tiny host tier: the request parks while its files are read
    core, runner = make_tiered_core(num_blocks=12, host_blocks=1, disk_blocks=500,
                                    load_delay_steps=3)
    convs = conversations(6, seed=7)
    chat(core, runner, convs, turns=1)
    add(core, "victim", convs[0], max_tokens=4)
    for _ in range(3):
        core.step()
        if core.scheduler.tier_loads.waiting:
            break
    req = core.scheduler.tier_loads.waiting.get("victim")
    assert req is not None and req.status is RequestStatus.WAITING_FOR_TIER_KVS
    core.abort_requests(["victim"])
    assert core.scheduler.kv_cache_manager.get_block_ids("victim")  # held while copies run
    for _ in range(6):
        core.step()
    assert not core.scheduler.has_pending_kv_work()
    assert_all_free(core)
    core.scheduler.tiers.check_consistency()
    chat(core, runner, convs, turns=1)  # and the engine goes on serving exact tokens


def test_kv_events_follow_every_tier_and_a_router_index_agrees(monkeypatch):
    """The core publishes the KV cache's events and the tiers' (with ``medium``) together; a
    router index fed with them holds exactly what each tier holds, also after a snapshot."""
    from pdserve.router.kv_index import InstanceKVIndex
    from pdserve.types.kv_events import KVEventBatch, KVSnapshot
    from tests.support.ports import free_port

    core, runner = make_tiered_core(num_blocks=20, host_blocks=6, disk_blocks=500,
                                    kv_events_endpoint=f"tcp://127.0.0.1:{free_port()}",
                                    kv_events_snapshot_endpoint=f"tcp://127.0.0.1:{free_port()}")
    batches: list = []
    monkeypatch.setattr(core.kv_events, "publish", lambda events: batches.append(list(events)))
    index = InstanceKVIndex("http://x")
    index.apply_snapshot(KVSnapshot(1, 0, 4, []))
    step = core.step

    def step_and_publish():
        out = step()
        core.publish_kv_events()
        index.apply_batch(KVEventBatch(1, index.seq + 1, 0.0, batches[-1]))
        return out

    monkeypatch.setattr(core, "step", step_and_publish)
    chat(core, runner, conversations(6, seed=8), turns=2)
    tiers = core.scheduler.tiers.snapshot()
    assert tiers["CPU"] and tiers["DISK"]
    assert index.hashes == set(core.scheduler.kv_cache_manager.cached_block_hashes())
    assert {m: sorted(s) for m, s in index.tier_hashes.items()} == {
        m: sorted(hs) for m, hs in tiers.items()}
    try:
        core.kv_events.close()
    finally:
        core.kv_events = None
