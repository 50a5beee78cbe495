"""Tests for dp_budget_provider.accounting.noise.

The discrete samplers are checked against their *exact* pmf (normalising constant summed
in the test) with chi-square goodness of fit at fixed seeds, on the vectorised int64 path,
on the natural big-number fallback (huge sigma) and on fallback paths forced by lowering
the module's int64 budget.  Fixed seeds make every statistical test deterministic: a
correct sampler passes, a sampler with the wrong pmf fails.
"""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy import stats

from dp_budget_provider.accounting import noise as N

pytestmark = pytest.mark.heavy  # long: xdist starts it first (tests/conftest.py)

N_SAMPLES = 200_000
P_MIN = 1e-3


# ----------------------------------------------------------------------------------------
# helpers
# ----------------------------------------------------------------------------------------


def dgauss_pmf(sigma2: float, half_width: int) -> tuple[np.ndarray, np.ndarray]:
    """Exact discrete Gaussian pmf on [-R, R]; mass outside is < exp(-R^2/(2 sigma2))."""
    ys = np.arange(-half_width, half_width + 1)
    w = np.exp(-(ys.astype(np.float64) ** 2) / (2.0 * sigma2))
    return ys, w / w.sum()


def dlap_pmf(scale: float, half_width: int) -> tuple[np.ndarray, np.ndarray]:
    """Exact discrete Laplace pmf on [-R, R], normalised by summation."""
    ys = np.arange(-half_width, half_width + 1)
    w = np.exp(-np.abs(ys).astype(np.float64) / scale)
    return ys, w / w.sum()


def gauss_support(sigma: float) -> int:
    return int(math.ceil(13 * sigma)) + 10  # tail mass < exp(-84)


def lap_support(scale: float) -> int:
    return int(math.ceil(60 * scale)) + 10  # tail mass < exp(-60)


def binned_chisquare(samples: np.ndarray, ys: np.ndarray, p: np.ndarray) -> float:
    """Chi-square p-value after merging adjacent support points into bins.

    Bins are grown left to right until each holds >= max(50, n/150) expected samples, so
    narrow pmfs keep one bin per value and wide ones (sigma = 1000) get ~150 bins; the
    tails are lumped into the first/last bins (samples beyond the support land there too).
    """
    n = samples.size
    expected_pts = p * n
    min_expected = max(50.0, n / 150.0)
    edges: list[int] = []
    acc = 0.0
    for y, e in zip(ys, expected_pts, strict=True):
        acc += e
        if acc >= min_expected:
            edges.append(int(y))
            acc = 0.0
    edges[-1] = int(ys[-1])  # leftover tail mass joins the last bin
    edge_arr = np.array(edges)
    n_bins = edge_arr.size
    assert n_bins >= 2
    point_bin = np.minimum(np.searchsorted(edge_arr, ys, side="left"), n_bins - 1)
    expected = np.bincount(point_bin, weights=p, minlength=n_bins)
    expected = expected / expected.sum() * n
    sample_bin = np.minimum(np.searchsorted(edge_arr, samples, side="left"), n_bins - 1)
    observed = np.bincount(sample_bin, minlength=n_bins)
    return float(stats.chisquare(observed, expected).pvalue)


def assert_moments(samples: np.ndarray, ys: np.ndarray, p: np.ndarray) -> None:
    """Mean ~ 0 and variance equal to the exact pmf's, within 5 standard errors."""
    n = samples.size
    yf = ys.astype(np.float64)
    var = float(np.sum(p * yf**2))
    mu4 = float(np.sum(p * yf**4))
    x = samples.astype(np.float64)
    assert abs(x.mean()) <= 5 * math.sqrt(var / n), (x.mean(), var)
    assert abs(x.var() - var) <= 5 * math.sqrt((mu4 - var**2) / n), (x.var(), var)


def check_dgauss(samples: np.ndarray, sigma: float) -> None:
    sigma2 = float(N.effective_discrete_gaussian_sigma2(sigma))
    ys, p = dgauss_pmf(sigma2, gauss_support(sigma))
    assert samples.dtype == np.int64
    pval = binned_chisquare(samples, ys, p)
    assert pval > P_MIN, pval
    assert_moments(samples, ys, p)


