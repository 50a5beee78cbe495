"""The accounts as one row per subject: the per-subject view over stored spend classes.

An account row holds the spend of a class of subjects (``schema``); people ask about
subjects. :data:`SubjectRow` is ``dp_accounts`` joined with their members (both arms of
``memberships``): one row per subject of a live window, its key the member's, every
other column its account's (so a query written against ``Account`` reads the same
against it), plus ``account``, the label of the account holding the subject's spend.
Several rows share one account ``id``: key such rows by their key, never by id.

Reads that only count or group subjects need no per-subject rows: an account stands for
``size`` subjects (:func:`subjects_of`), so they cost one row per class.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import ColumnElement, Subquery, func, select
from sqlalchemy.orm import aliased

from dp_budget_provider.ledger.memberships import Arm, memberships
from dp_budget_provider.ledger.schema import Account


def _rows() -> Subquery:
    # The key columns are the membership's (equal to the account's, the label included):
    # filters and the key order then run on each arm's index of members on either
    # backend, and the account's own ``subject`` is not a column here (the alias would
    # map ``subject`` to it).
    keys = {"tenant", "subject", "query_type", "window"}

    def columns(arm: Arm) -> list[Any]:
        return [
            getattr(arm, column.key).label(column.key)
            if column.key in keys
            else getattr(Account, column.key)
            for column in Account.__table__.columns
        ] + [arm.account.label("account")]

    return memberships(columns).subquery("subject_rows")


ROWS = _rows()
SubjectRow = aliased(Account, ROWS, name="subject_rows", adapt_on_names=True)
LABEL = ROWS.c.account  # the label of the account holding the row's subject


def subject_rows() -> Any:
    """Every column of the per-subject rows (``SubjectRow``'s and ``account``)."""
    return select(SubjectRow, LABEL)


def on(entity: Any, columns: tuple[Any, ...]) -> tuple[Any, ...]:
    """``Account`` columns as the same columns of ``entity`` (``Account`` or ``SubjectRow``)."""
    return tuple(getattr(entity, column.key) for column in columns)


def subjects_of(entity: Any) -> ColumnElement[Any]:
    """How many subjects the rows of ``entity`` in a group hold: one per per-subject row,
    ``size`` per account."""
    if entity is Account:
        return func.coalesce(func.sum(Account.size), 0)
    return func.count()
