"""The L2 sensitivity derived from contribution bounds is the least float at or above
sqrt(k * the sum of a cell's moves squared): never below it (the charge would be too
small), and never a needless ulp above it (on a lattice of whole units one ulp more is
one unit more of noise)."""

from __future__ import annotations

import math
from fractions import Fraction

from hypothesis import given
from hypothesis import strategies as st

from dp_budget_provider.aggregation import ContributionBounds


@given(
    st.integers(1, 10_000),
    st.integers(1, 1_000),
    st.floats(0.001, 1e6, allow_nan=False),
)
def test_the_l2_sensitivity_is_the_least_float_at_least_the_true_norm(groups, rows, high):
    bounds = ContributionBounds(groups, rows, (-high, high))
    for aggregate in ("count", "sum", "mean"):
        true_square = groups * sum(move**2 for move in bounds.cell_moves(aggregate))
        l2 = bounds.l2_sensitivity(aggregate)
        assert Fraction(l2) ** 2 >= true_square
        assert Fraction(math.nextafter(l2, 0.0)) ** 2 < true_square


def test_a_whole_sensitivity_stays_whole():
    assert ContributionBounds(1, 1).l2_sensitivity("count") == 1.0
    assert ContributionBounds(4, 3).l2_sensitivity("count") == 6.0
