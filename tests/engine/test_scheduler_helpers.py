"""Each of the scheduler's helpers built alone from its collaborators (queues, block manager,
remote-KV state, limits), without a Scheduler: what it decides, what state it owns, and the
outcome it hands back for its owner to apply."""

from __future__ import annotations

from pdserve.engine.admission import Admission, Admitter
from pdserve.engine.async_scheduling import AsyncSchedulingPolicy
from pdserve.engine.block_manager import KVCacheManager
from pdserve.engine.multi_step import MultiStepRounds
from pdserve.engine.remote_kv import LoadOutcome, RemoteKV
from pdserve.engine.request_queues import RequestQueues, scheduled_request
from pdserve.engine.token_acceptor import TokenAcceptor
from pdserve.types.kv_transfer_config import KVLoadFailurePolicy
from pdserve.types.outputs import (PLACEHOLDER_TOKEN, KVConnectorOutput, KVLoadError, KVLoadFailure,
                                   SchedulerOutput)
from pdserve.types.request import Request, RequestStatus
from pdserve.types.sampling_params import SamplingParams

BS = 4
EOS = 99


def request(request_id: str, prompt: list[int], **sp) -> Request:
    return Request(request_id=request_id, prompt_token_ids=prompt, sampling_params=SamplingParams(**sp),
                   eos_token_id=EOS)


class StubConnector:
    """The KV connector's scheduler side, scripted: every request matches ``external`` tokens
    (loaded asynchronously when ``load_async``); a finished request's blocks are held when
    ``hold``."""

    def __init__(self, external: int = 0, load_async: bool = True, hold: bool = False,
                 policy: str | None = None):
        self.external, self.load_async, self.hold, self.policy = external, load_async, hold, policy
        self.calls: list[tuple] = []

    def get_num_new_matched_tokens(self, req, num_local):
        self.calls.append(("matched", req.request_id, num_local))
        return self.external, self.load_async

    def update_state_after_alloc(self, req, block_ids, num_external):
        self.calls.append(("alloc", req.request_id, list(block_ids), num_external))

    def request_finished(self, req, block_ids):
        self.calls.append(("finished", req.request_id))
        return self.hold, {"held": self.hold}

    def load_failure_policy(self, req):
        return self.policy

    def update_connector_output(self, kv_out):
        self.calls.append(("output",))

    def has_pending_work(self):
        return False

    def release_held_blocks(self, request_id):
        self.calls.append(("release", request_id))


def parts(num_blocks: int = 16, connector=None, policy=KVLoadFailurePolicy.FAIL, max_num_seqs: int = 8):
    queues = RequestQueues()
    kvm = KVCacheManager(num_blocks, BS, enable_prefix_caching=True)
    remote_kv = RemoteKV(kvm, connector, policy)
    admitter = Admitter(queues, kvm, remote_kv, max_num_seqs)
    return queues, kvm, remote_kv, admitter


# ---------------------------------------------------------------- RequestQueues
def test_requeue_front_puts_the_request_first_and_waiting():
    queues = RequestQueues()
    a, b = request("a", [1, 2]), request("b", [3])
    queues.waiting.append(a)
    b.status = RequestStatus.WAITING_FOR_REMOTE_KVS
    queues.requeue_front(b)
    assert list(queues.waiting) == [b, a] and b.status == RequestStatus.WAITING


def test_scheduled_request_samples_only_at_the_last_known_token():
    req = request("r", [1, 2, 3, 4, 5])
    chunk = scheduled_request(req, 0, 3)
    assert chunk.token_ids == [1, 2, 3] and not chunk.sample and not chunk.input_from_previous_step
    last = scheduled_request(req, 3, 2)
    assert last.token_ids == [4, 5] and last.sample and last.num_output_tokens == -1
    ahead = scheduled_request(req, 5, 1, total=6, pending=True)
    assert ahead.token_ids == [PLACEHOLDER_TOKEN] and ahead.sample and ahead.input_from_previous_step
    assert ahead.num_output_tokens == 1


