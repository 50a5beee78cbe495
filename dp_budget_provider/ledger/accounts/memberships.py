"""Which account holds each subject: the one reading of class membership.

A class's members are either listed in ``dp_members``, one row per subject, or they are
exactly the members of the cohort the class refers to (``dp_accounts.cohort_id``): a
cohort new to its window makes such a class, and its million subjects are then stored
once, as the cohort, not a second time as members. So a subject's account is found in
two *arms*: its ``dp_members`` row, or a class referring to a cohort that holds it. No
subject is in both (a class that refers to a cohort has no ``dp_members`` rows, and a
cohort's subjects new to a window have no account there yet).

Every read of membership goes through :func:`memberships`, which filters each arm
before the two are put together: a filter on a union is not pushed into its arms by
every planner, and each arm has its own index (a subject's ``dp_members`` key; a
cohort's members by cohort and subject). The raw-SQL writers (``classes``) read the
referring arm through :data:`REFERRING`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from sqlalchemy import (
    ColumnElement,
    CompoundSelect,
    and_,
    case,
    func,
    select,
    type_coerce,
    union_all,
)
from sqlalchemy.orm import aliased

from dp_budget_provider.ledger.storage.schema import Account, CohortMember, Member

# The classes of a scope that refer to their cohort, with each of their members (``a``
# the account, ``r`` a member): the SQL form of the referring arm, for raw statements.
# ``a.cohort_id IS NOT NULL`` says what the equality implies, so that the planner starts
# from the few referring classes (an index on cohort_id) whatever its statistics say:
# without it PostgreSQL hash-joined every cohort member in the database to the cohort of a
# release (106 ms a release after 3,000 releases of 400 keys, against 0.1 ms with it).
REFERRING = (
    "dp_accounts a JOIN dp_cohort_members r ON a.cohort_id IS NOT NULL "
    "AND r.cohort_id = a.cohort_id"
)

# The referring arm's member rows: an alias, so that a subquery a caller filters with
# (a cohort's members, say) is never correlated to it.
_REFERRED = aliased(CohortMember, name="referred_member")


@dataclass(frozen=True)
class Arm:
    """The columns of one arm: a membership's key parts and its account's label, and
    ``accounts``, the table of its accounts (live or sealed) for the rest of their columns."""

    tenant: Any
    query_type: Any
    window: Any
    subject: Any
    account: Any
    accounts: Any = Account


def member_account(accounts: Any = Account) -> ColumnElement[bool]:
    """The join of a ``dp_members`` row to its account (live, or sealed: ``accounts``)."""
    return and_(
        accounts.tenant == Member.tenant,
        accounts.query_type == Member.query_type,
        accounts.window == Member.window,
        accounts.subject == Member.account,
    )


def arms(accounts: Any = Account) -> tuple[Arm, Arm]:
    """The two arms over ``accounts``: ``Account`` (the live windows) or ``SealedAccount``
    (the final spend of sealed ones, whose members a reset keeps where they were)."""
    listed = Arm(
        Member.tenant, Member.query_type, Member.window, Member.subject, Member.account, accounts
    )
    # The label as a column of no lineage (type_coerce renders as the bare column): an
    # entity aliased onto these rows by column correspondence (``subject_rows``) must map
    # the account's ``subject`` to the member, never to the label.
    referred = Arm(
        accounts.tenant,
        accounts.query_type,
        accounts.window,
        _REFERRED.subject,
        type_coerce(accounts.subject, accounts.subject.type),
        accounts,
    )
    return listed, referred


LISTED, REFERRED = arms()


def memberships(
    columns: Callable[[Arm], list[Any]],
    where: Callable[[Arm], list[ColumnElement[bool]]] = lambda arm: [],
    accounts: Any = Account,
) -> CompoundSelect:
    """Rows of ``columns(arm)`` (an arm's columns and its ``accounts``'), one per
    membership for which every ``where(arm)`` holds, from both arms (``UNION ALL``: no
    membership is in both), over the live accounts or (``accounts=SealedAccount``) the
    sealed ones."""
    listed_arm, referred_arm = arms(accounts)
    listed = (
        select(*columns(listed_arm)).select_from(Member).join(accounts, member_account(accounts))
    )
    referred = (
        select(*columns(referred_arm))
        .select_from(accounts)
        .join(
            _REFERRED,
            and_(accounts.cohort_id.is_not(None), _REFERRED.cohort_id == accounts.cohort_id),
        )
    )
    return union_all(listed.where(*where(listed_arm)), referred.where(*where(referred_arm)))


def in_scope(tenant: Any, query_type: Any, window: Any) -> Callable[[Arm], list[Any]]:
    """The ``where`` of one (tenant, query type, window)."""
    return lambda arm: [arm.tenant == tenant, arm.query_type == query_type, arm.window == window]


def least_member(accounts: Any = Account) -> Any:
    """The least subject of the account of the enclosing ``accounts`` row (correlated):
    its cohort's least member when it refers to one, else its least ``dp_members`` row."""
    listed = (
        select(func.min(Member.subject))
        .where(member_account(accounts))
        .correlate(accounts)
        .scalar_subquery()
    )
    referred = (
        select(func.min(_REFERRED.subject))
        .where(_REFERRED.cohort_id == accounts.cohort_id)
        .correlate(accounts)
        .scalar_subquery()
    )
    return case((accounts.cohort_id.is_(None), listed), else_=referred)
