"""The accounts as one row per subject: the per-subject view over stored spend classes.

An account row holds the spend of a class of subjects (``schema``); people ask about
subjects. :data:`SubjectRow` is ``dp_accounts`` joined with their members (both arms of
``memberships``): one row per subject of a live window, its key the member's, every
other column its account's (so a query written against ``Account`` reads the same
against it), plus ``account``, the label of the account holding the subject's spend.
Several rows share one account ``id``: key such rows by their key, never by id.

Reads that only count or group subjects need no per-subject rows: an account stands for
``size`` subjects (:func:`subjects_of`), so they cost one row per class.

A sealed window's accounts are in ``dp_sealed_accounts`` (the same columns, and
``sealed_at``), their members where they were: :data:`SEALED` is the same view over them,
:data:`LIVE` the one over the live windows. A read names the store it reads.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from sqlalchemy import ColumnElement, Subquery, func, null, select
from sqlalchemy.orm import aliased

from dp_budget_provider.ledger.accounts.memberships import Arm, memberships
from dp_budget_provider.ledger.storage.schema import Account, SealedAccount


def _rows(accounts: Any = Account) -> Subquery:
    # The key columns are the membership's (equal to the account's, the label included):
    # filters and the key order then run on each arm's index of members on either
    # backend, and the account's own ``subject`` is not a column here (the alias would
    # map ``subject`` to it).
    keys = {"tenant", "subject", "query_type", "window"}

    def columns(arm: Arm) -> list[Any]:
        return [
            getattr(arm, column.key).label(column.key)
            if column.key in keys
            else getattr(accounts, column.key)
            for column in accounts.__table__.columns
        ] + [arm.account.label("account")]

    name = "subject_rows" if accounts is Account else "sealed_subject_rows"
    return memberships(columns, accounts=accounts).subquery(name)


ROWS = _rows()
SubjectRow = aliased(Account, ROWS, name="subject_rows", adapt_on_names=True)
LABEL = ROWS.c.account  # the label of the account holding the row's subject


def subject_rows() -> Any:
    """Every column of the per-subject rows (``SubjectRow``'s and ``account``)."""
    return select(SubjectRow, LABEL)


_SEALED_ROWS = _rows(SealedAccount)


@dataclass(frozen=True)
class Store:
    """The accounts of the live windows, or the final ones of the sealed windows.

    ``accounts`` is the table of its accounts, ``rows`` its per-subject rows (an entity
    with ``Account``'s columns), ``label`` the rows' account label and ``sealed_at`` the
    column saying when a row's window was sealed (NULL in the live store).
    """

    accounts: Any
    rows: Any
    label: Any
    sealed_at: Any

    @property
    def sealed(self) -> bool:
        return self.accounts is SealedAccount

    def subject_rows(self) -> Any:
        """The store's per-subject rows: every column of ``Account``, ``account`` (the
        label) and ``sealed_at``, in that order (the same in both stores)."""
        return select(*self.columns(self.rows), self.label.label("account"), self.sealed_at)

    def account_rows(self) -> Any:
        """The store's accounts as the same columns (``account``: their own label)."""
        accounts = self.accounts
        return select(
            *self.columns(accounts), accounts.subject.label("account"), self.account_sealed_at
        )

    @property
    def account_sealed_at(self) -> Any:
        return self.accounts.sealed_at if self.sealed else null().label("sealed_at")

    @staticmethod
    def columns(entity: Any) -> list[Any]:
        """``Account``'s columns, in their order, as those of ``entity``."""
        return [getattr(entity, column.key) for column in Account.__table__.columns]


LIVE = Store(Account, SubjectRow, LABEL, null().label("sealed_at"))
SEALED = Store(
    SealedAccount,
    aliased(SealedAccount, _SEALED_ROWS, name="sealed_subject_rows", adapt_on_names=True),
    _SEALED_ROWS.c.account,
    _SEALED_ROWS.c.sealed_at,
)
STORES = (LIVE, SEALED)


def on(entity: Any, columns: tuple[Any, ...]) -> tuple[Any, ...]:
    """``Account`` columns as the same columns of ``entity`` (``Account`` or ``SubjectRow``)."""
    return tuple(getattr(entity, column.key) for column in columns)


def subjects_of(entity: Any) -> ColumnElement[Any]:
    """How many subjects the rows of ``entity`` in a group hold: one per per-subject row,
    ``size`` per account."""
    if entity in (Account, SealedAccount):
        return func.coalesce(func.sum(entity.size), 0)
    return func.count()