# ---------------------------------------------------------------- Admitter
def test_admitter_schedules_fcfs_within_budget_and_counts_its_prefix_hits():
    queues, kvm, _, admitter = parts()
    first = request("a", list(range(1, 10)))  # 9 tokens: 2 full blocks
    queues.waiting.append(first)
    sched_out = SchedulerOutput()
    assert admitter.admit_waiting(sched_out, 100) == 91
    assert queues.running == [first] and first.status == RequestStatus.RUNNING
    assert [len(sr.token_ids) for sr in sched_out.scheduled] == [9]
    first.num_computed_tokens = 9
    kvm.cache_blocks(first, 9)
    assert admitter.prompt_tokens_cached_total == 0

    second = request("b", list(range(1, 10)) + [50])  # same 8-token prefix
    third = request("c", [7] * 12)
    queues.waiting.extend([second, third])
    sched_out = SchedulerOutput()
    assert admitter.admit_waiting(sched_out, 5) == 0  # b computes 2 tokens, c gets 3 of 12
    assert [(sr.request_id, sr.num_computed_tokens, len(sr.token_ids)) for sr in sched_out.scheduled] == [
        ("b", 8, 2), ("c", 0, 3)]
    assert second.num_cached_tokens == 8 and admitter.prompt_tokens_cached_total == 8
    assert not queues.waiting


def test_admitter_stops_at_max_num_seqs_and_a_blocked_request_keeps_its_place():
    queues, kvm, _, admitter = parts(num_blocks=3, max_num_seqs=2)
    big, small, other = request("big", [1] * 16), request("small", [2]), request("x", [3])
    queues.waiting.extend([big, small, other])
    sched_out = SchedulerOutput()
    admitter.admit_waiting(sched_out, 100)
    # big needs 4 blocks of 3: blocked, and nothing behind it holds blocks to go ahead with
    assert not sched_out.scheduled and list(queues.waiting) == [big, small, other]
    assert admitter.try_schedule(queues.waiting.popleft(), SchedulerOutput(), 100) is Admission.BLOCKED
    queues.waiting.clear()
    queues.waiting.extend([small, other, request("y", [4])])
    admitter.admit_waiting(SchedulerOutput(), 100)
    assert queues.running == [small, other] and [r.request_id for r in queues.waiting] == ["y"]


def test_admitter_parks_an_async_load_with_remote_kv():
    connector = StubConnector(external=8, load_async=True)
    queues, kvm, remote_kv, admitter = parts(connector=connector)
    req = request("d", list(range(1, 12)))
    queues.waiting.append(req)
    sched_out = SchedulerOutput()
    assert admitter.admit_waiting(sched_out, 100) == 100
    assert not sched_out.scheduled and not queues.running and not queues.waiting
    assert req.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    assert remote_kv.waiting_for_remote == {"d": req} and remote_kv.pending_load == {"d": (0, 8)}
    assert ("alloc", "d", req.block_ids, 8) in connector.calls and len(req.block_ids) == 2


# ---------------------------------------------------------------- RemoteKV
def parked(connector, prompt_len: int = 11, num_blocks: int = 16, policy=KVLoadFailurePolicy.FAIL):
    queues, kvm, remote_kv, admitter = parts(num_blocks=num_blocks, connector=connector, policy=policy)
    req = request("d", list(range(1, prompt_len + 1)))
    queues.waiting.append(req)
    admitter.admit_waiting(SchedulerOutput(), 100)
    return kvm, remote_kv, req


def test_remote_kv_a_finished_load_is_a_loaded_result_for_the_owner():
    kvm, remote_kv, req = parked(StubConnector(external=8))
    kv_out = KVConnectorOutput(finished_recving={"d"})
    remote_kv.update_connector_output(kv_out)
    result = remote_kv.load_finished("d", kv_out)
    assert result.outcome is LoadOutcome.LOADED and result.request is req and result.first_token is None
    assert req.num_computed_tokens == 8 and req.num_transferred_tokens == 8
    assert remote_kv.prompt_tokens_transferred_total == 8
    assert not remote_kv.waiting_for_remote and not remote_kv.pending_load
    assert kvm.num_cached_blocks == 2  # the loaded blocks went into the prefix cache
    # the request itself is untouched by queues: its owner requeues it
    assert req.status == RequestStatus.WAITING_FOR_REMOTE_KVS


