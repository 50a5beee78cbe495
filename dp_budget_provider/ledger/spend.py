"""An amount of privacy spend as the ledger stores it: rho, a residual curve, Gaussian mu^2.

This is :class:`AccountantState` without its grid, plus addition, so that an account,
a reservation's cost and a prospective total are all the same kind of value and are
converted to epsilon by the one function the accountant uses.
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
from dp_budget_provider.ledger.errors import LedgerCorrupt


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
            residual = self.residual + other.residual
        mu2 = (
            None
            if self.gaussian_mu2 is None or other.gaussian_mu2 is None
            else self.gaussian_mu2 + other.gaussian_mu2
        )
        return Spend(self.rho + other.rho, residual, mu2)

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
        cls, rho: float, residual: str | None, gaussian_mu2: float | None, size: int
    ) -> Spend:
        """Load stored values, refusing anything corrupt (fail closed)."""
        values = None if residual is None else np.array(json.loads(residual), dtype=np.float64)
        problems = []
        if not (isinstance(rho, float | int) and math.isfinite(rho) and rho >= 0):
            problems.append(f"rho={rho!r}")
        if values is not None and (
            values.shape != (size,) or np.any(np.isnan(values)) or np.any(values < 0)
        ):
            problems.append("residual curve has NaN, negative values or the wrong length")
        if gaussian_mu2 is not None and not (math.isfinite(gaussian_mu2) and gaussian_mu2 >= 0):
            problems.append(f"gaussian_mu2={gaussian_mu2!r}")
        if problems:
            raise LedgerCorrupt("stored spend is corrupt: " + "; ".join(problems))
        return cls(float(rho), values, None if gaussian_mu2 is None else float(gaussian_mu2))

    @classmethod
    def from_payload(cls, payload: dict[str, Any], size: int) -> Spend:
        """Inverse of :meth:`as_payload` (history replay)."""
        residual = payload["residual"]
        return cls.from_columns(
            payload["rho"],
            None if residual is None else json.dumps(residual),
            payload["gaussian_mu2"],
            size,
        )

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