def check_dlap(samples: np.ndarray, scale: float) -> None:
    eff = float(N.effective_discrete_laplace_scale(scale))
    ys, p = dlap_pmf(eff, lap_support(scale))
    assert samples.dtype == np.int64
    pval = binned_chisquare(samples, ys, p)
    assert pval > P_MIN, pval
    assert_moments(samples, ys, p)


@pytest.fixture
def rejection_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """Route every parameter to the CKS rejection samplers (no certified-table sampler)."""
    monkeypatch.setattr(N, "sampler_for", lambda kind, parameter: None)


class Spy:
    """Counts calls to a module function while delegating to the real implementation."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, name: str) -> None:
        self.calls = 0
        self._real = getattr(N, name)
        monkeypatch.setattr(N, name, self)

    def __call__(self, *args: object) -> object:
        self.calls += 1
        return self._real(*args)


# ----------------------------------------------------------------------------------------
# exactness of the discrete samplers (vectorised path)
# ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(("sigma", "seed"), [(0.5, 11), (3.7, 12), (1000, 13)])
def test_discrete_gaussian_matches_exact_pmf(sigma: float, seed: int) -> None:
    check_dgauss(N.sample_discrete_gaussian(sigma, N_SAMPLES, seed=seed), sigma)


@pytest.mark.parametrize(("scale", "seed"), [(0.3, 21), (2.5, 22), (1000, 23)])
def test_discrete_laplace_matches_exact_pmf(scale: float, seed: int) -> None:
    check_dlap(N.sample_discrete_laplace(scale, N_SAMPLES, seed=seed), scale)


def test_chi_square_detects_wrong_sigma() -> None:
    """The goodness-of-fit machinery has power: a 2% larger sigma is rejected."""
    samples = N.sample_discrete_gaussian(3.7 * 1.02, N_SAMPLES, seed=12)
    ys, p = dgauss_pmf(3.7**2, gauss_support(3.7))
    assert binned_chisquare(samples, ys, p) < P_MIN


def test_chi_square_detects_continuous_rounding() -> None:
    """Rounded continuous Laplace noise is not the discrete Laplace and must be rejected."""
    rng = np.random.default_rng(5)
    samples = np.rint(rng.laplace(0.0, 2.5, size=N_SAMPLES)).astype(np.int64)
    ys, p = dlap_pmf(2.5, lap_support(2.5))
    assert binned_chisquare(samples, ys, p) < P_MIN


@pytest.mark.parametrize(
    ("num", "den"), [(0, 7), (1, 3), (3, 3), (5, 2), (7, 1), (123_456_789, 10**8)]
)
def test_vectorised_bernoulli_exp_is_exact(num: int, den: int) -> None:
    rng = np.random.default_rng(num + den)
    draws = N._bernoulli_exp(rng, np.full(N_SAMPLES, num, dtype=np.int64), den)
    target = math.exp(-num / den)
    if num == 0:
        assert draws.all()
    else:
        assert stats.binomtest(int(draws.sum()), N_SAMPLES, target).pvalue > P_MIN


@pytest.mark.parametrize(("num", "den"), [(1, 3), (5 * 2**70, 2 * 2**70), (2**80, 2**80 + 1)])
def test_python_bernoulli_exp_is_exact(num: int, den: int) -> None:
    """Python-int Algorithm 1, including uniform draws beyond int64 via raw bytes."""
    rng = np.random.default_rng(7)
    n = 20_000
    hits = sum(N._py_bernoulli_exp(rng, num, den) for _ in range(n))
    target = math.exp(-float(Fraction(num, den)))
    assert stats.binomtest(hits, n, target).pvalue > P_MIN


def test_py_uniform_big_bound_is_uniform() -> None:
    """Rejection sampling from bytes: uniform over [0, n) for n just above a power of two."""
    rng = np.random.default_rng(3)
    n = 2**64 + 2**63  # 65-bit bound -> rejection rate 1/4
    draws = np.array([N._py_uniform(rng, n) for _ in range(30_000)], dtype=object)
    assert all(0 <= d < n for d in draws)
    buckets = np.array([int(d * 12 // n) for d in draws])
    assert stats.chisquare(np.bincount(buckets, minlength=12)).pvalue > P_MIN


# ----------------------------------------------------------------------------------------
# big-number fallback paths
# ----------------------------------------------------------------------------------------


def test_huge_sigma_uses_python_fallback_and_matches_pmf(monkeypatch: pytest.MonkeyPatch) -> None:
    """sigma = 2**35: 2 a b t > 2**62, so every acceptance runs in Python ints.

    An exact pmf sum over ~10**12 support points is infeasible, so bin probabilities use the
    normal CDF at half-integer edges.  For sigma = 2**35 that equals the discrete-Gaussian
    bin mass to relative error ~1/sigma^2 ~ 1e-21 (Euler-Maclaurin; Poisson summation makes
    the normaliser exact up to exp(-2 pi^2 sigma^2)), far below chi-square resolution.
    """
    spy = Spy(monkeypatch, "_py_gaussian_accept")
    sigma = 2**35
    n = 40_000
    samples = N.sample_discrete_gaussian(sigma, n, seed=31)
    assert spy.calls >= n
    s = math.sqrt(float(N.effective_discrete_gaussian_sigma2(sigma)))
    inner = np.linspace(-2.5, 2.5, 41) * s
    edges = np.concatenate(([-np.inf], np.floor(inner) + 0.5, [np.inf]))
    probs = np.diff(stats.norm.cdf(edges / s))
    observed = np.histogram(samples.astype(np.float64), bins=edges)[0]
    assert stats.chisquare(observed, probs / probs.sum() * n).pvalue > P_MIN
    # spot-check exact integrality/parity structure is not lost: odd and even equally likely
    assert stats.binomtest(int(np.sum(samples % 2)), n, 0.5).pvalue > P_MIN


def test_forced_python_discrete_gaussian_matches_pmf(
    monkeypatch: pytest.MonkeyPatch, rejection_path: None
) -> None:
    """Budget 2**8: every acceptance test is done by the Python-int path."""
    monkeypatch.setattr(N, "_INT64_BUDGET", 2**8)
    spy = Spy(monkeypatch, "_py_gaussian_accept")
    n = 50_000
    samples = N.sample_discrete_gaussian(3.7, n, seed=41)
    assert spy.calls >= n
    check_dgauss(samples, 3.7)


def test_forced_python_discrete_laplace_matches_pmf(
    monkeypatch: pytest.MonkeyPatch, rejection_path: None
) -> None:
    """Budget 2**8 < t: whole Algorithm 2 in Python ints with byte-based uniform draws."""
    monkeypatch.setattr(N, "_INT64_BUDGET", 2**8)
    spy = Spy(monkeypatch, "_py_discrete_laplace")
    n = 30_000
    samples = N.sample_discrete_laplace(2.5, n, seed=42)
    assert spy.calls == n
    check_dlap(samples, 2.5)


def test_mixed_fast_and_fallback_discrete_laplace(
    monkeypatch: pytest.MonkeyPatch, rejection_path: None
) -> None:
    """Budget 2**54: elements with V >= 6 and Algorithm-1 rounds K >= 7 leave int64."""
    monkeypatch.setattr(N, "_INT64_BUDGET", 2**54)
    magnitude = Spy(monkeypatch, "_py_laplace_magnitude")
    two_draw = Spy(monkeypatch, "_bernoulli_one_over")
    samples = N.sample_discrete_laplace(2.5, N_SAMPLES, seed=43)
    assert magnitude.calls > 100
    assert two_draw.calls > 0
    check_dlap(samples, 2.5)


def test_mixed_fast_and_fallback_discrete_gaussian(
    monkeypatch: pytest.MonkeyPatch, rejection_path: None
) -> None:
    """Budget 2**56: proposals with |Y| > 32 are accepted/rejected by the Python path."""
    monkeypatch.setattr(N, "_INT64_BUDGET", 2**56)
    spy = Spy(monkeypatch, "_py_gaussian_accept")
    samples = N.sample_discrete_gaussian(3.7, N_SAMPLES, seed=44)
    assert 0 < spy.calls < N_SAMPLES // 100
    check_dgauss(samples, 3.7)


# ----------------------------------------------------------------------------------------
# rational representation of the parameters
# ----------------------------------------------------------------------------------------


@settings(max_examples=300, deadline=None)
@given(
    st.one_of(
        st.floats(min_value=1e-3, max_value=2.0**40),
        st.integers(min_value=1, max_value=2**40),
        st.fractions(min_value=Fraction(1, 1000), max_value=10**6).filter(lambda f: f > 0),
    )
)
def test_gaussian_sigma2_rounds_up_within_bound(sigma: float | int | Fraction) -> None:
    exact = Fraction(sigma)
    t, a, b = N._gaussian_rational(exact)
    eff = N.effective_discrete_gaussian_sigma2(sigma)
    table = N.sampler_for("gaussian", exact**2) is not None
    assert eff == (exact**2 if table else Fraction(t * a, b))
    eff = Fraction(t * a, b)
    assert eff >= exact**2  # never below: privacy claim stays sound
    excess = (eff - exact**2) / exact**2
    assert excess < Fraction(1, 2**25) * (Fraction(t) / exact) ** 2
    if exact >= Fraction(1, 2):
        assert excess < Fraction(1, 2**23)
    assert t == math.floor(exact) + 1
    assert b & (b - 1) == 0  # power of two
    if exact <= 2**30:  # fast path available: every int64 intermediate fits
        assert 2 * a * b * t <= 2**62
        assert a <= 2**31
        assert (2**31 // b) >= 32 * t or b == 1


@settings(max_examples=300, deadline=None)
@given(
    st.one_of(
        st.floats(min_value=1e-6, max_value=2.0**40),
        st.integers(min_value=1, max_value=2**40),
    )
)
def test_laplace_scale_rounds_up_within_bound(scale: float | int) -> None:
    exact = Fraction(scale)
    t, s = N._laplace_rational(exact)
    table = N.sampler_for("laplace", exact) is not None
    assert N.effective_discrete_laplace_scale(scale) == (exact if table else Fraction(t, s))
    assert Fraction(t, s) >= exact
    assert (Fraction(t, s) - exact) / exact < Fraction(1, 2**51)
    assert t <= 2**52
    assert s & (s - 1) == 0


# ----------------------------------------------------------------------------------------
# float noise
# ----------------------------------------------------------------------------------------


def test_gaussian_noise_std() -> None:
    values = np.zeros(1_000_000)
    noisy = N.unsafe_float_gaussian_noise(values, 4.0, seed=1)
    assert noisy.dtype == np.float64
    assert abs(noisy.std() / 4.0 - 1.0) < 0.005  # se of std is ~0.0007 sigma
    assert abs(noisy.mean()) < 5 * 4.0 / 1000
    assert stats.kstest(noisy[:100_000], stats.norm(scale=4.0).cdf).pvalue > P_MIN


def test_laplace_noise_mean_absolute_deviation() -> None:
    values = np.full(1_000_000, 10.0)
    noisy = N.unsafe_float_laplace_noise(values, 2.0, seed=2)
    assert noisy.dtype == np.float64
    mad = np.mean(np.abs(noisy - 10.0))
    assert abs(mad / 2.0 - 1.0) < 0.005  # se of MAD is scale/1000
    assert stats.kstest(noisy[:100_000] - 10.0, stats.laplace(scale=2.0).cdf).pvalue > P_MIN


def test_noise_functions_add_their_sampler() -> None:
    values = np.arange(-50, 50, dtype=np.int64).reshape(10, 10)
    assert np.array_equal(
        N.discrete_gaussian_noise(values, 3.0, seed=9) - values,
        N.sample_discrete_gaussian(3.0, (10, 10), seed=9),
    )
    assert np.array_equal(
        N.discrete_laplace_noise(values, 3.0, seed=9) - values,
        N.sample_discrete_laplace(3.0, (10, 10), seed=9),
    )


ALL_NOISE = [
    (N.unsafe_float_gaussian_noise, np.float64),
    (N.unsafe_float_laplace_noise, np.float64),
    (N.discrete_gaussian_noise, np.int64),
    (N.discrete_laplace_noise, np.int64),
]


@pytest.mark.parametrize(("fn", "dtype"), ALL_NOISE)
@pytest.mark.parametrize("shape", [(), (0,), (7,), (3, 4), (2, 3, 5)])
def test_shape_dtype_and_no_mutation(fn, dtype, shape) -> None:
    values = np.arange(math.prod(shape), dtype=np.int64).reshape(shape) * 3
    before = values.copy()
    out = fn(values, 5.0, seed=4)
    assert isinstance(out, np.ndarray)
    assert out.shape == values.shape
    assert out.dtype == dtype
    assert np.array_equal(values, before)
    assert out is not values


@pytest.mark.parametrize(("fn", "dtype"), ALL_NOISE)
def test_python_scalar_and_list_inputs(fn, dtype) -> None:
    out = fn(7, 2.0, seed=1)
    assert isinstance(out, np.ndarray) and out.shape == () and out.dtype == dtype
    lst = [1, 2, 3]
    out = fn(lst, 2.0, seed=1)
    assert out.shape == (3,) and lst == [1, 2, 3]


def test_float_input_not_mutated() -> None:
    values = np.linspace(0.0, 1.0, 50)
    before = values.copy()
    N.unsafe_float_gaussian_noise(values, 1.0)
    N.unsafe_float_laplace_noise(values, 1.0)
    assert np.array_equal(values, before)


@pytest.mark.parametrize("fn", [N.discrete_gaussian_noise, N.discrete_laplace_noise])
def test_discrete_accepts_integral_floats(fn) -> None:
    ints = np.array([[1, -2], [300, 4]])
    assert np.array_equal(fn(ints.astype(np.float64), 2.0, seed=3), fn(ints, 2.0, seed=3))
    assert fn(np.array([True, False]), 2.0, seed=3).dtype == np.int64


# ----------------------------------------------------------------------------------------
# entropy / seeding
# ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(("fn", "dtype"), ALL_NOISE)
def test_fresh_entropy_and_reproducible_seed(fn, dtype) -> None:
    values = np.zeros(1000, dtype=np.int64)
    a, b = fn(values, 5.0), fn(values, 5.0)
    assert not np.array_equal(a, b)  # seed=None -> fresh OS entropy on every call
    assert np.array_equal(fn(values, 5.0, seed=123), fn(values, 5.0, seed=123))
    assert not np.array_equal(fn(values, 5.0, seed=123), fn(values, 5.0, seed=124))


@pytest.mark.parametrize("sampler", [N.sample_discrete_gaussian, N.sample_discrete_laplace])
def test_samplers_fresh_entropy_and_seed(sampler) -> None:
    assert not np.array_equal(sampler(5.0, 1000), sampler(5.0, 1000))
    assert np.array_equal(sampler(5.0, (20, 50), seed=8), sampler(5.0, (20, 50), seed=8))
    assert sampler(5.0, (20, 50), seed=8).shape == (20, 50)


# ----------------------------------------------------------------------------------------
# bad inputs
# ----------------------------------------------------------------------------------------

BAD_PARAMS = [
    0,
    -1,
    0.0,
    -0.5,
    float("nan"),
    float("inf"),
    float("-inf"),
    True,
    False,
    np.bool_(True),
    "1",
    None,
    [1.0],
    1 + 0j,
    np.float64("nan"),
]

PARAM_FUNCS = [
    (N.unsafe_float_gaussian_noise, "sigma", True),
    (N.unsafe_float_laplace_noise, "scale", True),
    (N.discrete_gaussian_noise, "sigma", True),
    (N.discrete_laplace_noise, "scale", True),
    (N.sample_discrete_gaussian, "sigma", False),
    (N.sample_discrete_laplace, "scale", False),
]


def _call(fn, takes_values: bool, param: object, values: object = (1, 2, 3)) -> object:
    if takes_values:
        return fn(values, param, seed=0)
    return fn(param, 3, seed=0)


@pytest.mark.parametrize(("fn", "name", "takes_values"), PARAM_FUNCS)
@pytest.mark.parametrize("bad", BAD_PARAMS, ids=repr)
def test_bad_parameter_raises_naming_it(fn, name, takes_values, bad) -> None:
    with pytest.raises(ValueError, match=name) as excinfo:
        _call(fn, takes_values, bad)
    assert repr(bad) in str(excinfo.value)


@pytest.mark.parametrize(("fn", "name", "takes_values"), PARAM_FUNCS[2:])
def test_discrete_parameter_cap(fn, name, takes_values) -> None:
    with pytest.raises(ValueError, match=name):
        _call(fn, takes_values, 2**40 + 1)
    _call(fn, takes_values, 2**40)  # the cap itself is accepted


@pytest.mark.parametrize(("fn", "name", "takes_values"), PARAM_FUNCS)
def test_accepted_parameter_types(fn, name, takes_values) -> None:
    for ok in (2, 2.5, np.float32(2.5), np.int16(3), Fraction(5, 2)):
        _call(fn, takes_values, ok)


@pytest.mark.parametrize(("fn", "_"), ALL_NOISE)
@pytest.mark.parametrize(
    "values",
    [[1.0, float("nan")], [float("inf")], [[0.0], [-np.inf]], ["a", "b"], [1 + 2j], [None]],
    ids=repr,
)
def test_bad_values_raise(fn, _, values) -> None:
    with pytest.raises(ValueError, match="values"):
        fn(values, 1.0, seed=0)


@pytest.mark.parametrize("fn", [N.discrete_gaussian_noise, N.discrete_laplace_noise])
@pytest.mark.parametrize(
    "values",
    [[1.5], [0.0, 2.0000001], [1e30], np.array([2**64 - 1], dtype=np.uint64), [2**70]],
    ids=repr,
)
def test_discrete_rejects_non_int64_integers(fn, values) -> None:
    with pytest.raises(ValueError, match="values"):
        fn(values, 1.0, seed=0)


def test_non_integer_error_does_not_echo_private_data() -> None:
    with pytest.raises(ValueError) as excinfo:
        N.discrete_laplace_noise([12345.678], 1.0)
    assert "12345" not in str(excinfo.value)


@pytest.mark.parametrize("sampler", [N.sample_discrete_gaussian, N.sample_discrete_laplace])
@pytest.mark.parametrize("size", [-1, 1.5, True, (2, -1), "3", None], ids=repr)
def test_bad_size(sampler, size) -> None:
    with pytest.raises(ValueError, match="size"):
        sampler(1.0, size)


def test_bad_seed() -> None:
    with pytest.raises(ValueError, match="seed"):
        N.unsafe_float_gaussian_noise([1.0], 1.0, seed="42")  # type: ignore[arg-type]


def test_int64_overflow_raises_instead_of_wrapping() -> None:
    values = np.array([2**63 - 1] * 20 + [-(2**63)] * 20, dtype=np.int64)
    with pytest.raises(OverflowError):
        N.discrete_laplace_noise(values, 100.0, seed=1)


# ----------------------------------------------------------------------------------------
# layering
# ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(("fn", "dtype"), ALL_NOISE)
def test_production_noise_reads_os_urandom_never_numpy(fn, dtype, monkeypatch) -> None:
    """seed=None draws every bit from os.urandom; numpy's PCG64 is built only for a seed."""
    from dp_budget_provider.accounting import secure_random

    urandom_bytes: list[int] = []
    real_urandom = secure_random.os.urandom

    def counting_urandom(n: int) -> bytes:
        urandom_bytes.append(n)
        return real_urandom(n)

    def no_numpy(*args: object, **kwargs: object) -> None:
        raise AssertionError("numpy's generator drove production noise")

    monkeypatch.setattr(secure_random.os, "urandom", counting_urandom)
    monkeypatch.setattr(secure_random.np.random, "default_rng", no_numpy)
    fn([1, 2, 3], 2.0)
    assert sum(urandom_bytes) >= 3 * 4
    with pytest.raises(AssertionError, match="numpy"):
        fn([1, 2, 3], 2.0, seed=5)
