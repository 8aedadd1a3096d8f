"""KV connector: moves KV cache blocks between engine instances (disaggregated prefill/decode).

``base`` defines the two sides (scheduler side: which blocks move; worker side: moving bytes),
``config`` the validated ``--kv-transfer-config`` (``config_cli`` parses its command-line
forms), ``factory`` builds a side, and ``nixl`` is the NIXL implementation.
"""

from pdserve.kv_transfer.config import KVTransferConfig, KVTransferConfigError
from pdserve.kv_transfer.config_cli import extract_kv_transfer_args

__all__ = ["KVTransferConfig", "KVTransferConfigError", "extract_kv_transfer_args"]
