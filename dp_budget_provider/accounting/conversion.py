"""From a Rényi-DP curve to an (epsilon, delta) statement, and the closed forms around it.

Two sound conversions are offered:

* ``"classic"`` (Mironov 2017, Prop. 3): eps = RDP(a) + log(1/delta) / (a - 1).
* ``"improved"`` (Canonne-Kamath-Steinke 2020, Prop. 12; Asoodeh et al. 2020), the
  one Google dp_accounting, Opacus and OpenDP use:
  eps = RDP(a) + log1p(-1/a) - (log(delta) + log(a)) / (a - 1).

The improved formula is evaluated as dp_accounting evaluates it (including its
KL-divergence shortcut and its a > 1.01 stability floor), so that our numbers equal the
oracle's on the same grid up to the outward rounding below.

Outward rounding. A composed curve is a sum of the releases' float curves, and every
addition in it is rounded up (``accounting.rounding``: the accountant's composition and
the ledger's stored sums alike), so it is never below the exact sum of those float
curves, however many releases it holds. What remains is a relative error of each term,
which does not grow with their number: each mechanism's own evaluation of its curve
(a few ulps: the closed forms, and the last steps of the subsampled Gaussian, whose
series bound their own rounding), and the two roundings of reading the curve as
rho * a + residual. ``CURVE_ROUNDING`` (2^-42, 2.3e-13) is the allowance
for these: the conversion raises the curve by it, so the tests hold every mechanism's
float curve to within a quarter of it of the exact curve (mpmath, 60 digits). The
result is then raised by a bound of the conversion's own rounding (a few ulps of each
of its three terms). The eps returned is an upper bound of the exact conversion of the
exact curve; it exceeds the float evaluation by ~1e-13 relative, plus what the upward
sums added (about 4u per addition, 2u per term of a vectorised sum).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Literal, NamedTuple

import numpy as np

from dp_budget_provider.accounting import validation as check
from dp_budget_provider.accounting.orders import validate_orders

Conversion = Literal["improved", "classic"]
CONVERSIONS: tuple[Conversion, ...] = ("improved", "classic")
# Relative allowance for each term's own evaluation error (see the module docstring).
CURVE_ROUNDING = 2.0**-42
_UNIT_ROUNDOFF = 2.0**-53
_LOG_MAX_DOUBLE = math.log(2.0**1023)
# Ulps of each term the conversion itself may lose: log1p / log, a division, three sums.
_CONVERSION_ULPS = 8.0


def check_conversion(conversion: object) -> Conversion:
    """Refuse anything but the two supported conversion names."""
    if conversion not in CONVERSIONS:
        raise ValueError(f"conversion must be one of {CONVERSIONS}, got {conversion!r}")
    return conversion  # type: ignore[return-value]


class _Terms(NamedTuple):
    """The curve-independent parts of a conversion on a grid of orders:
    eps(a) = (RDP(a) + first) - second, +inf where ``unusable``."""

    first: np.ndarray
    second: np.ndarray
    unusable: np.ndarray
    tiny_curve_shortcut: bool


def _terms(orders: np.ndarray, delta: float, conversion: Conversion) -> _Terms:
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        if conversion == "classic":
            return _Terms(
                math.log(1.0 / delta) / (orders - 1.0),
                np.zeros(orders.shape),
                np.zeros(orders.shape, dtype=bool),
                tiny_curve_shortcut=False,
            )
        usable = orders > 1.01
        return _Terms(
            np.where(usable, np.log1p(-1.0 / orders), 0.0),
            np.where(usable, np.log(delta * orders) / (orders - 1.0), 0.0),
            ~usable,
            tiny_curve_shortcut=True,
        )


@functools.lru_cache(maxsize=32)
def _grid_terms(orders: bytes, delta: float, conversion: Conversion) -> _Terms:
    """:func:`_terms` of a fixed grid (a ledger's, an accountant's), validated and computed
    once: a conversion is then a few array operations, and the ledger makes two per
    release. The cached arrays are read-only: every conversion shares them."""
    terms = _terms(validate_orders(np.frombuffer(orders, dtype=np.float64)), delta, conversion)
    for array in (terms.first, terms.second, terms.unusable):
        array.flags.writeable = False
    return terms


def conversion_terms(
    orders: np.ndarray, delta: float, conversion: Conversion = "improved"
) -> np.ndarray:
    """``c(a)`` on a grid: what the conversion adds to a curve's value at each order
    (``+inf`` at orders it does not use), before any rounding or shortcut."""
    delta = check.open_unit("delta", delta)
    conversion = check_conversion(conversion)
    grid = np.ascontiguousarray(orders, dtype=np.float64)
    terms = _grid_terms(grid.tobytes(), delta, conversion)
    return np.where(terms.unusable, np.inf, terms.first - terms.second)


def conversion_term(order: float, delta: float, conversion: Conversion = "improved") -> float:
    """``c(a)`` at one order: a cap's Rényi budget at ``order`` is the cap less this."""
    return float(conversion_terms(np.array([order], dtype=np.float64), delta, conversion)[0])


