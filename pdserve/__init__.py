"""pdserve: LLM serving with disaggregated prefill/decode."""

__version__ = "0.1.0"
