"""A prefiller's pull of a decoder's turn waits for its lease claim no longer than computing its
tokens takes (pdserve/kv_transfer/nixl/bidirectional.py, "A pull never waits longer than its
recompute"): the pace P measures on its own prefills, the bound the scheduler side puts on a
pull, the worker giving the pull up at the bound (a load of no block, the owner told), and the
engine scheduler computing those tokens with nothing counted as failed. Fakes stand for the
side channel and the agent (as in test_partial_loads.py)."""

from __future__ import annotations

import time

import pytest

from pdserve.kv_transfer.nixl.bidirectional import PrefillPace
from pdserve.kv_transfer.nixl.scheduler import NixlConnectorScheduler
from pdserve.types.outputs import KVConnectorOutput, ModelRunnerOutput
from pdserve.types.request import RequestStatus
from tests.kv_transfer.test_bidirectional_unit import (B, _config, _request, d_params,
                                                       pulling_prefiller)
from tests.kv_transfer.test_partial_loads import TURN, Client, pull, tracker


# ---------------------------------------------------------------------------- the pace
def test_the_pace_is_a_weighted_mean_of_timed_legs_per_computed_token():
    pace = PrefillPace()
    assert pace.seconds_for(100) is None  # nothing timed yet
    pace.started("a", now=10.0)
    pace.finished("a", num_computed=200, now=10.2, normal=True)  # 1 ms per token
    assert pace.seconds_for(64) == pytest.approx(0.064) == pace.claim_wait_s(64)
    patient, unbounded = PrefillPace(wait_factor=3.0), PrefillPace(wait_factor=0.0)
    for p in (patient, unbounded):
        p.started("a", now=10.0)
        p.finished("a", num_computed=200, now=10.2, normal=True)
    assert patient.claim_wait_s(64) == pytest.approx(0.192) and unbounded.claim_wait_s(64) == 0.0
    pace.started("b", now=20.0)
    pace.finished("b", num_computed=100, now=20.6, normal=True)  # 6 ms per token
    assert pace.seconds_for(1) == pytest.approx(0.001 + PrefillPace.WEIGHT * 0.005)


def test_short_aborted_and_untimed_legs_leave_the_pace_alone():
    pace = PrefillPace()
    pace.started("short", now=0.0)
    pace.finished("short", num_computed=PrefillPace.MIN_TOKENS - 1, now=5.0, normal=True)
    pace.started("aborted", now=0.0)
    pace.finished("aborted", num_computed=500, now=5.0, normal=False)
    pace.finished("never-started", num_computed=500, now=5.0, normal=True)
    assert pace.seconds_for(10) is None
    pace.finished("aborted", num_computed=500, now=6.0, normal=True)  # forgotten at its end
    assert pace.seconds_for(10) is None and pace.claim_wait_s(10) == 0.0  # no bound yet


# ------------------------------------------------------------------ the scheduler side
@pytest.mark.parametrize("factor", [None, 2.5, 0])
def test_a_pull_is_bounded_by_the_pace_of_the_prefillers_own_legs(monkeypatch, factor):
    clock = [100.0]
    monkeypatch.setattr(time, "monotonic", lambda: clock[0])
    extra = {} if factor is None else {"kv_pull_wait_factor": factor}
    sched = NixlConnectorScheduler(_config("kv_producer", **extra), B)
    history = list(range(4000, 4200))
    prompt = history + list(range(10, 30))

    def planned_pull(rid: str) -> float:
        req = _request(rid, prompt, d_params(history, expiry=time.time() + 480))
        sched.request_added(req)
        n, _ = sched.get_num_new_matched_tokens(req, 32)
        sched.update_state_after_alloc(req, list(range(20, 34)), n)
        return sched.build_connector_meta(None).reqs_to_recv[rid].claim_wait_s

    assert planned_pull("p0") == 0.0  # no leg timed yet: no bound

    leg = _request("leg", list(range(300)), {"do_remote_decode": True})
    sched.request_added(leg)
    assert sched.get_num_new_matched_tokens(leg, 44) == (0, False)
    sched.update_state_after_alloc(leg, list(range(40, 59)), 0)  # computes 256 of 300 tokens
    leg.num_cached_tokens = 44
    clock[0] += 0.128  # 0.5 ms per computed token
    leg.status = RequestStatus.FINISHED_LENGTH
    sched.request_finished(leg, list(range(40, 59)))
    # the pull loads 160 tokens; kv_pull_wait_factor (default 1) scales the bound, 0: none
    assert planned_pull("p1") == pytest.approx((1.0 if factor is None else factor) * 160 * 0.0005)

    # a decoder's load of a prompt is never bounded (it cannot compute what it reads)
    decoder = NixlConnectorScheduler(_config("kv_consumer"), B)
    req = _request("d1", list(range(64)), {"do_remote_prefill": True, "remote_engine_id": "p",
                                           "remote_block_ids": [1, 2, 3, 4],
                                           "remote_host": "127.0.0.1", "remote_port": 5600,
                                           "remote_request_id": "p-req"})
    decoder.request_added(req)
    n, _ = decoder.get_num_new_matched_tokens(req, 0)
    decoder.update_state_after_alloc(req, [5, 6, 7, 8], n)
    assert decoder.build_connector_meta(None).reqs_to_recv["d1"].claim_wait_s == 0.0


