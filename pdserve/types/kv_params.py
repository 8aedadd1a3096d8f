"""The P/D wire protocol: a request's ``kv_transfer_params`` parsed once into
:class:`KVTransferParams`, and the params an instance returns, built here.

``kv_transfer_params`` follow vLLM's NixlConnector contract. A request carries them in; the
front end parses them once, when the request arrives (:func:`parse_request_params`), into one
typed :class:`KVTransferParams` that travels with the request (the front end's engine jobs, the
ZMQ :class:`~pdserve.types.core_messages.AddRequest`, the engine's
:class:`~pdserve.types.request.Request`). The front end, the engine and the connector ask that
object (``params.role``, ``params.remote``, ``params.first_token``,
``params.handed_prompt_ids(...)``); none of them reads the dict.

Fields read (all others are kept in ``wire`` and otherwise ignored):

* ``do_remote_decode: true`` -> :attr:`KVRole.PREFILL` (this instance prefills; a decoder reads
  the KV). With a bidirectional connector, a previous turn's decoder fields
  (``remote_engine_id``, ``remote_block_ids``, ``remote_request_id``, ...) name KV to pull back.
* ``do_remote_prefill: true`` -> :attr:`KVRole.DECODE` (this instance decodes from a prefiller's
  KV): ``remote_engine_id``, ``remote_block_ids``, ``remote_host``, ``remote_port``,
  ``remote_request_id`` (+ optional ``remote_num_tokens``, ``remote_block_hashes``,
  ``remote_blocks_expiry_time``), parsed into a
  :class:`~pdserve.types.remote_ref.RemoteKVRef`; ``first_token_id``: the token the
  prefiller sampled (only a hint: the decoder takes the prefiller's own token from its lease
  claim answer, see ``kv_transfer/nixl/leases.py``).
* ``transfer_id`` (prefill leg) and ``remote_transfer_id`` (decoder leg): the router's id of a
  concurrent hand-off (docs/proxy.md, "Concurrent hand-off"). A decoder leg with
  ``remote_transfer_id`` and no ``remote_block_ids`` / ``remote_request_id`` is *pending*
  (:attr:`RemoteKVRef.pending <pdserve.types.remote_ref.RemoteKVRef.pending>`): the decoder
  learns the prefiller's request, blocks and first token from the prefiller's side channel.
* ``prompt_tokens``: the prefiller's prompt ids for the decoder's front end
  (:mod:`pdserve.types.prompt_handoff`); consumed by the front end, not sent to the engine.

A prefill leg's front end adds the digest of the rendered prompt (``prompt_digest``, not a wire
field), so that the connector's scheduler side returns the params complete, P's prompt ids
included. Returned params (the response direction) are built by the connector only:
:func:`prefill_done_params` (P) plus :func:`with_prompt_handoff` (its prompt ids), and
:func:`decoder_turn_params` (a bidirectional D); the front end relays them as they are.
``remote_block_ids`` are returned per KV-cache group (a list of lists, vLLM's current form) and
accepted in both the flat and the per-group form (:func:`parse_block_id_groups`).
"""

from __future__ import annotations

import enum
from typing import TYPE_CHECKING, Any

import msgspec

from pdserve.types import prompt_handoff
from pdserve.types.remote_ref import (MAX_KV_CACHE_GROUPS, KVTransferParamsError, RemoteKVRef,
                                      check_transfer_id, parse_block_id_groups)

if TYPE_CHECKING:
    from pdserve.types.kv_transfer_config import KVTransferConfig
    from pdserve.types.request import Request

__all__ = [
    "KVRole", "KVTransferParams", "KVTransferParamsError", "MAX_KV_CACHE_GROUPS",
    "RemoteKVRef", "block_id_groups", "decoder_turn_params", "parse_block_id_groups",
    "may_use_first_token", "parse_request_params", "prefill_done_params", "with_prompt_handoff",
]

