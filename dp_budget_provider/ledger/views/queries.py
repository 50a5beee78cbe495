"""Read-only queries for browsing a ledger: filtered, sorted, paginated pages with totals.

The ledger API answers "what is the state of these keys"; a UI needs "which accounts
match, in what order, how many in total", one account's history and reservations a page
at a time, and the account's cumulative epsilon over time. Those are here, as plain
functions taking a :class:`PrivacyBudgetLedger`, so the ledger class stays about writing
and the queries stay usable from the CLI or a notebook (no Airflow import).

The accounts a page lists are subjects: one row per subject of a live account, at its
account's (its spend class's) spend, read through the memberships (``subject_rows``).
Counts and groups read the stored accounts instead, each standing for its ``size``
subjects, unless a subject filter needs the per-subject rows (:func:`grouped_source`).

Epsilon is not a column: it is converted from the stored RDP spend at read time. Filters
on key fields, and sorts on key fields, release counts or update time, run in SQL and
only the returned page is converted. Filtering by state or sorting by epsilon, fraction
or headroom has to convert every matching spend; each distinct stored spend (committed
and pending, with its scope: :mod:`standing`) is converted once (releases over many
subjects leave few distinct spends).
"""

from __future__ import annotations

import json
import unicodedata
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from itertools import groupby
from typing import Any, Generic, TypeVar

import numpy as np
from sqlalchemy import (
    ColumnElement,
    Connection,
    Select,
    and_,
    case,
    func,
    or_,
    select,
    tuple_,
)

from dp_budget_provider.accounting import EpsilonBound
from dp_budget_provider.ledger.accounts import classes, concerning
from dp_budget_provider.ledger.accounts.keys import (
    MAX_PART_LENGTH,
    LedgerKey,
    canonical_part,
    whole_number,
)
from dp_budget_provider.ledger.accounts.spend import Spend
from dp_budget_provider.ledger.accounts.standing import (
    SPEND_COLUMNS,
    Standing,
    Standings,
    stored_values,
)
from dp_budget_provider.ledger.accounts.subject_rows import (
    LIVE,
    SEALED,
    STORES,
    Store,
    SubjectRow,
    on,
    subject_rows,
    subjects_of,
)
from dp_budget_provider.ledger.ledger import PrivacyBudgetLedger
from dp_budget_provider.ledger.records import COMMITTED, OPEN, REAPED, RELEASED, AccountStatus
from dp_budget_provider.ledger.storage import history
from dp_budget_provider.ledger.storage.schema import (
    HistoryEntry,
    ReservationKey,
)
from dp_budget_provider.ledger.storage.schema import Reservation as ReservationRow
from dp_budget_provider.ledger.windows.policy import (
    STATE_EXHAUSTED,
    STATE_OK,
    STATE_WARNING,
    Policy,
)
from dp_budget_provider.ledger.windows.policy_store import policy_of_scope

T = TypeVar("T")

KEY_FIELDS = ("tenant", "subject", "query_type", "window")
STATES = (STATE_OK, STATE_WARNING, STATE_EXHAUSTED)
RESERVATION_STATES = (OPEN, COMMITTED, RELEASED, REAPED)
SQL_SORTS = ("key", *KEY_FIELDS, "releases", "open_reservations", "updated_at")
COMPUTED_SORTS = ("epsilon", "fraction", "remaining", "state")
SORTS = SQL_SORTS + COMPUTED_SORTS
MAX_PAGE = 1000
MAX_GROUPS = 500  # beyond this many distinct (scope, spend) groups: rank in one pass
WILDCARD = "*"
_CHARGES = ("commit", "reap")
CLOSINGS = ("reset", "rescope-away")  # series actions that end a key's account, not its spend
_STATE_RANK = {STATE_OK: 0, STATE_WARNING: 1, STATE_EXHAUSTED: 2}


@dataclass(frozen=True)
class Page(Generic[T]):
    """One page of a longer result: ``total`` counts every match, ``items`` this page."""

    total: int
    offset: int
    limit: int
    items: list[T] = field(default_factory=list)


