"""The Rényi-DP accountant: composition is addition, conversion happens once at read time.

The accumulated curve is kept in two parts. Gaussian, zCDP and pure-DP releases have
curves exactly linear in the order (rho * alpha), so they add up to one number, rho;
everything else (Laplace, subsampled Gaussian) adds to a residual curve on the grid.
The ledger persists the same three values, which lets a release over ten thousand
subjects update ten thousand scalars instead of ten thousand curves.

While every release is Gaussian, the accountant also keeps mu^2 = sum(count / z^2):
the composition is then exactly one Gaussian with that mu (Dong-Roth-Su), and the
default report is the exact analytical eps when it is smaller than the RDP bound. It is
never below the true loss.

Every sum is rounded up as it is made (``accounting.rounding``), so rho, the residual
and mu^2 are never below the exact sums of the releases' float costs, whether ten or ten
million releases were composed, at once or one by one.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from dp_budget_provider.accounting import validation as check
from dp_budget_provider.accounting.analytic_gaussian import gaussian_epsilon
from dp_budget_provider.accounting.conversion import (
    CURVE_ROUNDING,
    Conversion,
    check_conversion,
    rdp_to_epsilon,
)
from dp_budget_provider.accounting.mechanisms import GaussianMechanism, Mechanism
from dp_budget_provider.accounting.orders import DEFAULT_ORDERS, validate_orders
from dp_budget_provider.accounting.rounding import dot_up, sum_up


@dataclass(frozen=True)
class EpsilonBound:
    """An epsilon together with where it came from, for privacy reports.

    ``method`` is ``"none"`` (nothing released), ``"rdp-improved"``, ``"rdp-classic"``
    or ``"analytic-gaussian"``; ``order`` is the minimising Rényi order for the RDP
    methods and None otherwise.
    """

    epsilon: float
    order: float | None
    method: str


@dataclass(frozen=True)
class AccountantState:
    """Everything an accountant knows, as plain values: what the ledger persists.

    The curve is ``rho * orders + residual``. ``gaussian_mu_squared`` is
    sum(count / z^2) while every release was Gaussian, None once anything else was.
    """

    orders: tuple[float, ...]
    rho: float
    residual: tuple[float, ...]
    gaussian_mu_squared: float | None


def epsilon_bound(
    orders: np.ndarray,
    curve: np.ndarray,
    gaussian_mu_squared: float | None,
    delta: float,
    conversion: Conversion = "improved",
) -> EpsilonBound:
    """The tightest sound epsilon of a curve at ``delta``, and how it was obtained.

    ``"improved"`` also considers the exact analytical Gaussian bound when the curve
    comes from Gaussian releases only (``gaussian_mu_squared`` not None) and reports the
    smaller; ``"classic"`` is Mironov's conversion alone. Both are rounded outward.
    """
    delta = check.open_unit("delta", delta)
    conversion = check_conversion(conversion)
    epsilon, order = rdp_to_epsilon(orders, curve, delta, conversion)
    if gaussian_mu_squared is not None:
        mu_squared = _gaussian_mu_squared_of(orders, curve, gaussian_mu_squared)
    if order is None:
        return EpsilonBound(0.0, None, "none")
    if conversion == "improved" and gaussian_mu_squared and math.isfinite(mu_squared):
        exact = _exact_gaussian_epsilon(_mu_rounded_up(mu_squared), delta)
        if exact < epsilon:
            return EpsilonBound(exact, None, "analytic-gaussian")
    return EpsilonBound(epsilon, order, f"rdp-{conversion}")


def _gaussian_mu_squared_of(orders: np.ndarray, curve: np.ndarray, mu_squared: object) -> float:
    """The mu^2 of a Gaussian-only curve: the caller's, checked against the curve.

    A Gaussian composition's curve is exactly alpha mu^2 / 2, so a mu^2 that does not
    describe the curve (beyond the rounding of sums kept apart) is refused: it would turn
    the exact Gaussian bound into an arbitrary number. The larger of the two descriptions
    is used, so the rounding of either cannot lower the bound.
    """
    if mu_squared != math.inf:  # +inf: a noise multiplier whose 1/z^2 overflows
        mu_squared = check.non_negative("gaussian_mu_squared", mu_squared)
    grid = np.asarray(orders, dtype=np.float64)
    linear = grid * (mu_squared / 2.0)
    if not np.allclose(curve, linear, rtol=1e-6, atol=1e-12):
        raise ValueError(
            f"gaussian_mu_squared={mu_squared!r} does not describe the curve (a Gaussian-only "
            "curve is alpha * mu^2 / 2)"
        )
    with np.errstate(over="ignore", invalid="ignore"):
        from_curve = 2.0 * float(np.max(np.asarray(curve, dtype=np.float64) / grid))
    return max(mu_squared, from_curve)


def _exact_gaussian_epsilon(mu: float, delta: float) -> float:
    """The exact Gaussian eps, or +inf where it cannot be certified in doubles (mu beyond
    ~1e9, eps beyond ~1e18): the RDP bound, always available, is then the report."""
    try:
        return gaussian_epsilon(mu, delta)
    except ValueError:  # mu and delta are valid: the search's eps left the doubles
        return math.inf


def _mu_rounded_up(mu_squared: float) -> float:
    """sqrt(mu^2) raised by the error its terms may carry, and rounded up.

    The sum itself is rounded up as it is made (``compose_many``); each of its terms,
    count / z^2, rounds twice, a relative error that ``CURVE_ROUNDING`` covers with room
    for the rounding of this product, and the square root is rounded up.
    """
    return math.nextafter(math.sqrt(mu_squared * (1.0 + CURVE_ROUNDING)), math.inf)


Release = Mechanism | tuple[Mechanism, int]


class RDPAccountant:
    """Accumulates the RDP curve of a sequence of releases on a fixed grid of orders."""

    def __init__(self, orders: Sequence[float] | np.ndarray = DEFAULT_ORDERS) -> None:
        self._orders = validate_orders(orders)
        self._rho = 0.0
        self._residual = np.zeros(self._orders.size, dtype=np.float64)
        self._gaussian_mu_squared: float | None = 0.0

    @property
    def orders(self) -> np.ndarray:
        """The (read-only) grid of orders."""
        return self._orders

    @property
    def rdp(self) -> np.ndarray:
        """The accumulated curve (a fresh array)."""
        return self._rho * self._orders + self._residual

    @property
    def gaussian_mu_squared(self) -> float | None:
        """sum(count / z^2) while only Gaussian releases were composed, else None."""
        return self._gaussian_mu_squared

    def compose(self, mechanism: Mechanism, count: int = 1) -> None:
        """Add ``count`` independent invocations of ``mechanism``."""
        self.compose_many([(mechanism, count)])

    def compose_many(self, releases: Iterable[Release]) -> None:
        """Add many releases at once, vectorised per mechanism class.

        Each item is a mechanism or a ``(mechanism, count)`` pair. Every item is
        validated before anything is added, so a bad item leaves the accountant as it was.
        Every sum is rounded up (``rounding.dot_up`` for the items, ``rounding.sum_up``
        onto what was held), so the curve and mu^2 held are never below the exact sums of
        the releases' float costs, however many releases are composed, at once or one by one.
        """
        linear_counts: list[int] = []
        linear_rhos: list[float] = []
        gaussian_only = self._gaussian_mu_squared is not None
        mu_squared_terms: list[float] = []
        nonlinear: dict[type[Mechanism], tuple[list[Mechanism], list[int]]] = defaultdict(
            lambda: ([], [])
        )
        for release in releases:
            mechanism, count = release if isinstance(release, tuple) else (release, 1)
            if not isinstance(mechanism, Mechanism):
                raise ValueError(f"mechanism must be a Mechanism, got {mechanism!r}")
            count = check.count("count", count)
            if not isinstance(mechanism, GaussianMechanism):
                gaussian_only = False
            elif gaussian_only:
                mu_squared_terms.append(mechanism.mu_squared(count))
            rho = mechanism.zcdp_rho
            if rho is not None:
                linear_counts.append(count)
                linear_rhos.append(rho)
            else:
                mechanisms, counts = nonlinear[type(mechanism)]
                mechanisms.append(mechanism)
                counts.append(count)
        total_rho = self._rho
        if linear_rhos:
            total_rho = sum_up(total_rho, float(dot_up(np.array(linear_counts), linear_rhos)))
        mu_squared = self._gaussian_mu_squared if gaussian_only else None
        if mu_squared is not None and mu_squared_terms:
            ones = np.ones(len(mu_squared_terms))
            mu_squared = sum_up(mu_squared, float(dot_up(ones, mu_squared_terms)))
        residual = self._residual
        for cls, (mechanisms, counts) in nonlinear.items():
            composed = cls.composed_rdp(mechanisms, np.array(counts), self._orders)
            residual = sum_up(residual, composed)
        if np.any(np.isnan(residual)) or np.any(residual < 0.0):
            raise ValueError("a mechanism produced a NaN or negative RDP curve")
        self._rho, self._residual, self._gaussian_mu_squared = total_rho, residual, mu_squared

    def epsilon_bound(self, delta: float, conversion: Conversion = "improved") -> EpsilonBound:
        """The tightest sound epsilon at ``delta`` and the method that produced it."""
        return epsilon_bound(self._orders, self.rdp, self._gaussian_mu_squared, delta, conversion)

    def get_epsilon(
        self, delta: float, conversion: Conversion = "improved"
    ) -> tuple[float, float | None]:
        """``(epsilon, best_order)``; best_order is None when no Rényi order was used."""
        bound = self.epsilon_bound(delta, conversion)
        return bound.epsilon, bound.order

    def state(self) -> AccountantState:
        """A plain-value snapshot for persistence."""
        return AccountantState(
            orders=tuple(float(a) for a in self._orders),
            rho=self._rho,
            residual=tuple(float(r) for r in self._residual),
            gaussian_mu_squared=self._gaussian_mu_squared,
        )

    @classmethod
    def from_state(cls, state: AccountantState) -> RDPAccountant:
        """Rebuild an accountant from :meth:`state`, refusing corrupt values (fail closed)."""
        accountant = cls(state.orders)
        residual = np.array(state.residual, dtype=np.float64)
        if residual.shape != accountant._orders.shape:
            raise ValueError(
                f"stored curve has {residual.size} values for {accountant._orders.size} orders"
            )
        if np.any(np.isnan(residual)) or np.any(residual < 0.0):
            raise ValueError("stored RDP curve contains NaN or negative values")
        accountant._rho = check.non_negative("rho", state.rho)
        accountant._residual = residual
        if state.gaussian_mu_squared is not None:
            accountant._gaussian_mu_squared = check.non_negative(
                "gaussian_mu_squared", state.gaussian_mu_squared
            )
        else:
            accountant._gaussian_mu_squared = None
        return accountant

    def copy(self) -> RDPAccountant:
        """An independent accountant with the same history."""
        return RDPAccountant.from_state(self.state())