#: The remote fields a previous turn's decoder returns (and P reads for a bidirectional pull).
REMOTE_REF_FIELDS = (
    "remote_engine_id", "remote_block_ids", "remote_host", "remote_port", "remote_request_id",
)
# The fields without which a P leg names no previous turn on a decoder.
_D_FIELDS = ("remote_engine_id", "remote_block_ids", "remote_request_id")
_FLAGS = ("do_remote_prefill", "do_remote_decode")
_FIRST_TOKEN = "first_token_id"
#: The largest block id any instance can have: block tables are int32 on every path (the
#: attention kernels' block tables, the NIXL transfer's descriptor indices), so a larger id in
#: params is out of range whatever the remote's cache, and is refused at the edge.
MAX_BLOCK_ID = 2**31 - 1


class KVRole(enum.Enum):
    """What a request asks of this instance in a P/D flow."""

    NONE = "none"  # no P/D role (plain request)
    PREFILL = "prefill"  # ``do_remote_decode``: prefill here, a remote decoder reads the KV
    DECODE = "decode"  # ``do_remote_prefill``: decode here from a remote prefiller's KV


class KVTransferParams(msgspec.Struct, frozen=True, omit_defaults=True):
    """A request's ``kv_transfer_params``, parsed (see the module docstring).

    Attributes:
        role: the request's P/D role.
        remote: the remote KV the request names: the prefiller's (``DECODE``), or a previous
            turn's decoder's (``PREFILL`` with decoder fields); None when absent or malformed.
        remote_error: why the remote fields are unusable (the first problem; None when fine).
            The front end refuses such params with a 400; an engine that gets them anyway
            plans a failed load, so ``kv_load_failure_policy`` applies.
        error: the first problem of any field (flags, remote fields, first token), for the
            front end's check.
        first_token: the prefiller's first output token as relayed by the client (``DECODE``
            only; None when absent or malformed).
        handoff: the prefiller's prompt-ids hand-off as relayed (None once the front end has
            consumed it, see :meth:`for_engine`).
        wire: the params as received, without the hand-off (what is passed through, e.g. to
            a connector that reads its own fields).
        prompt_digest: a prefill leg's rendered-prompt digest
            (:func:`pdserve.types.prompt_handoff.text_digest`), set by the front end
            (:meth:`with_prompt_digest`): the connector hands the prompt ids on with the
            params it returns. None: nothing to hand on.
        transfer_id: a prefill leg's concurrent hand-off id (``transfer_id``): a decoder's
            pending claim naming it gets the held blocks. None: a sequential hand-off.
    """

    role: KVRole = KVRole.NONE
    remote: RemoteKVRef | None = None
    remote_error: str | None = None
    error: str | None = None
    first_token: int | None = None
    handoff: Any = None
    wire: dict[str, Any] = {}
    prompt_digest: str | None = None
    transfer_id: str | None = None

    # ------------------------------------------------------------------------ parsing
    @classmethod
    def parse(cls, raw: Any) -> "KVTransferParams | None":
        """Parse ``kv_transfer_params`` as received; never raises (problems are recorded in
        ``error`` / ``remote_error``; :meth:`check` raises them).

        Args:
            raw: the request's ``kv_transfer_params`` (a JSON object; parsed params are
                returned as they are), or None.

        Returns:
            The parsed params, or None for None.
        """
        if raw is None or isinstance(raw, KVTransferParams):
            return raw
        if not isinstance(raw, dict):
            return cls(error="kv_transfer_params must be a JSON object")
        error: str | None = None
        for flag in _FLAGS:
            value = raw.get(flag)
            if value is not None and not isinstance(value, bool) and error is None:
                error = f"kv_transfer_params.{flag} must be true or false, got {type(value).__name__}"
        if raw.get("do_remote_prefill"):
            role = KVRole.DECODE
        elif raw.get("do_remote_decode"):
            role = KVRole.PREFILL
        else:
            role = KVRole.NONE
        remote: RemoteKVRef | None = None
        remote_error: str | None = None
        names_remote = role is KVRole.DECODE or (
            role is KVRole.PREFILL and any(raw.get(k) is not None for k in REMOTE_REF_FIELDS))
        if names_remote:
            try:
                remote = RemoteKVRef.from_params(raw)
            except KVTransferParamsError as e:
                remote_error = str(e)
            if remote is not None:
                too_big = [b for b in remote.block_ids if b > MAX_BLOCK_ID]
                if too_big:
                    remote, remote_error = None, (
                        f"kv_transfer_params.remote_block_ids: block id {too_big[0]} is out of "
                        f"range (block ids are at most {MAX_BLOCK_ID})")
                elif remote.num_tokens is not None and remote.num_tokens > MAX_BLOCK_ID:
                    remote, remote_error = None, (
                        f"kv_transfer_params.remote_num_tokens {remote.num_tokens} is out of "
                        f"range")
            if role is KVRole.PREFILL and not all(raw.get(k) is not None for k in _D_FIELDS):
                remote = None  # a P leg names a previous turn only with all of D's fields
        first = raw.get(_FIRST_TOKEN)
        first_token: int | None = None
        first_error: str | None = None
        if role is KVRole.DECODE and first is not None:
            if isinstance(first, int) and not isinstance(first, bool) and first >= 0:
                first_token = first
            else:
                first_error = ("kv_transfer_params.first_token_id must be a non-negative integer "
                               "token id")
        transfer_id: str | None = None
        transfer_error: str | None = None
        if role is KVRole.PREFILL and raw.get("transfer_id") is not None:
            try:
                transfer_id = check_transfer_id(raw["transfer_id"], "transfer_id")
            except KVTransferParamsError as e:
                transfer_error = str(e)
        wire = {k: v for k, v in raw.items() if k != prompt_handoff.KEY}
        return cls(role=role, remote=remote, remote_error=remote_error,
                   error=error or remote_error or first_error or transfer_error,
                   first_token=first_token, handoff=raw.get(prompt_handoff.KEY), wire=wire,
                   transfer_id=transfer_id)

    def check(self, bidirectional: bool, vocab_size: int | None = None) -> None:
        """Refuse params of a KV transfer this instance would perform that lack or mistype a
        field, so that a client mistake is a 400 instead of a failed KV load.

        Checked: the role flags (booleans when given); on a decoder leg all remote fields and
        ``first_token_id`` (a token id in ``[0, vocab_size)``); on a prefill leg that names a
        previous turn's decoder, with ``bidirectional``, the remote fields. A prefill leg's
        decoder fields are not checked without ``bidirectional`` (they are ignored).

        Raises:
            KVTransferParamsError: the message names the field.
        """
        error = self.error
        if error is not None and error == self.remote_error and self.role is KVRole.PREFILL \
                and not bidirectional:
            error = None
        if error is not None:
            raise KVTransferParamsError(error)
        if self.first_token is not None and vocab_size is not None and self.first_token >= vocab_size:
            raise KVTransferParamsError(
                f"kv_transfer_params.first_token_id {self.first_token} is outside the "
                f"vocabulary [0, {vocab_size})")

    # ------------------------------------------------------------------------ questions
    @property
    def is_empty(self) -> bool:
        """No field at all (``{}``)."""
        return not self.wire and self.handoff is None

    @property
    def pulls_decoder_kv(self) -> bool:
        """A prefill leg that names a previous turn's KV on a decoder (bidirectional pull)."""
        return self.role is KVRole.PREFILL and self.remote is not None

    def handed_prompt_ids(self, digest: str, vocab_size: int | None) -> list[int] | None:
        """The prefiller's prompt ids relayed with a decoder leg, when they were computed from
        a text with ``digest`` (:func:`pdserve.types.prompt_handoff.decode`); else None."""
        if self.role is not KVRole.DECODE or self.handoff is None:
            return None
        return prompt_handoff.decode(self.handoff, digest, vocab_size)

    def for_engine(self) -> "KVTransferParams":
        """These params without the prompt-ids hand-off (the front end consumed it)."""
        return self if self.handoff is None else msgspec.structs.replace(self, handoff=None)

    def with_prompt_digest(self, digest: str | None) -> "KVTransferParams":
        """These params with a prefill leg's rendered-prompt digest (None: unchanged), so the
        connector returns the prompt ids with the params (:func:`with_prompt_handoff`)."""
        return self if digest is None else msgspec.structs.replace(self, prompt_digest=digest)

    @property
    def reads_remote_kv(self) -> bool:
        """The request reads KV held by another instance: a decoder leg (its prefiller's lease)
        or a prefill leg that pulls a previous turn from a decoder."""
        return self.remote is not None

    def for_other_choices(self) -> "KVTransferParams | None":
        """These params for the choices after the first (``n > 1``), or None.

        None when these params read a remote KV: a lease is read by one reader (the owner frees
        the blocks at the first reader's "done", which a second reader's READ of the same blocks
        could follow), so the first choice reads it and the others run without params, started
        once the first choice has its first output and the prompt's KV is in the local prefix
        cache (:attr:`pdserve.entrypoints.job_runner.EngineJob.after`). Otherwise these params
        without the prefiller's first token, which belongs to its one choice: the others draw
        their own."""
        if self.reads_remote_kv:
            return None
        if self.first_token is None and _FIRST_TOKEN not in self.wire:
            return self
        wire = {k: v for k, v in self.wire.items() if k != _FIRST_TOKEN}
        return msgspec.structs.replace(self, first_token=None, wire=wire)

    def to_dict(self) -> dict[str, Any]:
        """The params as received (without the prompt-ids hand-off)."""
        return dict(self.wire)


