"""``--kv-transfer-config``: the validated KV connector configuration (:class:`KVTransferConfig`).

The command-line forms below are parsed by :mod:`pdserve.kv_transfer.config_cli`. The surface
follows docs/configuration.md (field names as in vLLM's ``KVTransferConfig`` so that people who
know that system feel at home)::

    --kv-transfer-config '{"kv_connector": "NixlConnector", "kv_role": "kv_producer"}'
    --kv-transfer-config.kv_role kv_consumer
    --kv-transfer-config.kv_connector_extra_config.kv_lease_duration 5
    --kv-transfer-config.kv_connector_extra_config.backends+ LIBFABRIC    # append to a list

Top-level keys:

``kv_connector``
    ``"NixlConnector"`` (the only connector). vLLM's ``"NixlPushConnector"`` is accepted as the
    same connector: its aim, D holding the KV the moment P's prefill ends, is what pdserve's
    concurrent hand-off does with a read that starts then (docs/architecture.md, "The
    concurrent hand-off", says why a read and not a push); leases, heartbeats,
    ``kv_load_failure_policy`` and expiry are the same.
``kv_role``
    ``"kv_producer"`` (prefiller, P), ``"kv_consumer"`` (decoder, D), or ``"kv_both"``
    (deprecated: both at once; logs a warning).
``kv_load_failure_policy``
    What D does when a KV load fails: ``"fail"`` (default: the request ends with an error) or
    ``"recompute"`` (the missing tokens are prefilled locally).
``enable_permute_local_kv``
    Accepted for vLLM compatibility (bool). pdserve's block layout already keeps the heads
    dimension outside the token dimension (``[L, 2, H, B, D]`` per block), the layout that
    flag asks for, so nothing needs permuting.
``kv_buffer_device``
    Where transfers read and write: ``"auto"`` (default: the KV cache's own device), ``"cpu"`` or
    ``"cuda"``. ``"cpu"`` with a CUDA KV cache is host-buffer mode (a pinned host mirror of the
    cache, ``nixl/host_buffer.py``); otherwise it must match the KV cache device.
``engine_id``
    This instance's identity in ``kv_transfer_params`` (default: a random UUID).
``kv_connector_extra_config``
    NIXL settings, all optional:

    ============================ =========== ===================================================
    key                          default     meaning
    ============================ =========== ===================================================
    ``backends``                 ``["UCX"]`` NIXL backends to create (must exist in this build)
    ``kv_lease_duration``        30          seconds P keeps a finished request's blocks for D
    ``bidirectional_kv_xfer``    false       multi-turn: D keeps blocks, P may pull them back
    ``kv_recompute_threshold``   64          tokens: below this, P recomputes instead of pulling
    ``kv_pull_wait_factor``      1           a pull's claim waits at most this many times the
                                             time P takes to compute the tokens it would load
                                             (measured on P's own prefills); 0: no bound
    ``decoder_kv_blocks_ttl``    480         seconds D keeps a finished turn's blocks
    ``kv_metrics_log_interval``  10          seconds between ``KV Transfer metrics`` log lines
    ``kv_handshake_timeout``     5           seconds to wait for a remote side channel's answer
    ``kv_transfer_timeout``      120         seconds a posted READ may take before it fails
    ``kv_prefill_wait_timeout``  120         concurrent hand-off (docs/proxy.md): seconds a
                                             decoder's pending claim waits for the prefiller
    ``same_host_transport``      ``auto``    reads from a peer on the same GPU: ``auto`` (CUDA
                                             IPC copy when possible, else NIXL), ``cuda_ipc``
                                             (the same, warning when not possible) or ``nixl``
    ``nixl_progress_thread``     true        NIXL's progress thread, which polls UCX without
                                             pause and keeps one CPU core busy; false: transfers
                                             progress when the engine polls them (an owner's
                                             engine polls while it holds leases)
    ============================ =========== ===================================================

Environment: ``PDSERVE_NIXL_SIDE_CHANNEL_HOST`` (default ``localhost``) and
``PDSERVE_NIXL_SIDE_CHANNEL_PORT`` (default 5600; data-parallel rank ``r`` uses ``base + r``);
``VLLM_NIXL_SIDE_CHANNEL_HOST`` / ``VLLM_NIXL_SIDE_CHANNEL_PORT`` are used when ours are unset.
"""