def test_remote_kv_a_whole_prompt_loads_first_token_is_ready_before_the_load_ends():
    _, remote_kv, req = parked(StubConnector(external=8), prompt_len=8)
    # reported at the lease claim, the load still in flight: the caller appends it at once
    early = KVConnectorOutput(first_tokens={"d": 42})
    assert remote_kv.first_tokens_ready(early, lambda r, t: False) == [(req, 42)]
    req.output_token_ids.append(42)  # what the scheduler's append_token does
    assert remote_kv.first_tokens_ready(early, lambda r, t: False) == []  # never twice
    result = remote_kv.load_finished("d", KVConnectorOutput(finished_recving={"d"}))
    assert result.outcome is LoadOutcome.LOADED and result.first_token is None
    assert req.num_computed_tokens == 8  # the whole prompt; the token's KV is the next step's


def test_remote_kv_a_first_token_that_finishes_the_request_waits_for_the_load():
    _, remote_kv, req = parked(StubConnector(external=8), prompt_len=8)
    early = KVConnectorOutput(first_tokens={"d": 42})
    assert remote_kv.first_tokens_ready(early, lambda r, t: t == 42) == []
    result = remote_kv.load_finished("d", KVConnectorOutput(finished_recving={"d"}))
    assert result.outcome is LoadOutcome.LOADED and result.first_token == 42
    assert req.num_computed_tokens == 8 and req.output_token_ids == []


def test_remote_kv_drops_a_first_token_the_min_tokens_mask_forbids():
    """A prefill leg drawn without ``min_tokens``: its EOS or stop token cannot be the first
    token of a request with ``min_tokens`` (the draw masks them), so it is dropped and the
    load ends one token short (the request draws its own first token under the mask); any
    other token is used."""
    kvm, remote_kv, req = parked(StubConnector(external=8), prompt_len=8)
    req.sampling_params = SamplingParams(min_tokens=3, stop_token_ids=[7], temperature=0.0)
    for forbidden in (EOS, 7):
        early = KVConnectorOutput(first_tokens={"d": forbidden})
        assert remote_kv.first_tokens_ready(early, lambda r, t: False) == []
    result = remote_kv.load_finished("d", KVConnectorOutput(finished_recving={"d"}))
    assert result.outcome is LoadOutcome.LOADED and result.first_token is None
    assert req.num_computed_tokens == 7 and req.output_token_ids == []  # last prompt token left
    assert kvm.num_cached_blocks == 1  # the block with the last token is not cached yet

    _, remote_kv, req = parked(StubConnector(external=8), prompt_len=8)
    req.sampling_params = SamplingParams(min_tokens=3, stop_token_ids=[7], temperature=0.0)
    assert remote_kv.first_tokens_ready(KVConnectorOutput(first_tokens={"d": 42}),
                                        lambda r, t: False) == [(req, 42)]


def test_remote_kv_no_early_first_token_for_a_partial_or_failed_load():
    _, remote_kv, req = parked(StubConnector(external=8), prompt_len=11)  # 3 tokens to compute
    assert remote_kv.first_tokens_ready(KVConnectorOutput(first_tokens={"d": 42}),
                                        lambda r, t: False) == []
    _, remote_kv, req = parked(StubConnector(external=8), prompt_len=8)
    bad = KVConnectorOutput(first_tokens={"d": 42}, invalid_block_ids={req.block_ids[0]})
    remote_kv.update_connector_output(bad)
    assert remote_kv.first_tokens_ready(bad, lambda r, t: False) == []


