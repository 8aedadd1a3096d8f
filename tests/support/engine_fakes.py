"""Test doubles for the engine: a model runner that really reads its "KV cache" through the block
table, and a KV connector whose "remote instance" writes the right (or deliberately wrong) KV.

FakeModelRunner keeps, per KV slot, the ``(position, token)`` that was written there. To sample,
it reads positions ``0 .. end-1`` back through the request's block table and hashes what it
finds. So the sampled token equals :func:`reference_next_token` of the true sequence only if
every block-table, prefix-cache, preemption and transfer decision was right; any wrong or
missing KV changes the tokens.
"""

from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any, Callable

from pdserve.types.engine_config import EngineConfig
from pdserve.engine.core import EngineCore
from pdserve.types.kv_tiers import KVTierReport
from pdserve.types.outputs import KVConnectorOutput, ModelRunnerOutput, SchedulerOutput
from pdserve.kv_transfer.base import KVConnectorSchedulerSide, KVConnectorWorkerSide
from pdserve.types.outputs import KVLoadError

VOCAB = 1000
EOS = VOCAB - 1  # never produced by the hash (see reference_next_token); only when forced


def reference_next_token(seq: list[Any]) -> int:
    """Deterministic "model": a hash of the (position, token) pairs, in ``[0, VOCAB - 1)``."""
    h = hashlib.sha256()
    for item in seq:
        if item is None:
            h.update(b"<missing>")
        else:
            h.update(struct.pack("<qq", *item))
    return int.from_bytes(h.digest()[:8], "little") % (VOCAB - 1)


def reference_generate(prompt: list[int], max_tokens: int) -> list[int]:
    """What a correct engine produces with the fake runner (no stop tokens)."""
    seq = list(prompt)
    out: list[int] = []
    for _ in range(max_tokens):
        tok = reference_next_token(list(enumerate(seq)))
        out.append(tok)
        seq.append(tok)
    return out


