"""Noise mechanisms whose output distribution is exactly the one the accountant charges for.

Why this module exists
----------------------
The product adds differential-privacy noise itself, so the privacy claim is only as good as
the sampler.  A textbook ``value + numpy.random.laplace(scale)`` is *not* the Laplace
mechanism: floating-point sampling produces a distribution with holes and a non-uniform
grid of attainable outputs, and Mironov (2012, "On significance of the least significant
bits for differential privacy") showed that an attacker can often tell from the low-order
bits of a float release which input produced it -- the privacy loss is unbounded even though
the "scale" looks right.  Similar attacks exist for float Gaussian samplers (Jin et al.,
2022, "Are we there yet? Timing and floating-point attacks on differential privacy").

The integer-valued releases (counts, histograms, heatmaps) therefore use *exact* discrete
samplers from Canonne, Kamath & Steinke (2020), "The Discrete Gaussian for Differential
Privacy" (CKS):

* Algorithm 1 -- Bernoulli(exp(-gamma)) for rational gamma using only Bernoulli(rational)
  draws, each realised as ``uniform_integer(0, den) < num``;
* Algorithm 2 -- discrete Laplace with a rational scale ``t/s``;
* Algorithm 3 -- discrete Gaussian by rejection from a discrete Laplace of integer scale
  ``t = floor(sigma) + 1``.

Everything on the discrete path is integer or rational arithmetic plus exact uniform
integer draws (``numpy.random.Generator.integers`` with integer bounds, or rejection
sampling on raw OS-seeded bytes for numbers beyond int64).  There is no floating-point
comparison anywhere on that path, so the output pmf is exactly the stated one.

How to account for each mechanism
---------------------------------
* ``discrete_gaussian_noise(sigma)`` on an integer query with L2 sensitivity ``Delta``
  satisfies zCDP with ``rho = Delta**2 / (2 * sigma**2)`` (CKS 2020; for a vector query
  with independent noise per cell, Delta is the L2 norm of the change).  The sampler may
  use a variance slightly *above* ``sigma**2`` (see ``effective_discrete_gaussian_sigma2``);
  accounting with the requested ``sigma`` is therefore conservative.
* ``discrete_laplace_noise(scale)`` on an integer query with L1 sensitivity ``Delta``
  satisfies pure ``eps0 = Delta / scale`` differential privacy.  Do **not** account it with
  the exact Renyi-DP formula of the *continuous* Laplace mechanism: the discrete Laplace's
  privacy-loss random variable takes only the two extreme values ``+-eps0`` (like randomised
  response), so its Renyi divergence is *larger* than the continuous Laplace's at every
  order and the continuous formula under-reports the loss.  Use the pure-DP ``eps0``
  (or RDP/zCDP conversions that are valid for any ``eps0``-DP mechanism).
* ``unsafe_float_gaussian_noise`` / ``unsafe_float_laplace_noise`` are floating-point
  mechanisms, kept under names that say what they are: their low bits depend on the data
  (the attacks above), so no privacy guarantee holds for them as implemented.

Which sampler runs
------------------
A parameter whose certified CDF table is small enough (sigma up to about 2.8e4, scale up
to about 6e3) is sampled by exact inverse CDF from that table (``cdf_sampler``), about one
32-bit random word per cell.  Larger parameters use the CKS rejection samplers below,
vectorised over the batch of still-pending cells as numpy int64 arrays; only numbers that
would not fit int64 go through the per-element Python-int fallback.  Both produce exactly
the stated distribution.

Randomness
----------
All noise is driven by the OS's cryptographically secure generator (``os.urandom``, see
``secure_random``).  A fixed ``seed`` exists for tests only: it switches to a seeded PCG64
byte stream, reproducible and therefore NOT private.

Timing: the samplers' running time depends on the random bits drawn (never on the data).
They process whole batches, so only the aggregate batch time -- not any single cell's --
is observable.

Layering: this module imports only the standard library and numpy.
"""

from __future__ import annotations

import math
import numbers
from fractions import Fraction

import numpy as np
from numpy.typing import ArrayLike, NDArray