@dataclass(frozen=True)
class AccountFilter:
    """Which accounts to list. Key fields match exactly (canonicalised like keys), or as a
    pattern when they contain ``*`` (any run of characters); ``state`` is ``ok``,
    ``warning`` or ``exhausted`` (any case)."""

    tenant: str | None = None
    subject: str | None = None
    query_type: str | None = None
    window: str | None = None
    state: str | None = None
    sealed: bool = False  # include the sealed windows' final spend (state SEALED)

    def __post_init__(self) -> None:
        for name in KEY_FIELDS:
            value = getattr(self, name)
            if value is not None and not isinstance(value, str):
                raise ValueError(f"{name} filter must be a string, got {value!r}")
            if value is not None and len(value) > MAX_PART_LENGTH:
                raise ValueError(
                    f"{name} filter is {len(value)} characters long; a {name} has at most "
                    f"{MAX_PART_LENGTH}"
                )
        if self.state is not None:
            wanted = str(self.state).strip().lower()
            match = next((s for s in STATES if s.lower() == wanted), None)
            if match is None:
                raise ValueError(f"state must be one of {', '.join(STATES)}; got {self.state!r}")
            object.__setattr__(self, "state", match)
        if not isinstance(self.sealed, bool):
            raise ValueError(f"sealed must be True or False, got {self.sealed!r}")

    @property
    def stores(self) -> tuple[Store, ...]:
        """The stores these filters read: the live accounts, and the sealed ones when asked
        for (``sealed``) or when one window is named (its final spend, if it is sealed)."""
        one_window = self.window not in (None, "") and WILDCARD not in self.window
        return STORES if self.sealed or one_window else (LIVE,)


@dataclass(frozen=True)
class SeriesPoint:
    """The account's cumulative epsilon right after history entry ``seq``."""

    seq: int
    at: str
    action: str
    epsilon: float


@dataclass(frozen=True)
class SpendSeries:
    """Cumulative epsilon over time; ``points`` is at most ``max_points`` of ``events``."""

    events: int
    points: list[SeriesPoint]


# ---------------------------------------------------------------------- helpers


def _key_match(columns: Sequence[Any], key: LedgerKey) -> ColumnElement[bool]:
    return and_(*(column == value for column, value in zip(columns, _key_values(key), strict=True)))


def _key_values(key: LedgerKey) -> tuple[str, str, str, str]:
    return key.tenant, key.subject, key.query_type, key.window


def _account_columns(entity: Any = SubjectRow) -> tuple[Any, ...]:
    return (entity.tenant, entity.subject, entity.query_type, entity.window)


def _pattern(name: str, value: str) -> str | None:
    """The canonical text of a filter value, or None for an exact match (no wildcard)."""
    if WILDCARD not in value:
        return None
    text = " ".join(unicodedata.normalize("NFKC", value).casefold().split())
    for char in text:
        if unicodedata.category(char).startswith("C"):
            raise ValueError(f"{name} filter contains the control character {char!r}")
    escaped = text.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_")
    return escaped.replace(WILDCARD, "%")


def _condition(name: str, value: str | None, column: Any) -> ColumnElement[bool] | None:
    """What a filter value asks of its column; None when it matches anything."""
    if value is None or value == "":
        return None
    pattern = _pattern(name, value)
    if pattern is None:
        return column == canonical_part(name, value)
    if pattern.strip("%"):
        return column.like(pattern, escape="\\")
    return None


def filtered(query: Select[Any], filters: AccountFilter, entity: Any = SubjectRow) -> Select[Any]:
    """``query`` restricted to the rows of ``entity`` matching ``filters``' key fields:
    per-subject rows, or with ``entity=Account`` accounts (only when ``filters`` leaves
    the subject open, see :func:`grouped_source`)."""
    for name, column in zip(KEY_FIELDS, _account_columns(entity), strict=True):
        condition = _condition(name, getattr(filters, name), column)
        if condition is not None:
            query = query.where(condition)
    return query


def grouped_source(filters: AccountFilter, store: Store = LIVE) -> Any:
    """What a grouped read of the subjects matching ``filters`` reads in ``store``: the
    accounts, each counting the ``size`` subjects of its class (one row per class), unless
    the subjects are filtered, which only the per-subject rows can do (one row per
    subject)."""
    if _condition("subject", filters.subject, SubjectRow.subject) is None:
        return store.accounts
    return store.rows


