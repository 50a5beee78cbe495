"""From a Rényi-DP curve to an (epsilon, delta) statement, and the closed forms around it.

Two sound conversions are offered:

* ``"classic"`` (Mironov 2017, Prop. 3): eps = RDP(a) + log(1/delta) / (a - 1).
* ``"improved"`` (Canonne-Kamath-Steinke 2020, Prop. 12; Asoodeh et al. 2020), the
  one Google dp_accounting, Opacus and OpenDP use:
  eps = RDP(a) + log1p(-1/a) - (log(delta) + log(a)) / (a - 1).

The improved formula is evaluated exactly as dp_accounting evaluates it (including
its KL-divergence shortcut and its a > 1.01 stability floor) so that our numbers
equal the oracle's on the same grid.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Literal, NamedTuple

import numpy as np

from dp_budget_provider.accounting import validation as check

Conversion = Literal["improved", "classic"]
CONVERSIONS: tuple[Conversion, ...] = ("improved", "classic")


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
    """:func:`_terms` of a fixed grid (a ledger's, an accountant's), computed once: a
    conversion is then a few array operations, and the ledger makes two per release.
    The cached arrays are read-only: every conversion shares them."""
    terms = _terms(np.frombuffer(orders, dtype=np.float64), delta, conversion)
    for array in (terms.first, terms.second, terms.unusable):
        array.flags.writeable = False
    return terms


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
    """Smallest epsilon over the grid and the order achieving it.

    An all-zero curve (nothing released) is exactly eps = 0 with no order, not the
    positive residual log(1/delta)/(a-1) the classic formula would leave.
    """
    delta = check.open_unit("delta", delta)
    conversion = check_conversion(conversion)
    rdp = np.asarray(rdp, dtype=np.float64)
    if not (rdp >= 0.0).all():  # NaN compares false
        raise ValueError("RDP curve contains NaN or negative values; refusing to convert it")
    if not rdp.any():
        return 0.0, None
    grid = np.ascontiguousarray(orders, dtype=np.float64)
    per_order = _epsilon_per_order(rdp, delta, _grid_terms(grid.tobytes(), delta, conversion))
    best = int(np.argmin(per_order))
    return max(0.0, float(per_order[best])), float(grid[best])


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
    return check.non_negative("epsilon", epsilon) * check.positive_int("count", count)


def advanced_composition(epsilon: float, delta_prime: float, count: int) -> float:
    """Dwork-Rothblum-Vadhan 2010 advanced composition of k (eps, delta) releases.

    eps' = sqrt(2 k log(1/delta')) eps + k eps (e^eps - 1), at total delta k delta + delta'.
    """
    epsilon = check.non_negative("epsilon", epsilon)
    delta_prime = check.open_unit("delta_prime", delta_prime)
    count = check.positive_int("count", count)
    return math.sqrt(2.0 * count * math.log(1.0 / delta_prime)) * epsilon + count * epsilon * (
        math.expm1(epsilon)
    )
