"""How much one privacy unit may contribute to an aggregate, and what that bounds.

A release's noise is calibrated to its sensitivity: how far the exact answer can move when
one unit's contributions are added or removed. Declared by hand, that number is a promise
about code the ledger never sees. Here it is derived from bounds the query itself enforces
(:mod:`~dp_budget_provider.aggregation.bounded_sql`): at most ``max_groups_per_unit`` cells
of the domain per unit, at most ``max_rows_per_group`` rows per (unit, cell), and for sums
every value clamped to ``value_bounds``. The bounds are public (they are the DAG's
arguments), so the sensitivity is too, and no data decides it.

A mean is released as a sum and a count per cell in one release (one charge): its answer
is the vector of both, whose move is the pair's, so the sensitivities are those of the
pair taken jointly (``cell_moves``), computed exactly and rounded up.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from fractions import Fraction
from typing import Literal

from dp_budget_provider.accounting.rounding import float_at_least, sqrt_at_least

Aggregate = Literal["count", "sum", "mean"]
AGGREGATES: tuple[Aggregate, ...] = ("count", "sum", "mean")


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

    def cell_moves(self, aggregate: Aggregate) -> tuple[Fraction, ...]:
        """The most one unit moves each value a cell releases, exactly: its rows there,
        each counted once (count); each at most its largest clamped magnitude (sum); both
        (mean: the cell's sum and its count)."""
        rows = Fraction(self.max_rows_per_group)
        if aggregate == "count":
            return (rows,)
        if aggregate in ("sum", "mean"):
            if self.value_bounds is None:
                raise ValueError(
                    f"a {aggregate} needs value_bounds: every value is clamped to them"
                )
            low, high = self.value_bounds
            largest = rows * Fraction(max(abs(low), abs(high)))
            return (largest,) if aggregate == "sum" else (largest, rows)
        raise ValueError(f"aggregate must be one of {list(AGGREGATES)}, got {aggregate!r}")

    def per_cell(self, aggregate: Aggregate) -> float:
        """The most one unit moves any one value released for a cell."""
        return float_at_least(max(self.cell_moves(aggregate)))

    def l1_sensitivity(self, aggregate: Aggregate) -> float:
        """Over every cell: at most ``max_groups_per_unit`` cells move, each by at most
        the sum of its :meth:`cell_moves` (rounded up)."""
        return float_at_least(self.max_groups_per_unit * sum(self.cell_moves(aggregate)))

    def l2_sensitivity(self, aggregate: Aggregate) -> float:
        """The Euclidean norm of the same move, ``sqrt(k * sum of cell_moves**2)``, rounded
        up."""
        moves = self.cell_moves(aggregate)
        return sqrt_at_least(self.max_groups_per_unit * sum(move * move for move in moves))
