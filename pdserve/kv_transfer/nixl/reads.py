"""One KV load's record and its READs: posting them (one per owner rank read, each carrying the
"done" notification for that rank) and the time they took."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any

from pdserve.kv_transfer.nixl.agent import NixlAgent, block_runs
from pdserve.kv_transfer.nixl.metadata import RecvSpec
from pdserve.kv_transfer.nixl.notifications import encode_notif
from pdserve.kv_transfer.nixl.remotes import RemoteState


class LoadPhase(enum.Enum):
    """Where a load is: handshake -> claim -> xfer (-> unstage: host-buffer mode)."""

    HANDSHAKE = "handshake"  # waiting for the remote's handshake
    CLAIM = "claim"  # the lease claim was sent
    GRANTED = "granted"  # granted with the owner's first token: posted once that token is out
    XFER = "xfer"  # the READs (or the direct copy) are posted
    UNSTAGE = "unstage"  # host-buffer mode: the mirror -> GPU copy after the READ


@dataclass
class Load:
    """One request's load in progress."""

    spec: RecvSpec
    phase: LoadPhase = LoadPhase.HANDSHAKE
    claim: int | None = None  # SideChannelClient ticket
    early: bool = False  # the claim is the one sent at the request's arrival (claims.py)
    handles: list[Any] = field(default_factory=list)  # one per owner rank read
    mover: Any = None  # what posted the read: the NixlAgent or a DirectPeer (same interface)
    unstage: Any = None  # host-buffer mode: the mirror -> GPU copy after the READ
    t_start: float = field(default_factory=time.perf_counter)  # handed to the worker
    t_claim: float = 0.0  # claim sent
    claim_s: float = 0.0  # claim round trip
    t_post: float = 0.0
    post_s: float = 0.0
    deadline: float = 0.0
    aborted: bool = False
    rehandshakes: int = 0  # times the remote turned out to have restarted
    first_token: int | None = None  # the owner's first output token, from the claim answer
    token_out: bool = False  # GRANTED: the report carrying first_token was taken (post now)
    nbytes: int = 0  # bytes the READs move
    ndesc: int = 0  # their descriptors
    read_ranks: tuple[int, ...] = ()  # owner ranks read (their "done" rides on the READ)
    reader: str | None = None  # the reader id its claim and notices name (readers.py)
    # a partial load (granted_claims.py): the local blocks planned but not read, since the
    # owner holds only the leading ones now (the scheduler computes their tokens)
    unread: list[int] = field(default_factory=list)

    def claim_wait_left(self, now: float) -> float | None:
        """Seconds left of the claim wait's bound (``RecvSpec.claim_wait_s``, counted from the
        claim's send; ``now``: ``time.perf_counter()``), negative once past; None: no bound."""
        bound = self.spec.claim_wait_s
        return None if bound <= 0.0 else self.t_claim + bound - now


def post_reads(agent: NixlAgent, load: Load, remote: RemoteState) -> list[str]:
    """Post the READs of ``load`` from ``remote`` (one per owner rank it reads: whole blocks, or
    the byte regions of a head slice; a same-host peer's direct copy instead) and return their
    states (``"DONE"``, ``"ERR"`` or pending); records on ``load`` what they move (bytes,
    descriptors, handles, owner ranks read). Raises what posting raises (posted READs are
    released first)."""
    spec = load.spec
    route = remote.route
    if remote.direct is not None:  # same host: direct copy, "done" sent when it finishes
        handle, state = remote.direct.post_read(spec.local_block_ids,
                                                spec.remote_read_block_ids)
        load.handles = [handle]
        load.nbytes = len(spec.local_block_ids) * agent.block_bytes
        load.ndesc = len(block_runs(spec.local_block_ids, spec.remote_read_block_ids))
        return [state]
    states: list[str] = []
    load.nbytes = load.ndesc = 0
    try:
        for read in route.reads:
            owner = remote.agents[read.src_rank]
            notif = encode_notif("done", spec.remote.request_id,
                                 route.expected[read.src_rank], spec.remote.block_ids,
                                 load.reader)
            if route.whole(read):
                handle, state = agent.post_read(
                    owner, spec.local_block_ids, spec.remote_read_block_ids, notif)
                load.ndesc += len(block_runs(spec.local_block_ids,
                                             spec.remote_read_block_ids))
                load.nbytes += len(spec.local_block_ids) * owner.block_bytes
            else:
                regions = route.regions(read, spec.local_block_ids,
                                        spec.remote_read_block_ids)
                handle, state = agent.post_regions(owner, regions, notif)
                load.ndesc += len(regions)
                load.nbytes += int(regions[:, 2].sum())
            load.handles.append(handle)
            states.append(state)
    except Exception:
        for handle in load.handles:
            agent.release(handle)
        load.handles = []
        raise
    load.read_ranks = tuple(sorted({r.src_rank for r in route.reads}))
    return states


def read_time(load: Load, telemetry: list[Any], elapsed_s: float) -> tuple[float, int]:
    """The READs' time (seconds) and descriptor count: NIXL's own telemetry when every handle
    has it (READs of several owner ranks run together: the longest counts), else ``elapsed_s``
    (from post to seen done) and the descriptors counted when posting."""
    xfer_s, ndesc = elapsed_s, load.ndesc
    if telemetry and all(t is not None for t in telemetry):
        if all(t[1] > 0 for t in telemetry):
            xfer_s = max(t[1] for t in telemetry)
        if all(t[3] > 0 for t in telemetry):
            ndesc = sum(t[3] for t in telemetry)
    return xfer_s, ndesc