def test_remote_kv_a_failed_load_fails_or_recomputes_by_policy():
    error = KVLoadError(KVLoadFailure.TIMEOUT, "no answer")
    kvm, remote_kv, req = parked(StubConnector(external=8))
    kv_out = KVConnectorOutput(finished_recving={"d"}, invalid_block_ids={req.block_ids[1]},
                               load_errors={"d": error})
    remote_kv.update_connector_output(kv_out)
    result = remote_kv.load_finished("d", kv_out)
    assert result.outcome is LoadOutcome.FAIL and result.kv_load_failure is KVLoadFailure.TIMEOUT
    assert "timeout: no answer" in result.error and "'fail'" in result.error
    assert remote_kv.num_kv_load_failures_total == 1

    _, remote_kv, req = parked(StubConnector(external=8, policy="recompute"))
    kv_out = KVConnectorOutput(finished_recving={"d"}, invalid_block_ids={req.block_ids[1]})
    remote_kv.update_connector_output(kv_out)
    result = remote_kv.load_finished("d", kv_out)
    assert result.outcome is LoadOutcome.RECOMPUTE and result.error is None
    assert req.num_computed_tokens == BS and req.num_transferred_tokens == BS  # block 0 was good


def test_remote_kv_holds_a_finished_requests_blocks_until_sent():
    connector = StubConnector(external=0, hold=True)
    queues, kvm, remote_kv, admitter = parts(connector=connector)
    req = request("p", list(range(1, 10)))
    queues.waiting.append(req)
    admitter.admit_waiting(SchedulerOutput(), 100)
    queues.running.remove(req)
    assert remote_kv.request_finished(req) == {"held": True}
    assert set(remote_kv.held) == {"p"} and kvm.num_free_blocks == 16 - 3
    assert remote_kv.has_pending_work()
    remote_kv.release_held("p")
    assert ("release", "p") in connector.calls
    remote_kv.transfer_sent("p")
    assert not remote_kv.held and kvm.num_free_blocks == 16


def test_remote_kv_a_request_finished_while_loading_is_held_until_received():
    kvm, remote_kv, req = parked(StubConnector(external=8))
    remote_kv.request_finished(req)  # aborted while parked
    assert not remote_kv.waiting_for_remote and set(remote_kv.held) == {"d"}
    assert kvm.num_free_blocks == 16 - 2  # blocks for the 8 loaded tokens
    assert remote_kv.load_finished("d", KVConnectorOutput(finished_recving={"d"})) is None
    assert not remote_kv.held and kvm.num_free_blocks == 16


# ---------------------------------------------------------------- TokenAcceptor
def test_token_acceptor_applies_stop_conditions_and_counts():
    acceptor = TokenAcceptor([7], max_model_len=6)
    req = request("r", [1, 2], max_tokens=10, min_tokens=1, stop_token_ids=[5])
    assert acceptor.accept(req, 3) == (None, None)
    assert acceptor.accept(req, 5) == (RequestStatus.FINISHED_STOPPED, 5)
    assert acceptor.accept(request("e", [1]), 7) == (RequestStatus.FINISHED_STOPPED, None)
    assert acceptor.accept(request("f", [1], ignore_eos=True), EOS) == (None, None)
    long = request("g", [1, 2, 3, 4, 5])
    assert acceptor.accept(long, 3) == (RequestStatus.FINISHED_LENGTH, None)  # max_model_len
    early = request("h", [1], min_tokens=2)
    assert acceptor.accept(early, EOS) == (None, None)  # before min_tokens
    assert acceptor.generation_tokens_total == 6 and req.output_token_ids == [3, 5]


# ---------------------------------------------------------------- MultiStepRounds
def rounds(steps: int = 4, max_model_len: int = 64):
    queues, kvm, remote_kv, _ = parts()
    acceptor = TokenAcceptor([], max_model_len)
    multi = MultiStepRounds(queues, kvm, remote_kv, acceptor, steps, max_num_batched_tokens=64,
                            max_num_seqs=4, max_model_len=max_model_len)
    return queues, kvm, multi