def parse_request_params(raw: Any, kv_transfer_config: "KVTransferConfig | None",
                         vocab_size: int | None) -> KVTransferParams | None:
    """The front end's one parse of a request's ``kv_transfer_params``, the same with or without
    a KV connector: malformed params are refused either way; well-formed params on an instance
    without a connector are accepted and ignored (nothing here performs a transfer), as vLLM
    ignores them without a connector.

    Args:
        raw: the request's ``kv_transfer_params``.
        kv_transfer_config: this instance's
            :class:`~pdserve.types.kv_transfer_config.KVTransferConfig`, or None without a connector
            (then a prefill leg's decoder fields are checked as without bidirectional pulls).
        vocab_size: the model's vocabulary size (bounds ``first_token_id``), or None.

    Raises:
        KVTransferParamsError: a field the leg names is missing or mistyped (the message names
            it), a block id is beyond :data:`MAX_BLOCK_ID`, an integer beyond 64 bits, or the
            remote KV named is this instance's own (``remote_engine_id``: an instance never
            reads its own KV over the transfer path).
    """
    params = KVTransferParams.parse(raw)
    if params is not None:
        bidirectional = kv_transfer_config is not None and kv_transfer_config.bidirectional_kv_xfer
        params.check(bool(bidirectional), vocab_size)
        if (kv_transfer_config is not None and params.remote is not None
                and (params.role is KVRole.DECODE or bidirectional)
                and params.remote.endpoint.engine_id == kv_transfer_config.engine_id):
            raise KVTransferParamsError(
                f"kv_transfer_params.remote_engine_id {kv_transfer_config.engine_id!r} is this "
                "instance itself; the remote KV must be another instance's")
    if params is not None:
        try:  # the engine core gets the params over msgpack, whose integers have 64 bits
            msgspec.msgpack.encode(params.wire)
        except OverflowError:
            raise KVTransferParamsError(
                "kv_transfer_params holds an integer outside the 64-bit range") from None
    return params


