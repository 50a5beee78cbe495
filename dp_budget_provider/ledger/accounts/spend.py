"""An amount of privacy spend as the ledger stores it: rho, a residual curve, Gaussian mu^2.

This is :class:`AccountantState` without its grid, plus addition, so that an account,
a reservation's cost and a prospective total are all the same kind of value and are
converted to epsilon by the one function the accountant uses.

Every sum the ledger keeps (an account's spend, its pending spend, a prospective total)
is rounded up as it is made, on every backend, with the accountant's own
``accounting.rounding.sum_up`` / ``difference_up`` (the SQL updates bind the same factor,
``ROUND_UP``, and make the same exception for zero: ``statements._sum_up``). So a stored
sum is never below the exact sum of what it adds, however many additions it went through.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from dp_budget_provider.accounting import (
    AccountantState,
    Conversion,
    EpsilonBound,
    Mechanism,
    RDPAccountant,
    epsilon_bound,
)
from dp_budget_provider.accounting.rounding import difference_up, sum_up
from dp_budget_provider.ledger.errors import LedgerCorrupt

_BAD_CURVE = "residual curve has NaN, negative values or the wrong length"


def prospective(committed: Spend, pending: Pending, cost: Spend) -> Spend:
    """What an account would hold once a reservation of ``cost`` is granted, summed in the
    one order the reservation's own check uses (its pending spend with the cost's rho and
    mu^2 added, as the account row's lock adds them; the committed spend; the cost's
    residual curve last): a prediction then equals the check to the last bit."""
    after = pending.add(Spend(cost.rho, None, cost.gaussian_mu2))
    return committed.plus(after.as_spend()).plus(Spend(0.0, cost.residual, 0.0))


@dataclass(frozen=True, eq=False)
class Spend:
    """Composed privacy loss: curve = rho * orders + residual.

    ``gaussian_mu2`` is sum(1/z^2) while every release was Gaussian (0.0 for nothing
    yet), None as soon as anything else was spent.
    """

    rho: float = 0.0
    residual: np.ndarray | None = None
    gaussian_mu2: float | None = 0.0

    @classmethod
    def of_release(cls, mechanism: Mechanism, count: int, orders: np.ndarray) -> Spend:
        """The cost of ``count`` invocations of ``mechanism`` on the ledger's grid."""
        accountant = RDPAccountant(orders)
        accountant.compose(mechanism, count)
        state = accountant.state()
        residual = np.array(state.residual)
        return cls(state.rho, residual if np.any(residual) else None, state.gaussian_mu_squared)

    def plus(self, other: Spend) -> Spend:
        """Composition: everything adds; Gaussian-only survives only if both were."""
        if self.residual is None:
            residual = other.residual
        elif other.residual is None:
            residual = self.residual
        else:
            residual = sum_up(self.residual, other.residual)
        mu2 = (
            None
            if self.gaussian_mu2 is None or other.gaussian_mu2 is None
            else sum_up(self.gaussian_mu2, other.gaussian_mu2)
        )
        return Spend(sum_up(self.rho, other.rho), residual, mu2)

    @property
    def finite(self) -> bool:
        """False for a cost no cap can grant (its curve overflowed a double); such a cost
        is refused before it reaches a row, which stores finite values only."""
        residual_finite = self.residual is None or bool(np.all(np.isfinite(self.residual)))
        mu2_finite = self.gaussian_mu2 is None or math.isfinite(self.gaussian_mu2)
        return math.isfinite(self.rho) and residual_finite and mu2_finite

    def curve(self, orders: np.ndarray) -> np.ndarray:
        """The RDP curve on ``orders``."""
        linear = self.rho * orders
        return linear if self.residual is None else linear + self.residual

    def epsilon(self, orders: np.ndarray, delta: float, conversion: Conversion) -> EpsilonBound:
        """The epsilon the ledger reports for this spend: exactly what RDPAccountant reports."""
        return epsilon_bound(orders, self.curve(orders), self.gaussian_mu2, delta, conversion)

    def to_accountant(self, orders: np.ndarray) -> RDPAccountant:
        """An accountant holding this spend, e.g. to plan noise on top of it."""
        residual = np.zeros(orders.size) if self.residual is None else self.residual
        return RDPAccountant.from_state(
            AccountantState(
                tuple(float(a) for a in orders),
                self.rho,
                tuple(float(r) for r in residual),
                self.gaussian_mu2,
            )
        )

    @property
    def signature(self) -> tuple[Any, ...]:
        """A hashable value equal for equal spends (to convert each distinct spend once)."""
        return (
            self.rho,
            None if self.residual is None else self.residual.tobytes(),
            self.gaussian_mu2,
        )

    def residual_json(self) -> str | None:
        """The residual as stored (NULL while zero)."""
        return None if self.residual is None else json.dumps(self.residual.tolist())

    def as_payload(self) -> dict[str, Any]:
        """JSON form for the history."""
        return {
            "rho": self.rho,
            "residual": None if self.residual is None else self.residual.tolist(),
            "gaussian_mu2": self.gaussian_mu2,
        }

    @classmethod
    def from_columns(
        cls, rho: float, residual: str | None, gaussian_mu2: float | None, size: int | None
    ) -> Spend:
        """Load stored values, refusing anything corrupt (fail closed). The residual curve
        has one value per order of a grid of ``size`` (None: of a grid not known yet, see
        :meth:`on_grid`)."""
        values = None if residual is None else np.array(json.loads(residual), dtype=np.float64)
        problems = []
        if not (isinstance(rho, float | int) and math.isfinite(rho) and rho >= 0):
            problems.append(f"rho={rho!r}")
        if values is not None and (
            values.ndim != 1
            or (size is not None and values.size != size)
            or np.any(np.isnan(values))
            or np.any(values < 0)
        ):
            problems.append(_BAD_CURVE)
        if gaussian_mu2 is not None and not (math.isfinite(gaussian_mu2) and gaussian_mu2 >= 0):
            problems.append(f"gaussian_mu2={gaussian_mu2!r}")
        if problems:
            raise LedgerCorrupt("stored spend is corrupt: " + "; ".join(problems))
        return cls(float(rho), values, None if gaussian_mu2 is None else float(gaussian_mu2))

    @classmethod
    def from_payload(cls, payload: dict[str, Any], size: int | None) -> Spend:
        """Inverse of :meth:`as_payload` (history entries; ``size`` as for
        :meth:`from_columns`)."""
        residual = payload["residual"]
        return cls.from_columns(
            payload["rho"],
            None if residual is None else json.dumps(residual),
            payload["gaussian_mu2"],
            size,
        )

    def on_grid(self, size: int) -> Spend:
        """This spend, refused as corrupt unless its residual curve has one value per order
        of a grid of ``size`` (a history entry's cost is read before its grid is known)."""
        if self.residual is not None and self.residual.size != size:
            raise LedgerCorrupt(f"stored spend is corrupt: {_BAD_CURVE}")
        return self

    def close_to(self, other: Spend, rel: float = 1e-9) -> bool:
        """Equal up to floating-point reassociation (replay vs stored)."""
        a = self.residual if self.residual is not None else 0.0
        b = other.residual if other.residual is not None else 0.0
        if (self.gaussian_mu2 is None) != (other.gaussian_mu2 is None):
            return False
        same_mu = self.gaussian_mu2 is None or math.isclose(
            self.gaussian_mu2, other.gaussian_mu2 or 0.0, rel_tol=rel, abs_tol=1e-15
        )
        return (
            math.isclose(self.rho, other.rho, rel_tol=rel, abs_tol=1e-15)
            and same_mu
            and bool(np.allclose(a, b, rtol=rel, atol=1e-15))
        )