def decoding(kvm: KVCacheManager, request_id: str, prompt: list[int], **sp) -> Request:
    """A request with one output token whose KV is not computed yet (a plain decode)."""
    req = request(request_id, prompt, **sp)
    kvm.allocate_slots(req, len(prompt) + 1)
    req.num_computed_tokens = len(prompt)
    req.output_token_ids.append(1)
    req.status = RequestStatus.RUNNING
    return req


def test_multi_step_rounds_schedule_plain_decodes_only():
    queues, kvm, multi = rounds(steps=4, max_model_len=6)
    a, b = decoding(kvm, "a", [1, 2, 3]), decoding(kvm, "b", [4, 5, 6, 7, 8])
    queues.running.extend([a])
    sched_out = multi.schedule()
    assert sched_out.num_steps == 3  # a computes position 3 of max_model_len 6
    assert [sr.token_ids for sr in sched_out.scheduled] == [[1]]
    assert sched_out.total_num_scheduled_tokens == 3 and not sched_out.finished_request_ids
    queues.running.append(b)
    assert multi.schedule() is None  # b reaches max_model_len after one step
    queues.running.remove(b)
    queues.waiting.append(request("w", [9]))
    assert multi.schedule() is None  # a waiting request could be admitted
    assert not multi.may_follow(SchedulerOutput(scheduled=[scheduled_request(a, 4, 1)]))


def test_multi_step_commit_keeps_the_tokens_up_to_the_stop():
    queues, kvm, multi = rounds()
    req = decoding(kvm, "a", [1, 2, 3], stop_token_ids=[8])
    assert multi.commit(req, [5, 8, 9]) == ([5, 8], RequestStatus.FINISHED_STOPPED, 8)
    assert req.output_token_ids == [1, 5, 8] and req.num_computed_tokens == 5
    other = decoding(kvm, "b", [1, 2, 3])
    assert multi.commit(other, [5, 6]) == ([5, 6], None, None)
    assert other.num_computed_tokens == 5


# ---------------------------------------------------------------- AsyncSchedulingPolicy
def test_async_scheduling_policy_decodes_from_the_running_steps_token():
    queues, kvm, remote_kv, admitter = parts()
    multi = MultiStepRounds(queues, kvm, remote_kv, TokenAcceptor([], 64), 1, 64, 4, 64)
    policy = AsyncSchedulingPolicy(queues, kvm, remote_kv, admitter, multi,
                                   max_num_batched_tokens=64, max_model_len=64)
    a = request("a", [1, 2, 3, 4, 5], max_tokens=5)
    done = request("z", [6, 7], max_tokens=1)
    for r in (a, done):
        kvm.allocate_slots(r, r.num_prompt_tokens)
        r.status = RequestStatus.RUNNING
        queues.running.append(r)
    running_step = SchedulerOutput(scheduled=[scheduled_request(a, 0, 5), scheduled_request(done, 0, 2)])
    queues.waiting.append(request("w", [8, 9, 10]))
    nxt = policy.schedule_next(running_step)
    # z finishes by length with the running step's token: left out; w is admitted after a
    assert [(sr.request_id, sr.num_computed_tokens, sr.token_ids) for sr in nxt.scheduled] == [
        ("a", 5, [PLACEHOLDER_TOKEN]), ("w", 0, [8, 9, 10])]
    assert nxt.scheduled[0].input_from_previous_step and nxt.total_num_scheduled_tokens == 4
    assert len(a.block_ids) == 2  # room for the in-flight token's KV too
    assert policy.finishes_by_length(done) and not policy.finishes_by_length(a)
    penalised = request("p", [1, 2], repetition_penalty=1.2)
    kvm.allocate_slots(penalised, 2)
    penalised.status = RequestStatus.RUNNING
    queues.running.append(penalised)
    assert policy.schedule_next(SchedulerOutput(scheduled=[scheduled_request(penalised, 0, 2)])) is None