from __future__ import annotations

import copy
import enum
import logging
import math
import os
import uuid
from dataclasses import dataclass, field
from typing import Any

logger = logging.getLogger(__name__)

CONNECTORS = ("NixlConnector",)
#: Other names a configuration may give the one connector (vLLM's), with the reason logged.
CONNECTOR_ALIASES = {
    "NixlPushConnector": "pdserve's NixlConnector starts D's read the moment P holds the KV "
                         "(the concurrent hand-off), which is what a push achieves",
}
ROLES = ("kv_producer", "kv_consumer", "kv_both")


class KVLoadFailurePolicy(str, enum.Enum):
    """What a decoder does with a request whose KV load failed (``kv_load_failure_policy``).

    A ``str`` enum so that the configuration's JSON strings compare equal to its members.
    """

    FAIL = "fail"  # the request ends with finish_reason "error"
    RECOMPUTE = "recompute"  # the tokens from the first invalid block on are computed locally


FAILURE_POLICIES = tuple(p.value for p in KVLoadFailurePolicy)
BUFFER_DEVICES = ("auto", "cpu", "cuda")

DEFAULT_SIDE_CHANNEL_HOST = "localhost"
DEFAULT_SIDE_CHANNEL_PORT = 5600

# kv_connector_extra_config: key -> (default, accepted type(s), description)
EXTRA_DEFAULTS: dict[str, Any] = {
    "backends": ["UCX"],
    "kv_lease_duration": 30.0,
    "bidirectional_kv_xfer": False,
    "kv_recompute_threshold": 64,
    "kv_pull_wait_factor": 1.0,
    "decoder_kv_blocks_ttl": 480.0,
    "kv_metrics_log_interval": 10.0,
    "kv_handshake_timeout": 5.0,
    "kv_transfer_timeout": 120.0,
    "kv_prefill_wait_timeout": 120.0,
    "same_host_transport": "auto",
    "nixl_progress_thread": True,
}
SAME_HOST_TRANSPORTS = ("auto", "cuda_ipc", "nixl")
_EXTRA_POSITIVE_SECONDS = (
    "kv_lease_duration",
    "decoder_kv_blocks_ttl",
    "kv_metrics_log_interval",
    "kv_handshake_timeout",
    "kv_transfer_timeout",
    "kv_prefill_wait_timeout",
)
_TOP_KEYS = (
    "kv_connector",
    "kv_role",
    "kv_load_failure_policy",
    "enable_permute_local_kv",
    "kv_buffer_device",
    "engine_id",
    "kv_connector_extra_config",
)


