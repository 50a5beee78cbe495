"""Read-only queries for browsing a ledger: filtered, sorted, paginated pages with totals.

The ledger API answers "what is the state of these keys"; a UI needs "which accounts
match, in what order, how many in total", one account's history and reservations a page
at a time, and the account's cumulative epsilon over time. Those are here, as plain
functions taking a :class:`PrivacyBudgetLedger`, so the ledger class stays about writing
and the queries stay usable from the CLI or a notebook (no Airflow import).

Epsilon is not a column: it is converted from the stored RDP spend at read time. Filters
on key fields, and sorts on key fields, release counts or update time, run in SQL and
only the returned page is converted. Filtering by state or sorting by epsilon, fraction
or headroom has to convert every matching account; each distinct stored spend (committed
and pending, with its scope: :mod:`standing`) is converted once (releases over many
subjects leave many accounts with the same spend).
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
    func,
    or_,
    select,
    union_all,
)

from dp_budget_provider.accounting import EpsilonBound
from dp_budget_provider.ledger import history
from dp_budget_provider.ledger.keys import (
    MAX_PART_LENGTH,
    LedgerKey,
    canonical_part,
    whole_number,
)
from dp_budget_provider.ledger.ledger import PrivacyBudgetLedger
from dp_budget_provider.ledger.policy import (
    STATE_EXHAUSTED,
    STATE_OK,
    STATE_WARNING,
    Policy,
)
from dp_budget_provider.ledger.policy_store import policy_of_scope
from dp_budget_provider.ledger.records import COMMITTED, OPEN, REAPED, RELEASED, AccountStatus
from dp_budget_provider.ledger.schema import (
    Account,
    HistoryEntry,
    ReservationKey,
)
from dp_budget_provider.ledger.schema import Reservation as ReservationRow
from dp_budget_provider.ledger.spend import Spend
from dp_budget_provider.ledger.standing import SPEND_COLUMNS, Standing, Standings, stored_values

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


def _account_columns() -> tuple[Any, ...]:
    return (Account.tenant, Account.subject, Account.query_type, Account.window)


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


def filtered(query: Select[Any], filters: AccountFilter) -> Select[Any]:
    for name, column in zip(KEY_FIELDS, _account_columns(), strict=True):
        value = getattr(filters, name)
        if value is None or value == "":
            continue
        pattern = _pattern(name, value)
        if pattern is None:
            query = query.where(column == canonical_part(name, value))
        elif pattern.strip("%"):
            query = query.where(column.like(pattern, escape="\\"))
    return query


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
    """Live accounts matching ``filters``, sorted, one page of them, with the total count.

    ``sort`` is one of :data:`SORTS`; ties are broken by key (ascending), so pages are
    stable. Sorting by a key field, a count or the update time without a state filter is
    one SQL query (and one for the releases of the page's scopes). Otherwise the matching
    accounts are first grouped in SQL by what decides their standing and policy (tenant,
    query type, stored spend); each group is converted once, and the page is read group
    by group in sort order. Accounts charged by the same
    releases share a group, so this stays fast for releases over many subjects.
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
        query = filtered(select(Account), filters).where(or_(*map(_group_match, groups)))
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
    columns = (Account.tenant, Account.query_type, *SPEND_COLUMNS)
    query = filtered(select(*columns, func.count().label("count")), filters).group_by(*columns)
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
    return and_(
        Account.tenant == group.tenant,
        Account.query_type == group.query_type,
        *(holds(column, value) for column, value in zip(SPEND_COLUMNS, group.spend, strict=True)),
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
                    filtered(select(Account), filters)
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
    """The page when almost every account differs: rank them all, then read the page."""
    by_signature = {group.signature: group for group in groups}
    query = filtered(select(Account.id, *_account_columns(), *SPEND_COLUMNS), filters)
    if sort in SQL_SORTS and sort != "key":
        query = query.add_columns(getattr(Account, sort).label("sort_value"))
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
            ranked.append((value, key, row.id))
        ranked.sort(key=lambda item: item[1])
        if sort != "key":
            ranked.sort(key=lambda item: item[0], reverse=descending)
        elif descending:
            ranked.reverse()
        ids = [account_id for _, _, account_id in ranked[offset : offset + limit]]
        found = {
            row.id: row for row in connection.execute(select(Account).where(Account.id.in_(ids)))
        }
    return [found[account_id] for account_id in ids]


def _key_of(row: Any) -> LedgerKey:
    return LedgerKey(row.tenant, row.subject, row.query_type, row.window)


def _sql_order(sort: str, descending: bool) -> list[Any]:
    keys = _account_columns()
    if sort == "key":
        return [k.desc() if descending else k.asc() for k in keys]
    column = getattr(Account, sort)
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
    count = filtered(select(func.count()).select_from(Account), filters)
    page = filtered(select(Account), filters).order_by(*order).offset(offset).limit(limit)
    with ledger.reading() as connection:
        total = int(connection.execute(count).scalar_one())
        rows = list(connection.execute(page))
    items = [
        AccountStatus.of(row, standing, policies(row.tenant, row.query_type))
        for row, standing in zip(rows, standings.of_rows(rows), strict=True)
    ]
    return Page(total=total, offset=offset, limit=limit, items=items)


def account_status(ledger: PrivacyBudgetLedger, key: LedgerKey) -> AccountStatus | None:
    """The live account of ``key`` with its status, or None when it has none."""
    with ledger.reading() as connection:
        row = connection.execute(
            select(Account).where(_key_match(_account_columns(), key))
        ).one_or_none()
    if row is None:
        return None
    return AccountStatus.of(row, Standings(ledger).of_row(row), ledger.policy_for(key))


# ---------------------------------------------------------------------- history


def _history_of(key: LedgerKey, closing_seqs: Sequence[int], *columns: Any) -> Any:
    """Entries concerning ``key``: its own (key columns set), its multi-key reservations'
    and the entries that closed it (``closing_seqs``, see :func:`_closings`).

    A UNION ALL of indexed lookups: single-key entries carry the key, multi-key entries
    (key columns NULL) are found through the reservation's keys, closings by their seq.
    """
    history_key = (
        HistoryEntry.tenant,
        HistoryEntry.subject,
        HistoryEntry.query_type,
        HistoryEntry.window,
    )
    reservation_key = (
        ReservationKey.tenant,
        ReservationKey.subject,
        ReservationKey.query_type,
        ReservationKey.window,
    )
    touching = select(ReservationKey.reservation_id).where(_key_match(reservation_key, key))
    own = select(*columns).where(_key_match(history_key, key))
    shared = select(*columns).where(
        HistoryEntry.tenant.is_(None), HistoryEntry.reservation_id.in_(touching)
    )
    closed = select(*columns).where(HistoryEntry.seq.in_(list(closing_seqs)))
    return union_all(own, shared, closed).subquery()


def _closings(connection: Connection, key: LedgerKey) -> list[tuple[int, str, str]]:
    """(seq, at, action) of the entries that ended ``key``'s account: resets of its window
    that sealed its scope, and rescopes away from it (action ``rescope-away``).

    Neither carries ``key`` in its key columns (a reset is keyless, a rescope carries the
    new key and names the old one in its payload), so the history table would miss them
    and the chart would change with no matching row; both are read here, for both.
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
        closing_seqs = [seq for seq, _, _ in _closings(connection, key)]
        entries = _history_of(key, closing_seqs, *columns)
        order = entries.c.seq.desc() if newest_first else entries.c.seq.asc()
        total = int(connection.execute(select(func.count()).select_from(entries)).scalar_one())
        rows = list(connection.execute(select(entries).order_by(order).offset(offset).limit(limit)))
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
    reservation_key = (
        ReservationKey.tenant,
        ReservationKey.subject,
        ReservationKey.query_type,
        ReservationKey.window,
    )
    history_key = (
        HistoryEntry.tenant,
        HistoryEntry.subject,
        HistoryEntry.query_type,
        HistoryEntry.window,
    )
    touching = select(ReservationKey.reservation_id).where(_key_match(reservation_key, key))
    charges = (
        select(
            HistoryEntry.seq,
            HistoryEntry.at,
            HistoryEntry.action,
            ReservationRow.cost_rho,
            ReservationRow.cost_residual,
            ReservationRow.cost_gaussian_mu2,
        )
        .join(ReservationRow, ReservationRow.id == HistoryEntry.reservation_id)
        .where(HistoryEntry.action.in_(_CHARGES), HistoryEntry.reservation_id.in_(touching))
    )
    own = select(
        HistoryEntry.seq, HistoryEntry.at, HistoryEntry.action, HistoryEntry.payload
    ).where(_key_match(history_key, key), HistoryEntry.action.in_(("correction", "rescope")))
    events: list[tuple[int, str, str, Spend]] = []
    with ledger.reading() as connection:
        for row in connection.execute(charges):
            cost = Spend.from_columns(row.cost_rho, row.cost_residual, row.cost_gaussian_mu2, size)
            events.append((row.seq, row.at, row.action, cost))
        for row in connection.execute(own):
            payload = json.loads(row.payload)
            cost = payload["cost"] if row.action == "correction" else payload["carried"]
            events.append((row.seq, row.at, row.action, Spend.from_payload(cost, size)))
        events += [(seq, at, action, Spend()) for seq, at, action in _closings(connection, key)]
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


def _sample(count: int, max_points: int) -> set[int]:
    if count <= max_points:
        return set(range(count))
    return {int(round(i)) for i in np.linspace(0, count - 1, max_points)}


# ---------------------------------------------------------------------- reservations


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
    reservation_key = (
        ReservationKey.tenant,
        ReservationKey.subject,
        ReservationKey.query_type,
        ReservationKey.window,
    )
    base = (
        select(ReservationRow)
        .join(ReservationKey, ReservationKey.reservation_id == ReservationRow.id)
        .where(_key_match(reservation_key, key))
    )
    if wanted is not None:
        base = base.where(ReservationRow.state.in_(wanted))
    counted = base.with_only_columns(func.count()).order_by(None)
    page = base.order_by(ReservationRow.created_at.desc(), ReservationRow.id).offset(offset)
    epsilons = _Epsilons(ledger)
    with ledger.reading() as connection:
        total = int(connection.execute(counted).scalar_one())
        rows = list(connection.execute(page.limit(limit)))
    items = [
        {
            "id": row.id,
            "attempt_id": row.attempt_id,
            "state": row.state,
            "mechanism": json.loads(row.mechanism),
            "count": row.count,
            "key_count": row.key_count,
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
        for row in rows
    ]
    return Page(total=total, offset=offset, limit=limit, items=items)


# ---------------------------------------------------------------------- audit


def chain_head(ledger: PrivacyBudgetLedger) -> tuple[int, str]:
    """(last seq, digest of every chain head): changes whenever anything is written."""
    with ledger.reading() as connection:
        return history.heads_digest(connection)
