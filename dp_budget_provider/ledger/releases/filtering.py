"""Individual filtering: which of a cohort's subjects can afford a release.

A release made with individual filtering (Feldman and Zrnic 2021) is never refused for a
subject's sake: each subject whose accounts, at every scope whose cap applies to the
release (its own scope, the wider scopes, its principal's share), could not take the
release's cost on top of their committed and reserved spend is *left out*: the release
is made over the others, charged to them alone, and whoever reads the data leaves the
left-out subjects' rows out before aggregating. Why this keeps every subject within its
cap, and what it needs (a cap checked at a fixed Rényi order), is in docs/accounting.md,
"Individual filtering".

What is decided here runs inside the reservation's own transaction, under the locks the
reservation takes, in the order every charge takes them: the windows first (exclusively),
then the open reservations holding any account of one of the cohort's subjects at any of
those scopes, then those accounts, in key order. Nothing can
add spend to those accounts until the transaction ends (a commit or reap moves pending
spend to committed spend, which leaves the sum the check counts as it was), so the
reservation made next over the subjects kept fits by construction.

The subjects kept are a cohort of their own (registered here, in the same transaction),
so the reservation, its history entry and ``verify`` are those of any cohort's release.
When every subject is left out, the reservation holds no account at all: it is made and
committed all the same, so that nothing the release's task sees says so.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime

from dp_budget_provider.ledger.accounts import classes
from dp_budget_provider.ledger.accounts.classes import Cohort, CohortKeys
from dp_budget_provider.ledger.accounts.keys import LedgerKey
from dp_budget_provider.ledger.accounts.pricing import Pricing
from dp_budget_provider.ledger.accounts.spend import Spend, prospective
from dp_budget_provider.ledger.releases.locks import ChargeLocks, PoliciesChanged, check_windows
from dp_budget_provider.ledger.storage import clock, pipeline
from dp_budget_provider.ledger.storage.statements import LockedAccount
from dp_budget_provider.ledger.windows import scopes
from dp_budget_provider.ledger.windows.policy import Policy
from dp_budget_provider.ledger.windows.policy_store import (
    PolicyStore,
    policy_lookup,
    policy_of_scope,
)
from dp_budget_provider.ledger.windows.shares import dag_of


@dataclass(frozen=True)
class Admitted:
    """The part of a cohort a filtered release charges: ``cohorts``, its keys in each of
    the release's windows (empty when no subject can afford it), and ``left_out``, the
    canonical ids of the subjects it leaves out."""

    cohorts: list[CohortKeys]
    left_out: frozenset[str]


def filtered_cohort(cohorts: Sequence[CohortKeys]) -> Cohort:
    """The one registered cohort a filtered release covers (in one or more windows);
    ValueError for anything else: filtering decides per subject of one cohort."""
    found = {keys.cohort for keys in cohorts if isinstance(keys, CohortKeys)}
    if len(found) != 1 or not all(isinstance(keys, CohortKeys) for keys in cohorts):
        raise ValueError(
            "a filtered release covers one registered cohort (ledger.cohort(...)) in each "
            "of its windows, not a list of keys or several cohorts"
        )
    return found.pop()


class Filter:
    """Decides, under the reservation's locks, which subjects a filtered release keeps."""

    def __init__(self, pricing: Pricing, locks: ChargeLocks, store: PolicyStore) -> None:
        self._pricing = pricing
        self._locks = locks
        self._store = store

    def admitted(
        self,
        pipe: pipeline.Pipeline,
        cohorts: Sequence[CohortKeys],
        cost: Spend,
        attempt: str,
        moment: datetime,
    ) -> Admitted:
        """Lock what the release over ``cohorts`` would charge and keep the subjects every
        account of whose can take ``cost``; the kept subjects are registered as a cohort.

        ValueError when the release alone passes a cap that applies to it on an account
        with nothing spent: every subject would be left out whatever anyone released, a
        fact about the release and the policies alone.
        """
        cohort = filtered_cohort(cohorts)
        now = clock.stamp(moment)
        chosen = self._store.current(pipe)
        _, scoped = scopes.with_wider_scopes([], cohorts, chosen, dag=dag_of(attempt))
        self._locks.lock_windows(pipe, scoped, now)
        # Read honoured, under the locks: as a charge proves the scopes it chose.
        policies = self._store.read(pipe)
        if policies is not chosen and not scopes.same_wider_scopes(
            chosen, policies, {cohort.tenant}
        ):
            raise PoliciesChanged(
                "the ledger's policies changed while this release was being filtered: it was "
                "refused with nothing written; make it again"
            )
        # What refuses any charge of these windows, whoever is kept: the reservation that
        # follows keeps none when everyone is left out, and must be refused all the same.
        check_windows(scoped, policy_lookup(policies), moment, new_release=True)
        for scope in scoped:
            policy = policy_of_scope(policies, scope.tenant, scope.query_type)
            if policy.filter_order is None:
                raise ValueError(
                    f"the cap of {scope.tenant}/{scope.query_type} is checked on the reported "
                    "epsilon: individual filtering is valid only where every cap that applies "
                    "is checked at one fixed Renyi order (a privacy filter: docs/accounting.md)"
                )
            if not policy.admits(self._pricing.checked_alone(cost, policy)):
                raise ValueError(
                    f"the release alone passes the cap of {scope.tenant}/{scope.query_type} "
                    f"(eps {policy.cap_epsilon:g}) on an account with nothing spent: no "
                    "subject could afford it"
                )
        cohort_id = classes.registered(pipe, cohort)
        covering = [
            (scope_of(scope), sorted(classes.covering(pipe, scope_of(scope), cohort_id)))
            for scope in scoped
        ]
        # As a charge locks: the open reservations holding these accounts first (a commit
        # holds its reservation, then its accounts), then the accounts in key order.
        classes.lock_open_reservations(pipe, covering)
        ordered = sorted(
            (
                LedgerKey.from_canonical(tenant, label, query_type, window)
                for (tenant, query_type, window), labels in covering
                for label in labels
            ),
            key=lambda k: (k.tenant, k.subject, k.query_type, k.window),
        )
        locked = self._locks.lock_existing(pipe, ordered)
        affords = _affords(self._pricing, cost, policy_lookup(policies))
        short = [key for key in ordered if not affords(key, locked[key])]
        left_out: set[str] = set()
        for key in short:
            left_out.update(classes.members_in(pipe, key, cohort_id))
        if not left_out:
            return Admitted(list(cohorts), frozenset())
        kept = sorted(set(classes.cohort_members(pipe, cohort_id)) - left_out)
        if not kept:
            return Admitted([], frozenset(left_out))
        _, digest = classes.register(pipe, cohort.tenant, kept, now)
        part = Cohort(cohort.tenant, digest, len(kept))
        return Admitted(
            [part.in_window(keys.query_type, keys.window) for keys in cohorts],
            frozenset(left_out),
        )


def scope_of(keys: CohortKeys) -> classes.Scope:
    """The (tenant, query type, window) of a cohort's keys."""
    return (keys.tenant, keys.query_type, keys.window)


def _affords(
    pricing: Pricing, cost: Spend, policy_of: Callable[[LedgerKey], Policy]
) -> Callable[[LedgerKey, LockedAccount], bool]:
    """Whether a locked account can take ``cost``: checked as the reservation checks it
    (its committed and pending spend with the cost, at the policy's filter order). A
    re-scoped account can take nothing: no release may charge it."""

    def affords(key: LedgerKey, held: LockedAccount) -> bool:
        if held.rescoped_to is not None:
            return False
        total = prospective(held.spend, held.pending, cost)
        policy = policy_of(key)
        return policy.admits(pricing.checked_epsilon(total, policy))

    return affords
