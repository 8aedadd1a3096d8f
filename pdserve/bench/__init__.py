"""Benchmarks run as ``pdserve bench <name>`` (see :mod:`pdserve.bench.cli`).

``multi-turn`` (:mod:`pdserve.bench.multi_turn`): multi-turn chats against an OpenAI-compatible
endpoint; input in :mod:`~pdserve.bench.conversations`, HTTP/SSE in :mod:`~pdserve.bench.client`,
scheduling in :mod:`~pdserve.bench.runner`, statistics in :mod:`~pdserve.bench.stats`, the chart
in :mod:`~pdserve.bench.plot`.
"""