from dp_budget_provider.accounting.cdf_sampler import Kind, sampler_for
from dp_budget_provider.accounting.secure_random import SecureRandom, random_source

__all__ = [
    "MAX_DISCRETE_PARAMETER",
    "discrete_gaussian_noise",
    "discrete_laplace_noise",
    "effective_discrete_gaussian_sigma2",
    "effective_discrete_laplace_scale",
    "sample_discrete_gaussian",
    "sample_discrete_laplace",
    "unsafe_float_gaussian_noise",
    "unsafe_float_laplace_noise",
]

#: Largest sigma / scale accepted by the discrete samplers.  Outputs are int64; capping the
#: parameter at 2**40 keeps the noise (whose tails are a few dozen scales wide) far from the
#: int64 range, so an overflow is not a realistic failure mode of a release.
MAX_DISCRETE_PARAMETER: int = 2**40

# Every intermediate on the vectorised (int64) path is kept <= this bound; anything that
# would exceed it is routed through the exact pure-Python-int fallback instead.  It is a
# module attribute (not inlined) so tests can lower it to force the fallback paths.
_INT64_BUDGET: int = 2**62

_INT64_MAX: int = 2**63 - 1
_INT64_MIN: int = -(2**63)

# Bit budget for the discrete Laplace numerator t (scale = t/s, s a power of two): t <= 2**52,
# so the scale is rounded up by a relative amount < 2**-51 and t * K stays in int64 for
# every Algorithm-1 round K < 2**10 (later rounds, probability < 1/1000!, use two draws).
_LAPLACE_T_BITS: int = 52

# Bit budget for t * b in the discrete Gaussian (sigma~^2 = t * a / b, b a power of two):
# t * b <= 2**26 keeps |Y| * b <= 2**31 for every proposal |Y| <= 32 t (while b > 1), hence
# the Algorithm-1 numerator (|Y| b - a)**2 <= 2**62, and the denominator 2 a b t <= ~2**53.
_GAUSS_TB_BITS: int = 26

# --------------------------------------------------------------------------------------
# Validation
# --------------------------------------------------------------------------------------


def _exact_positive(name: str, value: object) -> Fraction:
    """Validate a noise parameter and return its *exact* rational value.

    Why exact: the discrete samplers round the parameter up to a convenient rational, and
    "never below the requested value" can only be guaranteed by comparing exact rationals.
    Why so strict: a silently coerced ``True`` (== 1), ``"1"`` or NaN would produce a
    release whose noise level nobody asked for, so every such input is a ValueError.
    """
    bad = ValueError(f"{name} must be a finite real number > 0, got {value!r}")
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real):
        raise bad
    if isinstance(value, numbers.Integral):
        exact = Fraction(int(value))
    elif isinstance(value, numbers.Rational):
        exact = Fraction(int(value.numerator), int(value.denominator))
    else:
        try:
            finite = math.isfinite(value)
        except (TypeError, ValueError, OverflowError):
            raise bad from None
        if not finite:
            raise bad
        try:
            num, den = value.as_integer_ratio()  # type: ignore[attr-defined]
        except (AttributeError, TypeError, ValueError, OverflowError):
            raise bad from None
        exact = Fraction(int(num), int(den))
    if exact <= 0:
        raise bad
    return exact


def _float_positive(name: str, value: object) -> float:
    """Validate a float-mechanism parameter; reject values that do not survive float64."""
    exact = _exact_positive(name, value)
    try:
        as_float = float(exact)
    except OverflowError:
        raise ValueError(f"{name} must be a finite real number > 0, got {value!r}") from None
    if not (math.isfinite(as_float) and as_float > 0.0):
        raise ValueError(f"{name} must be a finite real number > 0, got {value!r}")
    return as_float


def _discrete_positive(name: str, value: object) -> Fraction:
    """Validate a discrete-mechanism parameter, including the int64-driven upper cap."""
    exact = _exact_positive(name, value)
    if exact > MAX_DISCRETE_PARAMETER:
        raise ValueError(
            f"{name} must be <= {MAX_DISCRETE_PARAMETER} (2**40) so that int64 noisy "
            f"outputs cannot overflow, got {value!r}"
        )
    return exact


