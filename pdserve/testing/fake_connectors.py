"""A scripted KV connector worker side for tests of the tensor-parallel executor: each rank's
process builds one (:func:`scripted_worker`, a picklable connector factory), and every step
reports what the step's metadata scripts for that rank.

Metadata (the ``kv_connector_metadata`` of a step, a dict; absent keys mean nothing):
``{"recv": {rank: [request_id, ...]}, "send": {rank: [...]}, "first": {request_id: token},
"invalid": {rank: [block_id, ...]}, "fail_rank": rank}``. A rank reports ``first`` tokens
plus its rank (so a merge that took another rank's token shows), ``invalid`` blocks with a
load error for its ``recv`` requests, and raises in ``get_finished`` when it is
``fail_rank``.
"""

from __future__ import annotations

import os
from typing import Any

from pdserve.types.engine_config import EngineConfig
from pdserve.types.outputs import KVConnectorOutput
from pdserve.kv_transfer.base import KVCacheSpec, KVConnectorWorkerSide, TPRank
from pdserve.types.outputs import KVLoadError, KVLoadFailure


class ScriptedWorker(KVConnectorWorkerSide):
    """See the module docstring.

    Attributes:
        gathered: what ``tp.all_gather`` returned in :meth:`register_kv_cache` (every rank's
            ``(rank, pid, kv heads of its cache)``).
    """

    def __init__(self, tp: TPRank):
        self.tp = tp
        self.gathered: list[Any] = []
        self.spec: KVCacheSpec | None = None
        self._meta: dict[str, Any] = {}

    def register_kv_cache(self, kv_cache: Any, spec: KVCacheSpec) -> None:
        self.spec = spec
        mine = (self.tp.rank, os.getpid(), int(kv_cache.shape[3]), spec.total_num_kv_heads)
        self.gathered = self.tp.all_gather(mine) if self.tp.all_gather else [mine]

    def bind_connector_metadata(self, metadata: Any) -> None:
        self._meta = metadata or {}

    def start_load_kv(self) -> None:
        pass

    def get_finished(self, finished_request_ids: set[str]) -> KVConnectorOutput:
        rank = self.tp.rank
        meta = self._meta
        if meta.get("fail_rank") == rank:
            raise RuntimeError(f"scripted failure on rank {rank}")
        out = KVConnectorOutput()
        out.finished_recving = set(meta.get("recv", {}).get(rank, ()))
        out.finished_sending = set(meta.get("send", {}).get(rank, ()))
        out.first_tokens = {request_id: tok + rank for request_id, tok in meta.get("first", {}).items()}
        invalid = meta.get("invalid", {}).get(rank, ())
        if invalid:
            out.invalid_block_ids = set(invalid)
            out.load_errors = {request_id: KVLoadError(KVLoadFailure.TRANSPORT, f"rank {rank}")
                               for request_id in out.finished_recving}
        out.stats = {"polls": 1, "gathered": [list(g) for g in self.gathered]}
        return out

    def next_poll_in(self) -> float | None:
        return None


def scripted_worker(config: EngineConfig, tp: TPRank) -> ScriptedWorker:
    """Connector factory of the executor (``config`` unused)."""
    return ScriptedWorker(tp)


def failing_worker(config: EngineConfig, tp: TPRank) -> ScriptedWorker:
    """Connector factory whose rank 1 fails to start (start-up failure tests)."""
    if tp.rank == 1:
        raise RuntimeError("scripted start-up failure on rank 1")
    return ScriptedWorker(tp)
