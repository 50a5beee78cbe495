"""Spend classes: the subjects of a window that hold the same spend, shown as one row.

A release charges every subject it covers the same cost, so the subjects that the same
releases covered hold the same stored spend (committed and pending), release count and
open reservations. Listing them one per subject shows 50 identical rows for a release
over 50 subjects and a million for a population; a class row says "48,211 subjects, eps
1.99 of 3" once, and its members are a drill-down away. Classes are read by grouping the
stored accounts (each an exact class of the write path, ``classes``: several may hold
equal spend and show as one class here), counting their ``size``: one row per account,
never one per subject, unless a subject filter asks for the memberships, one row per
subject (``grouped``). A class's id is a digest of what its members share, so it names
the class while no release changes it.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any

from sqlalchemy import ColumnElement, and_, literal

from dp_budget_provider.ledger.accounts.grouped import grouped_spend
from dp_budget_provider.ledger.accounts.keys import canonical_part
from dp_budget_provider.ledger.accounts.standing import SPEND_COLUMNS, Standings
from dp_budget_provider.ledger.accounts.subject_rows import LIVE, STORES, Store, on
from dp_budget_provider.ledger.ledger import PrivacyBudgetLedger
from dp_budget_provider.ledger.records import AccountStatus
from dp_budget_provider.ledger.storage.schema import Account
from dp_budget_provider.ledger.views.pages import (
    AccountFilter,
    Page,
    PolicyCache,
    holds,
    page_bounds,
)

# What the members of a class share: their window, and everything their status reads.
SHARED = (
    Account.tenant,
    Account.query_type,
    Account.window,
    *SPEND_COLUMNS,
    Account.releases,
    Account.open_reservations,
    Account.rescoped_to,
)


@dataclass(frozen=True)
class SpendClass:
    """Subjects of one window holding the same spend.

    ``status`` is that of the class's least subject: every member's status but for its
    key and update time (``updated_at`` is the latest of the members'), and its
    ``account`` is None (the class may be held by several accounts of equal spend).
    ``subjects`` counts the members (those matching a subject filter, when one is given).
    """

    id: str
    subjects: int
    status: AccountStatus


def _class_id(row: Any) -> str:
    shared = [getattr(row, column.key) for column in SHARED]
    text = json.dumps(shared, separators=(",", ":"), allow_nan=False)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _grouped(filters: AccountFilter, store: Store = LIVE) -> Any:
    """The classes of the subjects matching ``filters`` in ``store``: what they share,
    with their subject count and least subject (:func:`~grouped.grouped_spend`), when
    their accounts were last updated and when their window was sealed (NULL while it is
    live)."""
    return grouped_spend(
        SHARED,
        filters.conditions,
        store=store,
        per_subject=filters.per_subject,
        least=True,
        latest=True,
    ).add_columns(literal(None).label("account"))  # a class may span several accounts


def _classes(ledger: PrivacyBudgetLedger, filters: AccountFilter) -> list[SpendClass]:
    with ledger.reading() as connection:
        rows = [
            row for store in filters.stores for row in connection.execute(_grouped(filters, store))
        ]
    policies = PolicyCache(ledger)
    classes = [
        SpendClass(
            _class_id(row),
            int(row.size),
            AccountStatus.of(row, standing, policies(row.tenant, row.query_type)),
        )
        for row, standing in zip(rows, Standings(ledger, policies).of_rows(rows), strict=True)
    ]
    if filters.state is not None:  # AccountFilter spells it as AccountStatus.state does
        classes = [c for c in classes if c.status.state == filters.state]
    return classes


def find_classes(
    ledger: PrivacyBudgetLedger,
    filters: AccountFilter | None = None,
    *,
    limit: int = 50,
    offset: int = 0,
) -> Page[SpendClass]:
    """The spend classes of the accounts matching ``filters``, one page, with the total.

    Ordered by tenant, query type and window, then the largest class first. A subject
    filter finds the classes of the matching subjects (the search for one person).
    """
    limit, offset = page_bounds(limit, offset)
    classes = every_class(ledger, filters)
    return Page(
        total=len(classes), offset=offset, limit=limit, items=classes[offset : offset + limit]
    )


def every_class(
    ledger: PrivacyBudgetLedger, filters: AccountFilter | None = None
) -> list[SpendClass]:
    """Every spend class matching ``filters``, in :func:`find_classes` order."""
    return sorted(
        _classes(ledger, filters or AccountFilter()),
        key=lambda c: (
            c.status.key.tenant,
            c.status.key.query_type,
            c.status.key.window,
            -c.subjects,
            c.status.key.subject,
        ),
    )


def class_members(
    ledger: PrivacyBudgetLedger,
    tenant: str,
    query_type: str,
    window: str,
    class_id: str,
    *,
    limit: int = 50,
    offset: int = 0,
) -> Page[AccountStatus] | None:
    """The members of one spend class (the subjects of its accounts), by subject, one
    page, each with its status and account; None when the window has no
    class of that id (it never had, or a release has since changed its members' spend)."""
    limit, offset = page_bounds(limit, offset)
    scope = AccountFilter(
        tenant=canonical_part("tenant", tenant),
        query_type=canonical_part("query_type", query_type),
        window=canonical_part("window", window),
    )
    if not isinstance(class_id, str) or not class_id:
        raise ValueError(f"class id must be a non-empty string, got {class_id!r}")
    with ledger.reading() as connection:
        shared, store = next(
            (
                (row, store)
                for store in STORES
                for row in connection.execute(_grouped(scope, store))
                if _class_id(row) == class_id
            ),
            (None, LIVE),
        )
        if shared is None:
            return None
        members = (
            store.subject_rows()
            .where(_same(shared, store.rows))
            .order_by(store.rows.subject)
            .offset(offset)
            .limit(limit)
        )
        rows = list(connection.execute(members))
    policies = PolicyCache(ledger)
    policy = policies(shared.tenant, shared.query_type)
    items = [
        AccountStatus.of(row, standing, policy)
        for row, standing in zip(rows, Standings(ledger, policies).of_rows(rows), strict=True)
    ]
    return Page(total=int(shared.size), offset=offset, limit=limit, items=items)


def _same(shared: Any, rows: Any) -> ColumnElement[bool]:
    """The subjects (``rows``: a store's per-subject rows) whose accounts hold exactly
    what ``shared`` (a grouped row) holds."""
    return and_(*(holds(column, getattr(shared, column.key)) for column in on(rows, SHARED)))
