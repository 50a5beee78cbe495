"""Rényi-DP curve of the Poisson-subsampled Gaussian mechanism (DP-SGD steps).

The mechanism
-------------
Each record joins the batch on its own with probability ``q`` (the sampling rate;
this is Poisson subsampling). The batch goes through a function whose L2 sensitivity
is 1, and Gaussian noise with standard deviation ``z`` (the noise multiplier) is
added to the result. One DP-SGD step is exactly this. Under add/remove-one
neighbouring, its Rényi-DP curve is ``RDP(alpha) = log(A_alpha) / (alpha - 1)``,
where ``A_alpha = E_{x ~ mu_0}[((1 - q) + q * mu_1(x) / mu_0(x)) ** alpha]``,
``mu_0 = N(0, z^2)`` and ``mu_1 = N(1, z^2)``.

Reference: I. Mironov, K. Talwar, L. Zhang, "Rényi Differential Privacy of the
Sampled Gaussian Mechanism", arXiv:1908.10530 (2019). Integer orders use the
finite binomial expansion of Section 3.2. Fractional orders use the two-sided
series of Section 3.3: the integral splits at
``z0 = z^2 log(1/q - 1) + 1/2`` and each part expands as a generalised binomial
series with log-erfc weights.

Agreement with dp_accounting, and where we differ to stay an upper bound
--------------------------------------------------------------------------
At integer orders the numbers agree with Google's ``dp_accounting`` package
(``RdpAccountant`` composing ``PoissonSampledDpEvent(q, GaussianDpEvent(z))``)
within 1e-6 relative or 1e-12 absolute, usually within 1e-13 to 2e-11 (ours is raised
by a bound of its rounding, below); at ``q = 1`` bit for bit. The fractional series
follows ``_compute_log_a_frac`` in ``dp_accounting/rdp/rdp_privacy_accountant.py`` with
its terms, but dp_accounting's result is a *truncation* of the series, not a bound: it
stops at the first index whose two terms are below ``exp(-30)``. At large orders that
is index 0 (``(1 - q)^alpha`` is tiny), which gave RDP 0.0 at alpha = 90.5, z = 10,
q = 0.3; and where the terms decay polynomially the dropped tail is far above
``exp(-30)``. Ours is an upper bound of the whole series:

* Binomial coefficients enter by **absolute value** (dp_accounting's ``gammaln`` is
  ``log|Gamma|``). For ``i > alpha`` the true generalised coefficients alternate in
  sign, so the complete series is a valid *upper bound* on ``A_alpha``.
* The sum stops only past ``alpha``, at the first index whose two terms are below
  ``exp(-30)``, and adds a proven bound of the tail it drops
  (:func:`_log_tail_bound`) and of its own rounding.
* The series can be loose (for large ``z`` and ``q`` near 1/2 it exceeds even the
  unsampled value ``alpha / (2 z^2)``). Every fractional order is therefore also
  bounded by the chord between the integer orders around it (``log A_alpha`` is
  convex in ``alpha``, :func:`_log_a_interpolated`), and the smaller bound is used.
  So fractional-order values may be below dp_accounting's (tighter, still upper
  bounds) and are above them by at most the tail dp_accounting dropped.

At integer orders we evaluate the same binomial sum in a more stable form,
``A_alpha - 1 = sum_{i>=2} C(alpha, i) q^i (1-q)^(alpha-i) expm1((i^2 - i) / (2 z^2))``.
Every term is non-negative, so ``log(A_alpha)`` keeps full relative accuracy
even when it is around 1e-20. dp_accounting's log-space sum cancels at tiny RDP:
with high-precision arithmetic as the reference, its relative error reaches
1e-5 at ``z = 100, q = 1e-6``. Ours is then raised by a bound of its own rounding,
which the log-factorials dominate at large orders: log C(alpha, i) is a difference of
numbers near log(alpha!), and without the raise the sum is up to 3e-13 below the exact
curve at alpha = 512 and 1.5e-12 at 4096. Raised, it is at or above exact and within ~1e-10 of
it at 4096 (up to ~2e-11 at 1024, ~1e-13 at small orders, on the default grid).

Extreme inputs
--------------
The function never returns NaN and never returns less than the RDP it bounds. A
value that overflows, or whose terms turn into NaN, is returned as ``+inf``. A
fractional series that has not met its stopping rule after ``2**21`` terms is
replaced by the chord bound alone; an order above ``2**21`` gets ``alpha / (2 z^2)``
(subsampling never increases RDP). dp_accounting would take minutes on inputs like
these.

Why no scipy at runtime
-----------------------
The accounting layer is pure ``math`` + numpy. The budget gate can then import
and evaluate it anywhere: scheduler, workers, a DAG-parse hook, a slim
container. Import costs microseconds, with no heavy scipy import and no compiled
special-function dependency. scipy's ``gammaln`` is replaced by
``math.lgamma`` (log-factorial table) and by a running product of
``|alpha - k| / (k + 1)``. ``log_ndtr`` is replaced by ``math.erfc`` in the range
where it is accurate, plus the asymptotic series for ``erfc`` in the far tail
(see ``special.log_erfc``). scipy and dp_accounting are test-only dependencies: they
serve as the oracle in ``tests/accounting/test_subsampled_gaussian.py``.
"""