class KVTransferConfigError(ValueError):
    """A ``--kv-transfer-config`` that cannot be used (unknown key, bad value or type)."""


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _validate_extra(extra: Any) -> dict[str, Any]:
    """Check ``kv_connector_extra_config`` and fill in defaults; returns a new dict."""
    if extra is None:
        extra = {}
    if not isinstance(extra, dict):
        raise KVTransferConfigError(
            f"kv_connector_extra_config must be a JSON object, got {type(extra).__name__}"
        )
    unknown = sorted(set(extra) - set(EXTRA_DEFAULTS))
    if unknown:
        raise KVTransferConfigError(
            f"unknown kv_connector_extra_config key(s) {unknown}; "
            f"known keys: {sorted(EXTRA_DEFAULTS)}"
        )
    out = copy.deepcopy(EXTRA_DEFAULTS)
    out.update(copy.deepcopy(extra))

    backends = out["backends"]
    if isinstance(backends, str):
        backends = [backends]
    if (
        not isinstance(backends, list)
        or not backends
        or not all(isinstance(b, str) and b.strip() for b in backends)
    ):
        raise KVTransferConfigError(
            f"kv_connector_extra_config.backends must be a non-empty list of backend names, "
            f"got {out['backends']!r}"
        )
    # keep order, drop duplicates (an append of an already listed backend is harmless)
    out["backends"] = list(dict.fromkeys(b.strip() for b in backends))

    for key in _EXTRA_POSITIVE_SECONDS:
        value = out[key]
        if not _is_number(value) or value <= 0:
            raise KVTransferConfigError(
                f"kv_connector_extra_config.{key} must be a positive number of seconds, "
                f"got {value!r}"
            )
        out[key] = float(value)
    if not isinstance(out["bidirectional_kv_xfer"], bool):
        raise KVTransferConfigError(
            "kv_connector_extra_config.bidirectional_kv_xfer must be true or false, "
            f"got {out['bidirectional_kv_xfer']!r}"
        )
    thr = out["kv_recompute_threshold"]
    if not isinstance(thr, int) or isinstance(thr, bool) or thr < 0:
        raise KVTransferConfigError(
            "kv_connector_extra_config.kv_recompute_threshold must be a non-negative integer "
            f"number of tokens, got {thr!r}"
        )
    factor = out["kv_pull_wait_factor"]
    if not isinstance(factor, (int, float)) or isinstance(factor, bool) or \
            not math.isfinite(factor) or factor < 0:
        raise KVTransferConfigError(
            "kv_connector_extra_config.kv_pull_wait_factor must be a non-negative number (0: "
            f"no bound on a pull's wait), got {factor!r}"
        )
    out["kv_pull_wait_factor"] = float(factor)
    if out["same_host_transport"] not in SAME_HOST_TRANSPORTS:
        raise KVTransferConfigError(
            f"kv_connector_extra_config.same_host_transport must be one of "
            f"{list(SAME_HOST_TRANSPORTS)}, got {out['same_host_transport']!r}"
        )
    if not isinstance(out["nixl_progress_thread"], bool):
        raise KVTransferConfigError(
            "kv_connector_extra_config.nixl_progress_thread must be true or false, "
            f"got {out['nixl_progress_thread']!r}"
        )
    return out


def _env(name: str) -> str | None:
    """``PDSERVE_<name>`` if set (non-empty), else ``VLLM_<name>``, else None."""
    for prefix in ("PDSERVE_", "VLLM_"):
        value = os.environ.get(prefix + name)
        if value not in (None, ""):
            return value
    return None


