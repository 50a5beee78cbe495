"""High-precision (mpmath, 60 digits) values of the curves the accounting layer bounds.

Test-only: the exact quantities, computed independently of the product's formulas, that
every curve and every epsilon must be at or above.
"""

from __future__ import annotations

import math

import mpmath as mp

DIGITS = 60


def gaussian_delta(epsilon: float, mu: float) -> mp.mpf:
    """Balle-Wang: Phi(-eps/mu + mu/2) - e^eps Phi(-eps/mu - mu/2)."""
    with mp.workdps(DIGITS):
        e, m = mp.mpf(epsilon), mp.mpf(mu)
        return mp.ncdf(-e / m + m / 2) - mp.exp(e) * mp.ncdf(-e / m - m / 2)


def randomised_response_rdp(order: float, epsilon0: float) -> mp.mpf:
    """Rényi divergence of binary randomised response, from its two-point definition.

    Its sum is 1 + ~eps0^2, so the digits that excess lies below are added to the working
    precision (down to eps0 = 5e-324).
    """
    a, e = mp.mpf(order), mp.mpf(epsilon0)
    lost = max(0, int(-2 * mp.log10(e))) if e < 1 else 0
    with mp.workdps(DIGITS + lost):
        p, not_p = 1 / (1 + mp.exp(-e)), 1 / (1 + mp.exp(e))  # not_p stays exact at e = 1e3
        return mp.log(p**a * not_p ** (1 - a) + not_p**a * p ** (1 - a)) / (a - 1)


def laplace_rdp(order: float, epsilon0: float) -> mp.mpf:
    """Mironov 2017, Prop. 6, in exact arithmetic.

    Its inner sum is 1 + ~a (a-1) eps0^2 / 2, so the log loses about as many digits as
    that excess is small: they are added to the working precision (60 digits remain).
    """
    a, e = mp.mpf(order), mp.mpf(epsilon0)
    excess = a * (a - 1) * e * e / 2
    lost = max(0, int(-mp.log10(excess))) if excess < 1 else 0
    with mp.workdps(DIGITS + lost):
        inner = a / (2 * a - 1) * mp.exp((a - 1) * e) + (a - 1) / (2 * a - 1) * mp.exp(-a * e)
        return mp.log(inner) / (a - 1)


def subsampled_gaussian_rdp(z: float, q: float, order: float) -> mp.mpf:
    """log E_{x~N(0,z^2)}[((1-q) + q e^{(2x-1)/(2z^2)})^alpha] / (alpha - 1) by quadrature.

    The integrand is split at its mode (found numerically) and a few scales around it,
    where mpmath's tanh-sinh quadrature converges to the working precision.
    """
    with mp.workdps(DIGITS):
        z, q, a = mp.mpf(z), mp.mpf(q), mp.mpf(order)

        def log_integrand(x: mp.mpf) -> mp.mpf:
            ratio = mp.exp((2 * x - 1) / (2 * z * z))
            return a * mp.log((1 - q) + q * ratio) - x * x / (2 * z * z)

        # The log-integrand is concave: bisect its derivative for the mode.
        lo, hi = mp.mpf(-10) * z, (a + 10) * z * z + 10 * z
        for _ in range(200):
            mid = (lo + hi) / 2
            if mp.diff(log_integrand, mid) > 0:
                lo = mid
            else:
                hi = mid
        mode, width = lo, z / mp.sqrt(1 + a * q)
        points = [mode + k * width for k in (-40, -10, -3, 0, 3, 10, 40)]
        integral = mp.quad(
            lambda x: mp.exp(log_integrand(x) - log_integrand(mode)), [-mp.inf, *points, mp.inf]
        )
        return (mp.log(integral) + log_integrand(mode) - mp.log(mp.sqrt(2 * mp.pi) * z)) / (a - 1)


def subsampled_gaussian_rdp_binomial(z: float, q: float, order: int) -> mp.mpf:
    """The same curve at an integer order, as its finite binomial sum (Mironov-Talwar-Zhang
    2019, Sec. 3.2): sum_i C(a, i) q^i (1-q)^(a-i) e^{(i^2-i)/(2z^2)}, in exact terms."""
    with mp.workdps(DIGITS):
        z, q = mp.mpf(z), mp.mpf(q)
        excess = mp.fsum(
            mp.binomial(order, i)
            * q**i
            * (1 - q) ** (order - i)
            * mp.expm1((i * i - i) / (2 * z * z))
            for i in range(2, order + 1)
        )
        return mp.log1p(excess) / (order - 1)


def mp_discrete_std(weight, parameter: float) -> float:
    """sqrt(sum y^2 w(y) / sum w(y)) over the integers, to 60 digits: every term out to
    100 times the parameter (the rest is below exp(-100) of the mass)."""
    with mp.workdps(60):
        terms = [(y, weight(mp.mpf(y))) for y in range(math.ceil(100 * parameter) + 2)]
        mass = 2 * mp.fsum(w for _y, w in terms) - terms[0][1]
        second = 2 * mp.fsum(y * y * w for y, w in terms)
        return float(mp.sqrt(second / mass))
