"""Benchmark: what checking caps as privacy filters costs, in releases per cap.

Run: ``.venv/bin/python bench/filter_cost.py``. For each built-in kind of release and
each cap (delta 1e-5, the default grid, the improved conversion), it counts how many
releases of a fixed sequence an account is granted before its first refusal, under
the two rules a policy can check its cap with, through the ledger's own pricing
(``Pricing.checked_epsilon``, the function every grant calls, no database):

* ``filter``: the default, the cap checked at its own Rényi order (``"auto"``);
* ``reported``: the cap checked on the reported epsilon (least over the grid, and the
  exact Gaussian bound while every release is Gaussian), not a filter under adaptivity.

and prints the ratio filter / reported. A prefix of a fixed sequence only grows its
curve at every order, so both checks are monotone in the number of releases and the
count is found by bisection.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from dp_budget_provider.accounting import (
    DEFAULT_ORDERS,
    GaussianMechanism,
    LaplaceMechanism,
    Mechanism,
    PureDPMechanism,
    ZCDPMechanism,
)
from dp_budget_provider.ledger.accounts.pricing import Pricing
from dp_budget_provider.ledger.accounts.spend import Spend
from dp_budget_provider.ledger.windows.policy import Policy

DELTA = 1e-5
CAPS = (0.5, 1.0, 3.0, 8.0)
Z = 20.0
LAPLACE_EPS0 = 0.1
GAUSSIAN = GaussianMechanism(Z)
# The operator's default noise: a discrete Gaussian on a lattice, charged as zCDP.
LATTICE = ZCDPMechanism(rho=1 / (2 * Z**2))
LAPLACE = LaplaceMechanism(LAPLACE_EPS0)
# A release of large epsilon alone: pure DP, what the operator's lattice Laplace is
# charged as, with eps0 = 1 (where a filter at the cap's order costs most).
LARGE_LAPLACE = PureDPMechanism(1.0)

# Each sequence as the mechanisms it repeats in turn: release i is cycle[i % len(cycle)].
SEQUENCES: dict[str, tuple[Mechanism, ...]] = {
    f"continuous Gaussian z={Z:g}": (GAUSSIAN,),
    f"lattice Gaussian (zCDP, z={Z:g})": (LATTICE,),
    f"Laplace eps0={LAPLACE_EPS0:g}": (LAPLACE,),
    "pure DP eps0=1 (lattice Laplace)": (LARGE_LAPLACE,),
    "Gaussian + Laplace, alternating": (GAUSSIAN, LAPLACE),
    "lattice Gaussian + Laplace, alternating": (LATTICE, LAPLACE),
}


def prefix_spend(pricing: Pricing, cycle: tuple[Mechanism, ...], releases: int) -> Spend:
    """The spend of the first ``releases`` releases of the sequence repeating ``cycle``."""
    spend = Spend()
    for position, mechanism in enumerate(cycle):
        count = len(range(position, releases, len(cycle)))
        if count:
            spend = spend.plus(pricing.cost(mechanism, count))
    return spend


def granted(fits: Callable[[int], bool]) -> int:
    """The largest n with ``fits(n)`` (``fits`` monotone, ``fits(0)``)."""
    low, high = 0, 1
    while fits(high):
        low, high = high, high * 2
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (middle, high) if fits(middle) else (low, middle)
    return low


def main() -> None:
    pricing = Pricing(np.asarray(DEFAULT_ORDERS, dtype=np.float64), DELTA, "improved")
    print(f"releases granted before the first refusal, delta={DELTA:g}, default grid")
    header = f"{'release':42} {'cap':>4} {'order':>6} {'reported':>9} {'filter':>7} {'ratio':>6}"
    print(header)
    print("-" * len(header))
    for name, cycle in SEQUENCES.items():
        for cap in CAPS:
            order = pricing.order_of(cap)
            counts = []
            for rule in (None, order):
                policy = Policy(cap, filter_order=rule)

                def fits(n: int, policy: Policy = policy, cycle: tuple = cycle) -> bool:
                    spend = prefix_spend(pricing, cycle, n)
                    return policy.admits(pricing.checked_epsilon(spend, policy))

                counts.append(granted(fits))
            reported, filtered = counts
            ratio = f"{filtered / reported:>6.3f}" if reported else f"{'-':>6}"
            print(f"{name:42} {cap:>4g} {order:>6g} {reported:>9d} {filtered:>7d} {ratio}")


if __name__ == "__main__":
    main()
