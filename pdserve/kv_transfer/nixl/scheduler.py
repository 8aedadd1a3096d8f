"""Scheduler side of the NIXL connector: decides which blocks move (pure bookkeeping, no torch,
no I/O).

Protocol (DESIGN §2):

* **Prefiller (P)**, request with ``kv_transfer_params.do_remote_decode``: when it finishes
  normally, :meth:`request_finished` keeps its blocks (``delay_free``) under a lease and returns
  ``{do_remote_prefill: true, do_remote_decode: false, remote_engine_id, remote_block_ids,
  remote_host, remote_port, remote_request_id, tp_size: 1}``. The worker side frees the blocks
  (``finished_sending``) on the reader's "done"/"abort" notification or when the lease expires.
* **Decoder (D)**, request with ``do_remote_prefill``: :meth:`get_num_new_matched_tokens`
  offers ``prompt_len - 1 - num_local_computed`` tokens, loaded asynchronously, so D reads only
  what its prefix cache lacks and recomputes only the last prompt token (for its logits). While
  the request waits in D's queue, the worker sends heartbeats that keep P's lease alive. A
  request finished on D before its read tells P to drop the lease ("abort"); one finished while
  its READ is in flight keeps its blocks until the READ is over (it appears in
  ``finished_recving``).

Unknown extra fields in ``kv_transfer_params`` are ignored.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pdserve.kv_transfer.base import KVConnectorSchedulerSide
from pdserve.kv_transfer.config import KVTransferConfig
from pdserve.kv_transfer.nixl.metadata import (
    KVTransferParamsError,
    NixlConnectorMetadata,
    RecvSpec,
    RemoteKVRef,
    RemoteNotice,
    SendSpec,
)

if TYPE_CHECKING:
    from pdserve.engine.outputs import KVConnectorOutput, SchedulerOutput
    from pdserve.engine.request import Request

logger = logging.getLogger(__name__)

_NORMAL_FINISH = ("stop", "length")


@dataclass
class _LoadPlan:
    """What :meth:`get_num_new_matched_tokens` offered, until the blocks are allocated."""

    remote: RemoteKVRef | None
    num_local_tokens: int
    num_tokens: int
    error: str | None = None


def _finish_reason(request: "Request") -> str | None:
    status = getattr(request, "status", None)
    return getattr(status, "finish_reason", None)


class NixlConnectorScheduler(KVConnectorSchedulerSide):
    """NIXL scheduler side (see the module docstring).

    Args:
        config: the validated transfer configuration.
        block_size: tokens per KV cache block (the engine's ``block_size``).
        data_parallel_rank: selects the side-channel port advertised to readers.
    """

    def __init__(self, config: KVTransferConfig, block_size: int, data_parallel_rank: int = 0):
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self.config = config
        self.block_size = block_size
        self.engine_id = config.engine_id
        self.side_channel_host = config.side_channel_host
        self.side_channel_port = config.side_channel_port_for(data_parallel_rank)
        self._plans: dict[str, _LoadPlan] = {}
        self._waiting: dict[str, RemoteKVRef] = {}  # heartbeated, blocks not allocated yet
        self._inflight: dict[str, RemoteKVRef] = {}  # load handed to the worker
        self._aborted_inflight: set[str] = set()  # finished while loading; blocks held
        self._leased: set[str] = set()  # blocks held for a remote reader
        self._meta = NixlConnectorMetadata()

    # ------------------------------------------------------------------------------- arrivals
    def request_added(self, request: "Request") -> None:
        """Optional hook when a request enters the queue: starts the handshake with the remote
        engine and the heartbeats that keep its lease alive while the request waits."""
        ref = self._remote_prefill_ref(request)
        if ref is not None and request.request_id not in self._waiting:
            self._start_waiting(request.request_id, ref)

    def _remote_prefill_ref(self, request: "Request") -> RemoteKVRef | None:
        params = request.kv_transfer_params
        if not isinstance(params, dict) or not params.get("do_remote_prefill"):
            return None
        try:
            return RemoteKVRef.from_params(params)
        except KVTransferParamsError:
            return None

    def _start_waiting(self, req_id: str, ref: RemoteKVRef) -> None:
        self._waiting[req_id] = ref
        self._meta.heartbeat_start[req_id] = ref
        self._meta.handshakes.append(ref.endpoint)

    def _consume_params(self, request: "Request") -> None:
        """Mark the remote-prefill params used, so a preempted request never loads twice."""
        params = dict(request.kv_transfer_params or {})
        params["do_remote_prefill"] = False
        request.kv_transfer_params = params

    # ---------------------------------------------------------------------------- the contract
    def get_num_new_matched_tokens(
        self, request: "Request", num_computed_tokens: int
    ) -> tuple[int, bool]:
        """Tokens that D can load from P: ``prompt_len - 1 - num_computed_tokens`` (the last
        prompt token is recomputed for its logits), loaded asynchronously.

        Bad params are not silently ignored: the load is planned and then reported as failed,
        so ``kv_load_failure_policy`` applies.
        """
        params = request.kv_transfer_params
        if not isinstance(params, dict) or not params.get("do_remote_prefill"):
            return 0, False
        req_id = request.request_id
        prompt_len = len(request.prompt_token_ids)
        num_tokens = prompt_len - 1 - num_computed_tokens
        error = None
        try:
            ref: RemoteKVRef | None = RemoteKVRef.from_params(params)
        except KVTransferParamsError as e:
            ref, error = None, str(e)
        if num_tokens <= 0:
            # nothing to read (one-token prompt, or the local prefix cache has it all)
            if ref is not None:
                self._meta.notices.append(RemoteNotice(ref, "abort"))
                if self._waiting.pop(req_id, None) is not None:
                    self._meta.heartbeat_stop.add(req_id)
            self._consume_params(request)
            return 0, False
        if ref is not None:
            needed = math.ceil((prompt_len - 1) / self.block_size)
            if len(ref.block_ids) < needed:
                error = (
                    f"kv_transfer_params.remote_block_ids has {len(ref.block_ids)} blocks but "
                    f"the prompt needs {needed}"
                )
            if ref.num_tokens is not None and ref.num_tokens < prompt_len - 1:
                error = (
                    f"the remote holds KV for {ref.num_tokens} tokens, the prompt needs "
                    f"{prompt_len - 1}"
                )
            if req_id not in self._waiting:
                self._start_waiting(req_id, ref)
        self._plans[req_id] = _LoadPlan(ref, num_computed_tokens, num_tokens, error)
        return num_tokens, True

    def update_state_after_alloc(
        self, request: "Request", block_ids: list[int], num_external_tokens: int
    ) -> None:
        """Hand the load to the worker: local blocks ``first..last`` (token positions
        ``num_local .. num_local + num_external_tokens - 1``) <- the same remote blocks.

        Args:
            block_ids: the request's whole block table after allocation (also accepted: only
                the blocks that will receive the loaded tokens).
        """
        req_id = request.request_id
        plan = self._plans.pop(req_id, None)
        if plan is None:
            return
        ref = plan.remote
        if num_external_tokens <= 0:
            if ref is not None:
                self._meta.notices.append(RemoteNotice(ref, "abort"))
            if self._waiting.pop(req_id, None) is not None:
                self._meta.heartbeat_stop.add(req_id)
            self._consume_params(request)
            return
        bs = self.block_size
        first = plan.num_local_tokens // bs
        last = (plan.num_local_tokens + num_external_tokens - 1) // bs
        error = plan.error
        if len(block_ids) > last:
            local = list(block_ids[first : last + 1])
        elif len(block_ids) == last - first + 1:
            local = list(block_ids)
        else:
            local = []
            error = error or (
                f"{len(block_ids)} allocated blocks cannot hold tokens up to position "
                f"{plan.num_local_tokens + num_external_tokens - 1}"
            )
        remote_ids = list(ref.block_ids[first : last + 1]) if ref is not None else []
        if ref is not None and len(remote_ids) != len(local) and error is None:
            error = "remote_block_ids is too short for the prompt"
        self._meta.reqs_to_recv[req_id] = RecvSpec(
            req_id=req_id,
            remote=ref,
            local_block_ids=local,
            remote_read_block_ids=remote_ids,
            num_tokens=num_external_tokens,
            error=error,
        )
        self._waiting.pop(req_id, None)
        if ref is not None:
            self._inflight[req_id] = ref
        else:
            self._inflight[req_id] = None  # type: ignore[assignment]
        self._consume_params(request)

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> NixlConnectorMetadata:
        meta, self._meta = self._meta, NixlConnectorMetadata()
        return meta

    def update_connector_output(self, output: "KVConnectorOutput") -> None:
        for req_id in output.finished_recving:
            self._inflight.pop(req_id, None)
            self._aborted_inflight.discard(req_id)
        for req_id in output.finished_sending:
            self._leased.discard(req_id)

    def request_finished(
        self, request: "Request", block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        """Decide whether the finished request's blocks stay allocated, and what to return.

        Returns:
            ``(True, P's params)`` on a prefiller for a normally finished request that asked for
            ``do_remote_decode``; ``(False, None)`` otherwise. A decoder request finished while
            its load is in flight is reported in ``finished_recving`` once no READ writes its
            blocks; the scheduler keeps the blocks until then.
        """
        req_id = request.request_id
        self._plans.pop(req_id, None)
        # --- reader side: the request ends before or during its load
        if req_id in self._inflight:
            # the READ may still write the blocks: the scheduler keeps them until the request
            # appears in finished_recving (the worker reports it once no READ is in flight)
            self._inflight.pop(req_id)
            self._aborted_inflight.add(req_id)
            self._meta.aborted_recvs.add(req_id)
            return False, None
        ref = self._waiting.pop(req_id, None)
        if ref is not None:
            self._meta.heartbeat_stop.add(req_id)
        elif (request.kv_transfer_params or {}).get("do_remote_prefill"):
            ref = self._remote_prefill_ref(request)
        if ref is not None:
            self._meta.notices.append(RemoteNotice(ref, "abort"))
            self._consume_params(request)
            return False, None
        # --- owner side: keep the prompt's blocks for the decoder
        params = request.kv_transfer_params
        if (
            isinstance(params, dict)
            and params.get("do_remote_decode")
            and _finish_reason(request) in _NORMAL_FINISH
        ):
            prompt_len = len(request.prompt_token_ids)
            remote_ids = list(block_ids[: math.ceil(prompt_len / self.block_size)])
            if not remote_ids or len(remote_ids) * self.block_size < prompt_len:
                return False, None
            self._meta.reqs_to_send[req_id] = SendSpec(
                req_id=req_id,
                block_ids=remote_ids,
                lease_duration=self.config.kv_lease_duration,
                renew_on_heartbeat=True,
            )
            self._leased.add(req_id)
            return True, {
                "do_remote_prefill": True,
                "do_remote_decode": False,
                "remote_engine_id": self.engine_id,
                "remote_block_ids": remote_ids,
                "remote_host": self.side_channel_host,
                "remote_port": self.side_channel_port,
                "remote_request_id": req_id,
                "tp_size": 1,
            }
        return False, None

    def has_pending_work(self) -> bool:
        """True while loads, leases, waiting (heartbeated) requests or undelivered metadata
        need engine steps."""
        return bool(
            self._waiting or self._inflight or self._leased or self._aborted_inflight
            or not self._meta.is_empty()
        )
