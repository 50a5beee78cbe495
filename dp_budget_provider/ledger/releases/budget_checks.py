"""Budget checks: would a release fit, and with how much noise (no writes)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from sqlalchemy import Connection

from dp_budget_provider.accounting import (
    Mechanism,
    RDPAccountant,
)
from dp_budget_provider.accounting import validation as check
from dp_budget_provider.ledger.accounts.covered import (
    Charged,
    Covered,
    cohorts_of,
    distinct,
    mechanism_of,
    one_key,
)
from dp_budget_provider.ledger.accounts.held import HeldState, cohort_states, held_states
from dp_budget_provider.ledger.accounts.keys import (
    LedgerKey,
)
from dp_budget_provider.ledger.accounts.pricing import Pricing
from dp_budget_provider.ledger.accounts.spend import Pending, Spend, prospective
from dp_budget_provider.ledger.records import (
    BudgetCheck,
)
from dp_budget_provider.ledger.releases.locks import ChargeLocks, refuse_sealed
from dp_budget_provider.ledger.storage.transactions import LedgerDatabase
from dp_budget_provider.ledger.windows import scopes
from dp_budget_provider.ledger.windows.policies import Policies
from dp_budget_provider.ledger.windows.policy import Policy
from dp_budget_provider.ledger.windows.policy_store import PolicyStore, policy_of_scope
from dp_budget_provider.ledger.windows.scopes import PolicyMap


class BudgetChecks:
    """Budget checks: would a release fit, and with how much noise (no writes)."""

    def __init__(
        self,
        database: LedgerDatabase,
        pricing: Pricing,
        locks: ChargeLocks,
        policies: Policies,
        store: PolicyStore,
    ) -> None:
        self._database = database
        self._pricing = pricing
        self._locks = locks
        self._policies = policies
        self._store = store

    def budget_check(
        self,
        keys: Covered,
        mechanism: Mechanism | Mapping[str, Any],
        count: int = 1,
        *,
        dag: str | None = None,
    ) -> BudgetCheck:
        """Would this release, by ``dag``, fit every one of ``keys`` now, and which key
        fits it worst? (``dag`` decides its share of every divided cap: :mod:`shares`.)

        Committed spend and every open reservation count, summed as the reservation's own
        check sums them, so a release this finds fitting is refused only if something
        else is reserved or committed first. What the reservation refuses whatever the
        budget (a quarantined ledger, a sealed window or re-scoped key, a window label
        that is not its calendar's or has not begun) this raises as the reservation
        raises it. One grouped read per window (and 10^6 subjects) and one conversion per
        distinct held state: the subjects of a cohort that has had the same releases hold
        one state, however many they are.
        """
        return self._check(keys, mechanism, count, chargeable=True, dag=dag)

    def _check(
        self,
        keys: Covered,
        mechanism: Mechanism | Mapping[str, Any],
        count: int,
        *,
        chargeable: bool,
        dag: str | None = None,
    ) -> BudgetCheck:
        """:meth:`budget_check`; with ``chargeable`` False, keys no release may charge
        are priced all the same (what a key would reach, as a number to look at), except
        those of a sealed window: its final spend is no live state to price on, and a
        price without it would read below what the key has lost."""
        cost = self._pricing.cost(mechanism_of(mechanism), check.count("count", count))
        with self._database.reading() as connection:
            policies = self._store.read(connection)
            distinct, states = self._states(connection, keys, policies, wider=chargeable, dag=dag)
            if chargeable:
                self._locks.refuse_unchargeable(connection, distinct, states, policies)
            else:
                refuse_sealed(connection, distinct)
        worst: tuple[float, bool, LedgerKey, float, float, float] | None = None
        for state in states:
            policy = policy_of_scope(policies, state.tenant, state.query_type)
            total = prospective(state.spend, state.pending, cost)
            epsilon = self._pricing.bounds([total])[0].epsilon
            checked = self._pricing.checked_epsilon(total, policy)
            # Ties go to a state with a named key (see HeldState.example).
            rank = (checked / policy.cap_epsilon, state.example is not None)
            if state.example is not None and (worst is None or rank > worst[:2]):
                worst = (*rank, state.example, epsilon, policy.cap_epsilon, checked)
        assert worst is not None  # every window has a named state: see held_states
        subjects = sum(state.keys for state in states)
        return BudgetCheck(subjects, worst[2], worst[3], worst[4], len(states), worst[5])

    def _states(
        self,
        connection: Connection,
        keys: Covered,
        policies: PolicyMap,
        *,
        wider: bool,
        dag: str | None = None,
    ) -> tuple[Sequence[Charged], list[HeldState]]:
        """What ``keys`` cover (distinct keys, or a cohort's keys in a window), with
        ``wider`` also the subjects' totals at every wider scope whose cap applies and
        the share accounts of ``dag``'s principal (as a reservation charges them:
        :mod:`scopes`), and the distinct states they hold."""
        cohorts = cohorts_of(keys)
        listed = [] if cohorts else distinct(keys)
        if wider:
            listed, cohorts = scopes.with_wider_scopes(listed, cohorts, policies, dag=dag)
        if cohorts:
            states = [
                state
                for covered in cohorts
                for state in cohort_states(connection, covered, self._pricing.orders.size)
            ]
            return cohorts, states
        return listed, held_states(connection, listed, self._pricing.orders.size)

    def would_exceed(
        self,
        keys: Covered,
        mechanism: Mechanism | Mapping[str, Any],
        count: int = 1,
    ) -> bool:
        """True if this release would pass the cap of any of ``keys`` now (counting open
        reservations): :meth:`budget_check` without the details."""
        return self.budget_check(keys, mechanism, count).exceeds

    def fits_an_empty_account(
        self,
        tenant: str,
        query_type: str,
        mechanism: Mechanism | Mapping[str, Any],
        count: int = 1,
        *,
        dag: str | None = None,
    ) -> bool:
        """Whether this release, by DAG ``dag``, alone fits the cap in force for (tenant,
        query type) (its share's where the cap is divided): if not, no window will ever
        fit it. Priced on nothing spent, never on an account (a subject of any name may
        hold spend), and counted as the cap check counts it (at the policy's filter
        order): a release the filter refuses alone is refused on every account, whatever
        its reported epsilon."""
        policy = self._policies.policy_for_release(tenant, query_type, dag)
        return policy.admits(self.checked_alone(policy, mechanism, count))

    def checked_alone(
        self, policy: Policy, mechanism: Mechanism | Mapping[str, Any], count: int = 1
    ) -> float:
        """What the cap of ``policy`` is compared with for this release on an account with
        nothing spent (:meth:`Pricing.checked_alone`): what noise is planned against."""
        cost = self._pricing.cost(mechanism_of(mechanism), check.count("count", count))
        return self._pricing.checked_alone(cost, policy)

    def epsilon_alone(self, mechanism: Mechanism | Mapping[str, Any], count: int = 1) -> float:
        """What this release costs on its own, in eps at the ledger's delta: priced as the
        reservation's check prices it on an account with nothing spent."""
        cost = self._pricing.cost(mechanism_of(mechanism), check.count("count", count))
        return self._pricing.bounds([prospective(Spend(), Pending(), cost)])[0].epsilon

    def prospective_accountants(
        self, keys: Covered, *, own: bool = False, dag: str | None = None
    ) -> list[tuple[RDPAccountant, Policy]]:
        """Each distinct committed-plus-reserved spend among ``keys`` (and, unless ``own``,
        their subjects' totals at every wider scope whose cap applies and ``dag``'s share
        accounts) as an accountant, with the policy over it (for noise planning: one
        entry per state, not per key)."""
        with self._database.reading() as connection:
            policies = self._store.read(connection)
            _, states = self._states(connection, keys, policies, wider=not own, dag=dag)
        planned: dict[tuple[Any, ...], tuple[RDPAccountant, Policy]] = {}
        for state in states:
            policy = policy_of_scope(policies, state.tenant, state.query_type)
            total = state.spend.plus(state.pending.as_spend())
            planned.setdefault(
                (total.signature, policy.cap_epsilon, policy.filter_order),
                (total.to_accountant(self._pricing.orders), policy),
            )
        return list(planned.values())

    def prospective_accountant(self, key: LedgerKey) -> RDPAccountant:
        """An accountant holding ``key``'s committed and reserved spend."""
        return self.prospective_accountants(one_key(key), own=True)[0][0]

    def prospective_epsilon(
        self, key: LedgerKey, mechanism: Mechanism | Mapping[str, Any], count: int = 1
    ) -> float:
        """The eps ``key`` would reach with this release on top of committed and reserved
        spend (also for a key no release may charge any more: see :meth:`budget_check`;
        a sealed window's key raises :class:`WindowSealed`, never a price without its
        final spend)."""
        return self._check(one_key(key), mechanism, count, chargeable=False).epsilon
