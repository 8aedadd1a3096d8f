"""KV connector: moves KV cache blocks between engine instances (disaggregated prefill/decode).

``base`` defines the two sides (scheduler side: which blocks move; worker side: moving bytes),
``params`` the P/D wire protocol (a request's ``kv_transfer_params``, parsed once at the edge, and
the params an instance returns), ``prompt_handoff`` the prompt-ids codec P hands to D, ``config``
the validated ``--kv-transfer-config`` (``config_cli`` parses its command-line forms),
``factory`` builds a side, and ``nixl`` is the NIXL implementation.
"""

from pdserve.types.kv_transfer_config import KVTransferConfig, KVTransferConfigError
from pdserve.kv_transfer.config_cli import extract_kv_transfer_args

__all__ = ["KVTransferConfig", "KVTransferConfigError", "extract_kv_transfer_args"]
