"""Per-step metadata that the NIXL connector's scheduler side hands to its worker side.

Pure Python (no torch). The scheduler side builds one :class:`NixlConnectorMetadata` per engine
step; the worker side acts on it in ``start_load_kv`` / ``get_finished``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pdserve.types.remote_ref import PackedTokens, RemoteEndpoint, RemoteKVRef


@dataclass
class RecvSpec:
    """One asynchronous KV load: read ``remote_block_ids[i]`` into ``local_block_ids[i]``.

    Attributes:
        request_id: the local request id.
        remote: the remote request (its full block table is sent in the lease claim).
        local_block_ids: local destination blocks, in token order.
        remote_read_block_ids: remote source blocks, same length and order.
        num_tokens: tokens this load makes computed (for logs).
        error: set when the load is known to fail before any I/O (bad params); the worker
            reports it as a failed load.
        min_lease_left_s: the READ is posted only when the owner's claim answer says its blocks
            live at least this many more seconds (bidirectional pulls from D's TTL blocks);
            0 for no check.
        digest_tokens: the reader's tokens up to the end of what it loads (positions
            ``0 .. digest_tokens - 1``), whose :func:`token_digest` the claim carries.
        token_digest: :func:`token_digest` of those tokens ("" for none).
        first_token: the prefiller's first output token as the client relayed it (None when
            not relayed: a pending reference); the worker fails the load when the owner's
            own token (from the claim answer) differs.
        starts_with_first_token: the load brings the whole prompt and the request starts with
            the owner's first token: the worker reports it (from the claim answer) in
            ``KVConnectorOutput.first_tokens``, and fails the load when the answer has none.
            A relayed ``first_token`` implies it.
        remote_first_block: the index, in the owner's block table, of the first block read
            (the blocks before it are in the local prefix cache); a pending reference's
            ``remote_read_block_ids`` are the owner's claimed blocks from there on.
        claim_wait_s: a pull's bound (seconds) on the wait for its lease claim's answer, from
            the claim's send: past it the worker gives the load up, reads nothing and reports
            it as a load of no block (:class:`~.bidirectional.PrefillPace`); 0 for no bound
            (the claim's own timeout applies).
    """

    request_id: str
    remote: RemoteKVRef | None
    local_block_ids: list[int]
    remote_read_block_ids: list[int]
    num_tokens: int
    error: str | None = None
    min_lease_left_s: float = 0.0
    digest_tokens: int = 0
    token_digest: str = ""
    first_token: int | None = None
    starts_with_first_token: bool = False
    remote_first_block: int = 0
    claim_wait_s: float = 0.0

    @property
    def takes_first_token(self) -> bool:
        """True when the load's claim answer brings the owner's first token (the request starts
        with it: ``starts_with_first_token``, or a relayed ``first_token``)."""
        return self.starts_with_first_token or self.first_token is not None


@dataclass
class SendSpec:
    """Blocks this instance holds for a remote reader.

    Attributes:
        request_id: the local request id (the ``remote_request_id`` the reader will name).
        block_ids: the blocks held, in token order.
        lease_duration: seconds to hold them without a heartbeat or read.
        renew_on_heartbeat: heartbeats extend the lease (P→D leases) or not (D's TTL blocks).
        tokens: the tokens whose KV the blocks hold, in order, packed; a claim must carry the
            :func:`token_digest` of a prefix of them (None: no check).
        first_token: the first output token sampled after those tokens (a prefiller's), told
            to the reader in the claim answer; None when there is none.
        transfer_id: the router's concurrent hand-off id the request came with: a reader's
            pending claim naming it is answered with this lease (None: no such claim).
    """

    request_id: str
    block_ids: list[int]
    lease_duration: float
    renew_on_heartbeat: bool = True
    tokens: PackedTokens | None = None
    first_token: int | None = None
    transfer_id: str | None = None


@dataclass
class PullClaim:
    """A bidirectional pull's lease claim sent when its request arrives (:mod:`.claims`).

    Attributes:
        remote: the decoder's held turn (its whole block table is claimed).
        num_tokens: the prompt's leading tokens whose digest the claim carries (at most the
            turn's tokens).
        token_digest: :func:`token_digest` of those tokens.
    """

    remote: RemoteKVRef
    num_tokens: int
    token_digest: str


@dataclass
class RemoteNotice:
    """A control notification to a remote instance about one of its requests.

    Attributes:
        remote: the remote request.
        kind: ``"abort"`` (this instance will not read; free the blocks) or ``"done"``.
        tp_rank: the remote TP rank to tell, or None for every remote rank this rank notifies
            (:func:`~pdserve.kv_transfer.nixl.tp_plan.notice_targets`).
        reader_request: the local request that read, or was to read, the remote blocks: the
            worker sends its reader id with the notice (:mod:`.readers`); None: the notice names
            no reader (the owner applies it whoever its lease is bound to).
    """

    remote: RemoteKVRef
    kind: str
    tp_rank: int | None = None
    reader_request: str | None = None


@dataclass
class NixlConnectorMetadata:
    """What the worker side must do this step.

    Attributes:
        reqs_to_recv: loads to start (after the scheduler allocated their blocks).
        reqs_to_send: finished requests whose blocks this instance holds for a remote reader.
        notices: control notifications to send (abort before read, release).
        heartbeat_start: requests waiting in the local queue whose remote lease must be kept
            alive (request_id -> remote request).
        heartbeat_stop: requests that no longer need heartbeats.
        aborted_recvs: requests finished locally while their load was planned or in flight;
            the worker reports each in ``finished_recving`` once no READ writes its blocks.
        release_sends: leases to drop now (the local side decided the blocks are not needed).
        early_releases: the proxy's early releases (request id -> the block ids it names):
            each lease ends only when it holds exactly those blocks.
        handshakes: remote instances to handshake with ahead of time.
        pull_claims: early lease claims of arriving pulls (request id -> claim; TP 1).
        expired_pulls: bidirectional pulls skipped because the decoder's blocks expire too soon
            (counted by the worker as expired requests).
        demote_turns: a decoder's turn leases to demote (give up their GPU blocks, which the
            scheduler frees into the prefix cache once every rank reports them demoted).
        keep_turns: turn leases whose demotion a rank refused (they hold their blocks again).
        restored_turns: demoted turn leases whose KV is back in GPU blocks (request id -> those
            blocks, in token order).
        serve_turns: restored turn leases every rank took (TP > 1: their claims are answered).
        lost_turns: demoted turn leases whose blocks left every tier, or that a rank could not
            restore (the lease ends).
    """

    reqs_to_recv: dict[str, RecvSpec] = field(default_factory=dict)
    reqs_to_send: dict[str, SendSpec] = field(default_factory=dict)
    notices: list[RemoteNotice] = field(default_factory=list)
    heartbeat_start: dict[str, RemoteKVRef] = field(default_factory=dict)
    heartbeat_stop: set[str] = field(default_factory=set)
    aborted_recvs: set[str] = field(default_factory=set)
    release_sends: set[str] = field(default_factory=set)
    early_releases: dict[str, list[int]] = field(default_factory=dict)
    handshakes: list[RemoteEndpoint] = field(default_factory=list)
    pull_claims: dict[str, PullClaim] = field(default_factory=dict)
    expired_pulls: int = 0
    demote_turns: set[str] = field(default_factory=set)
    keep_turns: set[str] = field(default_factory=set)
    restored_turns: dict[str, list[int]] = field(default_factory=dict)
    serve_turns: set[str] = field(default_factory=set)
    lost_turns: set[str] = field(default_factory=set)

    def is_empty(self) -> bool:
        return not (
            self.reqs_to_recv or self.reqs_to_send or self.notices or self.heartbeat_start
            or self.heartbeat_stop or self.aborted_recvs or self.release_sends
            or self.early_releases or self.handshakes or self.pull_claims or self.expired_pulls
            or self.demote_turns or self.keep_turns or self.restored_turns
            or self.serve_turns or self.lost_turns
        )
