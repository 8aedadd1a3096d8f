"""Reader side of the NIXL connector: each request's KV load, from the handshake through the
lease claim to the READ, and how it ends.

Load life cycle::

    handshake (once per remote engine, cached) -> claim (per request, checks and extends the
    owner's lease) -> READ posted (notification "done" rides on it) -> polled until DONE/ERR

A claim answered with the owner's first token (a decoder's load of a whole prompt) reports the
token at once and waits in ``granted`` until the report that carries it was taken
(:meth:`LoadTracker.report_taken`): the READ is posted in the next step, after the token went
out, so that posting it (up to about a millisecond of host work for a long prompt) does not
delay the first token.

Any failure ends the load with the request id in ``finished_recving``, its destination blocks in
``invalid_block_ids`` and its :class:`~pdserve.types.outputs.KVLoadError` in ``load_errors``;
the owner is told to drop its lease ("abort") when it can be reached.

A peer on this instance's GPU (CUDA IPC, :mod:`.cuda_ipc`) or, in host-buffer mode, with a
shared host mirror on this host (:mod:`.shared_host`) is read by a direct copy
(:mod:`.direct_read`, "done" sent when it completes) instead of the READ; in host-buffer mode
(:mod:`.host_buffer`) a READ fills the pinned host mirror and a copy to the GPU follows (phase
``unstage``).

Across TP sizes (:mod:`.tp_plan`): every reader rank claims the lease at the owner's side
channel (its rank 0), all with the request's one reader id (:mod:`.readers`), and posts one
READ per owner rank it reads (whole blocks, or the byte regions of a head slice), each carrying
a "done" for that owner rank with the count of notices it expects; when the READs are over the
reader tells the owner ranks it notifies but did not read ("done" by notification). A failure
tells every one of them ("abort").

Concurrent hand-off (docs/proxy.md): a pending reference names the router's transfer id, not
the owner's request and blocks. Its claim is a *pending claim* that the owner answers when it
holds the prompt's blocks (up to ``kv_prefill_wait_timeout``); the answer's request id and
block ids complete the reference, and the load goes on as any other. A load aborted while its
pending claim waits tells the owner by transfer id.
A claim of a decoder's demoted turn lease is answered with the blocks holding it again
(``block_ids``): the reference is resolved to them as a pending one is; when the owner holds only
the turn's leading blocks, the load reads those and the scheduler computes the rest (a *partial
load*, ``KVConnectorOutput.partial_loads``, counted apart from the failures). What an answer
means for the load is :mod:`.granted_claims`.
A pull's claim waits at most ``RecvSpec.claim_wait_s``, the time the prefiller takes to compute
the tokens it loads (:class:`~.bidirectional.PrefillPace`); still unanswered then, the load is
given up: nothing read, reported as a partial load of no block, counted in
``num_pulls_given_up``, and the owner told to drop the turn.

Restarted peers: a claim answered by another ``instance_id`` than the handshaken one (the owner
restarted, with the same engine id or on the same host and port) drops the cached agent and
sends the load back to the handshake; a READ that cannot be posted (``NIXL_ERR_REMOTE_DISCONNECT``)
does the same; a READ that fails drops the agent so later loads handshake afresh.

:class:`LoadTracker` is the state machine (handshake, claim, post, poll, end); one load's record
and the posting of its READs are :mod:`.reads`, its claims :mod:`.claims`, what a claim's answer
means :mod:`.granted_claims`. What is left stays one module (past 450 lines): every phase
moves the same loads through one table and ends them through the same report and notices.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Callable

from pdserve.utils import phase_trace
from pdserve.types.outputs import KVConnectorOutput
from pdserve.types.outputs import KVLoadError, KVLoadFailure
from pdserve.types.kv_transfer_config import KVTransferConfig
from pdserve.kv_transfer.nixl import host_buffer
from pdserve.kv_transfer.nixl.agent import NixlAgent
from pdserve.kv_transfer.nixl.granted_claims import (Refusal, blocks_refusal, grant_refusal,
                                                    resolve)
from pdserve.kv_transfer.nixl.metadata import RecvSpec, RemoteNotice
from pdserve.kv_transfer.nixl.claims import Claims
from pdserve.types.remote_ref import RemoteEndpoint
from pdserve.kv_transfer.nixl.reads import Load, LoadPhase, post_reads, read_time
from pdserve.kv_transfer.nixl.remotes import HandshakeFailure, RemoteRegistry
from pdserve.kv_transfer.nixl.side_channel import SideChannelTimeout
from pdserve.kv_transfer.nixl.side_channel_client import SideChannelClient
from pdserve.kv_transfer.nixl.stats import StatsRecorder
from pdserve.kv_transfer.nixl.transfer_path import TransferPaths

logger = logging.getLogger("pdserve.kv_transfer.nixl.worker")

# How often one load may go back to the handshake because the remote restarted under it.
MAX_REHANDSHAKES = 2

# NIXL cannot wake the engine loop when a READ completes: a posted READ is checked without
# waiting for XFER_SPIN_S after posting (short transfers are seen at once), then every
# XFER_POLL_INTERVAL_S.
XFER_SPIN_S = 0.002
XFER_POLL_INTERVAL_S = 0.001


class LoadTracker:
    """The loads of one worker (engine thread only).

    Args:
        config: the transfer configuration (timeouts).
        agent: the local NIXL agent.
        remotes: the handshaken remote engines.
        client: the engine thread's side-channel client (lease claims).
        stats: where transfers and failures are counted.
        output: returns the worker's report of the current step (loads add to it).
        notify: queues a notice ("abort") for a remote owner.
        mirror: returns the host-buffer mirror (``kv_buffer_device: cpu`` on CUDA), or None.
        paths: each peer's read path and bandwidth, for logs and metrics.
        reader: the reader id of a local request, named by its claims and notices
            (:mod:`.readers`); None: they name none.
    """

    def __init__(self, config: KVTransferConfig, agent: NixlAgent, remotes: RemoteRegistry,
                 client: SideChannelClient, stats: StatsRecorder,
                 output: Callable[[], KVConnectorOutput],
                 notify: Callable[[RemoteNotice], None],
                 mirror: Callable[[], host_buffer.HostMirror | None] = lambda: None,
                 paths: TransferPaths | None = None,
                 reader: Callable[[str], str] | None = None):
        self.config = config
        self.agent = agent
        self.remotes = remotes
        self._client = client
        self._stats = stats
        self._output = output
        self._notify = notify
        self._mirror = mirror
        self._paths = paths if paths is not None else TransferPaths()
        self.claims = Claims(config, client, reader)  # lease claims, early ones too
        self._loads: dict[str, Load] = {}

    def __len__(self) -> int:
        return len(self._loads)

    def add(self, request_id: str, spec: RecvSpec) -> None:
        """Start a load (its handshake at once when the remote is named)."""
        self._loads[request_id] = Load(spec, reader=self.claims.reader(request_id))
        if spec.remote is not None and spec.error is None:
            self.remotes.ensure(spec.remote.endpoint)

    def awaits_first_token(self) -> bool:
        """True while a load whose claim's answer carries the owner's first token is not
        answered yet (:meth:`~pdserve.kv_transfer.base.KVConnectorWorkerSide.expects_answer`)."""
        return any(load.spec.takes_first_token
                   and load.phase in (LoadPhase.HANDSHAKE, LoadPhase.CLAIM)
                   for load in self._loads.values())

    def abort(self, request_id: str) -> None:
        """The request was aborted: its load ends at the next step (a READ in flight first
        finishes, since it writes the blocks)."""
        load = self._loads.get(request_id)
        if load is None:  # already reported (or never started): harmless repeat
            self._output().finished_recving.add(request_id)
        else:
            load.aborted = True

    def next_poll_in(self) -> float | None:
        """0 while a READ waits to be posted or was posted less than :data:`XFER_SPIN_S` ago,
        else :data:`XFER_POLL_INTERVAL_S`, or the time left of a pull's claim wait
        (``RecvSpec.claim_wait_s``) when sooner; None without a READ in flight or to post or a
        bounded claim waiting."""
        now = time.perf_counter()
        waits = [0.0 if load.phase is LoadPhase.GRANTED or now - load.t_post < XFER_SPIN_S
                 else XFER_POLL_INTERVAL_S for load in self._loads.values()
                 if load.phase in (LoadPhase.GRANTED, LoadPhase.XFER, LoadPhase.UNSTAGE)]
        waits += [max(0.0, left) for load in self._loads.values()
                  if load.phase is LoadPhase.CLAIM
                  and (left := load.claim_wait_left(now)) is not None]
        return min(waits, default=None)

    # ----------------------------------------------------------------------------- progress
    def handshakes_failed(self, failures: list[HandshakeFailure]) -> None:
        """Fail the loads waiting on handshakes that failed."""
        for f in failures:
            for request_id, load in list(self._loads.items()):
                if load.phase is LoadPhase.HANDSHAKE and load.spec.remote is not None and \
                        load.spec.remote.endpoint.key == f.endpoint.key:
                    self._fail(request_id, f.kind, f.reason, notify_remote=f.reachable)

    def progress(self, now: float) -> None:
        """Send claims for loads whose handshake is done and post the READs whose claim was
        granted (never blocks)."""
        for request_id, load in list(self._loads.items()):
            spec = load.spec
            if load.phase is LoadPhase.HANDSHAKE:
                if spec.error is not None or spec.remote is None:
                    self._fail(request_id, KVLoadFailure.INVALID_REFERENCE,
                               spec.error or "no remote KV reference", notify_remote=False)
                    continue
                if load.aborted:
                    self._drop_unread(request_id, load)
                    continue
                remote = self.remotes.ensure(spec.remote.endpoint)
                if remote.agent is None:
                    continue
                if not spec.remote.pending and not self._blocks_fit(request_id, spec, remote):
                    continue
                phase_trace.mark("kv.claim_send")
                load.t_claim = time.perf_counter()
                self.claims.claim(request_id, load)  # maybe the one sent at its arrival
                load.phase = LoadPhase.CLAIM
            if load.phase is LoadPhase.CLAIM:
                try:
                    reply = self._client.result(load.claim)
                except Exception as e:
                    if self.claims.again(load):
                        continue
                    timeout = isinstance(e, SideChannelTimeout)
                    self._fail(request_id, KVLoadFailure.TIMEOUT if timeout else
                               KVLoadFailure.TRANSPORT, f"lease claim failed: {e}",
                               notify_remote=not timeout)
                    continue
                if reply is None:  # not answered yet
                    left = load.claim_wait_left(time.perf_counter())
                    waited_out = left is not None and left < 0.0
                    if load.aborted and (spec.remote.pending or waited_out):
                        self._drop_unread(request_id, load)  # gave up while the owner works
                    elif waited_out:
                        self._give_up(request_id, load)
                    continue
                if not reply.get("ok") and self.claims.again(load):
                    continue
                if not reply.get("ok"):
                    # No abort notice: this reader holds nothing, and one naming the lease's
                    # blocks would let a forged reference (right ids, other tokens) end the
                    # lease an honest reader is about to claim.
                    self._fail(request_id, KVLoadFailure.LEASE_REFUSED,
                               f"remote refused the read: {reply.get('reason')}",
                               notify_remote=False)
                    continue
                if self._remote_restarted(request_id, load, reply):
                    continue
                if not spec.remote.pending and isinstance(reply.get("block_ids"), list):
                    reply = dict(reply, request_id=spec.remote.request_id)  # a restored turn
                if (spec.remote.pending or "block_ids" in reply) and (
                        self._refused(request_id, resolve(load, reply))
                        # the remote's agent is loaded: _remote_restarted sent it back otherwise
                        or not self._blocks_fit(request_id, spec,
                                                self.remotes.get(spec.remote.endpoint))):
                    continue
                phase_trace.mark("kv.claim_ok")
                load.claim_s = time.perf_counter() - load.t_claim
                if self._refused(request_id, grant_refusal(load, reply)):
                    continue
                if load.first_token is not None:
                    # known now and independent of the local KV: the scheduler emits it while
                    # the blocks are read (KVConnectorOutput.first_tokens); posted after it
                    self._output().first_tokens[request_id] = load.first_token
                    load.phase = LoadPhase.GRANTED
            if load.phase is LoadPhase.GRANTED and not load.token_out:
                continue
            if load.phase in (LoadPhase.CLAIM, LoadPhase.GRANTED):
                if load.aborted:
                    self._drop_unread(request_id, load)
                    continue
                self._post(request_id, load, now)

    def report_taken(self) -> None:
        """The worker's report of this step was taken: the first tokens it carries are on
        their way out, so the loads that waited for that may post their READs."""
        for load in self._loads.values():
            if load.phase is LoadPhase.GRANTED:
                load.token_out = True

    def _blocks_fit(self, request_id: str, spec: RecvSpec, remote: Any) -> bool:
        """True when the remote blocks read exist on the remote and pair with the local ones;
        else the load fails."""
        return not self._refused(request_id, blocks_refusal(spec, remote.agent.num_blocks))

    def _refused(self, request_id: str, refusal: Refusal | None) -> bool:
        """Fail the load with ``refusal`` when there is one; True then."""
        if refusal is not None:
            self._fail(request_id, *refusal)
        return refusal is not None

    def _back_to_handshake(self, load: Load) -> None:
        load.phase, load.claim = LoadPhase.HANDSHAKE, None
        self.remotes.ensure(load.spec.remote.endpoint)

    def _remote_restarted(self, request_id: str, load: Load, reply: dict[str, Any]) -> bool:
        """True when a claim was answered by another instance than the handshaken one: the
        cached agent is dropped and the load goes back to the handshake (its lease claim,
        granted by the new instance, is repeated after it)."""
        endpoint = load.spec.remote.endpoint
        remote = self.remotes.get(endpoint)
        if remote is None or remote.agent is None:  # forgotten meanwhile (transport error)
            self._back_to_handshake(load)
            return True
        answered, known = reply.get("instance_id"), remote.instance_id
        if answered is None or known is None or answered == known:
            return False
        self.forget_remote(endpoint, f"instance {known} was replaced by {answered}")
        if load.rehandshakes >= MAX_REHANDSHAKES:
            self._fail(request_id, KVLoadFailure.TRANSPORT,
                       f"engine {endpoint.engine_id} restarted again during the load",
                       notify_remote=True)
            return True
        load.rehandshakes += 1
        if load.aborted:
            self._drop_unread(request_id, load)
        else:
            self._back_to_handshake(load)
        return True

    def forget_remote(self, endpoint: RemoteEndpoint, why: str) -> None:
        """Drop a remote engine's cached agent (restarted or vanished); READs still in flight
        from it fail; the next use of that endpoint handshakes afresh."""
        remote = self.remotes.get(endpoint)
        if remote is None or remote.agent is None:
            return
        for request_id, load in list(self._loads.items()):
            if load.phase is LoadPhase.XFER and load.spec.remote.endpoint.key == endpoint.key:
                self._xfer_failed(request_id, load, KVLoadFailure.TRANSPORT,
                                  f"the NIXL READ's remote went away ({why})", forget=False)
        self.remotes.forget(endpoint, why)

    def _post(self, request_id: str, load: Load, now: float) -> None:
        spec = load.spec
        remote = self.remotes.get(spec.remote.endpoint)
        t0 = time.perf_counter()
        load.mover = remote.direct or self.agent
        try:
            states = post_reads(self.agent, load, remote)
        except Exception as e:
            if remote.direct is not None:
                self._fail(request_id, KVLoadFailure.TRANSPORT, f"posting the direct copy failed: {e}",
                           notify_remote=True)
                return
            # The remote agent is gone (NIXL_ERR_REMOTE_DISCONNECT: the peer died or
            # restarted): forget it; this load handshakes afresh once, later loads too.
            self.forget_remote(spec.remote.endpoint, f"posting a READ failed: {e}")
            if load.rehandshakes < MAX_REHANDSHAKES and not load.aborted:
                load.rehandshakes += 1
                self._back_to_handshake(load)
                return
            self._fail(request_id, KVLoadFailure.TRANSPORT, f"posting the NIXL READ failed: {e}",
                       notify_remote=True)
            return
        phase_trace.mark("kv.posted")
        load.post_s = time.perf_counter() - t0
        load.t_post = t0
        load.phase = LoadPhase.XFER
        load.deadline = now + self.config.kv_transfer_timeout
        if "ERR" in states:
            self._xfer_failed(request_id, load, KVLoadFailure.TRANSPORT,
                              "the NIXL READ failed when posted")
        elif all(state == "DONE" for state in states):
            self._xfer_done(request_id, load)

    # ---------------------------------------------------------------------------- polling
    def poll(self, now: float) -> None:
        """Check every posted READ: done, failed, or past its deadline."""
        for request_id, load in list(self._loads.items()):
            if load.phase is LoadPhase.UNSTAGE:  # host-buffer mode: mirror -> GPU copy
                if host_buffer.HostMirror.done(load.unstage):
                    self._xfer_done(request_id, load)
                continue
            if load.phase is not LoadPhase.XFER:
                continue
            states = [load.mover.check(handle) for handle in load.handles]
            if all(state == "DONE" for state in states):
                self._xfer_done(request_id, load)
            elif "ERR" in states:
                self._xfer_failed(request_id, load, KVLoadFailure.TRANSPORT, "the NIXL READ failed")
            elif now > load.deadline:
                self._xfer_failed(
                    request_id, load, KVLoadFailure.TIMEOUT,
                    f"the NIXL READ did not finish within {self.config.kv_transfer_timeout:g} s",
                )

    def _xfer_done(self, request_id: str, load: Load) -> None:
        spec = load.spec
        mirror = self._mirror()
        if mirror is not None and load.phase is LoadPhase.XFER and load.mover is self.agent:
            # host-buffer mode: the READ filled the mirror; copy its blocks to the GPU
            load.phase = LoadPhase.UNSTAGE
            load.unstage = mirror.to_device(spec.local_block_ids)
            if not host_buffer.HostMirror.done(load.unstage):
                return  # finished by poll()
        elapsed = time.perf_counter() - load.t_post
        teles = [load.mover.telemetry(handle) for handle in load.handles]
        for handle in load.handles:
            load.mover.release(handle)
        load.handles = []
        nbytes = load.nbytes
        xfer_s, ndesc = read_time(load, teles, elapsed)
        if mirror is not None and load.mover is self.agent:  # the READ and the copy to the GPU
            xfer_s = elapsed
        self._stats.current.record_transfer(xfer_s, load.post_s, nbytes, ndesc)
        self._paths.observe(spec.remote.endpoint.engine_id, nbytes, xfer_s)
        if load.mover is not self.agent:  # a direct copy: tell the owner as NIXL would
            self._notify(RemoteNotice(spec.remote, "done", reader_request=request_id))
        else:  # owner ranks this rank notifies without reading them
            remote = self.remotes.get(spec.remote.endpoint)
            for rank in (remote.route.targets if remote is not None else ()):
                if rank not in load.read_ranks:
                    self._notify(RemoteNotice(spec.remote, "done", tp_rank=rank,
                                              reader_request=request_id))
        phase_trace.mark("kv.done")
        del self._loads[request_id]
        out = self._output()
        out.finished_recving.add(request_id)
        if load.unread:  # the owner held only the leading blocks: the scheduler computes the rest
            out.partial_loads[request_id] = len(spec.local_block_ids)
            self._stats.current.num_partial_transfers += 1
        if logger.isEnabledFor(logging.DEBUG):
            logger.debug(
                "NIXL: request %s loaded %d blocks in %.2f ms: handshake wait %.2f ms, claim "
                "%.2f ms, READ post %.2f ms, READ %.2f ms (from post to seen done %.2f ms)",
                request_id, len(spec.local_block_ids), 1e3 * (time.perf_counter() - load.t_start),
                1e3 * max(0.0, load.t_claim - load.t_start), 1e3 * load.claim_s,
                1e3 * load.post_s, 1e3 * xfer_s, 1e3 * elapsed)

    def _xfer_failed(self, request_id: str, load: Load, kind: KVLoadFailure, reason: str,
                     forget: bool = True) -> None:
        for handle in load.handles:
            (load.mover or self.agent).release(handle)
        load.handles = []
        self._fail(request_id, kind, reason, notify_remote=True)
        if forget and kind is KVLoadFailure.TRANSPORT and load.spec.remote is not None:
            self.forget_remote(load.spec.remote.endpoint, reason)

    def _fail(self, request_id: str, kind: KVLoadFailure, reason: str, notify_remote: bool) -> None:
        load = self._loads.pop(request_id, None)
        if load is None:
            return
        if load.claim is not None:
            self._client.cancel(load.claim)
        spec = load.spec
        self._stats.current.num_failed_transfers += 1
        logger.warning("NIXL: KV load of request %s failed (%s): %s", request_id, kind.value, reason)
        out = self._output()
        out.finished_recving.add(request_id)
        if not load.aborted:  # an aborted request's blocks are simply freed
            out.invalid_block_ids.update(spec.local_block_ids, load.unread)
            out.load_errors[request_id] = KVLoadError(kind, reason)
        if notify_remote and spec.remote is not None:
            self._notify(RemoteNotice(spec.remote, "abort", reader_request=request_id))

    def _give_up(self, request_id: str, load: Load) -> None:
        """A pull whose claim was not answered within ``claim_wait_s`` (the owner restores a
        demoted turn, or has not started its lease): computing its tokens is sooner. Nothing
        was read: reported as a load of no block (the scheduler computes from the request's
        local hit); the owner is told to drop the turn."""
        self._drop_unread(request_id, load)
        self._output().partial_loads[request_id] = 0
        self._stats.current.num_pulls_given_up += 1
        logger.info("NIXL: request %s: no answer to the pull's lease claim within its bound of "
                    "%.1f ms (kv_pull_wait_factor times the time computing its %d tokens takes); "
                    "computing them", request_id, 1e3 * load.spec.claim_wait_s,
                    load.spec.num_tokens)

    def _drop_unread(self, request_id: str, load: Load) -> None:
        """A load ended before its READ was posted (aborted, or given up): reported finished,
        its claim cancelled, the owner told."""
        del self._loads[request_id]
        if load.claim is not None:
            self._client.cancel(load.claim)
        self._output().finished_recving.add(request_id)
        if load.spec.remote is not None:
            self._notify(RemoteNotice(load.spec.remote, "abort", reader_request=request_id))

    def close(self) -> None:
        """Release the handles of READs still in flight."""
        for load in self._loads.values():
            for handle in load.handles:
                (load.mover or self.agent).release(handle)
        self._loads.clear()