def _float_values(values: ArrayLike) -> NDArray[np.float64]:
    """Copy ``values`` to a float64 array, refusing NaN/inf.

    A NaN would propagate through the noise and an inf would swamp it; either way the
    release is meaningless, so it is rejected rather than passed through.  The message does
    not echo the data because the data is the private input.
    """
    arr = np.asarray(values)
    if arr.dtype.kind not in "biuf":
        raise ValueError(f"values must be a real numeric array, got dtype {arr.dtype}")
    out = np.array(arr, dtype=np.float64, copy=True)
    if not np.all(np.isfinite(out)):
        raise ValueError("values must be finite; found NaN or infinity")
    return out


def _integer_values(values: ArrayLike) -> NDArray[np.int64]:
    """Copy integer-valued ``values`` to int64, refusing anything that is not an exact integer.

    Rounding a non-integer silently would change the query whose sensitivity was accounted,
    so a float is accepted only when it is exactly an integer in the int64 range.
    """
    arr = np.asarray(values)
    kind = arr.dtype.kind
    if kind in "bi":
        return np.array(arr, dtype=np.int64, copy=True)
    if kind == "u":
        if arr.size and int(arr.max()) > _INT64_MAX:
            raise ValueError("values must fit in int64; found an unsigned value above 2**63-1")
        return np.array(arr, dtype=np.int64, copy=True)
    if kind == "f":
        if not np.all(np.isfinite(arr)):
            raise ValueError("values must be finite; found NaN or infinity")
        if not np.all(arr == np.floor(arr)):
            raise ValueError(
                "values must be integer-valued for discrete noise; found non-integer entries"
            )
        # float(2**63) is exact, so these two comparisons are exact range checks.
        if arr.size and (float(arr.max()) >= 2.0**63 or float(arr.min()) < -(2.0**63)):
            raise ValueError("values must fit in int64; found an entry outside [-2**63, 2**63)")
        return arr.astype(np.int64)
    raise ValueError(
        f"values must be an integer-valued numeric array for discrete noise, got dtype {arr.dtype}"
    )


def _shape_from_size(size: object) -> tuple[int, ...]:
    """Validate a numpy-style ``size`` (int or tuple of ints) for the raw samplers."""

    def _one(dim: object) -> int:
        if isinstance(dim, (bool, np.bool_)) or not isinstance(dim, numbers.Integral):
            raise ValueError(f"size must be a non-negative int or tuple of ints, got {size!r}")
        if int(dim) < 0:
            raise ValueError(f"size must be a non-negative int or tuple of ints, got {size!r}")
        return int(dim)

    if isinstance(size, tuple):
        return tuple(_one(d) for d in size)
    return (_one(size),)


# --------------------------------------------------------------------------------------
# Rational representation of the parameters
# --------------------------------------------------------------------------------------


def _floor_log2(x: Fraction) -> int:
    """Exact floor(log2(x)) for a positive rational, without floating point."""
    p, q = x.numerator, x.denominator
    e = p.bit_length() - q.bit_length()  # 2**(e-1) < x < 2**(e+1)
    if (p << max(0, -e)) < (q << max(0, e)):
        e -= 1
    return e


