"""The runner's side of host-tier LOADs copied by layer range: a single step with prefills asks
the tier store for them and each layer's attention waits for its range's event (the
store's copies themselves run on CUDA only: tests/runner/test_kv_tier_store.py); a step
without prefills, or of several decode steps, asks for whole-step waits."""

from __future__ import annotations

import pytest

from pdserve.attention.metadata import KVReadyByLayer
from pdserve.runner.model_runner import ModelRunner
from pdserve.types.engine_config import EngineConfig
from pdserve.types.kv_tiers import KVTierJobs, KVTierReport, TierJob, TierJobKind
from pdserve.types.outputs import ScheduledRequest, SchedulerOutput
from pdserve.types.sampling_params import SamplingParams


class FakeTiers:
    """A tier store whose LOADs are copied by layer range: each range's event logs its wait."""

    loads_by_layer = True

    def __init__(self, log: list, layers: int):
        self.log, self.layers, self.asked = log, layers, []

    def run(self, jobs, by_layer=False):
        self.asked.append(by_layer)
        if not by_layer:
            return None
        store = self

        class Event:
            def __init__(self, layer: int):
                self.layer = layer

            def wait(self) -> None:
                store.log.append(("wait", self.layer))

        return KVReadyByLayer([Event(layer) for layer in range(self.layers)], 1)

    def wait_before_connector_writes(self) -> None:
        pass

    def report(self) -> KVTierReport:
        return KVTierReport()

    def shutdown(self) -> None:
        pass


@pytest.fixture(scope="module")
def runner(tiny_llama_path):
    r = ModelRunner(EngineConfig(model=tiny_llama_path, device="cpu", max_model_len=128,
                                 num_gpu_blocks_override=32))
    r.allocate_kv_cache(r.determine_num_blocks())
    return r


def _request(rid: str, tokens: list[int], computed: int) -> ScheduledRequest:
    prompt = list(range(1, computed + 1)) + tokens
    return ScheduledRequest(rid, tokens, computed, [0, 1, 2, 3], True,
                            SamplingParams(temperature=0), prompt, [])


@pytest.mark.parametrize("execute", ["execute", "execute_async"])
def test_a_prefill_steps_layers_each_wait_for_their_range_before_attending(runner, execute):
    log: list = []
    layers = runner.model_info.num_layers
    tiers = FakeTiers(log, layers)
    backend = runner.model.attn_backend
    forward = backend.forward

    def logged_forward(layer, *args, **kwargs):
        log.append(("attend", layer))
        return forward(layer, *args, **kwargs)

    runner._tiers, backend.forward = tiers, logged_forward
    jobs = KVTierJobs([TierJob(TierJobKind.LOAD, 1, 7, block_id=0, slot=0)])
    try:
        step = getattr(runner, execute)(SchedulerOutput(
            scheduled=[_request("p", [5, 6, 7], 16)], kv_tier_jobs=jobs))
        if execute == "execute_async":
            step.result()
        assert tiers.asked == [True]
        expected = [entry for layer in range(layers)
                    for entry in (("attend", layer), ("wait", layer))]
        assert log == expected
        # one decode token and no prefill: the whole step waits, not its layers
        runner.execute(SchedulerOutput(scheduled=[_request("d", [9], 19)], kv_tier_jobs=jobs))
        assert tiers.asked == [True, False]
    finally:
        runner._tiers = None
        del backend.forward
