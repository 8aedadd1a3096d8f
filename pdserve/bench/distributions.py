"""Integer distributions for synthetic conversation specs.

Every numeric field of a ``generate_conversations`` spec (number of turns, tokens per message, ...)
is a JSON object ``{"distribution": NAME, ...}``. The names and parameter names follow the spec
format of vLLM's multi-turn benchmark (``benchmarks/multi_turn/README.md``) so that its spec files
keep their meaning here:

=============  =====================================================================================
constant       ``value``: always this integer.
uniform        ``min``, ``max``: integers, both inclusive.
lognormal      either ``average`` (target mean) with optional ``median_ratio`` (median / mean, in
               (0, 1), default 0.85), or ``mean`` and ``sigma`` of the underlying normal.
zipf           ``alpha`` > 1 (numpy's Zipf, support 1, 2, 3, ...).
poisson        ``alpha``: the expected value lambda (> 0).
=============  =====================================================================================

Every distribution also takes optional ``min`` / ``max`` bounds that clip the sampled integers
(for ``uniform`` they are its range). Sampling uses the caller's ``numpy.random.Generator``, so a
seeded generator gives the same values on every run.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

DEFAULT_MEDIAN_RATIO = 0.85


class SpecError(ValueError):
    """A conversation spec or distribution is malformed; the message names the offending field."""


@dataclass(frozen=True)
class Distribution:
    """A parsed integer distribution.

    Attributes:
        name: one of ``constant``, ``uniform``, ``lognormal``, ``zipf``, ``poisson``.
        params: the distribution's own parameters (floats), already validated.
        lo: optional inclusive lower bound applied after sampling.
        hi: optional inclusive upper bound applied after sampling.
    """

    name: str
    params: dict[str, float]
    lo: int | None = None
    hi: int | None = None

    def sample(self, rng: np.random.Generator) -> int:
        """Draw one integer value (rounded to nearest for the continuous lognormal)."""
        p = self.params
        if self.name == "constant":
            value = int(p["value"])
        elif self.name == "uniform":
            value = int(rng.integers(int(p["min"]), int(p["max"]) + 1))
        elif self.name == "lognormal":
            value = int(round(float(rng.lognormal(p["mu"], p["sigma"]))))
        elif self.name == "zipf":
            value = int(rng.zipf(p["alpha"]))
        elif self.name == "poisson":
            value = int(rng.poisson(p["alpha"]))
        else:  # pragma: no cover - parse_distribution only builds the names above
            raise AssertionError(self.name)
        if self.lo is not None:
            value = max(value, self.lo)
        if self.hi is not None:
            value = min(value, self.hi)
        return value


_ALLOWED_KEYS = {
    "constant": {"value"},
    "uniform": {"min", "max"},
    "lognormal": {"average", "median_ratio", "mean", "sigma", "min", "max"},
    "zipf": {"alpha", "min", "max"},
    "poisson": {"alpha", "min", "max"},
}


def _number(spec: dict[str, Any], key: str, where: str) -> float:
    value = spec[key]
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise SpecError(f"{where}.{key} must be a finite number, got {value!r}")
    return float(value)


def _integer(spec: dict[str, Any], key: str, where: str) -> int:
    value = _number(spec, key, where)
    if value != int(value):
        raise SpecError(f"{where}.{key} must be an integer, got {spec[key]!r}")
    return int(value)


def parse_distribution(spec: Any, where: str) -> Distribution:
    """Validate one ``{"distribution": ...}`` object.

    Args:
        spec: the decoded JSON object.
        where: dotted path of the field, used in error messages (``prompt_input.num_tokens``).

    Raises:
        SpecError: unknown distribution, missing/unknown/invalid parameter, or an empty range.
    """
    if not isinstance(spec, dict) or "distribution" not in spec:
        raise SpecError(f'{where} must be an object with a "distribution" key, got {spec!r}')
    name = spec["distribution"]
    if name not in _ALLOWED_KEYS:
        raise SpecError(
            f"{where}.distribution: unknown distribution {name!r}; "
            f"expected one of {', '.join(sorted(_ALLOWED_KEYS))}"
        )
    unknown = set(spec) - _ALLOWED_KEYS[name] - {"distribution"}
    if unknown:
        raise SpecError(
            f"{where}: unknown key(s) {sorted(unknown)} for distribution {name!r}; "
            f"allowed: {sorted(_ALLOWED_KEYS[name])}"
        )

    lo = _integer(spec, "min", where) if "min" in spec else None
    hi = _integer(spec, "max", where) if "max" in spec else None
    params: dict[str, float] = {}

    def need(key: str) -> None:
        if key not in spec:
            raise SpecError(f"{where}: distribution {name!r} needs {key!r}")

    if name == "constant":
        need("value")
        params["value"] = _integer(spec, "value", where)
        if params["value"] < 0:
            raise SpecError(f"{where}.value must be >= 0")
    elif name == "uniform":
        need("min")
        need("max")
        params["min"], params["max"] = lo, hi  # type: ignore[assignment]
        if lo < 0 or hi < lo:  # type: ignore[operator]
            raise SpecError(f"{where}: uniform needs 0 <= min <= max, got min={lo} max={hi}")
    elif name == "lognormal":
        if "average" in spec:
            if "mean" in spec or "sigma" in spec:
                raise SpecError(f"{where}: give either 'average' or 'mean'+'sigma', not both")
            average = _number(spec, "average", where)
            ratio = _number(spec, "median_ratio", where) if "median_ratio" in spec else DEFAULT_MEDIAN_RATIO
            if average <= 0:
                raise SpecError(f"{where}.average must be > 0")
            if not 0 < ratio < 1:
                raise SpecError(f"{where}.median_ratio must be in (0, 1), got {ratio}")
            # For a lognormal, median = exp(mu) and mean = exp(mu + sigma^2 / 2), so
            # median / mean = exp(-sigma^2 / 2).
            sigma = math.sqrt(-2.0 * math.log(ratio))
            params["mu"] = math.log(average) - sigma * sigma / 2.0
            params["sigma"] = sigma
        else:
            if "median_ratio" in spec:
                raise SpecError(f"{where}: 'median_ratio' needs 'average'")
            need("mean")
            need("sigma")
            params["mu"] = _number(spec, "mean", where)
            params["sigma"] = _number(spec, "sigma", where)
            if params["sigma"] < 0:
                raise SpecError(f"{where}.sigma must be >= 0")
    elif name == "zipf":
        need("alpha")
        params["alpha"] = _number(spec, "alpha", where)
        if params["alpha"] <= 1:
            raise SpecError(f"{where}.alpha must be > 1 for zipf, got {params['alpha']}")
    elif name == "poisson":
        need("alpha")
        params["alpha"] = _number(spec, "alpha", where)
        if params["alpha"] <= 0:
            raise SpecError(f"{where}.alpha must be > 0 for poisson, got {params['alpha']}")

    if lo is not None and lo < 0:
        raise SpecError(f"{where}.min must be >= 0")
    if lo is not None and hi is not None and hi < lo:
        raise SpecError(f"{where}: max ({hi}) < min ({lo})")
    return Distribution(name=name, params=params, lo=lo, hi=hi)