# ---------------------------------------------------------------------------- block ids
def block_id_groups(block_ids: list[int]) -> list[list[int]]:
    """The returned ``remote_block_ids`` for a model with one KV-cache group: per group, as
    vLLM's NixlConnector returns them (``[[0, 15, 16]]``)."""
    return [list(block_ids)]


# ---------------------------------------------------------------------------- returned params
def prefill_done_params(engine_id: str, block_ids: list[int], host: str, port: int,
                        request_id: str, first_token: int | None, tp_size: int = 1
                        ) -> dict[str, Any]:
    """What a prefiller returns for the decoder leg: where its prompt KV is (kept under a
    lease), and the first token it sampled (None: not sampled). ``tp_size`` is the
    prefiller's ``EngineConfig.tensor_parallel_size`` (returned as ``tp_size``)."""
    params: dict[str, Any] = {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_engine_id": engine_id,
        "remote_block_ids": block_id_groups(block_ids),
        "remote_host": host,
        "remote_port": port,
        "remote_request_id": request_id,
        "tp_size": tp_size,
    }
    if first_token is not None:
        params[_FIRST_TOKEN] = first_token
    return params


def decoder_turn_params(engine_id: str, block_ids: list[int], num_tokens: int,
                        block_hashes: list[str], expiry_time: float, host: str, port: int,
                        request_id: str, tp_size: int = 1) -> dict[str, Any]:
    """What a bidirectional decoder returns at the end of a turn: where the turn's KV is kept
    (``expiry_time``: ``time.time()`` seconds at which the blocks are freed) for the next
    turn's prefiller to pull. ``tp_size`` is the decoder's
    ``EngineConfig.tensor_parallel_size``."""
    return {
        "do_remote_decode": True,
        "do_remote_prefill": False,
        "remote_engine_id": engine_id,
        "remote_block_ids": block_id_groups(block_ids),
        "remote_num_tokens": num_tokens,
        "remote_block_hashes": block_hashes,
        "remote_blocks_expiry_time": expiry_time,
        "remote_host": host,
        "remote_port": port,
        "remote_request_id": request_id,
        "tp_size": tp_size,
    }