@dataclass
class KVTransferConfig:
    """Validated ``--kv-transfer-config`` (see the module docstring for every key).

    Build it with :meth:`from_dict` (or the constructor, which validates too).

    Raises:
        KVTransferConfigError: unknown connector, role, policy or key, or a value of the wrong
            type (raised by the constructor).
    """

    kv_connector: str = "NixlConnector"
    kv_role: str | None = None
    kv_load_failure_policy: KVLoadFailurePolicy = KVLoadFailurePolicy.FAIL
    enable_permute_local_kv: bool = False
    kv_buffer_device: str = "auto"
    engine_id: str = field(default_factory=lambda: str(uuid.uuid4()))
    kv_connector_extra_config: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if isinstance(self.kv_connector, str) and self.kv_connector in CONNECTOR_ALIASES:
            logger.info("kv_connector %s runs as NixlConnector: %s", self.kv_connector,
                        CONNECTOR_ALIASES[self.kv_connector])
            self.kv_connector = "NixlConnector"
        if not isinstance(self.kv_connector, str) or self.kv_connector not in CONNECTORS:
            raise KVTransferConfigError(
                f"unknown kv_connector {self.kv_connector!r}; supported: {list(CONNECTORS)}"
            )
        if self.kv_role is None:
            raise KVTransferConfigError(
                f"kv_role is required; one of {['kv_producer', 'kv_consumer']}"
            )
        if not isinstance(self.kv_role, str) or self.kv_role not in ROLES:
            raise KVTransferConfigError(
                f"unknown kv_role {self.kv_role!r}; supported: {list(ROLES)}"
            )
        if self.kv_role == "kv_both":
            logger.warning(
                "kv_role 'kv_both' is deprecated: use 'kv_producer' for the prefiller and "
                "'kv_consumer' for the decoder (this instance now acts as both)"
            )
        if (
            not isinstance(self.kv_load_failure_policy, str)
            or self.kv_load_failure_policy not in FAILURE_POLICIES
        ):
            raise KVTransferConfigError(
                f"unknown kv_load_failure_policy {self.kv_load_failure_policy!r}; "
                f"supported: {list(FAILURE_POLICIES)}"
            )
        self.kv_load_failure_policy = KVLoadFailurePolicy(self.kv_load_failure_policy)
        if not isinstance(self.enable_permute_local_kv, bool):
            raise KVTransferConfigError(
                f"enable_permute_local_kv must be true or false, got "
                f"{self.enable_permute_local_kv!r}"
            )
        if not isinstance(self.kv_buffer_device, str) or self.kv_buffer_device not in BUFFER_DEVICES:
            raise KVTransferConfigError(
                f"unknown kv_buffer_device {self.kv_buffer_device!r}; supported: "
                f"{list(BUFFER_DEVICES)}"
            )
        if not isinstance(self.engine_id, str) or not self.engine_id.strip():
            raise KVTransferConfigError(
                f"engine_id must be a non-empty string, got {self.engine_id!r}"
            )
        self.kv_connector_extra_config = _validate_extra(self.kv_connector_extra_config)

    # ----------------------------------------------------------------------------- construction
    @classmethod
    def from_dict(cls, data: Any) -> "KVTransferConfig":
        """Build from a parsed JSON object.

        Raises:
            KVTransferConfigError: not an object, unknown keys, or invalid values.
        """
        if not isinstance(data, dict):
            raise KVTransferConfigError(
                f"--kv-transfer-config must be a JSON object, got {type(data).__name__}"
            )
        unknown = sorted(set(data) - set(_TOP_KEYS))
        if unknown:
            raise KVTransferConfigError(
                f"unknown --kv-transfer-config key(s) {unknown}; known keys: {list(_TOP_KEYS)}"
            )
        kwargs = dict(data)
        if kwargs.get("engine_id") is None:
            kwargs.pop("engine_id", None)
        if kwargs.get("kv_connector_extra_config") is None:
            kwargs.pop("kv_connector_extra_config", None)
        return cls(**kwargs)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-serialisable copy (round-trips through :meth:`from_dict`)."""
        return {
            "kv_connector": self.kv_connector,
            "kv_role": self.kv_role,
            "kv_load_failure_policy": self.kv_load_failure_policy.value,
            "enable_permute_local_kv": self.enable_permute_local_kv,
            "kv_buffer_device": self.kv_buffer_device,
            "engine_id": self.engine_id,
            "kv_connector_extra_config": copy.deepcopy(self.kv_connector_extra_config),
        }

    # ------------------------------------------------------------------------------- properties
    @property
    def is_producer(self) -> bool:
        """True for a prefiller (``kv_producer`` or the deprecated ``kv_both``)."""
        return self.kv_role in ("kv_producer", "kv_both")

    @property
    def is_consumer(self) -> bool:
        """True for a decoder (``kv_consumer`` or the deprecated ``kv_both``)."""
        return self.kv_role in ("kv_consumer", "kv_both")

    @property
    def backends(self) -> list[str]:
        return list(self.kv_connector_extra_config["backends"])

    @property
    def kv_lease_duration(self) -> float:
        """Seconds P keeps a finished request's blocks waiting for D's read."""
        return self.kv_connector_extra_config["kv_lease_duration"]

    @property
    def bidirectional_kv_xfer(self) -> bool:
        return self.kv_connector_extra_config["bidirectional_kv_xfer"]

    @property
    def kv_recompute_threshold(self) -> int:
        """Tokens: a reusable remote prefix shorter than this is recomputed, not pulled."""
        return self.kv_connector_extra_config["kv_recompute_threshold"]

    @property
    def kv_pull_wait_factor(self) -> float:
        """How many times the time P takes to compute a pull's tokens its lease claim may wait
        (0: no bound; :class:`~pdserve.kv_transfer.nixl.bidirectional.PrefillPace`)."""
        return self.kv_connector_extra_config["kv_pull_wait_factor"]

    @property
    def decoder_kv_blocks_ttl(self) -> float:
        """Seconds D keeps a finished turn's blocks (bidirectional mode)."""
        return self.kv_connector_extra_config["decoder_kv_blocks_ttl"]

    @property
    def kv_metrics_log_interval(self) -> float:
        """Seconds between two ``KV Transfer metrics`` log lines."""
        return self.kv_connector_extra_config["kv_metrics_log_interval"]

    @property
    def kv_handshake_timeout(self) -> float:
        """Seconds to wait for a remote side channel's answer."""
        return self.kv_connector_extra_config["kv_handshake_timeout"]

    @property
    def kv_transfer_timeout(self) -> float:
        """Seconds a posted READ may stay in progress before it counts as failed."""
        return self.kv_connector_extra_config["kv_transfer_timeout"]

    @property
    def kv_prefill_wait_timeout(self) -> float:
        """Seconds a decoder's pending claim (concurrent hand-off) waits for the prefiller to
        hold the prompt's blocks before the load fails."""
        return self.kv_connector_extra_config["kv_prefill_wait_timeout"]

    @property
    def same_host_transport(self) -> str:
        """How reads from a peer on the same GPU travel: ``auto``, ``cuda_ipc`` or ``nixl``
        (kv_transfer/nixl/transfer_path.py)."""
        return self.kv_connector_extra_config["same_host_transport"]

    @property
    def nixl_progress_thread(self) -> bool:
        """Whether the NIXL agent runs its own progress thread (kv_transfer/nixl/agent.py)."""
        return self.kv_connector_extra_config["nixl_progress_thread"]

    @property
    def side_channel_host(self) -> str:
        """Host other instances use to reach this instance's side channel."""
        return _env("NIXL_SIDE_CHANNEL_HOST") or DEFAULT_SIDE_CHANNEL_HOST

    @property
    def side_channel_base_port(self) -> int:
        """Side-channel port of data-parallel rank 0.

        Raises:
            KVTransferConfigError: the environment variable is not a port number.
        """
        raw = _env("NIXL_SIDE_CHANNEL_PORT")
        if raw is None:
            return DEFAULT_SIDE_CHANNEL_PORT
        try:
            port = int(raw)
        except ValueError:
            raise KVTransferConfigError(
                f"PDSERVE_NIXL_SIDE_CHANNEL_PORT must be an integer port, got {raw!r}"
            ) from None
        if not 0 < port < 65536:
            raise KVTransferConfigError(f"side-channel port {port} is out of range 1..65535")
        return port

    def engine_id_for(self, data_parallel_rank: int, data_parallel_size: int) -> str:
        """Engine id of a data-parallel rank: ``engine_id`` alone, with more than one rank
        suffixed ``_dp<rank>`` (vLLM's scheme), so each rank is a distinct engine to its
        peers."""
        if data_parallel_size > 1:
            return f"{self.engine_id}_dp{data_parallel_rank}"
        return self.engine_id

    def side_channel_port_for(self, data_parallel_rank: int = 0) -> int:
        """Side-channel port of a data-parallel rank (``base + rank``)."""
        return self.side_channel_base_port + data_parallel_rank

    @property
    def side_channel_port(self) -> int:
        """Side-channel port of data-parallel rank 0."""
        return self.side_channel_port_for(0)
