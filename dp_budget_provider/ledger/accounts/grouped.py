"""One grouped read of stored spend: the distinct spends some subjects hold, and how many.

Three questions have this shape. The budget check asks which distinct states the keys of a
release hold (``held``); the accounts page, sorted by epsilon or filtered by state, which
(scope, spend) groups match a filter (``views.queries``); the spend classes, which subjects
of a window hold the same spend (``views.spend_classes``). Each groups the stored accounts
by some of their columns (the spend among them) and counts the subjects holding each
group, in the live or the sealed store. What differs is the columns, the filter, and where
the subjects are counted:

- in the accounts, each counting the ``size`` subjects of its class: one row read per
  class, for a filter that leaves the subject open;
- in the memberships, one row per subject (both arms of ``memberships``, the filter
  applied to each arm), for a filter on the subjects themselves: a list of them, a
  cohort's members, a subject pattern.

:func:`grouped_spend` builds that SELECT for all of them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from sqlalchemy import ColumnElement, Select, func, null, select

from dp_budget_provider.ledger.accounts.memberships import Arm, least_member, memberships
from dp_budget_provider.ledger.accounts.subject_rows import LIVE, Store, on, subjects_of

# Conditions on the key columns (tenant, subject, query_type, window) of what is read:
# an arm of the memberships, or a store's accounts.
Where = Callable[[Any], list[ColumnElement[bool]]]


def grouped_spend(
    shared: Sequence[Any],
    where: Where,
    *,
    store: Store = LIVE,
    per_subject: bool = False,
    least: bool = False,
    latest: bool = False,
) -> Select:
    """The distinct values of ``shared`` (``Account`` columns, as their names) among the
    subjects for which every ``where`` holds in ``store``, with ``size``, how many subjects
    hold each.

    The subjects are counted in their accounts (``size`` each), or with ``per_subject``
    one row per membership, ``where`` then applying to each arm. ``least`` adds
    ``subject``, the least subject of a group (of an account: its least member);
    ``latest`` adds ``updated_at`` and ``sealed_at``, the latest update and seal of the
    group's accounts (``sealed_at`` NULL in the live store).
    """
    accounts = store.accounts
    if not per_subject:
        grouping = on(accounts, tuple(shared))
        columns = [*grouping, subjects_of(accounts).label("size")]
        if least:
            columns.append(func.min(least_member(accounts)).label("subject"))
        if latest:
            sealed_at = accounts.sealed_at if store.sealed else null()
            columns += [
                func.max(accounts.updated_at).label("updated_at"),
                func.max(sealed_at).label("sealed_at"),
            ]
        return select(*columns).where(*where(accounts)).group_by(*grouping)

    def picked(arm: Arm) -> list[Any]:
        found = [*on(arm.accounts, tuple(shared)), arm.subject.label("member")]
        if latest:
            found.append(arm.accounts.updated_at)
            if store.sealed:
                found.append(arm.accounts.sealed_at)
        return found

    rows = memberships(picked, where, accounts).subquery("members")
    grouping = [rows.c[column.key] for column in shared]
    columns = [*grouping, func.count().label("size")]
    if least:
        columns.append(func.min(rows.c.member).label("subject"))
    if latest:
        sealed_at = rows.c.sealed_at if store.sealed else null()
        columns += [
            func.max(rows.c.updated_at).label("updated_at"),
            func.max(sealed_at).label("sealed_at"),
        ]
    return select(*columns).group_by(*grouping)
