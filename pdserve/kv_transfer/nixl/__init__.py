"""NIXL connector: ``scheduler`` (which blocks move), ``worker`` (moves them with an ``agent``),
``side_channel`` (ZMQ handshake and lease claims), ``leases``, ``metadata`` and ``stats``."""