def page_bounds(limit: int, offset: int) -> tuple[int, int]:
    if not isinstance(limit, int) or not 1 <= limit <= MAX_PAGE:
        raise ValueError(f"limit must be an integer in [1, {MAX_PAGE}], got {limit!r}")
    return limit, whole_number("offset", offset)


class _Epsilons:
    """Epsilon of stored spends, converting each distinct stored value once."""

    def __init__(self, ledger: PrivacyBudgetLedger) -> None:
        self._orders = np.asarray(ledger.orders)
        self._delta = ledger.delta
        self._conversion = ledger.conversion
        self._cache: dict[tuple[Any, Any, Any], EpsilonBound] = {}

    def of_columns(self, rho: float, residual: str | None, mu2: float | None) -> EpsilonBound:
        signature = (rho, residual, mu2)
        bound = self._cache.get(signature)
        if bound is None:
            spend = Spend.from_columns(rho, residual, mu2, self._orders.size)
            bound = spend.epsilon(self._orders, self._delta, self._conversion)
            self._cache[signature] = bound
        return bound

    def of_spend(self, spend: Spend) -> float:
        return spend.epsilon(self._orders, self._delta, self._conversion).epsilon


class PolicyCache:
    """The policy of each (tenant, query type), looked up once."""

    def __init__(self, ledger: PrivacyBudgetLedger) -> None:
        self._stored = {policy.scope: policy for policy in ledger.policies()}
        self._cache: dict[tuple[str, str], Policy] = {}

    def __call__(self, tenant: str, query_type: str) -> Policy:
        policy = self._cache.get((tenant, query_type))
        if policy is None:
            policy = self._cache[(tenant, query_type)] = policy_of_scope(
                self._stored, tenant, query_type
            )
        return policy


# ---------------------------------------------------------------------- accounts


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
    standings = Standings(ledger)
    policies = PolicyCache(ledger)
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
        epsilon, cap = self.standing.committed.epsilon, self.policy.cap_epsilon
        if sort == "epsilon":
            return epsilon
        if sort == "fraction":
            return epsilon / cap
        if sort == "remaining":  # what a new release can still get: after the held spend
            return max(0.0, cap - self.standing.held.epsilon)
        return _STATE_RANK[self.state]


def _groups(
    ledger: PrivacyBudgetLedger,
    filters: AccountFilter,
    standings: Standings,
    policies: PolicyCache,
) -> list[_Group]:
    entity = grouped_source(filters)
    columns = (entity.tenant, entity.query_type, *on(entity, SPEND_COLUMNS))
    counted = select(*columns, subjects_of(entity).label("count"))
    query = filtered(counted, filters, entity).group_by(*columns)
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
                int(row.count),
                standing,
                policy,
                policy.state_at(standing.held.epsilon, standing.next_epsilon),
            )
        )
    return groups


def holds(column: Any, value: Any) -> ColumnElement[bool]:
    """The row's ``column`` holds exactly ``value`` (NULL included, which ``=`` misses)."""
    return column.is_(None) if value is None else column == value


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
                    .order_by(*_account_columns())
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
    keys = _account_columns()
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
    keys = _account_columns()
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
    entity = grouped_source(filters)
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
                query = rows.where(_key_match(_account_columns(store.accounts), key))
            else:
                query = store.subject_rows().where(_key_match(_account_columns(store.rows), key))
            row = connection.execute(query).one_or_none()
            if row is not None:
                break
    if row is None:
        return None
    return AccountStatus.of(row, Standings(ledger).of_row(row), ledger.policy_for(key))


# ---------------------------------------------------------------------- history


def _concerning(connection: Connection, key: LedgerKey) -> Any:
    """Seqs of the entries concerning ``key`` (:func:`concerning.entries`) and of those
    that closed it (:func:`_closings`)."""
    closing_seqs = [seq for seq, _, _ in _closings(connection, key)]
    closed = select(HistoryEntry.seq).where(HistoryEntry.seq.in_(closing_seqs))
    return concerning.entries(key, closed).subquery("concerning")