class FakeModelRunner:
    """Implements the ModelRunner contract of docs/architecture.md without torch.

    Args:
        num_blocks / block_size: KV cache geometry.
        max_position_embeddings: reported in ``model_info``.
        force: optional ``(request_id, output_index) -> token | None`` to force sampled tokens (EOS,
            stop tokens); None means "use the hash of the KV read back".
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        max_position_embeddings: int = 4096,
        force: Callable[[str, int], int | None] | None = None,
    ):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.model_info = SimpleNamespace(
            name="fake", max_position_embeddings=max_position_embeddings,
            eos_token_ids=[EOS], vocab_size=VOCAB,
        )
        self.force = force
        self.kv: list[tuple[int, int] | None] = []
        self.worker: Any = None
        self.steps: list[SchedulerOutput] = []
        self.num_executes = 0
        self._launched: list[FakePendingStep] = []  # execute_async steps not yet "run"
        self._previous: dict[str, int] = {}  # the last run step's sampled tokens

    def determine_num_blocks(self) -> int:
        return self.num_blocks

    def allocate_kv_cache(self, num_blocks: int) -> None:
        self.kv = [None] * (num_blocks * self.block_size)

    @property
    def kv_cache(self) -> list:
        return self.kv

    @property
    def kv_cache_spec(self) -> int:
        return self.block_size  # all the fake worker needs

    def set_kv_connector_worker(self, worker: Any) -> None:
        self.worker = worker

    def _slot(self, block_ids: list[int], pos: int) -> int:
        return block_ids[pos // self.block_size] * self.block_size + pos % self.block_size

    def execute(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        self._run_launched()
        self._previous = {}
        self.num_executes += 1
        if sched.scheduled:
            self.steps.append(sched)
        if self.worker is not None:
            self.worker.bind_connector_metadata(sched.kv_connector_metadata)
            self.worker.start_load_kv()
        out = ModelRunnerOutput()
        out.sampled_token_ids = self._compute(sched)
        if self.worker is not None:
            out.kv_connector_output = self.worker.get_finished(sched.finished_request_ids)
        return out

    def execute_async(self, sched: SchedulerOutput) -> "FakePendingStep":
        """Overlapped scheduling's launch: connector work happens now (as on the host), the
        "device" work (KV writes, sampling) only when a result is asked for, in launch order:
        the latest a real device could run it, so that a block reused too early by the engine
        (e.g. for a KV load) is overwritten by a late write and the tokens show it."""
        self.num_executes += 1
        if sched.scheduled:
            self.steps.append(sched)
        if self.worker is not None:
            self.worker.bind_connector_metadata(sched.kv_connector_metadata)
            self.worker.start_load_kv()
        step = FakePendingStep(self, sched)
        self._launched.append(step)
        if self.worker is not None:
            step.kv_connector_output = self.worker.get_finished(sched.finished_request_ids)
        return step

    def _run_launched(self, until: "FakePendingStep | None" = None) -> None:
        while self._launched:
            step = self._launched.pop(0)
            step.tokens = self._previous = self._compute(step.sched)
            if step is until:
                return

    def _compute(self, sched: SchedulerOutput) -> dict[str, int]:
        # Write every scheduled token's KV first (as a layer-wise forward pass does), then read.
        for sr in sched.scheduled:
            for i, tok in enumerate(sr.token_ids):
                if sr.input_from_previous_step:
                    tok = self._previous[sr.request_id]
                pos = sr.num_computed_tokens + i
                self.kv[self._slot(sr.block_ids, pos)] = (pos, tok)
        sampled: dict[str, int] = {}
        for sr in sched.scheduled:
            if not sr.sample:
                continue
            end = sr.num_computed_tokens + len(sr.token_ids)
            seq = [self.kv[self._slot(sr.block_ids, p)] for p in range(end)]
            tok = reference_next_token(seq)
            if self.force is not None:
                forced = self.force(sr.request_id, sr.output_position())
                if forced is not None:
                    tok = forced
            sampled[sr.request_id] = tok
        return sampled

    def shutdown(self) -> None:
        pass


class FakePendingStep:
    """A step launched by :meth:`FakeModelRunner.execute_async`."""

    def __init__(self, runner: FakeModelRunner, sched: SchedulerOutput):
        self.runner = runner
        self.sched = sched
        self.tokens: dict[str, int] | None = None
        self.kv_connector_output: KVConnectorOutput | None = None
        self.kv_tier_report: KVTierReport | None = None

    def result(self) -> ModelRunnerOutput:
        if self.tokens is None:
            self.runner._run_launched(until=self)
        return ModelRunnerOutput(sampled_token_ids=dict(self.tokens),
                                 kv_connector_output=self.kv_connector_output,
                                 kv_tier_report=self.kv_tier_report)


# ------------------------------------------------------------------ fake KV connector
@dataclass
class _Load:
    request_id: str
    block_ids: list[int]
    start: int  # first token position to load
    tokens: list[int]  # the request's prompt
    num_tokens: int  # tokens to load


@dataclass
class FakeRemote:
    """State shared by both fake connector sides (the "other instance").

    Attributes:
        load_delay_steps: steps between posting a load and reporting it in finished_recving.
        poison: request id -> indices in its block table whose load "fails": garbage KV is
            written there and those block ids are reported in invalid_block_ids.
        release: request ids whose held blocks the "decoder" has read; reported in
            finished_sending on the next poll.
        load_error: the reason reported with a poisoned load (``load_errors``), or None.
        first_tokens: request id -> the "prefiller's" first token, reported in the step its load
            is posted, before the load finishes (``KVConnectorOutput.first_tokens``), as the
            NIXL connector reports it from the lease claim's answer.
        partial: request id -> how many leading blocks of its load the "owner" still holds: the
            blocks after them get garbage KV (not reported invalid) and the load is reported in
            ``KVConnectorOutput.partial_loads``, so only a scheduler that computes their tokens
            gets the right tokens.
    """

    load_delay_steps: int = 2
    poison: dict[str, set[int]] = field(default_factory=dict)
    load_error: KVLoadError | None = None
    release: set[str] = field(default_factory=set)
    first_tokens: dict[str, int] = field(default_factory=dict)
    partial: dict[str, int] = field(default_factory=dict)
    added: list[str] = field(default_factory=list)
    finished_calls: list[tuple[str, list[int]]] = field(default_factory=list)
    released_kept: list[str] = field(default_factory=list)
    matched_calls: list[tuple[str, int]] = field(default_factory=list)
    alloc_calls: list[tuple[str, list[int], int]] = field(default_factory=list)
    outputs_seen: list[KVConnectorOutput] = field(default_factory=list)


class FakeConnectorScheduler(KVConnectorSchedulerSide):
    """``kv_transfer_params={"remote": True}`` -> the whole prompt is available remotely
    (async load); ``{"remote_sync": True}`` -> the same, loaded synchronously within the step;
    ``{"do_remote_decode": True}`` -> keep blocks after finishing (delay_free)."""

    def __init__(self, remote: FakeRemote):
        self.remote = remote
        self._loads: list[_Load] = []
        self._block_size = 0

    def request_added(self, request):
        self.remote.added.append(request.request_id)

    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        self.remote.matched_calls.append((request.request_id, num_computed_tokens))
        params = request.kv_transfer_params.to_dict() if request.kv_transfer_params else {}
        if params.get("remote"):
            return request.num_prompt_tokens - num_computed_tokens, True
        if params.get("remote_sync"):  # loaded by start_load_kv before this step's forward pass
            return request.num_prompt_tokens - num_computed_tokens, False
        return 0, False

    def update_state_after_alloc(self, request, block_ids, num_external_tokens):
        self.remote.alloc_calls.append((request.request_id, list(block_ids), num_external_tokens))
        if num_external_tokens > 0:
            start = request.num_prompt_tokens - num_external_tokens
            self._loads.append(
                _Load(request.request_id, list(block_ids), start, list(request.prompt_token_ids), num_external_tokens)
            )

    def build_connector_meta(self, scheduler_output):
        loads, self._loads = self._loads, []
        return {"loads": loads}

    def update_connector_output(self, output):
        self.remote.outputs_seen.append(output)

    def release_held_blocks(self, request_id):
        self.remote.released_kept.append(request_id)
        self.remote.release.add(request_id)  # the worker ends the hold: reported on the next poll

    def request_finished(self, request, block_ids):
        self.remote.finished_calls.append((request.request_id, list(block_ids)))
        params = request.kv_transfer_params.to_dict() if request.kv_transfer_params else {}
        if params.get("do_remote_decode") and block_ids:
            return True, {"remote_block_ids": list(block_ids), "remote_request_id": request.request_id}
        return False, None


class FakeConnectorWorker(KVConnectorWorkerSide):
    def __init__(self, remote: FakeRemote):
        self.remote = remote
        self.kv: list | None = None
        self.block_size = 0
        self._meta: Any = None
        self._in_flight: dict[str, list] = {}  # request_id -> [steps_left, invalid blocks]
        self._first: dict[str, int] = {}  # first tokens of loads posted since the last report

    def register_kv_cache(self, kv_cache, spec):
        self.kv = kv_cache
        self.block_size = spec

    def bind_connector_metadata(self, metadata):
        self._meta = metadata

    def start_load_kv(self):
        for load in (self._meta or {}).get("loads", []):
            bad: set[int] = set()
            held = self.remote.partial.get(load.request_id)
            for pos in range(load.start, load.start + load.num_tokens):
                block = load.block_ids[pos // self.block_size]
                slot = block * self.block_size + pos % self.block_size
                if pos // self.block_size in self.remote.poison.get(load.request_id, ()):
                    self.kv[slot] = (pos, -7)  # garbage KV
                    bad.add(block)
                elif held is not None and \
                        pos // self.block_size - load.start // self.block_size >= held:
                    self.kv[slot] = (pos, -8)  # not loaded: garbage unless computed
                else:
                    self.kv[slot] = (pos, load.tokens[pos])
            self._in_flight[load.request_id] = [self.remote.load_delay_steps, bad]
            if load.request_id in self.remote.first_tokens:
                self._first[load.request_id] = self.remote.first_tokens[load.request_id]

    def get_finished(self, finished_request_ids):
        out = KVConnectorOutput()
        out.first_tokens, self._first = self._first, {}
        for rid in list(self._in_flight):
            entry = self._in_flight[rid]
            entry[0] -= 1
            if entry[0] <= 0 or rid in finished_request_ids:
                out.finished_recving.add(rid)
                if rid in self.remote.partial:
                    out.partial_loads[rid] = self.remote.partial[rid]
                out.invalid_block_ids |= entry[1]
                if entry[1] and self.remote.load_error is not None:
                    out.load_errors[rid] = self.remote.load_error
                del self._in_flight[rid]
        out.finished_sending = set(self.remote.release)
        self.remote.release.clear()
        out.stats = {"num_loads_done": len(out.finished_recving)} if out.finished_recving else None
        return out


# async_scheduling of the engines built here unless a test says otherwise: the engine's
# default (the ``scheduling_mode`` fixture of tests/engine/conftest.py sets each mode)
ASYNC_SCHEDULING = EngineConfig.async_scheduling


def make_config(**kw: Any) -> EngineConfig:
    kw.setdefault("async_scheduling", ASYNC_SCHEDULING)
    kw.setdefault("block_size", 4)
    kw.setdefault("max_num_batched_tokens", 64)
    kw.setdefault("max_num_seqs", 16)
    return EngineConfig(model="fake", **kw)


def make_core(
    num_blocks: int = 64,
    block_size: int = 4,
    force: Callable[[str, int], int | None] | None = None,
    remote: FakeRemote | None = None,
    kv_load_failure_policy: str = "fail",
    max_position_embeddings: int = 4096,
    **cfg: Any,
) -> tuple[EngineCore, FakeModelRunner]:
    """An EngineCore over a FakeModelRunner, with the fake connector when ``remote`` is given."""
    runner = FakeModelRunner(num_blocks, block_size, max_position_embeddings, force)
    kv_cfg = None
    if remote is not None:
        kv_cfg = SimpleNamespace(kv_load_failure_policy=kv_load_failure_policy)
    config = make_config(block_size=block_size, kv_transfer_config=kv_cfg, **cfg)
    connectors = None
    if remote is not None:
        connectors = (FakeConnectorScheduler(remote), FakeConnectorWorker(remote))
    return EngineCore(config, lambda _config: runner, connectors=connectors), runner


# ------------------------------------------------------------------ driving a core
@dataclass
class Result:
    tokens: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | None = None
    error: str | None = None
    num_cached_tokens: int = 0
    num_transferred_tokens: int = 0
    kv_transfer_params: dict | None = None
    kv_load_failure: Any = None


def add(core: EngineCore, rid: str, prompt: list[int], kv_transfer_params: dict | None = None, **sp: Any):
    """Add a request with ``SamplingParams(temperature=0, **sp)``; returns the rejection or None."""
    from pdserve.types.core_messages import AddRequest
    from pdserve.types.sampling_params import SamplingParams
    from pdserve.types.kv_params import KVTransferParams

    sp.setdefault("temperature", 0.0)
    return core.add_request(
        AddRequest(rid, list(prompt), SamplingParams(**sp),
                   kv_transfer_params=KVTransferParams.parse(kv_transfer_params))
    )


def collect(results: dict[str, Result], outputs) -> None:
    for o in outputs:
        r = results.setdefault(o.request_id, Result())
        r.tokens.extend(o.new_token_ids)
        r.num_cached_tokens = o.num_cached_tokens
        r.num_transferred_tokens = o.num_transferred_tokens
        if o.finish_reason is not None:
            assert r.finish_reason is None, f"{o.request_id} finished twice"
            r.finish_reason, r.stop_reason, r.error = o.finish_reason, o.stop_reason, o.error
            r.kv_transfer_params = o.kv_transfer_params
            r.kv_load_failure = o.kv_load_failure


def run_until_done(core: EngineCore, results: dict[str, Result] | None = None, max_steps: int = 10_000,
                   on_step: Callable[[int], None] | None = None) -> dict[str, Result]:
    """Step until the scheduler has no unfinished request (KV work may remain pending)."""
    results = {} if results is None else results
    for i in range(max_steps):
        if not core.scheduler.has_unfinished_requests():
            return results
        outputs, _ = core.step()
        collect(results, outputs)
        if on_step is not None:
            on_step(i)
    raise AssertionError(f"requests not finished after {max_steps} steps: {core.stats()}")


def drain(core: EngineCore, max_steps: int = 1000) -> None:
    """Step until no KV work is pending and finished ids were reported to the runner."""
    for _ in range(max_steps):
        if not core.scheduler.has_pending_kv_work() and not core.scheduler.finished_request_ids:
            return
        core.step()
    raise AssertionError("KV work still pending")


def assert_all_free(core: EngineCore) -> None:
    kvm = core.scheduler.kv_cache_manager
    kvm.check_consistency()
    assert kvm.num_free_blocks == kvm.num_blocks, core.stats()
    assert all(rc == 0 for rc in kvm.ref_counts)