# ---------------------------------------------------------------------------- the worker
class Silent(Client):
    """A side channel whose claims stay unanswered (the owner restores a demoted turn)."""

    def __init__(self):
        super().__init__({})
        self.cancelled: list[int] = []

    def result(self, ticket):
        return None

    def cancel(self, ticket):
        self.cancelled.append(ticket)


def bounded(wait_s: float):
    spec = pull()
    spec.claim_wait_s = wait_s
    return spec


def test_an_unanswered_claim_is_given_up_at_its_bound_as_a_load_of_no_block():
    loads, out, agent, _, _, stats = tracker({})
    silent, notices = Silent(), []
    loads._client = loads.claims._client = silent
    loads._notify = notices.append
    loads.add("p1", bounded(0.02))
    loads.progress(time.monotonic())
    assert not out.finished_recving  # still within its bound
    assert 0.0 < loads.next_poll_in() <= 0.02  # the engine loop wakes up for the bound
    time.sleep(0.03)
    assert loads.next_poll_in() == 0.0
    loads.progress(time.monotonic())
    assert out.finished_recving == {"p1"} and out.partial_loads == {"p1": 0}
    assert not out.invalid_block_ids and not out.load_errors  # no failure
    assert agent.reads == [] and silent.cancelled == [1] and len(loads) == 0
    assert [(n.kind, n.remote.request_id) for n in notices] == [("abort", TURN.request_id)]
    delta = stats.take_delta()
    assert delta["num_pulls_given_up"] == 1 and delta["num_failed_transfers"] == 0


def test_without_a_bound_or_with_an_answer_in_time_the_pull_reads():
    loads, out, _, _, _, _ = tracker({})
    loads._client = loads.claims._client = Silent()
    loads.add("p1", bounded(0.0))
    loads.progress(time.monotonic())
    time.sleep(0.03)
    loads.progress(time.monotonic())
    assert not out.finished_recving and len(loads) == 1 and loads.next_poll_in() is None

    loads, out, agent, _, _, _ = tracker({"ok": True, "lease_expiry_in": 60.0})
    loads.add("p1", bounded(0.02))
    loads.progress(time.monotonic())
    assert out.finished_recving == {"p1"} and not out.partial_loads
    assert agent.reads == [([30, 31, 32], [101, 102, 103])]


def test_an_aborted_request_whose_claim_waits_out_its_bound_is_dropped_not_reported_partial():
    loads, out, _, _, _, _ = tracker({})
    loads._client = loads.claims._client = Silent()
    loads._notify = lambda notice: None
    loads.add("p1", bounded(0.01))
    loads.progress(time.monotonic())
    loads.abort("p1")
    time.sleep(0.02)
    loads.progress(time.monotonic())
    assert out.finished_recving == {"p1"} and not out.partial_loads and len(loads) == 0


# ------------------------------------------------------------------------ the scheduler
def test_a_given_up_pull_computes_its_tokens_and_counts_no_failure():
    sched, out, prompt = pulling_prefiller(_config("kv_producer"))
    given_up = KVConnectorOutput(finished_recving={"p1"}, partial_loads={"p1": 0})
    outputs = sched.update_from_output(out, ModelRunnerOutput(kv_connector_output=given_up))
    assert not any(o.finish_reason for o in outputs)
    out = sched.schedule()
    assert [(s.request_id, s.num_computed_tokens, len(s.token_ids)) for s in out.scheduled] == \
        [("p1", 0, len(prompt))]
    stats = sched.stats()
    assert stats["num_kv_load_failures_total"] == 0 and stats["num_kv_partial_loads_total"] == 1
