"""Pricing: what a release costs on the ledger's grid, and what a spend is worth in eps.

Both are pure functions of values the ledger fixes for its life (grid, delta,
conversion), so one :class:`Pricing` per ledger keeps their results: tasks repeat the
same release, and the subjects of a cohort hold the same spend.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from dp_budget_provider.accounting import Conversion, EpsilonBound, Mechanism
from dp_budget_provider.accounting.conversion import conversion_term
from dp_budget_provider.accounting.filter import filter_epsilon, filter_order
from dp_budget_provider.ledger.accounts.keys import LedgerKey
from dp_budget_provider.ledger.accounts.spend import Pending, Spend, prospective
from dp_budget_provider.ledger.errors import LedgerCorrupt
from dp_budget_provider.ledger.records import SpendReceipt
from dp_budget_provider.ledger.storage import history
from dp_budget_provider.ledger.windows.policy import AUTO_ORDER, Policy
from dp_budget_provider.ledger.windows.policy_store import policy_lookup

# How many converted spends (epsilon bounds, costs) are kept before starting afresh.
CACHE_SIZE = 100_000


class Pricing:
    """Costs and epsilon bounds on one ledger's grid, delta and conversion, kept."""

    def __init__(self, orders: np.ndarray, delta: float, conversion: Conversion) -> None:
        self.orders = orders
        self.delta = delta
        self.conversion: Conversion = conversion
        self.bound_cache: dict[tuple[Any, ...], EpsilonBound] = {}
        self.cost_cache: dict[tuple[Any, int], Spend] = {}
        self.filter_cache: dict[tuple[Any, ...], float] = {}
        self.order_cache: dict[float, float] = {}

    def cost(self, mechanism: Mechanism, count: int) -> Spend:
        """The cost of a release on the ledger's grid.

        Mechanisms are frozen value objects with validated float fields, so equal ones
        describe the same release; one that is not hashable is known by its spec.
        """
        signature: tuple[Any, int] = (mechanism, count)
        try:
            hash(signature)
        except TypeError:
            signature = (history.canonical_json(mechanism.to_spec()), count)
        cost = self.cost_cache.get(signature)
        if cost is None:
            if len(self.cost_cache) > CACHE_SIZE:
                self.cost_cache.clear()
            cost = self.cost_cache[signature] = Spend.of_release(mechanism, count, self.orders)
        return cost

    def bounds(self, spends: Sequence[Spend]) -> list[EpsilonBound]:
        """Epsilon of many spends, converting each distinct spend once (and kept across
        calls: a one-step spend converts its prospective total once, for the check and
        for the receipt)."""
        cache = self.bound_cache
        if len(cache) > CACHE_SIZE:
            cache.clear()
        bounds = []
        for spend in spends:
            signature = spend.signature
            if signature not in cache:
                cache[signature] = spend.epsilon(self.orders, self.delta, self.conversion)
            bounds.append(cache[signature])
        return bounds

    def order_of(self, cap: float) -> float:
        """The Rényi order a filter with this cap checks on the ledger's grid
        (:func:`~dp_budget_provider.accounting.filter.filter_order`)."""
        order = self.order_cache.get(cap)
        if order is None:
            order = self.order_cache[cap] = filter_order(
                self.orders, cap, self.delta, self.conversion
            )
        return order

    def fixed_order(self, order: float | str | None, cap: float) -> float | None:
        """A policy's filter order as the ledger checks it: ``"auto"`` made the cap's own
        order, None kept; an order off the grid refused (no curve is held there)."""
        if order == AUTO_ORDER:
            return self.order_of(cap)
        if order is not None and order not in self.orders:
            raise ValueError(
                f"filter_order {order:g} is not an order of the ledger's grid "
                f"({self.orders.size} orders from {self.orders[0]:g} to "
                f"{self.orders[-1]:g}); give one of them, or 'auto'"
            )
        return order  # type: ignore[return-value]

    def conversion_term(self, order: float) -> float:
        """What the conversion adds at ``order`` (a grid order) to a curve's value there:
        a cap's Rényi budget at that order is the cap less this."""
        if order not in self.orders:
            raise ValueError(f"order {order!r} is not an order of the ledger's grid")
        return conversion_term(order, self.delta, self.conversion)

    def checked_epsilon(self, spend: Spend, policy: Policy) -> float:
        """What the cap of ``policy`` is compared with for an account holding ``spend``
        (committed, open and the release asked for). Every decision to grant compares
        this: with the policy's ``filter_order``, the privacy filter's statistic at that
        one order (valid for releases chosen from earlier outputs); without one, the
        epsilon the ledger reports (the least over the grid, and the exact Gaussian bound
        while every release is Gaussian: the tighter figure for releases fixed in advance,
        not a filter, see docs/accounting.md)."""
        order = policy.filter_order
        if order is None:
            return self.bounds([spend])[0].epsilon
        if not isinstance(order, float):  # only set_policy's "auto" is, and it never stores it
            raise LedgerCorrupt(f"a stored policy checks its cap at order {order!r}, no order")
        signature = (spend.signature, order)
        found = self.filter_cache.get(signature)
        if found is None:
            if len(self.filter_cache) > CACHE_SIZE:
                self.filter_cache.clear()
            curve = spend.curve(self.orders)
            found = filter_epsilon(self.orders, curve, order, self.delta, self.conversion)
            self.filter_cache[signature] = found
        return found

    def checked_alone(self, cost: Spend, policy: Policy) -> float:
        """What the cap of ``policy`` is compared with for a release of ``cost`` on an
        account with nothing spent: what planning and "can this ever fit" must price,
        since a release the filter refuses alone is refused on every account."""
        return self.checked_epsilon(prospective(Spend(), Pending(), cost), policy)

    def stored_epsilon(self, rho: float, mu2: float | None) -> float:
        """The epsilon of a prospective spend the server recorded (validated as stored)."""
        spend = Spend.from_columns(rho, None, mu2, self.orders.size)
        return self.bounds([spend])[0].epsilon

    def receipts(
        self,
        keys: Sequence[LedgerKey],
        spends: Sequence[Spend],
        policies: Mapping[tuple[str, str], Policy],
        sizes: Sequence[int],
    ) -> list[SpendReceipt]:
        """Receipts of accounts ``keys`` holding ``spends`` for classes of ``sizes``
        subjects; each distinct (spend, policy) pair is converted once. The epsilon is the
        one the ledger reports; remaining, fraction and warning are counted as the cap is
        checked (:meth:`checked_epsilon`), so an account the cap will grant nothing more
        shows no room."""
        policy_of = policy_lookup(policies)
        made: dict[tuple[int, int], tuple[Any, ...]] = {}
        receipts = []
        for key, spend, size in zip(keys, spends, sizes, strict=True):
            policy = policy_of(key)
            marker = (id(spend), id(policy))
            fields = made.get(marker)
            if fields is None:
                fields = made[marker] = _receipt_fields(
                    self.bounds([spend])[0], self.checked_epsilon(spend, policy), policy
                )
            receipts.append(SpendReceipt(key, *fields, subjects=size))
        return receipts


def _receipt_fields(bound: EpsilonBound, checked: float, policy: Policy) -> tuple[Any, ...]:
    """A receipt's values after its key (SpendReceipt's field order)."""
    return (
        bound.epsilon,
        max(0.0, policy.cap_epsilon - checked),
        checked / policy.cap_epsilon,
        policy.warns_at(checked),
        policy.cap_epsilon,
        bound.method,
    )
