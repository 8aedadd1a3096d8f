import numpy as np
import pytest

from pdserve.bench.distributions import SpecError, parse_distribution


def draw(spec, n=2000, seed=0):
    dist = parse_distribution(spec, "field")
    rng = np.random.default_rng(seed)
    return np.array([dist.sample(rng) for _ in range(n)])


def test_constant_and_uniform_ranges():
    assert set(draw({"distribution": "constant", "value": 42}, n=50)) == {42}
    values = draw({"distribution": "uniform", "min": 3, "max": 6})
    assert set(values) == {3, 4, 5, 6}  # both ends inclusive


def test_lognormal_average_parameterisation_hits_the_average():
    values = draw({"distribution": "lognormal", "average": 400, "median_ratio": 0.8}, n=20000)
    assert abs(values.mean() - 400) / 400 < 0.03
    assert abs(np.median(values) - 320) / 320 < 0.05
    capped = draw({"distribution": "lognormal", "average": 400, "max": 500})
    assert capped.max() == 500 and capped.min() >= 0


def test_lognormal_mean_sigma_parameterisation():
    values = draw({"distribution": "lognormal", "mean": 3.0, "sigma": 0.0}, n=10)
    assert set(values) == {round(float(np.exp(3.0)))}


def test_zipf_and_poisson():
    zipf = draw({"distribution": "zipf", "alpha": 2.0, "max": 10})
    assert zipf.min() >= 1 and zipf.max() == 10
    assert (zipf == 1).mean() > 0.5  # P(1) = 1/zeta(2) ~ 0.61
    poisson = draw({"distribution": "poisson", "alpha": 7}, n=20000)
    assert abs(poisson.mean() - 7) < 0.15


def test_min_max_clip_every_distribution():
    values = draw({"distribution": "poisson", "alpha": 20, "min": 18, "max": 21})
    assert values.min() == 18 and values.max() == 21


def test_same_seed_same_values_different_seed_different_values():
    spec = {"distribution": "uniform", "min": 0, "max": 10**6}
    assert (draw(spec, 20, seed=5) == draw(spec, 20, seed=5)).all()
    assert (draw(spec, 20, seed=5) != draw(spec, 20, seed=6)).any()


@pytest.mark.parametrize(
    "spec, message",
    [
        ({"distribution": "gauss", "value": 1}, "unknown distribution"),
        ({"distribution": "constant"}, "needs 'value'"),
        ({"distribution": "uniform", "min": 5, "max": 2}, "min <= max"),
        ({"distribution": "zipf", "alpha": 1.0}, "alpha must be > 1"),
        ({"distribution": "poisson", "alpha": 0}, "alpha must be > 0"),
        ({"distribution": "lognormal", "average": 10, "median_ratio": 1.5}, "median_ratio"),
        ({"distribution": "lognormal", "average": 10, "sigma": 1}, "not both"),
        ({"distribution": "constant", "value": 3, "valeu": 4}, "unknown key"),
        ({"distribution": "constant", "value": 2.5}, "must be an integer"),
        ({"value": 3}, '"distribution" key'),
    ],
)
def test_bad_specs_name_the_field(spec, message):
    with pytest.raises(SpecError, match="field") as info:
        parse_distribution(spec, "field")
    assert message in str(info.value)