def with_prompt_handoff(returned: dict[str, Any] | None, prompt_ids: list[int],
                        digest: str | None) -> dict[str, Any] | None:
    """A prefiller's returned params plus its prompt ids for the decoder's front end
    (:mod:`pdserve.types.prompt_handoff`); built by the connector's scheduler side when the
    request's params carry the rendered prompt's ``digest``. Unchanged when ``digest`` is None,
    the params send no decoder here, or an id does not fit the wire format."""
    if digest is None or not isinstance(returned, dict) or not returned.get("do_remote_prefill"):
        return returned
    try:
        handed = prompt_handoff.encode(prompt_ids, digest)
    except OverflowError:
        return returned
    return dict(returned, **{prompt_handoff.KEY: handed})


def may_use_first_token(request: "Request") -> bool:
    """Whether a decoder's request may start with the prefiller's first output token instead
    of recomputing the last prompt token for its logits.

    The prefiller returns the token its prefill sampled; the decoder then loads the KV of the
    whole prompt and emits that token without a forward pass (the token's own KV is computed by
    the first decode step). This holds the same distribution as sampling on the decoder, since
    the prefill leg runs the same sampling parameters, except for what the prefill leg cannot
    reproduce: logprobs (not transferred); with ``n > 1`` the front end passes the token to the
    first choice only. ``min_tokens``: the proxy's prefill leg carries ``min_tokens: 1`` (a
    leg from elsewhere may carry none); the decoder drops a first token that the ``min_tokens``
    mask forbids and draws its own (:meth:`RemoteKV.first_tokens_ready
    <pdserve.engine.remote_kv.RemoteKV.first_tokens_ready>`), which is the masked draw when
    :attr:`SamplingParams.min_tokens_by_rejection
    <pdserve.types.sampling_params.SamplingParams.min_tokens_by_rejection>` holds; other
    ``min_tokens`` requests (seeded, or with top-k / top-p / min-p), requests with logprobs or
    ``n > 1``, and requests that already have output tokens, recompute the last prompt token
    as before. The
    token itself comes from the prefiller's lease-claim answer (see
    ``kv_transfer/nixl/leases.py``); the relayed one is only compared with it. A pending
    reference (concurrent hand-off) relays none: the claim answer is the only source.
    """
    params = request.kv_transfer_params
    if params is None or params.role is not KVRole.DECODE:
        return False
    pending = params.remote is not None and params.remote.pending
    if params.first_token is None and not pending:  # pending: the claim answer brings it
        return False
    sp = request.sampling_params
    return not (sp.n != 1 or sp.logprobs is not None
                or (sp.min_tokens > 0 and not sp.min_tokens_by_rejection)
                or request.output_token_ids)
