"""Per-request sampling and stopping parameters (pure Python, no torch).

The field names and defaults follow the OpenAI API and vLLM's ``SamplingParams`` so that users of
those systems find the same knobs.
"""

from __future__ import annotations

from dataclasses import dataclass, field


#: Largest value of an integer parameter (``top_k``, ``seed``, a stop token id): the engine core's
#: messages and the sampler's tensors carry int64, and a larger value would fail there instead of
#: being refused here.
INT64_MAX = 2**63 - 1
#: A temperature below this samples greedily (vLLM's ``_SAMPLING_EPS``, vllm/sampling_params.py):
#: dividing the logits by a smaller one overflows float32 to infinity, and the draw then sees NaN.
GREEDY_TEMPERATURE_EPS = 1e-5


class SamplingParamsError(ValueError):
    """A sampling parameter out of range; ``param`` is its field name (the OpenAI error's
    ``param``)."""

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param


@dataclass
class SamplingParams:
    """How one sequence is sampled and when it stops.

    Attributes:
        n: number of independent choices for the prompt (the front end fans these out into
            ``n`` engine requests).
        temperature: softmax temperature; ``0`` means greedy (argmax). The API maps a
            temperature below :data:`GREEDY_TEMPERATURE_EPS` to ``0``.
        top_p: nucleus sampling mass in (0, 1]; ``1`` disables it.
        top_k: keep the ``k`` most likely tokens; ``0`` or ``-1`` disables it.
        min_p: drop tokens whose probability is below ``min_p * p_max``; ``0`` disables it.
        seed: per-request RNG seed; the same seed gives the same tokens.
        repetition_penalty: CTRL-style penalty (Keskar et al., 2019) on tokens seen in the prompt
            or the output; ``1`` disables it.
        presence_penalty: OpenAI presence penalty on tokens seen in the output.
        frequency_penalty: OpenAI frequency penalty, proportional to output occurrence counts.
        max_tokens: upper bound on generated tokens.
        min_tokens: EOS and ``stop_token_ids`` are suppressed until this many tokens exist,
            and no stop string may end in the text of these first tokens.
        stop: strings that end generation; they are not included in the returned text.
        stop_token_ids: token ids that end generation (in addition to EOS); the text of the
            one that ends it (or of EOS) is not included in the returned text, its id is.
        ignore_eos: keep generating past EOS (benchmarks).
        logprobs: ``None`` for no logprobs, else the number of top alternatives per token (0..20).
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    max_tokens: int = 16
    min_tokens: int = 0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None

    @property
    def greedy(self) -> bool:
        """True when sampling reduces to argmax (temperature 0)."""
        return self.temperature == 0.0

    def min_tokens_mask(self, eos_token_id: int | None) -> list[int]:
        """The token ids a draw below ``min_tokens`` cannot give: ``stop_token_ids`` and the
        request's EOS (``eos_token_id``, None: none); the sampler sets their logits to
        ``-inf`` (``pdserve.runner.logits_processors.apply_min_tokens``)."""
        ids = list(self.stop_token_ids)
        if eos_token_id is not None:
            ids.append(eos_token_id)
        return ids

    @property
    def min_tokens_by_rejection(self) -> bool:
        """True when a token drawn without the ``min_tokens`` mask, kept if it is not in
        :meth:`min_tokens_mask` and else drawn again with the mask, is the masked draw: so for
        greedy rows (the argmax, when it is not masked, is the masked argmax) and for unseeded
        draws without top-k / top-p / min-p (rejection sampling: ``p(t) + p(masked) * q(t) =
        q(t)`` for the masked distribution ``q``). A seeded draw would take other noise, and a
        truncation computed over the unmasked distribution keeps another set of tokens."""
        if self.greedy:
            return True
        return (self.seed is None and self.top_k in (0, -1) and self.top_p == 1.0
                and self.min_p == 0.0)

    @property
    def uses_penalties(self) -> bool:
        """True when a repetition, presence or frequency penalty applies: the next token then
        depends on the values of the earlier ones."""
        return (self.repetition_penalty != 1.0 or self.presence_penalty != 0.0
                or self.frequency_penalty != 0.0)

    def validate(self) -> None:
        """Check ranges.

        Raises:
            SamplingParamsError: a ``ValueError`` naming the offending field (``param``).
        """
        checks = (
            ("n", self.n >= 1, f"n must be at least 1, got {self.n}"),
            ("temperature", self.temperature >= 0,
             f"temperature must be non-negative, got {self.temperature}"),
            ("top_p", 0 < self.top_p <= 1, f"top_p must be in (0, 1], got {self.top_p}"),
            ("top_k", -1 <= self.top_k <= INT64_MAX,
             f"top_k must be -1 (disabled) or in [0, {INT64_MAX}], got {self.top_k}"),
            ("seed", self.seed is None or -INT64_MAX - 1 <= self.seed <= INT64_MAX,
             f"seed must be a 64-bit signed integer, got {self.seed}"),
            ("min_p", 0 <= self.min_p <= 1, f"min_p must be in [0, 1], got {self.min_p}"),
            ("repetition_penalty", self.repetition_penalty > 0,
             f"repetition_penalty must be positive, got {self.repetition_penalty}"),
            ("presence_penalty", -2 <= self.presence_penalty <= 2,
             f"presence_penalty must be in [-2, 2], got {self.presence_penalty}"),
            ("frequency_penalty", -2 <= self.frequency_penalty <= 2,
             f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}"),
            ("max_tokens", self.max_tokens >= 1,
             f"max_tokens must be at least 1, got {self.max_tokens}"),
            ("min_tokens", self.min_tokens >= 0,
             f"min_tokens must be non-negative, got {self.min_tokens}"),
            ("min_tokens", self.min_tokens <= self.max_tokens,
             f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})"),
            ("logprobs", self.logprobs is None or 0 <= self.logprobs <= 20,
             f"logprobs must be in [0, 20], got {self.logprobs}"),
            ("stop_token_ids", all(0 <= t <= INT64_MAX for t in self.stop_token_ids),
             f"stop_token_ids must be token ids in [0, {INT64_MAX}]"),
        )
        for param, ok, message in checks:
            if not ok:
                raise SamplingParamsError(param, message)
