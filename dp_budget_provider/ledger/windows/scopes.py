"""Caps at wider scopes: what a release charges beyond its own query type's accounts.

A cap per (tenant, query type, window) bounds one account. A subject released over as a
heatmap, a count and a trajectory statistic in one week has lost the sum of three, and
after a year of weekly windows fifty-two times that. Where a tenant has a policy across
query types (``Policy(across="query_types")``) or across the windows of a horizon
(``Policy(across="windows", horizon_windows=52)``), every release also charges the
subject's total at that scope: an account under the query type
:data:`~.policy.ACROSS_QUERY_TYPES` in the same window, and one under
:data:`~.policy.ACROSS_WINDOWS` in the horizon period the window lies in. They are
ordinary accounts (spend classes, cohorts, locks, pending spend, seals, verify): the
check and the charge of every scope happen in the release's one reservation, under the
same locks, all or nothing, with one cap check per account.

A release charged to two windows of one horizon charges the horizon once: it is one
release. The wider scopes' calendars are made of the same windows as the query types'
(a horizon spans whole windows), so each window lies in exactly one period of each; a
query type whose calendar differs from its tenant's wider caps is refused a release
rather than charged to periods its windows do not fit.

This module is the one place that decides which scope accounts a release charges:
reservations, corrections and budget checks all ask it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from dp_budget_provider.ledger.accounts.classes import CohortKeys
from dp_budget_provider.ledger.accounts.covered import in_lock_order
from dp_budget_provider.ledger.accounts.keys import MAX_PART_LENGTH, LedgerKey
from dp_budget_provider.ledger.errors import LedgerError
from dp_budget_provider.ledger.storage.entries import ChargedCohort
from dp_budget_provider.ledger.windows.calendar import window_bounds
from dp_budget_provider.ledger.windows.policy import ANY, SCOPE_ACCOUNTS, Policy, kept_by_ledger
from dp_budget_provider.ledger.windows.policy_store import policy_lookup
from dp_budget_provider.ledger.windows.shares import (
    SHARE_PREFIX,
    parse_share,
    principal_of,
    share_query_type,
)

PolicyMap = Mapping[tuple[str, str], Policy]


def wider_policies(policies: PolicyMap, tenant: str) -> list[Policy]:
    """The caps across query types and windows that apply to ``tenant`` (its own, else
    every tenant's), in a fixed order."""
    found = []
    for query_type in sorted(SCOPE_ACCOUNTS):
        policy = policies.get((tenant, query_type)) or policies.get((ANY, query_type))
        if policy is not None:
            found.append(policy)
    return found


def refuse_scope_names(query_types: set[str]) -> None:
    """Refuse a release that names a wider scope's query type, or a share's, as its own."""
    named = sorted(query_types & SCOPE_ACCOUNTS)
    if named:
        raise ValueError(
            f"query type {named[0]!r} is the ledger's account of a subject's total across "
            "a wider scope; a release names its own query type"
        )
    shared = sorted(q for q in query_types if q.startswith(SHARE_PREFIX))
    if shared:
        raise ValueError(
            f"query type {shared[0]!r} is the ledger's account of a principal's share of a "
            f"cap (query types starting {SHARE_PREFIX!r} are the ledger's own); a release "
            "names its own query type"
        )


def _periods(
    policy_of: Callable[[LedgerKey], Policy],
    tenant: str,
    query_type: str,
    window: str,
    wider: Sequence[Policy],
) -> list[tuple[str, str]]:
    """(scope query type, period) of each wider cap a release in ``window`` is charged to."""
    own = policy_of(LedgerKey.from_canonical(tenant, "-", query_type, window)).calendar
    start = window_bounds(window)[0]
    periods = []
    for policy in wider:
        if policy.calendar.windows != own:
            raise LedgerError(
                f"tenant {tenant!r} has a cap across {policy.across.replace('_', ' ')} "
                f"in {policy.calendar.windows.kind} windows, but query type {query_type!r} "
                f"has {own.kind} windows: a release is charged to both, so give the query "
                "type's policy the same calendar"
            )
        periods.append((policy.query_type, policy.calendar.window_of(start)))
    return periods


def with_wider_scopes(
    keys: Sequence[LedgerKey],
    cohorts: Sequence[CohortKeys],
    policies: PolicyMap,
    *,
    shared: bool = True,
    dag: str | None = None,
) -> tuple[list[LedgerKey], list[CohortKeys]]:
    """What a release over ``keys`` (subject keys in lock order) or ``cohorts`` charges
    with every wider cap that applies: the same subjects in each wider scope's period of
    each window they are charged in, once per period; and, where a cap is divided among
    principals, the subjects' accounts of the share of the release's principal (the
    principal of ``dag``, the release's DAG: :mod:`shares`); keys in lock order.

    A window label that is not a calendar window is left to the window checks that
    follow (they refuse it naming its calendar); it charges no wider scope here. A
    release whose DAG has no share of a divided cap is refused (:class:`NoShare`).
    Without ``shared`` (a correction: a release the ledger missed, by no principal) no
    share is charged; the scopes' own accounts still hold it.
    """
    refuse_scope_names({key.query_type for key in keys} | {c.query_type for c in cohorts})
    divided = shared and any(policy.shares for policy in policies.values())
    if not divided and not any(query_type in SCOPE_ACCOUNTS for _, query_type in policies):
        return list(keys), list(cohorts)  # no wider or divided cap anywhere: nothing to add
    policy_of = policy_lookup(policies)
    wider_of: dict[str, list[Policy]] = {}

    def periods(tenant: str, query_type: str, window: str) -> list[tuple[str, str]]:
        wider = wider_of.get(tenant)
        if wider is None:
            wider = wider_of[tenant] = wider_policies(policies, tenant)
        if not wider:
            return []
        try:
            return _periods(policy_of, tenant, query_type, window, wider)
        except ValueError:  # not a calendar label: refused by the window checks
            return []

    def scopes_of(tenant: str, query_type: str, window: str) -> list[tuple[str, str]]:
        """(query type, window or period) of every account a release charges for its
        (tenant, query type, window), its own first."""
        charged = [(query_type, window), *periods(tenant, query_type, window)]
        if not divided:
            return charged
        shares = []
        for scope, period in charged:
            policy = policy_of(LedgerKey.from_canonical(tenant, "-", scope, period))
            if policy.shares:
                shares.append((_share_of(policy, tenant, scope, dag), period))
        return charged + shares

    if cohorts:
        extra: dict[tuple[str, str, str], CohortKeys] = {}
        for given in cohorts:
            for query_type, period in scopes_of(given.tenant, given.query_type, given.window)[1:]:
                extra.setdefault(
                    (given.cohort.digest, query_type, period),
                    CohortKeys(given.cohort, query_type, period),
                )
        return list(keys), [*cohorts, *extra.values()]
    by_scope: dict[tuple[str, str, str], list[tuple[str, str]]] = {}
    added: dict[tuple[str, str, str, str], LedgerKey] = {}
    for key in keys:
        scope = (key.tenant, key.query_type, key.window)
        targets = by_scope.get(scope)
        if targets is None:
            targets = by_scope[scope] = scopes_of(*scope)[1:]
        for query_type, period in targets:
            parts = (key.tenant, key.subject, query_type, period)
            if parts not in added:
                added[parts] = LedgerKey.from_canonical(*parts)
    if not added:
        return list(keys), []
    return in_lock_order([*keys, *added.values()]), []


class NoShare(LedgerError):
    """A release at a scope whose cap is divided among principals, by a DAG that no share
    names (or with no DAG at all): it has no budget there."""


def _share_of(policy: Policy, tenant: str, query_type: str, dag: str | None) -> str:
    """The query type of the share accounts a release by ``dag`` charges at the divided
    scope (tenant, query type), whose policy is ``policy``."""
    share = principal_of(policy.shares, dag)
    if share is None:
        raise NoShare(
            f"the cap of tenant {tenant!r}, query type {query_type!r} is divided among "
            f"principals ({', '.join(s.principal for s in policy.shares)}) and no share names "
            f"DAG {dag!r}: an administrator gives the DAG a share (`dp-budget policy set "
            "--share`)"
        )
    found = share_query_type(share.principal, query_type)
    if len(found) > MAX_PART_LENGTH:
        raise NoShare(
            f"query type {query_type!r} is too long to be divided among principals (its "
            f"share accounts' query type would pass {MAX_PART_LENGTH} characters)"
        )
    return found


def missed_totals(charged: Sequence[ChargedCohort], policies: PolicyMap) -> list[str]:
    """What a charge that covered ``charged`` (its history entry's cohorts) should also
    have charged under ``policies`` and did not, as verify names it: for each cohort of a
    query type's window, the subjects' total at each wider scope whose cap applied, in
    that window's period.

    A total holds the union of the subjects the charge covers in its period, once. Where
    one cohort is all the charge covers in that period (a release of one query type in one
    window of it: what the operators make) the total is that very cohort; where several
    are (keys of two query types, or of two windows of one horizon, in one release), it
    holds at least as many subjects as the largest and at most as many as all of them."""
    recorded = {(c.tenant, c.query_type, c.window): c for c in charged}
    feeding: dict[tuple[str, str, str], list[ChargedCohort]] = {}
    needed: list[tuple[ChargedCohort, Policy, str]] = []
    for cohort in charged:
        if kept_by_ledger(cohort.query_type):
            continue
        try:
            start = window_bounds(cohort.window)[0]
        except ValueError:  # not a calendar label: never charged beyond itself
            continue
        for policy in wider_policies(policies, cohort.tenant):
            period = policy.calendar.window_of(start)
            feeding.setdefault((cohort.tenant, policy.query_type, period), []).append(cohort)
            needed.append((cohort, policy, period))
    missed = []
    for cohort, policy, period in needed:
        scope = (cohort.tenant, policy.query_type, period)
        total, fed = recorded.get(scope), feeding[scope]
        if total is None or (
            total.cohort != cohort.cohort
            if len(fed) == 1
            else not max(c.size for c in fed) <= total.size <= sum(c.size for c in fed)
        ):
            missed.append(
                f"cohort {cohort.cohort} in window {cohort.window} of ({cohort.tenant}, "
                f"{cohort.query_type}) is not charged to its subjects' total "
                f"{policy.query_type!r} in {period}, which a cap applied to"
            )
    return missed


def missed_shares(
    charged: Sequence[ChargedCohort], policies: PolicyMap, dag: str | None
) -> list[str]:
    """What a reservation by ``dag`` that covered ``charged`` (its history entry's
    cohorts) charged wrongly at a divided cap, as verify names it: each account of a
    divided scope must come with the very same cohort in its principal's share account,
    and no share may be charged that the DAG does not hold."""
    if not any(policy.shares for policy in policies.values()):
        expected: set[tuple[str, str, str, str]] = set()
    else:
        policy_of = policy_lookup(policies)
        expected = set()
        for cohort in charged:
            if parse_share(cohort.query_type) is not None:
                continue
            key = LedgerKey.from_canonical(cohort.tenant, "-", cohort.query_type, cohort.window)
            policy = policy_of(key)
            if not policy.shares:
                continue
            share = principal_of(policy.shares, dag)
            if share is None:
                return [
                    f"cohort {cohort.cohort} is charged at the divided cap of "
                    f"({cohort.tenant}, {cohort.query_type}) by DAG {dag!r}, which no share names"
                ]
            expected.add(
                (
                    cohort.tenant,
                    share_query_type(share.principal, cohort.query_type),
                    cohort.window,
                    cohort.cohort,
                )
            )
    found = {
        (c.tenant, c.query_type, c.window, c.cohort)
        for c in charged
        if parse_share(c.query_type) is not None
    }
    return [
        f"cohort {cohort} in {window} of tenant {tenant!r} is not charged to its share "
        f"account {query_type!r}, which its DAG's share required"
        for tenant, query_type, window, cohort in sorted(expected - found)
    ] + [
        f"cohort {cohort} in {window} of tenant {tenant!r} is charged to the share account "
        f"{query_type!r}, which its DAG {dag!r} does not hold"
        for tenant, query_type, window, cohort in sorted(found - expected)
    ]


class CorrectedTotals:
    """Verify's account of what corrections charged to the totals.

    A correction charges its key's own account and the subject's totals whose caps apply,
    one entry each, the own entry first naming the totals' query types. Other
    transactions' entries may come between them, so the totals are matched by what they
    carry: tenant, the subject's cohort, cost, count and reason.
    """

    def __init__(self) -> None:
        self._due: dict[tuple[Any, ...], int] = {}

    def own(
        self,
        cohort: ChargedCohort,
        named: Sequence[str] | None,
        what: tuple[Any, ...],
        policies: PolicyMap,
    ) -> list[str]:
        """The own entry of a correction: the totals a cap applied to must be named, and
        each named one is then due in its period of the window (``what``: cost, count and
        reason)."""
        try:
            start = window_bounds(cohort.window)[0]
        except ValueError:
            return []
        wider = {policy.query_type: policy for policy in wider_policies(policies, cohort.tenant)}
        given = set(named or ())
        for query_type in given:
            policy = wider.get(query_type)
            period = policy.calendar.window_of(start) if policy else cohort.window
            key = (cohort.tenant, cohort.cohort, query_type, period, *what)
            self._due[key] = self._due.get(key, 0) + 1
        required = set(wider)
        return [
            f"the correction of cohort {cohort.cohort} in window {cohort.window} of "
            f"({cohort.tenant}, {cohort.query_type}) does not charge its subject's total "
            f"{query_type!r}, which a cap applied to"
            for query_type in sorted(required - given)
        ]

    def total(self, cohort: ChargedCohort, what: tuple[Any, ...]) -> str | None:
        """A total's entry of a correction: one its own entry named, in the period of its
        window, else the problem."""
        key = (cohort.tenant, cohort.cohort, cohort.query_type, cohort.window, *what)
        if self._due.get(key, 0) == 0:
            return (
                f"a correction charges the total {cohort.query_type!r} of cohort "
                f"{cohort.cohort} in {cohort.window} that no correction of its own key named"
            )
        self._due[key] -= 1
        return None

    def unmet(self) -> list[str]:
        """After the last entry: totals a correction named but never charged."""
        return [
            f"a correction of tenant {tenant!r}, cohort {cohort} named its total "
            f"{query_type!r} in {period} but never charged it"
            for (tenant, cohort, query_type, period, *_), due in sorted(self._due.items())
            if due > 0
        ]


def same_wider_scopes(before: PolicyMap, after: PolicyMap, tenants: set[str]) -> bool:
    """Whether ``after`` holds the policies ``before`` held for ``tenants`` (theirs and
    every tenant's): then the wider scopes a release's were chosen by are those in force
    under its locks. Any change of them, not only of a wider cap, is a difference: a
    query type's calendar decides its periods too."""

    def theirs(policies: PolicyMap) -> dict[tuple[str, str], Policy]:
        return {scope: p for scope, p in policies.items() if scope[0] in tenants or scope[0] == ANY}

    return theirs(before) == theirs(after)