def _closings(connection: Connection, key: LedgerKey) -> list[tuple[int, str, str]]:
    """(seq, at, action) of the entries that ended ``key``'s account: resets of its window
    that sealed its scope, and rescopes away from it (action ``rescope-away``).

    Neither names ``key`` (a reset is keyless, a rescope names the new account, and the
    old one in its payload), so the history table would miss them and the chart would
    change with no matching row; both are read here, for both. A subject's rescope away
    from it is one of its charges already (:func:`concerning.charges`), found here too
    only when written before spend classes (its payload names the subject's key).
    """
    entries = select(HistoryEntry.seq, HistoryEntry.at, HistoryEntry.action, HistoryEntry.payload)
    moved = entries.where(
        HistoryEntry.action == "rescope",
        HistoryEntry.tenant == key.tenant,
        HistoryEntry.window == key.window,
    )
    found = [
        (row.seq, row.at, "rescope-away")
        for row in connection.execute(moved)
        if LedgerKey(**json.loads(row.payload)["from"]) == key
    ]
    resets = entries.where(HistoryEntry.action == "reset")
    found += [
        (row.seq, row.at, "reset")
        for row in connection.execute(resets)
        if _reset_closes(json.loads(row.payload), key)
    ]
    return found


def _reset_closes(payload: dict[str, Any], key: LedgerKey) -> bool:
    """Whether a reset entry dropped ``key``'s account: its window, and its scope among the
    sealed ones (entries written before windows were sealed name no scopes: all of them)."""
    if payload.get("window") != key.window:
        return False
    sealed = payload.get("sealed")
    return sealed is None or [key.tenant, key.query_type] in sealed


def key_history(
    ledger: PrivacyBudgetLedger,
    key: LedgerKey,
    *,
    limit: int = 50,
    offset: int = 0,
    newest_first: bool = True,
) -> Page[dict[str, Any]]:
    """One page of the history entries concerning ``key``, with the total count.

    Each entry is the ledger's history dict (seq, at, action, actor, reservation_id, key,
    payload, hash) plus, when it belongs to a reservation, that reservation's
    ``attempt_id``, ``mechanism``, ``count``, ``key_count`` and ``state``.
    """
    limit, offset = page_bounds(limit, offset)
    columns = (
        HistoryEntry.seq,
        HistoryEntry.at,
        HistoryEntry.action,
        HistoryEntry.actor,
        HistoryEntry.reservation_id,
        HistoryEntry.tenant,
        HistoryEntry.subject,
        HistoryEntry.query_type,
        HistoryEntry.window,
        HistoryEntry.payload,
        HistoryEntry.hash,
    )
    with ledger.reading() as connection:
        seqs = _concerning(connection, key)
        total = int(connection.execute(select(func.count()).select_from(seqs)).scalar_one())
        # The page's seqs first, then only their rows.
        order = seqs.c.seq.desc() if newest_first else seqs.c.seq.asc()
        page = select(seqs.c.seq).order_by(order).offset(offset).limit(limit)
        order = HistoryEntry.seq.desc() if newest_first else HistoryEntry.seq.asc()
        query = select(*columns).where(HistoryEntry.seq.in_(page)).order_by(order)
        rows = list(connection.execute(query))
        reservations = _reservations_by_id(
            connection, sorted({r.reservation_id for r in rows if r.reservation_id})
        )
    items = []
    for row in rows:
        entry = history.entry_record(row)
        reservation = reservations.get(row.reservation_id or "")
        if reservation is not None:
            entry.update(
                attempt_id=reservation.attempt_id,
                mechanism=json.loads(reservation.mechanism),
                count=reservation.count,
                key_count=reservation.key_count,
                state=reservation.state,
            )
        items.append(entry)
    return Page(total=total, offset=offset, limit=limit, items=items)


def _reservations_by_id(connection: Connection, ids: Sequence[str]) -> dict[str, Any]:
    found: dict[str, Any] = {}
    for start in range(0, len(ids), 1000):
        chunk = ids[start : start + 1000]
        for row in connection.execute(select(ReservationRow).where(ReservationRow.id.in_(chunk))):
            found[row.id] = row
    return found


Event = tuple[int, str, str, Spend]  # (seq, at, action, cost)