from __future__ import annotations

import functools
import math

import numpy as np

from dp_budget_provider.accounting import validation as check
from dp_budget_provider.accounting.rounding import SMALLEST_NORMAL, not_vanishing
from dp_budget_provider.accounting.special import log_erfc

__all__ = ["poisson_subsampled_gaussian_rdp"]

_LOG_2 = math.log(2.0)
_LOG_HALF = math.log(0.5)
_SQRT_2 = math.sqrt(2.0)

# dp_accounting's stopping rule for the fractional series: stop after the first index at
# which both new terms are below exp(-30).
_LOG_TERM_CUTOFF = -30.0
# Longest series we evaluate, per order, before using the fallback bound.
_MAX_SERIES_TERMS = 1 << 21
# Series terms are evaluated in blocks (orders x terms): the first block has
# _FIRST_CHUNK terms per order, later ones grow 4x up to _MAX_CHUNK, and a block
# holds at most about _BLOCK_ELEMENTS elements.
_FIRST_CHUNK = 32
_MAX_CHUNK = 1 << 16
_BLOCK_ELEMENTS = 1 << 18
_UNIT_ROUNDOFF = 2.0**-53
# Rounding-error allowance of the fractional series, in units of the unit roundoff per
# unit of magnitude of a term's log (generous: each part is a handful of operations).
_ROUNDING_ULPS = 16.0
# Relative rounding error of summing one block of terms and merging it into the running
# sum, in units of the unit roundoff: an exp per term, numpy's pairwise sum over < 2^18
# terms (log2 + a few), the merge's handful of operations; with a margin.
_SUM_ULPS = 32.0


# --------------------------------------------------------------------------- validation


def _check_orders(orders: object) -> np.ndarray:
    try:
        raw = np.asarray(orders)
    except (TypeError, ValueError) as exc:  # e.g. ragged nested sequences
        raise ValueError(f"orders must be an array of real numbers > 1, got {orders!r}") from exc
    if raw.dtype.kind not in "iuf":
        raise ValueError(
            f"orders must be an array of real numbers > 1, got dtype {raw.dtype} ({orders!r})"
        )
    alphas = raw.astype(np.float64)
    bad = ~(np.isfinite(alphas) & (alphas > 1.0))
    if bad.any():
        index = int(np.flatnonzero(bad.ravel())[0])
        raise ValueError(
            f"orders must all be finite and > 1, got {alphas.ravel()[index]!r} "
            f"at flat index {index}"
        )
    return alphas


# ------------------------------------------------------------------ numerical helpers


_log_factorial_table: np.ndarray = np.zeros(1)


def _log_factorials(n: int) -> np.ndarray:
    """Array of log(k!) for k = 0..n (at least), computed with math.lgamma and cached."""
    global _log_factorial_table
    table = _log_factorial_table
    if table.size <= n:
        size = max(n + 1, 2 * table.size, 1025)
        table = np.array([math.lgamma(k + 1.0) for k in range(size)])
        _log_factorial_table = table
    return table


def _log_expm1(y: np.ndarray) -> np.ndarray:
    """log(exp(y) - 1) for y >= 0, without overflow for large y."""
    small = np.log(np.expm1(np.minimum(y, _LOG_2)))
    large = y + np.log1p(-np.exp(-np.maximum(y, _LOG_2)))
    return np.where(y > _LOG_2, large, small)


