"""Where an account stands: committed eps, held eps, and whether another release still fits.

Epsilons are those the ledger reports; whether a release still fits, and how much room
is left, are counted as the cap check counts them (:meth:`Pricing.checked_epsilon`, at
the policy's filter order), so an account is shown exhausted exactly when the cap will
grant it nothing its scope releases.

An account row stores its committed spend and the summed cost of its open reservations
(``pending_*``). What people need to read is both: what has been spent, and what is
spent once every open reservation is charged (the prospective check of the next release
counts it). Whether the account is exhausted is decided at read time, never recorded:
a refused release leaves the ledger untouched, so "has a release been refused" is not a
fact the ledger has. Instead the account is exhausted when the cheapest release its
scope (tenant, query type) has ever reserved would no longer fit on its held spend: the
next such release is certain to be refused (:meth:`Policy.exhausts_at`).

Accounts charged by the same releases hold the same stored values, so each distinct
(scope, stored values) is converted once, as the reading paths group them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
from sqlalchemy import Connection, select

from dp_budget_provider.accounting import EpsilonBound
from dp_budget_provider.ledger.accounts.spend import Pending, Spend, prospective
from dp_budget_provider.ledger.storage.schema import Account, ReservationKey
from dp_budget_provider.ledger.storage.schema import Reservation as ReservationRow
from dp_budget_provider.ledger.windows.policy import Policy


class SpendPricing(Protocol):
    """What a standing needs of the ledger's pricing (:class:`Pricing`, which this module
    does not import: pricing's receipts are records, and records hold standings)."""

    orders: np.ndarray

    def bounds(self, spends: Sequence[Spend]) -> list[EpsilonBound]: ...

    def checked_epsilon(self, spend: Spend, policy: Policy) -> float: ...


class ReadableLedger(Protocol):
    """What a standing needs of a ledger: its pricing, and a read."""

    @property
    def pricing(self) -> SpendPricing: ...

    def reading(self) -> AbstractContextManager[Connection]: ...


# The stored columns that decide an account's standing (with its tenant and query type).
SPEND_COLUMNS = (
    Account.rho,
    Account.residual,
    Account.gaussian_mu2,
    Account.pending_rho,
    Account.pending_residual,
    Account.pending_mu2,
    Account.pending_others,
)

Scope = tuple[str, str]


@dataclass(frozen=True)
class Checked:
    """The committed and held spend of an account as its cap check counts them."""

    committed: float
    held: float


@dataclass(frozen=True)
class Standing:
    """An account's committed and held eps, and what the next release would bring.

    ``held`` counts every open reservation as charged. ``checked`` is both as the cap
    check counts them. ``next_epsilon`` is the least the cap check would count for any
    release its scope has reserved on top of the held spend; None while the scope has
    reserved nothing (no release to measure against).
    """

    committed: EpsilonBound
    held: EpsilonBound
    next_epsilon: float | None
    checked: Checked


def stored_values(row: Any) -> tuple[Any, ...]:
    """The scope and the stored spend of an account row: equal values, equal standing."""
    return (row.tenant, row.query_type, *(getattr(row, c.key) for c in SPEND_COLUMNS))


class Standings:
    """The standing of account rows of one ledger, converting each distinct value once.

    ``policy_of`` gives the policy over a (tenant, query type): how its cap is checked.
    """

    def __init__(self, ledger: ReadableLedger, policy_of: Callable[[str, str], Policy]) -> None:
        self._ledger = ledger
        self._pricing = ledger.pricing
        self._policy_of = policy_of
        self._orders = np.asarray(self._pricing.orders)
        self._releases: dict[Scope, list[Spend]] = {}
        self._standings: dict[tuple[Any, ...], Standing] = {}

    def of_rows(self, rows: Sequence[Any]) -> list[Standing]:
        """The standing of each account row (rows carry the key and ``SPEND_COLUMNS``)."""
        self._load_releases({(row.tenant, row.query_type) for row in rows})
        return [self._standing(row) for row in rows]

    def of_row(self, row: Any) -> Standing:
        """The standing of one account row."""
        return self.of_rows([row])[0]

    def epsilon(self, spend: Spend) -> EpsilonBound:
        """The eps of ``spend`` at the ledger's delta (cached by value)."""
        return self._pricing.bounds([spend])[0]

    def _standing(self, row: Any) -> Standing:
        stored = stored_values(row)
        standing = self._standings.get(stored)
        if standing is None:
            size = self._orders.size
            committed = Spend.from_columns(row.rho, row.residual, row.gaussian_mu2, size)
            pending = Pending.from_columns(
                row.pending_rho, row.pending_residual, row.pending_mu2, row.pending_others, size
            )
            held = committed.plus(pending.as_spend())
            releases = self._releases[(row.tenant, row.query_type)]
            policy = self._policy_of(row.tenant, row.query_type)
            checked = self._pricing.checked_epsilon
            next_epsilon = min(
                (checked(prospective(committed, pending, cost), policy) for cost in releases),
                default=None,
            )
            standing = Standing(
                self.epsilon(committed),
                self.epsilon(held),
                next_epsilon,
                Checked(checked(committed, policy), checked(held, policy)),
            )
            self._standings[stored] = standing
        return standing

    def _load_releases(self, scopes: set[Scope]) -> None:
        missing = sorted(scopes - self._releases.keys())
        if not missing:
            return
        size = self._orders.size
        with self._ledger.reading() as connection:
            for scope in missing:
                costs = [
                    Spend.from_columns(rho, residual, mu2, size)
                    for rho, residual, mu2 in _release_costs(connection, scope)
                ]
                self._releases[scope] = _undominated(costs)


def _release_costs(connection: Connection, scope: Scope) -> Iterable[Any]:
    """Each distinct cost reserved on a key of ``scope``, whatever became of it.

    A released or reaped reservation was granted all the same: its cost is a release
    the scope makes. Asked per reservation with EXISTS, which stops at its first key in
    the scope (a release's keys usually share one scope), instead of reading every key
    row of every release over many subjects.
    """
    tenant, query_type = scope
    in_scope = (
        select(ReservationKey.position)
        .where(
            ReservationKey.reservation_id == ReservationRow.id,
            ReservationKey.tenant == tenant,
            ReservationKey.query_type == query_type,
        )
        .exists()
    )
    query = (
        select(
            ReservationRow.cost_rho,
            ReservationRow.cost_residual,
            ReservationRow.cost_gaussian_mu2,
        )
        .where(in_scope)
        .distinct()
    )
    return connection.execute(query)


def _undominated(costs: list[Spend]) -> list[Spend]:
    """The costs no other cost is cheaper than on every order (only those can be cheapest).

    Releases of one DAG task repeat one cost, and noise calibrated at different levels
    gives curves ordered by their noise, so this leaves very few to convert.
    """
    kept: list[Spend] = []
    for cost in sorted(costs, key=lambda c: (c.rho, c.signature[1] or b"")):
        if not any(_no_dearer(other, cost) for other in kept):
            kept.append(cost)
    return kept


def _no_dearer(cheap: Spend, dear: Spend) -> bool:
    """True when ``cheap`` adds no more than ``dear`` to any account, on every order."""
    if cheap.rho > dear.rho:
        return False
    if dear.residual is not None or cheap.residual is not None:
        mine = 0.0 if cheap.residual is None else cheap.residual
        theirs = 0.0 if dear.residual is None else dear.residual
        if not bool(np.all(mine <= theirs)):
            return False
    if cheap.gaussian_mu2 is None:
        return dear.gaussian_mu2 is None
    return dear.gaussian_mu2 is None or cheap.gaussian_mu2 <= dear.gaussian_mu2