@dataclass(frozen=True, eq=False)
class Pending:
    """The summed cost of an account's open reservations, as the account row stores it.

    Unlike a :class:`Spend`, the Gaussian part is kept as the mu^2 sum over the open
    Gaussian-only reservations plus a count of the others: when the last non-Gaussian
    reservation closes, the exact Gaussian bound is available again (a Spend's None could
    never come back). Closing subtracts, clamped at zero; callers reset to ``Pending()``
    when the account's last open reservation closes, so rounding never outlives a burst.
    ``statements.close_accounts`` does the same arithmetic set-based, for a release's
    residual-free cost on many accounts at once.
    """

    rho: float = 0.0
    residual: np.ndarray | None = None
    mu2: float = 0.0
    others: int = 0

    def as_spend(self) -> Spend:
        """What the open reservations add to the prospective check."""
        return Spend(self.rho, self.residual, None if self.others else self.mu2)

    def add(self, cost: Spend) -> Pending:
        """One more open reservation of ``cost``."""
        residual = Spend(0.0, self.residual).plus(Spend(0.0, cost.residual)).residual
        rho = sum_up(self.rho, cost.rho)
        if cost.gaussian_mu2 is None:
            return Pending(rho, residual, self.mu2, self.others + 1)
        return Pending(rho, residual, sum_up(self.mu2, cost.gaussian_mu2), self.others)

    def remove(self, cost: Spend) -> Pending:
        """One open reservation of ``cost`` closes (while others stay open)."""
        residual = self.residual
        if cost.residual is not None:
            base = np.zeros_like(cost.residual) if residual is None else residual
            residual = difference_up(base, cost.residual)
        rho = difference_up(self.rho, cost.rho)
        if cost.gaussian_mu2 is None:
            return Pending(rho, residual, self.mu2, max(0, self.others - 1))
        return Pending(rho, residual, difference_up(self.mu2, cost.gaussian_mu2), self.others)

    @property
    def signature(self) -> tuple[Any, ...]:
        """A hashable value equal for equal pending sums."""
        residual = None if self.residual is None else self.residual.tobytes()
        return (self.rho, residual, self.mu2, self.others)

    def residual_json(self) -> str | None:
        """The residual as stored (NULL while zero)."""
        return None if self.residual is None else json.dumps(self.residual.tolist())

    @classmethod
    def from_columns(
        cls, rho: float, residual: str | None, mu2: float, others: int, size: int
    ) -> Pending:
        """Load stored values, refusing anything corrupt (fail closed)."""
        if mu2 is None:
            raise LedgerCorrupt("stored pending mu^2 is NULL")
        loaded = Spend.from_columns(rho, residual, mu2, size)
        if not isinstance(others, int) or others < 0:
            raise LedgerCorrupt(f"stored pending count is corrupt: {others!r}")
        return cls(loaded.rho, loaded.residual, loaded.gaussian_mu2 or 0.0, others)

    def close_to(self, other: Pending, rel: float = 1e-9) -> bool:
        """Equal up to floating-point reassociation, with the same count of others."""
        return self.others == other.others and Spend(self.rho, self.residual, self.mu2).close_to(
            Spend(other.rho, other.residual, other.mu2), rel
        )