def spend_series(
    ledger: PrivacyBudgetLedger, key: LedgerKey, *, max_points: int = 200
) -> SpendSeries:
    """``key``'s cumulative epsilon after each charge, replayed from the history.

    Charges are commits and reaps of reservations holding the key, corrections of the key
    and spend carried onto it by a rescope. A reset of its window or a rescope away from
    it ends the account but refunds nothing (the window or the key is sealed), so the
    curve is the key's lifetime spend: it never drops, and such a closing is a point at
    the level reached, matching the history row that :func:`key_history` lists for it.
    With more than ``max_points`` events, an evenly spaced subset (first and last always
    included) is converted, plus every closing; the curve is monotone, so the subset is an
    honest picture.
    """
    if not isinstance(max_points, int) or max_points < 2:
        raise ValueError(f"max_points must be an integer >= 2, got {max_points!r}")
    size = np.asarray(ledger.orders).size
    needs_payload = HistoryEntry.action.in_(("correction", "rescope"))
    columns = (
        HistoryEntry.seq,
        HistoryEntry.at,
        HistoryEntry.action,
        HistoryEntry.query_type,
        case((needs_payload, HistoryEntry.payload), else_=None).label("payload"),
        ReservationRow.cost_rho,
        ReservationRow.cost_residual,
        ReservationRow.cost_gaussian_mu2,
    )
    events: list[Event] = []
    with ledger.reading() as connection:
        closing_seqs = {seq for seq, _, _ in _closings(connection, key)}
        seqs = _concerning(connection, key)
        query = (
            select(*columns)
            .where(HistoryEntry.seq.in_(select(seqs.c.seq)))
            .outerjoin(
                ReservationRow,
                and_(
                    ReservationRow.id == HistoryEntry.reservation_id,
                    HistoryEntry.action.in_(_CHARGES),
                ),
            )
        )
        for row in connection.execute(query):
            event = _event(row, key, row.seq in closing_seqs, size)
            if event is not None:
                events.append(event)
    events.sort(key=lambda event: event[0])
    closings = {index for index, event in enumerate(events) if event[2] in CLOSINGS}
    wanted = _sample(len(events), max_points) | closings
    epsilons = _Epsilons(ledger)
    total = Spend()
    points = []
    for index, (seq, at, action, cost) in enumerate(events):
        total = total.plus(cost)
        if index in wanted:
            points.append(SeriesPoint(seq, at, action, epsilons.of_spend(total)))
    return SpendSeries(events=len(events), points=points)


def _event(row: Any, key: LedgerKey, closing: bool, size: int) -> Event | None:
    """What one entry concerning ``key`` adds to its spend: (seq, at, action, cost), None
    for an entry that charges nothing (reserve, release).

    A commit or reap charges its reservation's cost, a correction its own, a rescope onto
    the key what it carried; a rescope away (a rescope of another query type) and a reset
    close the account, adding nothing.
    """
    if row.action in _CHARGES:
        cost = Spend.from_columns(row.cost_rho, row.cost_residual, row.cost_gaussian_mu2, size)
        return row.seq, row.at, row.action, cost
    if row.action == "correction":
        cost = Spend.from_payload(json.loads(row.payload)["cost"], size)
        return row.seq, row.at, row.action, cost
    if row.action == "rescope" and row.query_type == key.query_type:
        cost = Spend.from_payload(json.loads(row.payload)["carried"], size)
        return row.seq, row.at, row.action, cost
    if row.action == "rescope":
        return row.seq, row.at, "rescope-away", Spend()
    if closing:
        return row.seq, row.at, row.action, Spend()
    return None


def _sample(count: int, max_points: int) -> set[int]:
    if count <= max_points:
        return set(range(count))
    return {int(round(i)) for i in np.linspace(0, count - 1, max_points)}


# ---------------------------------------------------------------------- reservations


def reserve_cohorts(
    connection: Connection, reservation_ids: Iterable[str]
) -> dict[str, list[dict[str, Any]]]:
    """Reservation id -> the cohorts its ``reserve`` entry charged (their sizes count the
    subjects a reservation covers: one account may be a class of 10^5 of them). Ids whose
    entry predates spend classes are absent."""
    ids = sorted(set(reservation_ids))
    found: dict[str, list[dict[str, Any]]] = {}
    for start in range(0, len(ids), 1000):
        rows = connection.execute(
            select(HistoryEntry.reservation_id, HistoryEntry.payload).where(
                HistoryEntry.action == "reserve",
                HistoryEntry.reservation_id.in_(ids[start : start + 1000]),
            )
        )
        for reservation_id, payload in rows:
            cohorts = json.loads(payload).get("cohorts")
            if cohorts is not None:
                found[reservation_id] = cohorts
    return found


