"""The model's building blocks: linear, norm, rotary, activation and embedding / LM head layers.

Each layer that has a Triton kernel is a :class:`~pdserve.layers.custom_op.CustomOp`: its
``forward`` picks the torch op or the Triton op in one place, following the model's attention
backend (docs/architecture.md). Layers that own weights give every parameter a
``weight_loader`` (and ``num_shards``) so that checkpoint loading stays generic and
tensor-parallel variants can narrow their shard there.
"""