class _LogSumAccumulator:
    """Streaming log-sum-exp over the rows of a sequence of blocks.

    Each row's running sum is stored as exp(top) * (1 + rest), where ``top`` is the
    largest log-term seen so far. ``log()`` returns ``top + log1p(rest)``. A sum
    dominated by one term near 1 plus tiny corrections therefore keeps the
    corrections to full relative precision; that is what makes log(A_alpha) ~ 1e-20
    accurate. Entries of -inf are empty. NaN or +inf in a row make its result NaN or
    +inf.
    """

    def __init__(self, n_rows: int) -> None:
        self.top = np.full(n_rows, -np.inf)
        self.rest = np.zeros(n_rows)

    def add(self, rows: np.ndarray, block: np.ndarray) -> None:
        """Add ``block[r]`` (a 1-D run of log-terms) to the sum of row ``rows[r]``."""
        pos = np.argmax(block, axis=1)  # the first NaN, if any, else the maximum
        idx = np.arange(block.shape[0])
        new_top = block[idx, pos]
        finite = np.isfinite(new_top)
        weights = np.exp(block - np.where(finite, new_top, 0.0)[:, None])
        weights[idx, pos] = 0.0
        new_rest = np.where(finite, weights.sum(axis=1), 0.0)

        top, rest = self.top[rows], self.rest[rows]
        poisoned = np.isnan(new_top) | (new_top == np.inf)
        up = finite & (new_top > top)
        down = finite & ~up
        rest = np.where(up, np.exp(top - new_top) * (1.0 + rest) + new_rest, rest)
        rest = np.where(down, rest + np.exp(new_top - top) * (1.0 + new_rest), rest)
        top = np.where(up | poisoned, new_top, top)
        self.top[rows], self.rest[rows] = top, rest

    def log(self) -> np.ndarray:
        return self.top + np.log1p(self.rest)


