"""How much one privacy unit may contribute to an aggregate, and what that bounds.

A release's noise is calibrated to its sensitivity: how far the exact answer can move when
one unit's contributions are added or removed. Declared by hand, that number is a promise
about code the ledger never sees. Here it is derived from bounds the query itself enforces
(:mod:`~dp_budget_provider.aggregation.bounded_sql`): at most ``max_groups_per_unit`` cells
of the domain per unit, at most ``max_rows_per_group`` rows per (unit, cell), and for sums
every value clamped to ``value_bounds``. The bounds are public (they are the DAG's
arguments), so the sensitivity is too, and no data decides it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from fractions import Fraction
from typing import Literal

Aggregate = Literal["count", "sum"]
AGGREGATES: tuple[Aggregate, ...] = ("count", "sum")


@dataclass(frozen=True)
class ContributionBounds:
    """The most one privacy unit contributes: to how many cells, with how many rows each,
    and (for sums) within which values."""

    max_groups_per_unit: int
    max_rows_per_group: int
    value_bounds: tuple[float, float] | None = None

    def __post_init__(self) -> None:
        for name in ("max_groups_per_unit", "max_rows_per_group"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a whole number of at least 1, got {value!r}")
        if self.value_bounds is not None:
            try:
                low, high = (float(bound) for bound in self.value_bounds)
            except (TypeError, ValueError):
                raise ValueError(
                    f"value_bounds must be two numbers (low, high), got {self.value_bounds!r}"
                ) from None
            if not (math.isfinite(low) and math.isfinite(high)) or low > high:
                raise ValueError(
                    f"value_bounds must be finite with low <= high, got {self.value_bounds!r}"
                )
            object.__setattr__(self, "value_bounds", (low, high))

    def per_cell(self, aggregate: Aggregate) -> float:
        """The most one unit moves one cell: its rows there, each counted once (count) or
        at most its largest clamped magnitude (sum)."""
        if aggregate == "count":
            return float(self.max_rows_per_group)
        if aggregate == "sum":
            if self.value_bounds is None:
                raise ValueError("a sum needs value_bounds: every value is clamped to them")
            low, high = self.value_bounds
            return self.max_rows_per_group * max(abs(low), abs(high))
        raise ValueError(f"aggregate must be one of {list(AGGREGATES)}, got {aggregate!r}")

    def l1_sensitivity(self, aggregate: Aggregate) -> float:
        """Over every cell: at most ``max_groups_per_unit`` cells move, each by at most
        :meth:`per_cell`."""
        return self.max_groups_per_unit * self.per_cell(aggregate)

    def l2_sensitivity(self, aggregate: Aggregate) -> float:
        """The Euclidean norm of the same move: ``sqrt(k) * per_cell``, rounded up to the
        least float at least as large (exact when it is a float: one more ulp would be
        one more lattice unit of noise where the sensitivity is a whole number of them)."""
        return at_least_root(self.max_groups_per_unit * Fraction(self.per_cell(aggregate)) ** 2)


def at_least_root(square: Fraction) -> float:
    """The least float whose square is at least ``square`` (``math.sqrt`` rounds to
    nearest, so that float is its result or the next one up)."""
    root = math.sqrt(square)
    while Fraction(root) ** 2 < square:
        root = math.nextafter(root, math.inf)
    return root
