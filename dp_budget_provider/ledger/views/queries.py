"""The accounts page: which subjects match, in what order, how many in total.

The ledger API answers "what is the state of these keys"; a UI needs "which accounts
match, in what order, how many in total". That is here (:func:`find_accounts`, one
account's status, :func:`account_status`, and the history's head that the UI keys its
cached verification on, :func:`chain_head`), as plain functions taking a
:class:`PrivacyBudgetLedger`, so the ledger class stays about writing and the queries stay
usable from the CLI or a notebook (no Airflow import).

The accounts a page lists are subjects: one row per subject of a live account, at its
account's (its spend class's) spend, read through the memberships (``subject_rows``).
Counts and groups read the stored accounts instead, each standing for its ``size``
subjects, unless a subject filter needs the per-subject rows
(:attr:`~pages.AccountFilter.per_subject`).

Epsilon is not a column: it is converted from the stored RDP spend at read time. Filters
on key fields, and sorts on key fields, release counts or update time, run in SQL and
only the returned page is converted. Filtering by state or sorting by epsilon, fraction
or headroom has to convert every matching spend; each distinct stored spend (committed
and pending, with its scope: :mod:`standing`) is converted once (releases over many
subjects leave few distinct spends).

The CLI and the UI's routes (``plugins/app.py``) reach the pages through this module
alone (their reach into the ledger is fixed in ``tests/test_layering.py``), so it hands on
the other pages' names: filters and pages (``pages``), one account's history
(``account_history``), releases (``release_pages``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import groupby
from typing import Any

from sqlalchemy import ColumnElement, Connection, and_, or_, select, tuple_

from dp_budget_provider.ledger.accounts import classes
from dp_budget_provider.ledger.accounts.grouped import grouped_spend
from dp_budget_provider.ledger.accounts.keys import LedgerKey
from dp_budget_provider.ledger.accounts.standing import (
    SPEND_COLUMNS,
    Standing,
    Standings,
    stored_values,
)
from dp_budget_provider.ledger.accounts.subject_rows import (
    LIVE,
    SEALED,
    SubjectRow,
    on,
    subject_rows,
    subjects_of,
)
from dp_budget_provider.ledger.ledger import PrivacyBudgetLedger
from dp_budget_provider.ledger.records import AccountStatus
from dp_budget_provider.ledger.storage import history
from dp_budget_provider.ledger.storage.schema import Account
from dp_budget_provider.ledger.views.account_history import key_history, spend_series
from dp_budget_provider.ledger.views.pages import (
    KEY_FIELDS,
    MAX_PAGE,
    STATES,
    AccountFilter,
    Page,
    PolicyCache,
    filtered,
    holds,
    key_columns,
    page_bounds,
)
from dp_budget_provider.ledger.views.release_pages import Release, key_reservations, release
from dp_budget_provider.ledger.windows import scopes
from dp_budget_provider.ledger.windows.calendar import window_bounds
from dp_budget_provider.ledger.windows.policy import (
    STATE_EXHAUSTED,
    STATE_OK,
    STATE_WARNING,
    Policy,
)

__all__ = [
    # the accounts page
    "COMPUTED_SORTS",
    "MAX_GROUPS",
    "SORTS",
    "SQL_SORTS",
    "account_status",
    "subject_totals",
    "chain_head",
    "count_subjects",
    "find_accounts",
    # handed on from the other pages
    "MAX_PAGE",
    "STATES",
    "AccountFilter",
    "Page",
    "key_history",
    "spend_series",
    "Release",
    "key_reservations",
    "release",
]

SQL_SORTS = ("key", *KEY_FIELDS, "releases", "open_reservations", "updated_at")
COMPUTED_SORTS = ("epsilon", "fraction", "remaining", "state")
SORTS = SQL_SORTS + COMPUTED_SORTS
MAX_GROUPS = 500  # beyond this many distinct (scope, spend) groups: rank in one pass
SCOPED_SPEND = (Account.tenant, Account.query_type, *SPEND_COLUMNS)  # what decides a standing
_STATE_RANK = {STATE_OK: 0, STATE_WARNING: 1, STATE_EXHAUSTED: 2}


def _key_match(columns: Sequence[Any], key: LedgerKey) -> ColumnElement[bool]:
    return and_(*(column == value for column, value in zip(columns, _key_values(key), strict=True)))


def _key_values(key: LedgerKey) -> tuple[str, str, str, str]:
    return key.tenant, key.subject, key.query_type, key.window


def find_accounts(
    ledger: PrivacyBudgetLedger,
    filters: AccountFilter | None = None,
    *,
    sort: str = "key",
    descending: bool = False,
    limit: int = 50,
    offset: int = 0,
) -> Page[AccountStatus]:
    """The subjects of live accounts matching ``filters``, sorted, one page of them, with
    the total count.

    ``sort`` is one of :data:`SORTS`; ties are broken by key (ascending), so pages are
    stable. Sorting by a key field, a count or the update time without a state filter is
    one SQL query for the page and one count by account (and one for the releases of the
    page's scopes). Otherwise the matching accounts are first grouped in SQL by what
    decides their standing and policy (tenant, query type, stored spend); each group is
    converted once, and the page is read group by group in sort order. Subjects charged
    by the same releases share an account, and accounts with equal spend a group, so
    this stays fast for releases over many subjects.
    """
    filters = filters or AccountFilter()
    limit, offset = page_bounds(limit, offset)
    if sort not in SORTS:
        raise ValueError(f"sort must be one of {', '.join(SORTS)}; got {sort!r}")
    policies = PolicyCache(ledger)
    standings = Standings(ledger, policies)
    if filters.state is None and sort in SQL_SORTS:
        return _sql_page(ledger, filters, sort, descending, limit, offset, standings, policies)
    groups = _groups(ledger, filters, standings, policies)
    if filters.state is not None:
        groups = [group for group in groups if group.state == filters.state]
    total = sum(group.count for group in groups)
    if not groups or offset >= total:
        return Page(total=total, offset=offset, limit=limit)
    if len(groups) > MAX_GROUPS:
        rows = _full_pass(ledger, filters, groups, sort, descending, limit, offset)
    elif sort in SQL_SORTS:
        query = filtered(subject_rows(), filters).where(or_(*map(_group_match, groups)))
        query = query.order_by(*_sql_order(sort, descending)).offset(offset).limit(limit)
        with ledger.reading() as connection:
            rows = list(connection.execute(query))
    else:
        rows = _banded(ledger, filters, groups, sort, descending, limit, offset)
    by_signature = {group.signature: group for group in groups}
    items = []
    for row in rows:
        group = by_signature[stored_values(row)]
        items.append(AccountStatus.of(row, group.standing, group.policy))
    return Page(total=total, offset=offset, limit=limit, items=items)


@dataclass(frozen=True)
class _Group:
    """Accounts with the same tenant, query type and stored spend (committed and pending):
    one standing, one policy."""

    tenant: str
    query_type: str
    spend: tuple[Any, ...]  # the values of SPEND_COLUMNS
    count: int
    standing: Standing
    policy: Policy
    state: str

    @property
    def signature(self) -> tuple[Any, ...]:
        return (self.tenant, self.query_type, *self.spend)

    def value(self, sort: str) -> float:
        checked, cap = self.standing.checked, self.policy.cap_epsilon
        if sort == "epsilon":
            return self.standing.committed.epsilon
        if sort == "fraction":  # as AccountStatus counts them: as the cap check does
            return checked.committed / cap
        if sort == "remaining":  # what a new release can still get: after the held spend
            return max(0.0, cap - checked.held)
        return _STATE_RANK[self.state]


def _groups(
    ledger: PrivacyBudgetLedger,
    filters: AccountFilter,
    standings: Standings,
    policies: PolicyCache,
) -> list[_Group]:
    query = grouped_spend(SCOPED_SPEND, filters.conditions, per_subject=filters.per_subject)
    with ledger.reading() as connection:
        rows = list(connection.execute(query))
    groups = []
    for row, standing in zip(rows, standings.of_rows(rows), strict=True):
        policy = policies(row.tenant, row.query_type)
        groups.append(
            _Group(
                row.tenant,
                row.query_type,
                stored_values(row)[2:],
                int(row.size),
                standing,
                policy,
                policy.state_at(standing.checked.held, standing.next_epsilon),
            )
        )
    return groups


def _group_match(group: _Group) -> ColumnElement[bool]:
    """The per-subject rows of ``group``."""
    spend = on(SubjectRow, SPEND_COLUMNS)
    return and_(
        SubjectRow.tenant == group.tenant,
        SubjectRow.query_type == group.query_type,
        *(holds(column, value) for column, value in zip(spend, group.spend, strict=True)),
    )


def _banded(
    ledger: PrivacyBudgetLedger,
    filters: AccountFilter,
    groups: list[_Group],
    sort: str,
    descending: bool,
    limit: int,
    offset: int,
) -> list[Any]:
    """The page of a computed sort: walk the groups in value order, read only the page."""
    ordered = sorted(groups, key=lambda group: group.value(sort), reverse=descending)
    rows: list[Any] = []
    position, end = 0, offset + limit
    with ledger.reading() as connection:
        for _, members in groupby(ordered, key=lambda group: group.value(sort)):
            band = list(members)  # equal values: one band, ordered by key
            size = sum(group.count for group in band)
            if position + size > offset and position < end:
                skip = max(0, offset - position)
                take = min(size, end - position) - skip
                query = (
                    filtered(subject_rows(), filters)
                    .where(or_(*map(_group_match, band)))
                    .order_by(*key_columns())
                    .offset(skip)
                    .limit(take)
                )
                rows += connection.execute(query)
            position += size
            if position >= end:
                break
    return rows


def _full_pass(
    ledger: PrivacyBudgetLedger,
    filters: AccountFilter,
    groups: list[_Group],
    sort: str,
    descending: bool,
    limit: int,
    offset: int,
) -> list[Any]:
    """The page when almost every account differs: rank every subject, then read the page.

    Subjects are ranked by key (their account's ``id`` is shared by its whole class).
    """
    by_signature = {group.signature: group for group in groups}
    keys = key_columns()
    query = filtered(select(*keys, *on(SubjectRow, SPEND_COLUMNS)), filters)
    if sort in SQL_SORTS and sort != "key":
        query = query.add_columns(getattr(SubjectRow, sort).label("sort_value"))
    with ledger.reading() as connection:
        ranked = []
        for row in connection.execute(query):
            group = by_signature.get(stored_values(row))
            if group is None:
                continue
            key = (row.tenant, row.subject, row.query_type, row.window)
            if sort == "key":
                value: Any = None
            elif sort in SQL_SORTS:
                value = row.sort_value
            else:
                value = group.value(sort)
            ranked.append((value, key))
        ranked.sort(key=lambda item: item[1])
        if sort != "key":
            ranked.sort(key=lambda item: item[0], reverse=descending)
        elif descending:
            ranked.reverse()
        page = [key for _, key in ranked[offset : offset + limit]]
        found = (
            {
                (row.tenant, row.subject, row.query_type, row.window): row
                for row in connection.execute(subject_rows().where(tuple_(*keys).in_(page)))
            }
            if page
            else {}
        )
    return [found[key] for key in page]


def _sql_order(sort: str, descending: bool) -> list[Any]:
    keys = key_columns()
    if sort == "key":
        return [k.desc() if descending else k.asc() for k in keys]
    column = getattr(SubjectRow, sort)
    return [column.desc() if descending else column.asc(), *keys]


def _sql_page(
    ledger: PrivacyBudgetLedger,
    filters: AccountFilter,
    sort: str,
    descending: bool,
    limit: int,
    offset: int,
    standings: Standings,
    policies: PolicyCache,
) -> Page[AccountStatus]:
    order = _sql_order(sort, descending)
    page = filtered(subject_rows(), filters).order_by(*order).offset(offset).limit(limit)
    with ledger.reading() as connection:
        total = count_subjects(connection, filters)
        rows = list(connection.execute(page))
    items = [
        AccountStatus.of(row, standing, policies(row.tenant, row.query_type))
        for row, standing in zip(rows, standings.of_rows(rows), strict=True)
    ]
    return Page(total=total, offset=offset, limit=limit, items=items)


def count_subjects(connection: Connection, filters: AccountFilter) -> int:
    """How many subjects of live accounts match ``filters`` (one row per class read
    unless the subjects are filtered)."""
    entity = LIVE.rows if filters.per_subject else LIVE.accounts
    query = filtered(select(subjects_of(entity)).select_from(entity), filters, entity)
    return int(connection.execute(query).scalar_one())


def account_status(ledger: PrivacyBudgetLedger, key: LedgerKey) -> AccountStatus | None:
    """The status of subject key ``key`` (its account's), or of account key ``key`` (a
    class label: the account's own, for its ``size`` subjects); None when it has none.
    A key of a sealed window reads its final spend there (state SEALED)."""
    with ledger.reading() as connection:
        row = None
        for store in (LIVE, SEALED):
            if classes.is_label(key.subject):
                rows = store.account_rows()
                query = rows.where(_key_match(key_columns(store.accounts), key))
            else:
                query = store.subject_rows().where(_key_match(key_columns(store.rows), key))
            row = connection.execute(query).one_or_none()
            if row is not None:
                break
    if row is None:
        return None
    policies = PolicyCache(ledger)
    standing = Standings(ledger, policies).of_row(row)
    return AccountStatus.of(row, standing, policies(row.tenant, row.query_type))


def subject_totals(ledger: PrivacyBudgetLedger, key: LedgerKey) -> list[AccountStatus]:
    """The subject's totals at the wider scopes whose caps cover ``key``'s window: across
    query types in that window, across the windows of the horizon it lies in (each where
    a cap keeps one and the subject has been charged to it). Empty for an account's own
    key (a class label) and for a window that is not a calendar's."""
    if classes.is_label(key.subject):
        return []
    try:
        start = window_bounds(key.window)[0]
    except ValueError:
        return []
    policies = {policy.scope: policy for policy in ledger.policies()}
    found = []
    for policy in scopes.wider_policies(policies, key.tenant):
        if policy.query_type == key.query_type:
            continue
        period = policy.calendar.window_of(start)
        total = LedgerKey.from_canonical(key.tenant, key.subject, policy.query_type, period)
        status = account_status(ledger, total)
        if status is not None:
            found.append(status)
    return found


def chain_head(ledger: PrivacyBudgetLedger) -> tuple[int, str]:
    """(last seq, digest of every chain head): changes whenever anything is written."""
    with ledger.reading() as connection:
        return history.heads_digest(connection)
