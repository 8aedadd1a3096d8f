"""The NIXL notification payloads pdserve sends between instances ("done", "abort",
"heartbeat" for one of the owner's requests)."""

from __future__ import annotations

NOTIF_PREFIX = b"pdserve1|"
NOTIF_KINDS = ("done", "abort", "heartbeat")


def encode_notif(kind: str, req_id: str) -> bytes:
    """Notification payload naming one of the owner's requests."""
    return NOTIF_PREFIX + kind.encode() + b"|" + req_id.encode()


def decode_notif(msg: bytes) -> tuple[str, str] | None:
    """``(kind, req_id)`` of a pdserve notification, or None for anything else."""
    if not msg.startswith(NOTIF_PREFIX):
        return None
    kind, sep, req = msg[len(NOTIF_PREFIX):].partition(b"|")
    if not sep:
        return None
    try:
        kind_s, req_s = kind.decode(), req.decode()
    except UnicodeDecodeError:
        return None
    return (kind_s, req_s) if kind_s in NOTIF_KINDS else None
