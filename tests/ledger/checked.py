"""What a default cap check counts, computed apart from the ledger.

A policy's cap is by default a privacy filter at the cap's own Rényi order
(``filter_order="auto"``): the account's summed curve at that one order, converted there
alone. Tests that fill an account up to its cap count with this, not with the reported
epsilon (the least over the grid, and the exact Gaussian bound), which is below it.
"""

from __future__ import annotations

from dp_budget_provider.accounting import DEFAULT_ORDERS, Mechanism, RDPAccountant
from dp_budget_provider.accounting.filter import filter_epsilon, filter_order


def checked_epsilon(
    cap: float, delta: float, *releases: tuple[Mechanism, int], conversion: str = "improved"
) -> float:
    """The filter's statistic of ``releases`` ((mechanism, count) pairs) under a cap of
    ``cap`` checked at its own order on the default grid."""
    accountant = RDPAccountant(DEFAULT_ORDERS)
    for mechanism, count in releases:
        if count:
            accountant.compose(mechanism, count)
    order = filter_order(DEFAULT_ORDERS, cap, delta, conversion)  # type: ignore[arg-type]
    return filter_epsilon(DEFAULT_ORDERS, accountant.rdp, order, delta, conversion)  # type: ignore[arg-type]
