"""Torch-free check, before any engine process starts, that a model splits over a TP size.

``pdserve serve -tp N`` and ``pdserve up --prefill-tp N / --decode-tp N`` call
:func:`check_splits` so that a model whose attention heads, KV heads, vocabulary or MLP width do
not divide over ``N`` is refused with one line and exit code 2, instead of after an engine
process started. The numbers come from the model's ``config.json`` (a Hugging Face directory, or
a built-in model already converted), else from the GGUF metadata (a ``.gguf`` file, or the
built-in SmolLM2's packaged GGUF before its one-time conversion):
:func:`pdserve.model_files.config_values.model_config_values`. A model whose numbers cannot be
read here is checked later, by the engine (:func:`pdserve.models.loader.check_model_splits`).
The rule, :func:`check_tp_divisible`, lives here (torch-free) for both.
"""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.model_files.config_values import model_config_values

__all__ = ["SplitNumbers", "TPShardingError", "check_splits", "check_tp_divisible",
           "split_numbers"]


class TPShardingError(ValueError):
    """The model cannot be split over the requested TP size (the message names the numbers)."""


def check_tp_divisible(size: int, *, num_heads: int, num_kv_heads: int, vocab_size: int,
                       intermediate_size: int) -> None:
    """Check at start-up that a model splits over ``size`` ranks (the split of
    :mod:`pdserve.distributed.sharding`).

    Requires ``num_heads % size == 0``, ``num_kv_heads % size == 0`` or
    ``size % num_kv_heads == 0``, ``vocab_size % size == 0`` and
    ``intermediate_size % size == 0``.

    Raises:
        TPShardingError: one sentence per failed condition, naming the numbers.
    """
    if size == 1:
        return
    problems = []
    if num_heads % size:
        problems.append(f"{num_heads} attention heads are not divisible by {size}")
    if num_kv_heads % size and size % num_kv_heads:
        problems.append(f"{num_kv_heads} KV heads are neither divisible by {size} nor a divisor of "
                        f"{size}")
    if vocab_size % size:
        problems.append(f"the vocabulary of {vocab_size} tokens is not divisible by {size}")
    if intermediate_size % size:
        problems.append(f"intermediate_size {intermediate_size} is not divisible by {size}")
    if problems:
        raise TPShardingError(f"the model cannot run with tensor_parallel_size {size}: "
                              + "; ".join(problems))


@dataclass(frozen=True)
class SplitNumbers:
    """The sizes tensor parallelism divides (counts, not bytes)."""

    num_heads: int
    num_kv_heads: int
    vocab_size: int
    intermediate_size: int


def split_numbers(model: str) -> SplitNumbers | None:
    """The sizes of ``model`` (a built-in name, a Hugging Face directory or a ``.gguf`` file)
    that TP divides, or None when they cannot be read without loading the model
    (:func:`~pdserve.model_files.config_values.model_config_values`)."""
    hf = model_config_values(model)
    if hf is None:
        return None
    try:
        heads = int(hf["num_attention_heads"])
        return SplitNumbers(heads, int(hf.get("num_key_value_heads") or heads),
                            int(hf["vocab_size"]), int(hf["intermediate_size"]))
    except (KeyError, TypeError, ValueError):
        return None


def check_splits(model: str, tp_size: int) -> None:
    """Refuse a model that does not split over ``tp_size`` ranks (nothing to do at TP 1, or when
    the sizes cannot be read here).

    Raises:
        TPShardingError: one sentence naming the numbers that do not divide.
    """
    if tp_size == 1:
        return
    numbers = split_numbers(model)
    if numbers is None:
        return
    check_tp_divisible(tp_size, num_heads=numbers.num_heads, num_kv_heads=numbers.num_kv_heads,
                       vocab_size=numbers.vocab_size,
                       intermediate_size=numbers.intermediate_size)