def _ceil_fraction(x: Fraction) -> int:
    return -((-x.numerator) // x.denominator)


def _laplace_rational(scale: Fraction) -> tuple[int, int]:
    """Round ``scale`` UP to ``t / s`` with ``s = 2**k`` and ``t <= 2**52``.

    Rounding up only adds noise, so the eps0 = Delta/scale claim stays valid.  Choosing k
    so that ``scale * 2**k`` lies in [2**51, 2**52) makes the relative round-up
    ``(t/s - scale)/scale < 2**-51`` for every accepted scale (k >= 0 always holds because
    scale <= 2**40), while keeping every int64 intermediate small.
    """
    k = max(0, _LAPLACE_T_BITS - 1 - _floor_log2(scale))
    s = 1 << k
    t = _ceil_fraction(scale * s)
    return t, s


def _gaussian_rational(sigma: Fraction) -> tuple[int, int, int]:
    """Return ``(t, a, b)`` with ``t = floor(sigma) + 1`` and sigma~^2 = t * a / b >= sigma^2.

    Representation: ``q = sigma^2 / t`` is rounded UP to ``a / b`` with ``b = 2**k`` chosen
    from sigma's size so that ``t * b <= 2**26`` (``b = 1`` once ``t >= 2**25``).  With that
    form the CKS acceptance exponent is the small rational

        gamma = (|Y| - sigma~^2/t)^2 / (2 sigma~^2) = (|Y| b - a)^2 / (2 a b t),

    whose numerator fits int64 for every proposal |Y| <= 32 t and whose denominator is
    about 2**53 (for sigma >= 2**25, where b = 1, the denominator is ~2 sigma^2 and large
    proposals, or all of them above sigma ~ 2**30.5, take the exact Python-int fallback,
    which is slower but equally exact).  The relative round-up of the variance is
    ``(sigma~^2 - sigma^2)/sigma^2 < 2**-25 * (t/sigma)^2``, i.e. < 2**-23 (1.2e-7) for
    every sigma >= 0.5 (and < 2**-25 / sigma^2 below that).  Using a slightly larger
    variance only adds noise, so rho = Delta^2/(2 sigma^2) remains a valid (conservative)
    charge.
    """
    t = sigma.numerator // sigma.denominator + 1
    k = max(0, _GAUSS_TB_BITS - t.bit_length())
    b = 1 << k
    a = _ceil_fraction(sigma * sigma * b / t)
    return t, a, b


def effective_discrete_laplace_scale(scale: float | int | Fraction) -> Fraction:
    """The exact scale the discrete Laplace sampler uses for a requested ``scale``.

    Exposed so accountants and audits can see the real mechanism: ``scale`` itself on the
    table path, else (rejection path) rounded up by a relative amount < 2**-51.
    """
    exact = _discrete_positive("scale", scale)
    if sampler_for("laplace", exact) is not None:
        return exact
    t, s = _laplace_rational(exact)
    return Fraction(t, s)


def effective_discrete_gaussian_sigma2(sigma: float | int | Fraction) -> Fraction:
    """The exact variance parameter sigma~^2 the discrete Gaussian sampler uses.

    ``sigma**2`` itself on the table path; on the rejection path (large sigma) it exceeds
    it by a relative < 2**-25 * ((floor(sigma)+1)/sigma)**2 (< 2**-23 for sigma >= 0.5).
    """
    exact = _discrete_positive("sigma", sigma)
    if sampler_for("gaussian", exact * exact) is not None:
        return exact * exact
    t, a, b = _gaussian_rational(exact)
    return Fraction(t * a, b)


# --------------------------------------------------------------------------------------
# Exact pure-Python-int fallback (arbitrary precision; used for elements whose numbers do
# not fit the int64 budget, and as the reference implementation of CKS Algorithms 1-3)
# --------------------------------------------------------------------------------------


def _py_uniform(rng: SecureRandom, n: int) -> int:
    """Exact uniform integer in [0, n) for any positive Python int ``n``.

    Small bounds use ``Generator.integers`` (exact); large ones use rejection sampling on
    raw random bytes: draw ``bit_length(n-1)`` uniform bits and retry if >= n.
    """
    if n <= _INT64_BUDGET:
        return int(rng.integers(0, n))
    nbits = (n - 1).bit_length()
    nbytes = (nbits + 7) // 8
    mask = (1 << nbits) - 1
    while True:
        u = int.from_bytes(rng.bytes(nbytes), "little") & mask
        if u < n:
            return u


def _py_bernoulli_exp_unit(rng: SecureRandom, num: int, den: int) -> bool:
    """CKS Algorithm 1, gamma = num/den in [0, 1]: Bernoulli(exp(-gamma)), exact.

    Draw A_K ~ Bernoulli(gamma/K) for K = 1, 2, ... until the first 0; return 1 iff the
    stopping K is odd.
    """
    k = 1
    while _py_uniform(rng, den * k) < num:
        k += 1
    return k % 2 == 1


def _py_bernoulli_exp(rng: SecureRandom, num: int, den: int) -> bool:
    """CKS Algorithm 1 for any rational gamma = num/den >= 0, exact.

    exp(-gamma) = exp(-1)**floor(gamma) * exp(-frac(gamma)); each factor is an independent
    Bernoulli and the loop stops at the first failure, so huge gamma costs O(1) expected.
    """
    whole, frac = divmod(num, den)
    i = 0
    while i < whole:
        if not _py_bernoulli_exp_unit(rng, 1, 1):
            return False
        i += 1
    return _py_bernoulli_exp_unit(rng, frac, den)


def _checked_int64(value: int) -> int:
    if not _INT64_MIN < value <= _INT64_MAX:
        raise OverflowError("discrete noise sample does not fit in int64")
    return value


def _py_laplace_magnitude(u: int, v: int, t: int, s: int) -> int:
    """floor((u + t*v) / s) in Python ints, for the rare V too large for int64 products."""
    return _checked_int64((u + t * v) // s)


def _py_discrete_laplace(rng: SecureRandom, t: int, s: int) -> int:
    """CKS Algorithm 2 in Python ints: one exact sample with P[Z=z] ∝ exp(-|z| s / t)."""
    while True:
        u = _py_uniform(rng, t)
        if not _py_bernoulli_exp_unit(rng, u, t):
            continue
        v = 0
        while _py_bernoulli_exp_unit(rng, 1, 1):
            v += 1
        y = (u + t * v) // s
        negative = _py_uniform(rng, 2) == 1
        if negative and y == 0:
            continue
        return _checked_int64(-y if negative else y)


def _py_gaussian_accept(rng: SecureRandom, y_abs: int, a: int, b: int, t: int) -> bool:
    """CKS Algorithm 3 acceptance, Bernoulli(exp(-(|Y| b - a)^2 / (2 a b t))), in Python ints."""
    c = y_abs * b - a
    return _py_bernoulli_exp(rng, c * c, 2 * a * b * t)


# --------------------------------------------------------------------------------------
# Vectorised int64 path: each rejection loop runs over the whole batch of pending elements
# --------------------------------------------------------------------------------------


def _bernoulli_exp_unit(rng: SecureRandom, num: NDArray[np.int64], den: int) -> NDArray[np.bool_]:
    """Vectorised CKS Algorithm 1 for gamma_i = num_i / den in [0, 1].

    All still-running elements share the same loop counter K, so round K draws one exact
    uniform in [0, den*K) per element and compares it with num_i.  Round 1 runs on the
    whole batch without index bookkeeping because it is where almost all the work is.
    """
    n = num.shape[0]
    if den > _INT64_BUDGET:  # never on production parameters; kept exact regardless
        return np.array(
            [_py_bernoulli_exp_unit(rng, int(num[i]), den) for i in range(n)], dtype=np.bool_
        )
    hit = rng.integers(0, den, size=n, dtype=np.int64) < num
    out = ~hit  # stopped at K = 1 (odd) -> 1
    idx = np.flatnonzero(hit)
    _alg1_rounds(rng, out, idx, num[idx], den, 2)
    return out


def _bernoulli_exp_minus_one(rng: SecureRandom, m: int) -> NDArray[np.bool_]:
    """m exact Bernoulli(exp(-1)) draws: Algorithm 1 with gamma = 1/1.

    Round K = 1 is Bernoulli(1/1) == 1 for certain, so it is skipped without drawing.
    """
    out = np.empty(m, dtype=np.bool_)
    _alg1_rounds(rng, out, np.arange(m), np.ones(m, dtype=np.int64), 1, 2)
    return out


def _alg1_rounds(
    rng: SecureRandom,
    out: NDArray[np.bool_],
    idx: NDArray[np.intp],
    cur: NDArray[np.int64],
    den: int,
    k: int,
) -> None:
    """Run Algorithm 1's loop from round ``k`` for the elements ``idx`` (numerators ``cur``).

    Each round draws A ~ Bernoulli(cur/(den K)) as ``uniform[0, den K) < cur``; elements
    with A = 0 stop and get ``K odd``.  If den*K would exceed the int64 budget, A is drawn
    as the product of the independent Bernoulli(cur/den) and Bernoulli(1/K) -- still
    exact, no overflow possible.
    """
    while idx.size:
        m = idx.size
        if den <= _INT64_BUDGET // k:
            hit = rng.integers(0, den * k, size=m, dtype=np.int64) < cur
        else:
            hit = rng.integers(0, den, size=m, dtype=np.int64) < cur
            hit &= _bernoulli_one_over(rng, k, m)
        out[idx[~hit]] = k % 2 == 1
        idx = idx[hit]
        cur = cur[hit]
        k += 1


def _bernoulli_one_over(rng: SecureRandom, k: int, m: int) -> NDArray[np.bool_]:
    """m exact Bernoulli(1/k) draws (k may exceed int64 only in absurd, forced cases)."""
    if k <= _INT64_BUDGET:
        return rng.integers(0, k, size=m, dtype=np.int64) == 0
    return np.array([_py_uniform(rng, k) == 0 for _ in range(m)], dtype=np.bool_)


def _bernoulli_exp(rng: SecureRandom, num: NDArray[np.int64], den: int) -> NDArray[np.bool_]:
    """Vectorised CKS Algorithm 1 for any gamma_i = num_i / den >= 0 (den <= budget)."""
    whole = num // den
    frac = num - whole * den
    res = _bernoulli_exp_unit(rng, frac, den)
    idx = np.flatnonzero(res & (whole > 0))
    remaining = whole[idx]
    while idx.size:
        ok = _bernoulli_exp_minus_one(rng, idx.size)
        res[idx[~ok]] = False
        idx = idx[ok]
        remaining = remaining[ok] - 1
        more = remaining > 0
        idx = idx[more]
        remaining = remaining[more]
    return res


def _geometric_exp1(rng: SecureRandom, m: int) -> NDArray[np.int64]:
    """V with P[V >= v] = exp(-v): count successes of Bernoulli(exp(-1)) until a failure."""
    v = np.zeros(m, dtype=np.int64)
    active = np.arange(m)
    while active.size:
        ok = _bernoulli_exp_minus_one(rng, active.size)
        active = active[ok]
        v[active] += 1
    return v


def _discrete_laplace_batch(rng: SecureRandom, t: int, s: int, count: int) -> np.ndarray:
    """``count`` exact samples of CKS Algorithm 2, P[Z=z] ∝ exp(-|z| s / t), as int64."""
    out = np.empty(count, dtype=np.int64)
    if t > _INT64_BUDGET:  # numbers do not fit: whole algorithm in Python ints
        for i in range(count):
            out[i] = _py_discrete_laplace(rng, t, s)
        return out
    v_fast_max = _INT64_BUDGET // t - 1  # t*(V+1) <= budget  =>  U + t*V fits
    todo = np.arange(count)
    while todo.size:
        u = rng.integers(0, t, size=todo.size, dtype=np.int64)
        d = _bernoulli_exp_unit(rng, u, t)
        retry = [todo[~d]]
        idx = todo[d]
        u = u[d]
        v = _geometric_exp1(rng, idx.size)
        y = np.empty(idx.size, dtype=np.int64)
        fast = v <= v_fast_max
        x = u[fast] + t * v[fast]
        # X < t*(V+1) <= budget, so when s > budget floor(X/s) is exactly 0.
        y[fast] = x // s if s <= _INT64_BUDGET else 0
        for i in np.flatnonzero(~fast):
            y[i] = _py_laplace_magnitude(int(u[i]), int(v[i]), t, s)
        negative = rng.integers(0, 2, size=idx.size, dtype=np.int64) == 1
        reject = negative & (y == 0)
        keep = ~reject
        out[idx[keep]] = np.where(negative[keep], -y[keep], y[keep])
        retry.append(idx[reject])
        todo = np.concatenate(retry)
    return out


def _discrete_gaussian_batch(rng: SecureRandom, t: int, a: int, b: int, count: int) -> np.ndarray:
    """``count`` exact samples of CKS Algorithm 3 with sigma~^2 = t a / b, as int64.

    Proposals Y ~ DLap(t) are accepted with probability exp(-(|Y| b - a)^2 / (2 a b t)).
    Elements whose numerator or denominator would not fit the int64 budget are decided by
    the exact Python-int fallback; the rest are decided in one vectorised pass.
    """
    out = np.empty(count, dtype=np.int64)
    den = 2 * a * b * t
    root = math.isqrt(_INT64_BUDGET)
    # |c| = ||Y| b - a| <= max(|Y| b, a) <= root  =>  c^2 <= budget.
    y_fast_max = root // b if (den <= _INT64_BUDGET and a <= root) else -1
    todo = np.arange(count)
    while todo.size:
        y = _discrete_laplace_batch(rng, t, 1, todo.size)
        y_abs = np.abs(y)
        fast = y_abs <= y_fast_max
        accept = np.empty(todo.size, dtype=np.bool_)
        if fast.any():
            c = y_abs[fast] * b - a
            accept[fast] = _bernoulli_exp(rng, c * c, den)
        for i in np.flatnonzero(~fast):
            accept[i] = _py_gaussian_accept(rng, int(y_abs[i]), a, b, t)
        out[todo[accept]] = y[accept]
        todo = todo[~accept]
    return out


# --------------------------------------------------------------------------------------
# Public API
# --------------------------------------------------------------------------------------


def _draw(kind: Kind, exact: Fraction, count: int, rng: SecureRandom) -> NDArray[np.int64]:
    """``count`` exact samples: from the certified CDF table when it is short enough, else CKS."""
    table = sampler_for(kind, exact * exact if kind == "gaussian" else exact)
    if table is not None:
        return table.sample(count, rng)
    if kind == "gaussian":
        t, a, b = _gaussian_rational(exact)
        return _discrete_gaussian_batch(rng, t, a, b, count)
    t, s = _laplace_rational(exact)
    return _discrete_laplace_batch(rng, t, s, count)


def sample_discrete_laplace(
    scale: float | int | Fraction, size: int | tuple[int, ...], *, seed: int | None = None
) -> np.ndarray:
    """Exact i.i.d. discrete Laplace noise, P[Y=y] ∝ exp(-|y|/scale), as an int64 array.

    The scale used is ``effective_discrete_laplace_scale(scale)`` (>= ``scale``).  Adding
    this noise to an integer query of L1 sensitivity Delta is pure (Delta/scale)-DP -- do
    not use continuous-Laplace RDP.

    ``seed``: for tests only: a fixed seed makes the noise reproducible and therefore NOT
    private; production calls leave it None so every release reads the OS's CSPRNG.
    """
    exact = _discrete_positive("scale", scale)
    shape = _shape_from_size(size)
    return _draw("laplace", exact, math.prod(shape), random_source(seed)).reshape(shape)


def sample_discrete_gaussian(
    sigma: float | int | Fraction, size: int | tuple[int, ...], *, seed: int | None = None
) -> np.ndarray:
    """Exact i.i.d. discrete Gaussian noise, P[Y=y] ∝ exp(-y^2/(2 sigma~^2)), int64 array.

    sigma~^2 = ``effective_discrete_gaussian_sigma2(sigma)`` >= sigma^2.  Adding this noise
    to an integer query of L2 sensitivity Delta is rho-zCDP with rho = Delta^2/(2 sigma^2).

    ``seed``: for tests only: a fixed seed makes the noise reproducible and therefore NOT
    private; production calls leave it None so every release reads the OS's CSPRNG.
    """
    exact = _discrete_positive("sigma", sigma)
    shape = _shape_from_size(size)
    return _draw("gaussian", exact, math.prod(shape), random_source(seed)).reshape(shape)


def _add_int64_checked(values: NDArray[np.int64], noise: NDArray[np.int64]) -> np.ndarray:
    """values + noise in int64, raising instead of silently wrapping on overflow."""
    flat_v = values.reshape(-1)
    flat_n = noise.reshape(-1)
    total = flat_v + flat_n
    if np.any(((flat_v ^ total) & (flat_n ^ total)) < 0):
        raise OverflowError("values + discrete noise overflows int64")
    return total.reshape(values.shape)


def discrete_laplace_noise(
    values: ArrayLike, scale: float | int | Fraction, *, seed: int | None = None
) -> np.ndarray:
    """Return ``values + Y`` with Y exact discrete Laplace, P[Y=y] ∝ exp(-|y|/scale).

    ``values`` must be integer-valued (int dtype, or floats that are exact integers); the
    result is an int64 array of the same shape (a scalar gives a 0-d array).  The input is
    never modified.  Account as pure eps0 = Delta_1/scale DP (see module docstring).

    ``seed``: for tests only: a fixed seed makes the noise reproducible and therefore NOT
    private; production calls leave it None so every release reads the OS's CSPRNG.
    """
    exact = _discrete_positive("scale", scale)
    ints = _integer_values(values)
    noise = _draw("laplace", exact, ints.size, random_source(seed))
    return _add_int64_checked(ints, noise.reshape(ints.shape))


def discrete_gaussian_noise(
    values: ArrayLike, sigma: float | int | Fraction, *, seed: int | None = None
) -> np.ndarray:
    """Return ``values + Y`` with Y exact discrete Gaussian, P[Y=y] ∝ exp(-y^2/(2 sigma^2)).

    ``values`` must be integer-valued (int dtype, or floats that are exact integers); the
    result is an int64 array of the same shape (a scalar gives a 0-d array).  The input is
    never modified.  The sampler's variance parameter is never below sigma^2, so
    rho = Delta_2^2/(2 sigma^2) zCDP is a valid charge.

    ``seed``: for tests only: a fixed seed makes the noise reproducible and therefore NOT
    private; production calls leave it None so every release reads the OS's CSPRNG.
    """
    exact = _discrete_positive("sigma", sigma)
    ints = _integer_values(values)
    noise = _draw("gaussian", exact, ints.size, random_source(seed))
    return _add_int64_checked(ints, noise.reshape(ints.shape))


def _open_unit_doubles(rng: SecureRandom, count: int) -> NDArray[np.float64]:
    """Uniform doubles (k + 1/2) 2**-53 in (0, 1) from 53 random bits each."""
    top = (rng.words64(count) >> np.uint64(11)).astype(np.float64)
    return (top + 0.5) * 2.0**-53


def unsafe_float_gaussian_noise(
    values: ArrayLike, sigma: float | int | Fraction, *, seed: int | None = None
) -> np.ndarray:
    """Return ``values + N(0, sigma^2)`` in floating point (Box-Muller), float64 array.

    UNSAFE: the set of doubles this can output depends on ``values`` (Mironov 2012), so the
    low bits of a release identify its input; no differential-privacy guarantee holds for
    it as implemented.  Use ``discrete_gaussian_noise`` on a lattice instead.

    ``seed``: for tests only (reproducible, NOT private).
    """
    spread = _float_positive("sigma", sigma)
    out = _float_values(values)
    rng = random_source(seed)
    radius = np.sqrt(-2.0 * np.log(_open_unit_doubles(rng, out.size)))
    angle = (2.0 * np.pi) * _open_unit_doubles(rng, out.size)
    out += (spread * radius * np.cos(angle)).reshape(out.shape)
    return out


def unsafe_float_laplace_noise(
    values: ArrayLike, scale: float | int | Fraction, *, seed: int | None = None
) -> np.ndarray:
    """Return ``values + Laplace(0, scale)`` in floating point (log of a uniform), float64.

    UNSAFE: exactly the construction Mironov (2012) attacked -- the low bits of the output
    reveal the input.  Use ``discrete_laplace_noise`` on a lattice instead.

    ``seed``: for tests only (reproducible, NOT private).
    """
    spread = _float_positive("scale", scale)
    out = _float_values(values)
    rng = random_source(seed)
    magnitude = -spread * np.log(_open_unit_doubles(rng, out.size))
    negative = (rng.words32(out.size) & np.uint32(1)).astype(np.bool_)
    out += np.where(negative, -magnitude, magnitude).reshape(out.shape)
    return out