def _epsilon_per_order(rdp: np.ndarray, delta: float, terms: _Terms) -> np.ndarray:
    per_order = rdp + terms.first
    per_order -= terms.second
    per_order[terms.unusable] = np.inf
    if terms.tiny_curve_shortcut:
        # Bretagnolle-Huber: TV <= sqrt(1 - exp(-KL)) and KL <= RDP(a), so a curve this
        # small already gives (0, delta)-DP.
        per_order[delta**2 + np.expm1(-rdp) > 0.0] = 0.0
    return per_order


def rdp_to_epsilon(
    orders: np.ndarray, rdp: np.ndarray, delta: float, conversion: Conversion = "improved"
) -> tuple[float, float | None]:
    """An upper bound of the smallest epsilon over the grid, and the order achieving it.

    ``orders`` must be a valid grid (finite, distinct, all > 1: an order of 0.5 or NaN
    would make a wrong number, not an error) and ``rdp`` a non-negative curve of the
    same length. An all-zero curve (nothing released) is exactly eps = 0 with no order,
    not the positive residual log(1/delta)/(a-1) the classic formula would leave. The
    result is rounded outward (module docstring).
    """
    delta = check.open_unit("delta", delta)
    conversion = check_conversion(conversion)
    try:
        grid = np.ascontiguousarray(orders, dtype=np.float64)
        rdp = np.asarray(rdp, dtype=np.float64)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"orders and rdp must be arrays of numbers: {exc}") from exc
    if rdp.shape != grid.shape:
        raise ValueError(f"rdp has shape {rdp.shape}, orders {grid.shape}: one value per order")
    if not (rdp >= 0.0).all():  # NaN compares false
        raise ValueError("rdp contains NaN or negative values; refusing to convert it")
    terms = _grid_terms(grid.tobytes(), delta, conversion)
    if not rdp.any():
        return 0.0, None
    raised = rdp * (1.0 + CURVE_ROUNDING)
    per_order = _epsilon_per_order(raised, delta, terms)
    best = int(np.argmin(per_order))
    epsilon = float(per_order[best])
    if epsilon > 0.0:
        magnitude = raised[best] + abs(terms.first[best]) + abs(terms.second[best])
        epsilon += _CONVERSION_ULPS * _UNIT_ROUNDOFF * float(magnitude)
    return max(0.0, epsilon), float(grid[best])


def continuous_optimal_epsilon(
    rdp_at: Callable[[float], float],
    delta: float,
    conversion: Conversion = "improved",
    *,
    min_order: float = 1.0 + 1e-6,
    max_order: float = 1e6,
) -> tuple[float, float]:
    """Minimise a conversion over *continuous* orders, numerically.

    ``rdp_at(alpha)`` evaluates the composed curve at any order. A dense log-spaced
    scan finds the basin, golden-section search refines it. This is the reference
    the discrete grid is checked against: the grid can never beat it.
    """
    delta = check.open_unit("delta", delta)
    conversion = check_conversion(conversion)

    def objective(log_excess: float) -> float:
        alpha = 1.0 + math.exp(log_excess)
        terms = _terms(np.array([alpha]), delta, conversion)
        value = _epsilon_per_order(np.array([rdp_at(alpha)]), delta, terms)
        return float(value[0])

    lo, hi = math.log(min_order - 1.0), math.log(max_order - 1.0)
    scan = np.linspace(lo, hi, 4001)
    values = [objective(x) for x in scan]
    best = int(np.argmin(values))
    left, right = scan[max(best - 1, 0)], scan[min(best + 1, scan.size - 1)]
    ratio = (math.sqrt(5.0) - 1.0) / 2.0
    c, d = right - ratio * (right - left), left + ratio * (right - left)
    fc, fd = objective(c), objective(d)
    for _ in range(200):
        if fc < fd:
            right, d, fd = d, c, fc
            c = right - ratio * (right - left)
            fc = objective(c)
        else:
            left, c, fc = c, d, fd
            d = left + ratio * (right - left)
            fd = objective(d)
    x = (left + right) / 2.0
    return max(0.0, objective(x)), 1.0 + math.exp(x)


def zcdp_to_dp(rho: float, delta: float) -> float:
    """Classic closed form for rho-zCDP: eps = rho + 2 sqrt(rho log(1/delta)) (Bun-Steinke 2016).

    This is the continuous optimum of the classic conversion for the curve rho * alpha.
    """
    rho = check.non_negative("rho", rho)
    delta = check.open_unit("delta", delta)
    return rho + 2.0 * math.sqrt(rho * math.log(1.0 / delta))


def basic_composition(epsilon: float, count: int) -> float:
    """k-fold basic composition of an (eps, delta) release: k * eps (with k * delta)."""
    return check.non_negative("epsilon", epsilon) * check.count("count", count)


def advanced_composition(epsilon: float, delta_prime: float, count: int) -> float:
    """Dwork-Rothblum-Vadhan 2010 advanced composition of k (eps, delta) releases.

    eps' = sqrt(2 k log(1/delta')) eps + k eps (e^eps - 1), at total delta k delta + delta'.
    """
    epsilon = check.non_negative("epsilon", epsilon)
    delta_prime = check.open_unit("delta_prime", delta_prime)
    count = check.count("count", count)
    growth = math.expm1(epsilon) if epsilon < _LOG_MAX_DOUBLE else math.inf  # not OverflowError
    return math.sqrt(2.0 * count * math.log(1.0 / delta_prime)) * epsilon + count * epsilon * growth