def _reservation_item(
    row: Any, cohorts: list[dict[str, Any]] | None, epsilons: _Epsilons
) -> dict[str, Any]:
    """A reservation as the pages and the API show it (``cohorts``: its reserve entry's)."""
    return {
        "id": row.id,
        "attempt_id": row.attempt_id,
        "state": row.state,
        "mechanism": json.loads(row.mechanism),
        "count": row.count,
        "key_count": row.key_count,
        # before spend classes each key was a subject
        "subjects": row.key_count if cohorts is None else sum(c["size"] for c in cohorts),
        "cost_epsilon": epsilons.of_columns(
            row.cost_rho, row.cost_residual, row.cost_gaussian_mu2
        ).epsilon,
        "prospective_epsilon": row.prospective_epsilon
        if row.prospective_epsilon is not None
        else epsilons.of_columns(row.prospective_rho, None, row.prospective_mu2).epsilon,
        "actor": row.actor,
        "created_at": row.created_at,
        "resolved_at": row.resolved_at,
    }


@dataclass(frozen=True)
class Release:
    """One release (a reservation, whatever became of it) and a page of the accounts it
    held: each a subject's, or a spend class's covering many subjects."""

    reservation: dict[str, Any]
    windows: list[str]
    accounts: Page[LedgerKey]


def release(
    ledger: PrivacyBudgetLedger, reservation_id: str, *, limit: int = 50, offset: int = 0
) -> Release | None:
    """The release of ``reservation_id`` (None if there is none): what the task link of a
    release opens, for a release over one subject or a million."""
    limit, offset = page_bounds(limit, offset)
    keys = select(
        ReservationKey.tenant,
        ReservationKey.subject,
        ReservationKey.query_type,
        ReservationKey.window,
    )
    with ledger.reading() as connection:
        row = connection.execute(
            select(ReservationRow).where(ReservationRow.id == reservation_id)
        ).first()
        if row is None:
            return None
        cohorts = reserve_cohorts(connection, [reservation_id]).get(reservation_id)
        held = ReservationKey.reservation_id == reservation_id
        windows = sorted(connection.scalars(select(ReservationKey.window).where(held).distinct()))
        total = connection.execute(
            select(func.count()).select_from(ReservationKey).where(held)
        ).scalar_one()
        found = connection.execute(
            keys.where(held).order_by(ReservationKey.position).offset(offset).limit(limit)
        ).all()
    return Release(
        reservation=_reservation_item(row, cohorts, _Epsilons(ledger)),
        windows=windows,
        accounts=Page(
            total=total, offset=offset, limit=limit, items=[LedgerKey.from_row(k) for k in found]
        ),
    )


def key_reservations(
    ledger: PrivacyBudgetLedger,
    key: LedgerKey,
    *,
    states: Iterable[str] | None = None,
    limit: int = 50,
    offset: int = 0,
) -> Page[dict[str, Any]]:
    """Reservations holding ``key`` (newest first), optionally only in ``states``."""
    limit, offset = page_bounds(limit, offset)
    wanted = None if states is None else sorted(set(states))
    for state in wanted or []:
        if state not in RESERVATION_STATES:
            raise ValueError(f"reservation state must be one of {RESERVATION_STATES}: {state!r}")
    base = select(ReservationRow).where(ReservationRow.id.in_(concerning.reservations(key)))
    if wanted is not None:
        base = base.where(ReservationRow.state.in_(wanted))
    counted = base.with_only_columns(func.count()).order_by(None)
    page = base.order_by(ReservationRow.created_at.desc(), ReservationRow.id).offset(offset)
    epsilons = _Epsilons(ledger)
    with ledger.reading() as connection:
        total = int(connection.execute(counted).scalar_one())
        rows = list(connection.execute(page.limit(limit)))
        cohorts = reserve_cohorts(connection, [row.id for row in rows])
    items = [_reservation_item(row, cohorts.get(row.id), epsilons) for row in rows]
    return Page(total=total, offset=offset, limit=limit, items=items)


# ---------------------------------------------------------------------- audit


def chain_head(ledger: PrivacyBudgetLedger) -> tuple[int, str]:
    """(last seq, digest of every chain head): changes whenever anything is written."""
    with ledger.reading() as connection:
        return history.heads_digest(connection)