def _chunk_length(start: int, n_rows: int, previous: int) -> int:
    """Terms per row in the next block: grow geometrically, bounded in total elements."""
    if start == 0 or previous == 0:
        return _FIRST_CHUNK
    return max(_FIRST_CHUNK, min(4 * previous, _MAX_CHUNK, _BLOCK_ELEMENTS // n_rows))


# ---------------------------------------------------------------------------- series


def _log_a_int(q: float, sigma: float, alphas: np.ndarray) -> np.ndarray:
    """Upper bound of log(A_alpha) for integer orders 2 <= alpha <= _MAX_SERIES_TERMS, 0 < q < 1.

    Computed as log1p(A_alpha - 1). Summing the binomial terms gives
    A_alpha - 1 = sum_{i>=2} C(alpha, i) q^i (1-q)^(alpha-i) expm1((i^2-i) / (2 sigma^2)),
    because the binomial weights add up to 1 and the i = 0, 1 terms vanish. Every
    term is positive. Each term's log is raised by what its parts may lose (as in
    :func:`_log_a_frac`): the log-factorials (``math.lgamma``, within 3.2 ulps of mpmath's
    log-gamma at every k <= 3000 and at 3000 sampled k <= 2^21) cancel in log C(alpha, i)
    to an absolute error of ulps of log(alpha!) (the sum would be 3e-13 below the exact
    curve at alpha = 512, 1.5e-12 at 4096). The sum is raised by the error of its block
    sums.
    """
    orders = alphas.astype(np.int64)
    log_q = math.log(q)
    log_1mq = math.log1p(-q)
    two_var = 2 * (sigma * sigma)  # inf (not OverflowError) for absurdly large sigma
    log_two_var = math.log(2.0) + 2.0 * math.log(sigma)
    log_fact = _log_factorials(int(orders.max()))
    ulps = _ROUNDING_ULPS * _UNIT_ROUNDOFF
    acc = _LogSumAccumulator(orders.size)
    blocks = np.zeros(orders.size)  # blocks added, per row
    start, length = 2, 0
    pending = np.flatnonzero(orders >= start)
    while pending.size:
        a = orders[pending][:, None]
        length = _chunk_length(start - 2, pending.size, length)
        stop = min(start + length, int(a.max()) + 1)
        idx = np.arange(start, stop)[None, :]
        i = idx.astype(np.float64)
        beyond = idx > a
        fact_a, fact_i = log_fact[a], log_fact[idx]
        fact_rest = log_fact[np.where(beyond, 0, a - idx)]
        growth = (i * i - i) / two_var
        # Where growth underflows (to 0 once 2 sigma^2 overflows, z above ~1.3e154) its
        # log is log(i^2 - i) - log(2 sigma^2), exact to far below the raise: expm1(g) = g.
        log_growth = np.where(
            growth < SMALLEST_NORMAL, np.log(i * i - i) - log_two_var, _log_expm1(growth)
        )
        from_q, from_1mq = i * log_q, (a - i) * log_1mq  # both <= 0
        terms = fact_a - fact_i - fact_rest + from_q + from_1mq + log_growth
        parts = fact_a + fact_i + fact_rest - from_q - from_1mq + np.abs(log_growth) + growth
        raised = terms + ulps * (parts + 1.0)
        acc.add(pending, np.where(beyond, -np.inf, raised))
        blocks[pending] += 1
        start = stop
        pending = pending[orders[pending] >= start]
    return np.logaddexp(0.0, acc.log() + _SUM_ULPS * _UNIT_ROUNDOFF * (blocks + 1.0))


def _log_erfc_slope_bound(x: np.ndarray) -> np.ndarray:
    """An upper bound of |d log erfc(x) / dx| = 2 e^{-x^2} / (sqrt(pi) erfc(x)).

    For x <= 0, erfc(x) >= 1 gives 2 e^{-x^2} / sqrt(pi) < 1.2 e^{-x^2}; for x > 0 the
    Mills-ratio bound e^{-x^2} / erfc(x) <= sqrt(pi) (x + 1) gives 2 x + 2.
    """
    with np.errstate(under="ignore"):
        return np.where(x > 0.0, 2.0 * x + 2.0, 1.2 * np.exp(-x * x))


def _log_tail_bound(
    log_s0: np.ndarray, log_s1: np.ndarray, k: np.ndarray, alphas: np.ndarray
) -> np.ndarray:
    """log of an upper bound on every term of both series after index ``k`` (``k > alpha``).

    Because erfc(x) e^{x^2} decreases, each series' term ratio is at most
    |alpha - i| / (i + 1) (the Gaussian and erfc factors cancel exactly in the bound), so
    the terms after k sum to at most term_k (k - alpha) / alpha (Gauss's 2F1(.., 1; ..; 1)).
    The factor 2 covers the rounding of the computed term_k. Without this tail the series
    would be a lower, not an upper, estimate of A_alpha.
    """
    return np.logaddexp(log_s0, log_s1) + np.log(2.0 * (k - alphas) / alphas)


def _log_a_frac(q: float, sigma: float, alphas: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """log(A_alpha) for fractional orders alpha > 1 and 0 < q < 1.

    Uses the two-sided series of Mironov et al. with |binomial coefficients|, the
    same terms as dp_accounting's ``_compute_log_a_frac``, but an upper bound of the
    whole series rather than a truncation of it: the sum stops only past alpha, adds a
    bound on the dropped tail (:func:`_log_tail_bound`) and bounds on its own rounding:
    each term's log is raised by the error of its parts (each a few ulps of its
    magnitude; the running sum of log-coefficients one ulp of a partial sum per step),
    and the sum by the error of the block sums. Terms are evaluated in vectorised
    blocks, with orders as rows. Returns ``(log_a, converged)``. Where the stopping rule
    was not met within ``_MAX_SERIES_TERMS`` terms, ``converged`` is False and
    ``log_a`` is meaningless.
    """
    log_q = math.log(q)
    log_1mq = math.log1p(-q)
    # z0 = sigma^2 log(1/q - 1) + 1/2. Written so that it cannot overflow into NaN
    # (inf * 0 at q = 1/2) and log(1/q - 1) does not cancel near q = 1.
    z0 = sigma * (sigma * (log_1mq - log_q)) + 0.5
    scale = _SQRT_2 * sigma
    two_var = 2 * (sigma * sigma)
    n = alphas.size
    acc = _LogSumAccumulator(n)
    log_coef_start = np.zeros(n)  # log|C(alpha, start)|
    converged = np.zeros(n, dtype=bool)
    coef_abs_start = np.zeros(n)  # sum of |log|C(alpha, k)|| for k < start
    blocks = np.zeros(n)  # blocks added, per row
    pending = np.arange(n)
    start, length = 0, 0
    while pending.size and start < _MAX_SERIES_TERMS:
        length = min(_chunk_length(start, pending.size, length), _MAX_SERIES_TERMS - start)
        i = np.arange(start, start + length, dtype=np.float64)
        a = alphas[pending][:, None]
        j = a - i
        # log|C(alpha, k+1)| - log|C(alpha, k)| = log(|alpha - k| / (k + 1)); never -inf here.
        steps = np.log(np.abs(j) / (i + 1.0))
        log_coef = np.empty_like(steps)
        log_coef[:, 0] = log_coef_start[pending]
        log_coef[:, 1:] = log_coef_start[pending][:, None] + np.cumsum(steps[:, :-1], axis=1)
        log_coef_start[pending] = log_coef[:, -1] + steps[:, -1]
        # The cumulative sum rounds once per step, each time to an ulp of its partial sum.
        coef_error = coef_abs_start[pending][:, None] + np.cumsum(np.abs(log_coef), axis=1)
        coef_abs_start[pending] = coef_error[:, -1]

        x0, x1 = (i - z0) / scale, (z0 - j) / scale
        log_e0 = _LOG_HALF + log_erfc(x0)
        log_e1 = _LOG_HALF + log_erfc(x1)
        log_s0 = log_coef + i * log_q + j * log_1mq + (i * i - i) / two_var + log_e0
        log_s1 = log_coef + j * log_q + i * log_1mq + (j * j - j) / two_var + log_e1
        # What each log-term's parts may lose, in units of the unit roundoff: an ulp or so
        # of each part's magnitude, and the rounding of erfc's argument times the slope of
        # log erfc there.
        spread = (np.abs(i) + np.abs(j) + 3.0 * abs(z0) + 1.0) / scale
        parts0 = (
            np.abs(i * log_q)
            + np.abs(j * log_1mq)
            + (i * i + i) / two_var
            + np.abs(log_e0)
            + _log_erfc_slope_bound(x0) * (spread + np.abs(x0))
        )
        parts1 = (
            np.abs(j * log_q)
            + np.abs(i * log_1mq)
            + (j * j + np.abs(j)) / two_var
            + np.abs(log_e1)
            + _log_erfc_slope_bound(x1) * (spread + np.abs(x1))
        )

        # dp_accounting stops at the first index whose terms are both below the cutoff, which
        # at large orders can be index 0 ((1-q)^alpha is tiny): we only stop past alpha, where
        # the tail bound below holds. NaN never counts as small.
        small = (np.maximum(log_s0, log_s1) < _LOG_TERM_CUTOFF) & (i[None, :] > a)
        done = small.any(axis=1)
        last = np.argmax(small, axis=1)  # the last term added, in rows that are done
        limit = np.where(done, last + 1, length)
        beyond = np.arange(length)[None, :] >= limit[:, None]
        rows = np.arange(pending.size)
        tail = np.where(
            done, _log_tail_bound(log_s0[rows, last], log_s1[rows, last], i[last], a[:, 0]), -np.inf
        )
        # Each term is summed as its upper bound: its log plus that log's rounding error.
        ulps = _ROUNDING_ULPS * _UNIT_ROUNDOFF
        block = np.concatenate(
            (
                np.where(beyond, -np.inf, log_s0 + ulps * (parts0 + coef_error)),
                np.where(beyond, -np.inf, log_s1 + ulps * (parts1 + coef_error)),
                tail[:, None],
            ),
            axis=1,
        )
        acc.add(pending, block)
        blocks[pending] += 1
        # A row whose sum is already NaN or +inf (only for absurd sigma) cannot recover; it
        # stops here and is reported as +inf.
        done |= ~np.isfinite(acc.top[pending])
        converged[pending[done]] = True
        pending = pending[~done]
        start += length
    # Summing a block (pairwise in numpy) and merging it loses at most _SUM_ULPS ulps.
    return acc.log() + _SUM_ULPS * _UNIT_ROUNDOFF * (blocks + 1.0), converged


def _log_a_interpolated(q: float, sigma: float, alphas: np.ndarray) -> np.ndarray:
    """Upper bound of log(A_alpha) at fractional orders 1 < alpha < _MAX_SERIES_TERMS.

    log A_alpha is a cumulant generating function in alpha, hence convex, and
    log A_1 = 0: it lies below the chord between the integer orders around alpha, which
    the finite binomial sum evaluates accurately. Tighter than the series where the
    series is loose (large z, q near 1/2) and where its rounding bound dominates (tiny
    RDP); never below the exact value.
    """
    below = np.floor(alphas)
    weight = alphas - below
    integers = np.unique(np.concatenate((below[below >= 2.0], below + 1.0)))
    log_a = dict(zip(integers.tolist(), _log_a_int(q, sigma, integers).tolist(), strict=True))
    log_a[1.0] = 0.0
    low = np.array([log_a[b] for b in below.tolist()])
    high = np.array([log_a[b + 1.0] for b in below.tolist()])
    return (1.0 - weight) * low + weight * high


def _gaussian_rdp(sigma: float, alphas: np.ndarray) -> np.ndarray:
    """RDP of the unsampled Gaussian mechanism, alpha / (2 sigma^2); an upper bound for any q.

    Uses the same expression as dp_accounting, so the result is bit-identical to it.
    For sigma > ~1e154, ``sigma**2`` raises OverflowError; there alpha / (2 sigma) / sigma
    (still a normal number up to sigma ~1e156 at alpha = 1024) is used.
    """
    try:
        return alphas / (2 * sigma**2)
    except OverflowError:
        return alphas / (2 * sigma) / sigma


def _subsampled_rdp(q: float, sigma: float, alphas: np.ndarray) -> np.ndarray:
    """RDP at distinct orders alpha > 1 for 0 < q < 1; may contain NaN (the caller maps it)."""
    log_a = np.full(alphas.size, np.nan)
    is_int = alphas == np.floor(alphas)
    ints = np.flatnonzero(is_int & (alphas <= _MAX_SERIES_TERMS))
    if ints.size:
        log_a[ints] = _log_a_int(q, sigma, alphas[ints])
    fracs = np.flatnonzero(~is_int & (alphas < _MAX_SERIES_TERMS))
    if fracs.size:
        log_a_frac, converged = _log_a_frac(q, sigma, alphas[fracs])
        chord = _log_a_interpolated(q, sigma, alphas[fracs])
        log_a[fracs] = np.where(converged, np.fmin(log_a_frac, chord), chord)
    # A_alpha >= 1, so log(A_alpha) >= 0. Clamp the last ulp of rounding noise, and raise
    # a log(A_alpha) that vanished before a fractional order's a - 1 < 1 scales its error.
    rdp = not_vanishing(np.maximum(log_a, 0.0)) / (alphas - 1.0)  # np.maximum propagates NaN
    # Beyond the longest sum we evaluate: subsampling never increases RDP.
    beyond = np.flatnonzero(alphas > _MAX_SERIES_TERMS)
    rdp[beyond] = _gaussian_rdp(sigma, alphas[beyond])
    return rdp


@functools.lru_cache(maxsize=512)
def _rdp_curve(sigma: float, q: float, orders: tuple[float, ...]) -> np.ndarray:
    alphas = np.array(orders, dtype=np.float64)
    with np.errstate(all="ignore"):
        if q == 1.0:
            curve = _gaussian_rdp(sigma, alphas)
        else:
            distinct, inverse = np.unique(alphas, return_inverse=True)
            curve = _subsampled_rdp(q, sigma, distinct)[inverse]
    curve[np.isnan(curve)] = np.inf
    not_vanishing(curve)  # q > 0 and z finite: it leaks, so no order's loss may read 0
    curve.setflags(write=False)
    return curve


def poisson_subsampled_gaussian_rdp(
    noise_multiplier: float, sampling_rate: float, orders: np.ndarray
) -> np.ndarray:
    """RDP curve of the Poisson-subsampled Gaussian mechanism at the given orders.

    Args:
        noise_multiplier: ``z``, the noise standard deviation divided by the L2
            sensitivity. Must be a finite real number > 0.
        sampling_rate: ``q``, the Poisson inclusion probability of each record.
            Must be a finite real number in (0, 1].
        orders: Rényi orders; each must be finite and > 1. Any array-like of
            real numbers is accepted.

    Returns:
        A new float64 array with the same shape as ``orders``, holding RDP(alpha)
        for each order. At ``sampling_rate == 1`` this is exactly
        ``alpha / (2 z^2)``. Values are non-negative and never NaN. They are
        ``+inf`` only where the true value overflows a double (``z`` below about
        1e-154), plus, as a conservative answer, at fractional orders when
        ``sqrt(2) z`` overflows (``z`` above about 1.2e308).

    Raises:
        ValueError: if a parameter is out of range or of the wrong type. The
            message names the parameter.
    """
    sigma = check.positive("noise_multiplier", noise_multiplier)
    q = check.half_open_unit("sampling_rate", sampling_rate)
    alphas = _check_orders(orders)
    curve = _rdp_curve(sigma, q, tuple(alphas.ravel().tolist()))
    return curve.reshape(alphas.shape).copy()
