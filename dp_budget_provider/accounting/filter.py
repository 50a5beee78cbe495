"""The cap as a privacy filter: one Rényi order, fixed before the first release.

A DAG author picks each release's mechanism and noise, and may pick them from what earlier
releases returned (noise sized to the remaining budget, work rerouted after a refusal, a
sensor waiting for room). Composition theorems for parameters fixed in advance do not
cover that; a *privacy filter* does: a stopping rule on the declared costs whose guarantee
holds whatever the analyst does (Rogers, Roth, Ullman and Vadhan 2016).

The rule here is Feldman and Zrnic's Rényi filter (2021, Theorem 3.1 and its filter form,
Theorem 4.3) at one order ``a`` fixed before the first release: a release is granted only
if the account's summed curve at ``a`` (committed, open and this one) converts to at most
the cap there. Along every history the granted curves then sum to at most the cap's
budget at ``a``, so the whole transcript has Rényi divergence of order ``a`` at most that
budget, and any RDP-to-DP conversion valid for two arbitrary distributions (the improved
one of Canonne, Kamath and Steinke 2020, Prop. 12; Mironov's classic one) gives
(cap, delta).

Two rules that look alike are *not* filters at the full delta: granting while *some*
order of the grid fits (the order may follow the outputs: an adaptive strategy can
collect the slack of two orders, up to twice delta), and switching from the exact
Gaussian (GDP) bound to the Rényi bound when a non-Gaussian release arrives (up to 1.25
delta). Both were measured against exact hockey-stick divergences; see docs/accounting.md.

The order is the one at which a zCDP curve (Gaussian noise, the operator's lattice
Gaussian) reaching the cap does so: ``a`` maximising ``(cap - c(a)) / a`` where ``c(a)``
is the conversion's own term at ``a``. For such curves the filter grants exactly what
the minimum over the grid grants; for others it grants at most that.
"""

from __future__ import annotations

import numpy as np

from dp_budget_provider.accounting import validation as check
from dp_budget_provider.accounting.conversion import Conversion, conversion_terms, rdp_to_epsilon
from dp_budget_provider.accounting.orders import validate_orders


def filter_order(orders: np.ndarray, cap: float, delta: float, conversion: Conversion) -> float:
    """The grid order a filter with this cap checks: where a zCDP curve ``rho * a`` can
    grow largest before its conversion passes the cap (the order minimising that curve's
    epsilon when it reaches the cap)."""
    cap = check.positive("cap", cap)
    grid = validate_orders(np.asarray(orders, dtype=np.float64))
    budgets = (cap - conversion_terms(grid, delta, conversion)) / grid
    return float(grid[int(np.argmax(budgets))])


def filter_epsilon(
    orders: np.ndarray, curve: np.ndarray, order: float, delta: float, conversion: Conversion
) -> float:
    """What the filter compares with the cap: ``curve`` at ``order`` (a grid order)
    converted there alone, rounded outward like every conversion."""
    grid = np.asarray(orders, dtype=np.float64)
    found = np.flatnonzero(grid == order)
    if found.size != 1:
        raise ValueError(f"order {order!r} is not an order of the grid")
    index = int(found[0])
    return rdp_to_epsilon(
        grid[index : index + 1], np.asarray(curve)[index : index + 1], delta, conversion
    )[0]
