"""The NIXL notification payloads pdserve sends between instances: a reader's "done", "abort"
or "heartbeat" for one of the owner's requests (the same kinds the side channel's ``notify``
takes; rank 0 forwards those to its sibling ranks in this form).

Two encodings are read: ``pdserve1|kind|request_id`` (one notice closes a lease) and
``pdserve2|`` + msgpack ``{"k": kind, "r": request_id, "n": expected, "b": block_ids[, "w":
reader]}``, written since TP: ``expected`` is how many "done" notices the receiving owner rank
gets for the request (:func:`pdserve.kv_transfer.nixl.tp_plan.expected_notices`), ``block_ids``
the owner's block ids the reader's params named (an owner acts on a notice only when they are
exactly the lease's, see :mod:`.leases`; the old form carries none, so it ends no lease),
``reader`` the reader id of the request that read or gave up (:mod:`.readers`: a lease bound to
another reader ignores its "done" and "abort"; absent from an older pdserve's, and from
heartbeats).
"""

from __future__ import annotations

from dataclasses import dataclass

import msgspec

from pdserve.kv_transfer.nixl.readers import is_reader

NOTIF_PREFIX = b"pdserve1|"
NOTIF_PREFIX_V2 = b"pdserve2|"
#: The notice kinds a reader sends an owner (by NIXL notification or side channel). The proxy's
#: early release is not one: it reaches the owner through its own engine core (release.py).
NOTIF_KINDS = ("done", "abort", "heartbeat")

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder()


@dataclass(frozen=True)
class Notice:
    """One decoded notification.

    Attributes:
        kind: ``"done"``, ``"abort"`` or ``"heartbeat"`` (:data:`NOTIF_KINDS`).
        request_id: the owner's request id.
        expected: "done" notices the owner rank receives for this request in all (>= 1).
        block_ids: the lease's block ids as the sender knows them (None in the old form).
        reader: the sender's reader id (:mod:`.readers`); None when it names none.
    """

    kind: str
    request_id: str
    expected: int = 1
    block_ids: list[int] | None = None
    reader: str | None = None


def encode_notif(kind: str, request_id: str, expected: int = 1,
                 block_ids: list[int] | None = None, reader: str | None = None) -> bytes:
    """Notification payload naming one of the owner's requests (see :class:`Notice`)."""
    body: dict = {"k": kind, "r": request_id, "n": int(expected)}
    if block_ids is not None:
        body["b"] = list(block_ids)
    if reader is not None:
        body["w"] = reader
    return NOTIF_PREFIX_V2 + _encoder.encode(body)


def decode_notif(msg: bytes) -> Notice | None:
    """The :class:`Notice` of a pdserve notification, or None for anything else."""
    if msg.startswith(NOTIF_PREFIX_V2):
        try:
            body = _decoder.decode(msg[len(NOTIF_PREFIX_V2):])
        except msgspec.DecodeError:
            return None
        if not isinstance(body, dict):
            return None
        kind, req, n, blocks = body.get("k"), body.get("r"), body.get("n", 1), body.get("b")
        if kind not in NOTIF_KINDS or not isinstance(req, str) or not isinstance(n, int) \
                or isinstance(n, bool) or n < 1:
            return None
        if blocks is not None and not (isinstance(blocks, list)
                                       and all(isinstance(b, int) for b in blocks)):
            return None
        reader = body.get("w")
        if reader is not None and not is_reader(reader):
            return None
        return Notice(kind, req, n, blocks, reader)
    if not msg.startswith(NOTIF_PREFIX):
        return None
    kind, sep, req = msg[len(NOTIF_PREFIX):].partition(b"|")
    if not sep:
        return None
    try:
        kind_s, req_s = kind.decode(), req.decode()
    except UnicodeDecodeError:
        return None
    return Notice(kind_s, req_s) if kind_s in NOTIF_KINDS else None
